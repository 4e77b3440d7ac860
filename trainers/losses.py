"""The DVI objective on logged verifier feedback.

Two terms, both computed from what the server logged (no target forward pass in the trainer):

* `topk_kl_loss`: distil the target's logged top-k log-probs into the drafter.
* `reward_loss`: REINFORCE on the drafter's own proposals, reward 1 if the target accepted the
  drafted token and 0 for the first rejected one.

`dvi_loss` starts as pure KL and ramps the reward term in (`ramp_weight`), as in DVI: KL gives a
dense, stable signal; the reward targets exactly what raises acceptance once the drafter is close.

All inputs may have any leading shape ([N, ...] or [B, T, ...]); they are flattened to rows.

Reduced draft vocabulary (`dvi.drafters.vocab`): the student's logits are the [.., N] subset logits and
`to_subset` maps the logged target ids onto subset positions first, so no term ever sees the -inf
the served drafter has outside its subset (see `to_subset` for how the target mass is treated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dvi.config import TrainerConfig

_DEFAULTS = TrainerConfig()  # LossWeights' defaults


def _rows(x: torch.Tensor, trailing: int) -> torch.Tensor:
    return x.reshape(-1, *x.shape[x.dim() - trailing :]) if trailing else x.reshape(-1)


def _mask(mask: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(n, device=device)
    m = _rows(mask, 0).to(device=device, dtype=torch.float32)
    if m.numel() != n:
        raise ValueError(f"mask has {m.numel()} entries, expected {n}")
    return m


def _masked_mean(x: torch.Tensor, m: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    # 0 (with a graph) when nothing is selected, so a batch without positions is harmless. `total`: the whole step's
    # mask sum, when `m` is one micro-batch's share of it (`StepTotals`)
    return (x * m).sum() / (m.sum() if total is None else total).clamp_min(1.0)


def _kl_mask(ids: torch.Tensor, tlp: torch.Tensor, m: torch.Tensor, tail_bucket: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions' weights the KL averages over, [n, k] valid logged entries): without the tail bucket a position
    without a valid entry has no KL."""
    valid = torch.isfinite(tlp) & (ids >= 0)
    return (m if tail_bucket else m * valid.any(-1).float()), valid


def topk_kl_loss(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    tail_bucket: bool = True,
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over masked positions of KL(target || student) on the logged top-k support (`total`: divide by the
    whole step's mask sum instead of this call's, `StepTotals`).

    Default (`tail_bucket=True`): the principled coarsening. Both distributions are mapped to
    k+1 outcomes: the k logged ids plus one bucket for "everything else". The target's bucket
    mass is 1 - sum(exp(topk_logprobs)) (its logged log-probs are raw log_softmax, not
    renormalised); the student's comes from its full-vocab softmax. This is an exact KL between
    coarsened distributions, a lower bound on the full-vocab KL that is 0 only if the student
    matches the target on each logged id and on the total tail mass. It keeps the student from
    parking probability on tokens the target never ranks (which the renormalised variant cannot
    see, and which directly lowers acceptance sum_x min(p, q)).

    `tail_bucket=False`: KL(target top-k renormalised || student restricted to the same k ids and
    renormalised). Only ratios among the k ids matter; kept for comparison.

    Shapes: student_logits [..., V], topk_ids [..., k], topk_logprobs [..., k], mask [...] (bool
    or 0/1). Short rows may be padded with id -1 or log-prob -inf (any id); padding is ignored.
    """
    logits = _rows(student_logits, 1).float()
    ids = _rows(topk_ids, 1).long()
    tlp = _rows(topk_logprobs, 1).to(logits.device).float()
    n, v = logits.shape
    if ids.shape != tlp.shape or ids.shape[0] != n:
        raise ValueError(
            f"topk_ids {tuple(ids.shape)} / topk_logprobs {tuple(tlp.shape)} do not match logits rows {n}"
        )
    # Padding: entries with id < 0 or log-prob -inf carry no target mass and no student support.
    m, valid = _kl_mask(ids, tlp, _mask(mask, n, logits.device), tail_bucket)
    ids_c = ids.clamp_min(0)
    tlp = tlp.masked_fill(~valid, 0.0)  # keep every branch finite (nan-free gradients)
    slp = F.log_softmax(logits, dim=-1)
    s_k = slp.gather(1, ids_c)  # student log q on the logged ids
    if not tail_bucket:
        ok = valid & valid.any(-1)[:, None]
        neg = torch.finfo(torch.float32).min
        t_lp = F.log_softmax(torch.where(ok, tlp, neg), dim=-1)
        s_lp = F.log_softmax(torch.where(ok, s_k, neg), dim=-1)
        kl = torch.where(ok, t_lp.exp() * (t_lp - s_lp), 0.0).sum(-1)
        return _masked_mean(kl, m, total)
    p_k = torch.where(valid, tlp.exp(), 0.0)
    kl = torch.where(valid, p_k * (tlp - s_k), 0.0).sum(-1)
    # log of the student's mass outside the k ids, exactly: logsumexp over the other ids.
    in_k = torch.zeros_like(logits).scatter_add(1, ids_c, valid.float()) > 0
    has_out = (~in_k).any(-1)
    outside = torch.where(has_out[:, None], logits.masked_fill(in_k, float("-inf")), logits)
    s_tail = torch.logsumexp(outside, dim=-1) - torch.logsumexp(logits, dim=-1)
    p_tail = torch.where(has_out, (1.0 - p_k.sum(-1)).clamp_min(0.0), 0.0)
    tail = torch.where(p_tail > 0, p_tail * (torch.log(p_tail.clamp_min(1e-30)) - s_tail), 0.0)
    return _masked_mean(kl + tail, m, total)


def reward_loss(
    student_logits: torch.Tensor,
    drafted_ids: torch.Tensor,
    accepted: torch.Tensor,
    mask: torch.Tensor | None = None,
    baseline: float | str | torch.Tensor = "mean",
    total: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE on drafted positions: -(r - b) * log q(drafted), r = 1 accepted / 0 rejected.

    Accepted drafts above the baseline are pushed up, rejected ones pushed down. `baseline` is a
    number or "mean" (the batch's masked acceptance rate, detached) to reduce variance. Positions
    with drafted_ids < 0 (no draft) are ignored. The logged drafts are the drafter's own samples,
    so this is on-policy for the drafter version that produced them (off-policy for later ones;
    no importance weights — keep the trainer close to the serving drafter).
    """
    logits = _rows(student_logits, 1).float()
    n = logits.shape[0]
    d = _rows(drafted_ids, 0).long().to(logits.device)
    r = _rows(accepted, 0).to(device=logits.device, dtype=torch.float32)
    if d.numel() != n or r.numel() != n:
        raise ValueError(f"drafted_ids ({d.numel()}) / accepted ({r.numel()}) do not match logits rows {n}")
    m = _mask(mask, n, logits.device) * (d >= 0).float()
    logq = F.log_softmax(logits, dim=-1).gather(1, d.clamp_min(0)[:, None])[:, 0]
    if isinstance(baseline, torch.Tensor):  # the whole step's (`StepTotals`)
        b = baseline.to(logits.device)
    elif baseline == "mean":
        b = _masked_mean(r, m).detach()
    elif isinstance(baseline, str):
        raise ValueError(f"baseline must be a number or 'mean', got {baseline!r}")
    else:
        b = torch.tensor(float(baseline), device=logits.device)
    return _masked_mean(-(r - b) * logq, m, total)


class LoggedTargets(NamedTuple):
    """What the feedback log says at each trained position: the target's top-k ids [..., k] (-1 padding) and
    log-probs [..., k], the token drafted there [...] (-1: none) and whether the target accepted it [...]."""

    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    drafted_ids: torch.Tensor
    accepted: torch.Tensor


def to_subset(subset_index: torch.Tensor, logged: LoggedTargets) -> LoggedTargets:
    """Map logged target ids onto a reduced draft vocabulary; drop the ids outside it, renormalise.

    `subset_index` [V] holds each target id's position in the subset (-1 outside). A drafter over a
    subset S can at best match the target conditioned on S, p_S(x) = p(x) / p(S): that q maximises the
    acceptance sum_x min(p, q) over drafters supported on S (it reaches p(S)), and it is the KL
    optimum. So logged ids outside S are dropped and the remaining log-probs are shifted by
    -log(1 - dropped mass). The unlogged tail (mass beyond the top-k) is counted as inside S (its
    split is unknown; the subset holds the frequent tokens), so it stays the tail bucket of
    `topk_kl_loss`, renormalised the same way. Drafts outside S (an older full-vocab drafter's) get -1
    and are ignored by `reward_loss`.
    """
    index = subset_index.to(logged.topk_ids.device)
    ids = logged.topk_ids.long()
    lp = logged.topk_logprobs.float()
    is_logged = (ids >= 0) & torch.isfinite(lp)
    pos = index[ids.clamp_min(0)]  # [..., k]
    inside = is_logged & (pos >= 0)
    dropped = torch.where(is_logged & ~inside, lp.exp(), torch.zeros_like(lp)).sum(-1, keepdim=True)  # [..., 1]
    remaining = (1.0 - dropped).clamp_min(1e-6)
    new_lp = torch.where(inside, lp - remaining.log(), torch.full_like(lp, float("-inf")))
    new_ids = torch.where(inside, pos, torch.full_like(pos, -1))
    d = logged.drafted_ids.long().to(index.device)
    new_d = torch.where(d >= 0, index[d.clamp_min(0)], torch.full_like(d, -1))
    return LoggedTargets(new_ids, new_lp, new_d, logged.accepted)


def ramp_weight(step: int, start: int, ramp_steps: int, max_weight: float) -> float:
    """0 before `start`, then linear up to `max_weight` over `ramp_steps` (a step if 0)."""
    if step < start:
        return 0.0
    if ramp_steps <= 0:
        return float(max_weight)
    return float(max_weight) * min(1.0, (step - start) / ramp_steps)


class DviLoss(NamedTuple):
    loss: torch.Tensor
    kl: torch.Tensor
    reward: torch.Tensor
    reward_weight: float


@dataclass(frozen=True)
class LossWeights:
    """How `dvi_loss` mixes its terms. The defaults are the config's (trainer.kl_weight, reward_weight,
    reward_ramp_*), so a caller that leaves them out trains what a default config trains."""

    kl_weight: float = _DEFAULTS.kl_weight
    reward_start: int = _DEFAULTS.reward_ramp_start
    reward_ramp_steps: int = _DEFAULTS.reward_ramp_steps
    reward_max_weight: float = _DEFAULTS.reward_weight
    tail_bucket: bool = True
    baseline: float | str = "mean"

    @classmethod
    def of(cls, tc: TrainerConfig) -> LossWeights:
        return cls(kl_weight=tc.kl_weight, reward_start=tc.reward_ramp_start, reward_ramp_steps=tc.reward_ramp_steps,
                   reward_max_weight=tc.reward_weight)


def dvi_loss(
    student_logits: torch.Tensor,
    logged: LoggedTargets,
    mask: torch.Tensor | None = None,
    *,
    step: int = 0,
    weights: LossWeights = LossWeights(),
    subset_index: torch.Tensor | None = None,
    totals: StepTotals | None = None,
) -> DviLoss:
    """kl_weight * KL + ramp_weight(step) * reward; returns the parts for logging.

    `mask` selects the positions to train on (e.g. real generated positions with logged top-k);
    the reward term additionally skips positions without a draft. With a reduced draft vocabulary,
    `student_logits` are the [..., N] subset logits and `subset_index` [V] maps target ids to subset
    positions (`dvi.drafters.vocab.SubsetHead.index`); the logged targets are mapped by `to_subset`. `totals`: the
    whole step's (`step_totals`) when these rows are one of its micro-batches.
    """
    if subset_index is not None:
        logged = to_subset(subset_index, logged)
    kl = topk_kl_loss(student_logits, logged.topk_ids, logged.topk_logprobs, mask, tail_bucket=weights.tail_bucket,
                      total=None if totals is None else totals.kl)
    w = ramp_weight(step, weights.reward_start, weights.reward_ramp_steps, weights.reward_max_weight)
    if w > 0:
        baseline = totals.baseline if totals is not None and weights.baseline == "mean" else weights.baseline
        rl = reward_loss(student_logits, logged.drafted_ids, logged.accepted, mask, baseline=baseline,
                         total=None if totals is None else totals.reward)
    else:
        rl = torch.zeros((), device=kl.device)
    return DviLoss(weights.kl_weight * kl + w * rl, kl.detach(), rl.detach(), w)


class StepTotals(NamedTuple):
    """A whole step's denominators and reward baseline, handed to each of its micro-batches' losses so that their sum
    is the one-pass loss (and gradient): all are sums over logged data, none depends on the weights trained."""

    kl: torch.Tensor  # the KL positions' weight sum
    reward: torch.Tensor  # the drafted positions' weight sum
    baseline: torch.Tensor  # their weighted acceptance rate (the reward's "mean" baseline)
    rescale: torch.Tensor  # weight sum / weighted positions (`batch_loss`)
    feature: torch.Tensor | None  # weighted positions x feature width (`feature_loss`), eagle only


def step_totals(parts: Sequence, weights: LossWeights, subset_index: torch.Tensor | None = None) -> StepTotals:
    """The totals of a whole step from its micro-batches (`trainers.online.collate.Batch` each), as `dvi_loss` /
    `batch_loss` compute them from all of its rows at once."""
    kl = reward = hits = w_sum = weighted = torch.zeros(())
    for batch in parts:
        logged = LoggedTargets(batch.topk_ids, batch.topk_logprobs, batch.drafted_ids, batch.accepted)
        if subset_index is not None:
            logged = to_subset(subset_index, logged)
        m = _rows(batch.weights, 0).float()
        ids, tlp = _rows(logged.topk_ids, 1).long(), _rows(logged.topk_logprobs, 1).float()
        rm = m * (_rows(logged.drafted_ids, 0) >= 0).float()
        kl = kl + _kl_mask(ids, tlp, m, weights.tail_bucket)[0].sum()
        reward, hits = reward + rm.sum(), hits + (_rows(logged.accepted, 0).float() * rm).sum()
        w_sum, weighted = w_sum + m.sum(), weighted + (m > 0).sum()
    targets = getattr(parts[0], "feature_targets", None)
    return StepTotals(kl=kl, reward=reward, baseline=hits / reward.clamp_min(1.0), rescale=w_sum / weighted.clamp_min(1),
                      feature=None if targets is None else weighted * targets.shape[-1])


def feature_loss(out, batch, total: torch.Tensor | None = None) -> torch.Tensor | None:
    """Smooth-L1 of an eagle head's predicted features `out.features` [B, T, H] onto the target's
    `batch.feature_targets` [B, T, H] over the trained positions (EAGLE's regression term); None for
    drafters without features."""
    targets = getattr(batch, "feature_targets", None)
    if targets is None or getattr(out, "features", None) is None or not getattr(out, "regress", True):
        return None  # a fused head's features are its own hidden states: no target to regress onto
    pred = out.features[:, -targets.shape[1]:].float()  # [B, T, H]
    keep = (batch.weights > 0).unsqueeze(-1)  # [B, T, 1]
    err = torch.nn.functional.smooth_l1_loss(pred, targets.float(), reduction="none") * keep
    return err.sum() / (keep.sum() * pred.shape[-1] if total is None else total).clamp_min(1)


def chained_features(batch, out) -> torch.Tensor:
    """Eagle inputs [B, W, H] for a second pass: the generated positions read the head's own predicted
    feature of the position before (as drafts 2..K of a step do), the prompt keeps the target's."""
    t = out.features.shape[1]  # [B, T, H], the predictions at the last T inputs
    own = out.features[:, :-1].to(batch.features.dtype)  # predictions of f at inputs W-T .. W-2
    return torch.cat([batch.features[:, : batch.features.shape[1] - t + 1], own], 1)


def batch_loss(module, batch, inputs: dict, tc: TrainerConfig, step: int, totals: StepTotals | None = None):
    """(loss, dvi_loss output, feature loss or None, forward output) of one teacher-forced pass of the online
    trainer's `module` over a collated `batch` (`trainers.online.collate.Batch`); `inputs` are the extra
    forward arguments (an eagle head's features). `totals`: the step's (`step_totals`) when `batch` is one of its
    micro-batches (`trainers.online.collate.micro_batches`): the parts' losses then sum to the whole's."""
    from dvi.drafters.vocab import subset_mode

    # A reduced draft vocabulary trains on its [B, T, N] subset logits (never the served -inf padding).
    with subset_mode(module) as head:
        fwd = module(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=batch.position_ids, use_cache=False, logits_to_keep=batch.width, **inputs)
    logged = LoggedTargets(batch.topk_ids, batch.topk_logprobs, batch.drafted_ids, batch.accepted)
    out = dvi_loss(fwd.logits, logged, batch.weights, step=step, weights=LossWeights.of(tc),
                   subset_index=head.index if head is not None else None, totals=totals)
    w = batch.weights
    # dvi_loss normalises by the weight sum; rescale so down-weighted rows count less in absolute terms
    loss = out.loss * (w.sum() / (w > 0).sum().clamp_min(1) if totals is None else totals.rescale)
    feat_loss = feature_loss(fwd, batch, None if totals is None else totals.feature)
    if feat_loss is not None:
        loss = loss + tc.feature_weight * feat_loss
    return loss, out, feat_loss, fwd
