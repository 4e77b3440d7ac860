"""Offline acceptance estimates from logged feedback, without running the target.

The feedback log carries, for every generated position, the target's token and its top-k
log-probs. That is enough to score a candidate drafter offline: run the drafter teacher-forced
over prompt + generated tokens and ask how often it would have been accepted.

* greedy traffic (temperature 0): a greedy draft is accepted iff the drafter's argmax equals
  the target's token, so α̂ = mean(argmax q == token).
* sampled traffic: rejection sampling accepts with probability Σ_x min(p(x), q(x)); with p known
  only on the target's top-k (renormalised there), the sum runs over those k ids; it is exact
  when the top-k hold nearly all the mass (k = 32 does on the embedded models).

Both the trainer (the manifest's held-out α) and the server (shadow check before promotion)
use this, so a promotion decision and its reported estimate always agree; `dvi.feedback.verdict.compare` is the
one comparison of two versions built on it, `dvi.feedback.heldout.HeldOutSet` the records it reads.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dvi.decode.results import acceptance_rate
from dvi.decode.sampling import GREEDY_BELOW_TEMPERATURE
from dvi.feedback.record import FeedbackRecord

SHADOW_MAX_POSITIONS = 4096
"""Generated positions one shadow estimate reads at most: the trainer's held-out check before a
publish and the server's check before a promotion use the same cap, so they estimate alike."""

LogitsFn = Callable[..., torch.Tensor]
"""Maps input ids ``[1, L]`` (and, for an eagle head, its input features ``[1, L, H]``) to logits
``[1, L, V]`` (teacher forcing, no cache), or of the last ``keep`` positions ``[1, keep, V]``.
``fn.needs_features`` marks the eagle kind."""


def is_heldout(request_id: str, fraction: float) -> bool:
    """Whether a record is in the held-out slice (`trainer.heldout_fraction` of records, by a hash of the
    request id): never trained on by any trainer rank, the only records a publish check, a server's shadow
    check scores. Every process, rank and restart agrees without talking."""
    if fraction <= 0:
        return False
    h = hashlib.sha256(("heldout/" + request_id).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


@dataclass
class ShadowEstimate:
    alpha: float | None  # None: no scored position (dvi.decode.results' convention); NaN: the drafter's logits were
    positions: int
    records: int


def _usable(alpha: float | None) -> bool:
    return alpha is not None and math.isfinite(alpha)


def shadow_passes(new_alpha: float | None, old_alpha: float | None, margin: float) -> bool:
    """Whether a candidate with shadow α `new_alpha` may replace one with `old_alpha`.

    A candidate without a finite estimate (no data, NaN, inf) never passes (``not (nan < x)`` is
    True, which once promoted a worse drafter); it is compared only with a usable live estimate.
    """
    if not _usable(new_alpha):
        return False
    return not _usable(old_alpha) or new_alpha >= old_alpha - margin


def hf_logits_fn(model: torch.nn.Module) -> LogitsFn:
    """Teacher-forced logits of a Hugging Face causal LM (or any module returning ``.logits``)."""

    from dvi.drafters.eagle import EagleModel

    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def fn(ids: torch.Tensor, features: torch.Tensor | None = None, keep: int = 0) -> torch.Tensor:
        # keep: logits of the last `keep` positions only (0: all): the generated ones, not the prompt's, whose
        # full-vocabulary rows were most of a shadow check's memory
        extra = {} if features is None else {"features": features}
        out = model(input_ids=ids, use_cache=False, logits_to_keep=keep, **extra)
        return out.logits if hasattr(out, "logits") else out

    fn.needs_features = isinstance(base, EagleModel)
    return fn


def _record_features(record: FeedbackRecord, device: torch.device | str) -> torch.Tensor | None:
    """An eagle head's input features F [1, L - 1, H] from a record's logged target features, or None."""
    from dvi.drafters.eagle import features_from_hidden

    h = record.features()
    if h is None:
        return None
    h = torch.from_numpy(np.array(h))  # a copy: logged arrays are read-only
    return features_from_hidden(h).unsqueeze(0).to(device)


def record_scores(logits_fn: LogitsFn, records: Iterable[FeedbackRecord], device: torch.device | str = "cpu",
                  max_positions: int | None = None) -> list[tuple[FeedbackRecord, float, int]]:
    """(record, expected accepted positions, positions) of every scored record, in order; records
    that cannot be scored (empty, an eagle record without features) are left out."""
    return [(rec, float(acc.sum()), int(acc.numel()))
            for rec, acc in record_acceptance(logits_fn, records, device, max_positions)]


@torch.inference_mode()
def record_acceptance(logits_fn: LogitsFn, records: Iterable[FeedbackRecord], device: torch.device | str = "cpu",
                      max_positions: int | None = None) -> list[tuple[FeedbackRecord, torch.Tensor]]:
    """(record, [n] per-position acceptance on CPU) of every scored record: what `record_scores` sums, kept per
    position so a chain of drafts can be scored (`chain_tokens`). Greedy records give 1.0 / 0.0 (argmax
    agreement), sampled ones Σ min(p, q) at each position; the same records as `record_scores` are left out."""
    needs_features = bool(getattr(logits_fn, "needs_features", False))
    out: list[tuple[FeedbackRecord, torch.Tensor]] = []
    total = 0
    for rec in records:
        prompt: Sequence[int] = list(rec.prompt_ids)
        tokens: Sequence[int] = list(rec.token_ids)
        if not prompt or not tokens:
            continue
        ids = torch.tensor([list(prompt) + list(tokens)[:-1]], device=device)
        if needs_features:
            feats = _record_features(rec, device)
            if feats is None:
                continue
            logits = logits_fn(ids, feats, keep=len(tokens))[0, -len(tokens):].float()  # predicts tokens[0..]
        else:
            logits = logits_fn(ids, keep=len(tokens))[0, -len(tokens):].float()
        out.append((rec, _acceptance(rec, logits, tokens, device)))
        total += len(tokens)
        if max_positions is not None and total >= max_positions:
            break
    return out


def _acceptance(rec: FeedbackRecord, logits: torch.Tensor, tokens: Sequence[int],
                device: torch.device | str) -> torch.Tensor:
    """[n] acceptance of each position of one record: argmax matches (greedy) or Σ min(p, q) (sampled)."""
    temperature = served_temperature(rec.temperature)
    if temperature <= 0.0:
        return (logits.argmax(-1).cpu() == torch.tensor(list(tokens))).float()
    topk_ids = torch.tensor([list(x) for x in rec.topk_ids], device=device)
    topk_lp = torch.tensor([list(x) for x in rec.topk_logprobs], device=device)
    q = torch.softmax(logits / temperature, dim=-1)
    p = torch.softmax(topk_lp / temperature, dim=-1)  # target warped on its top-k
    return torch.minimum(p, q.gather(-1, topk_ids)).sum(-1).cpu()


def accepted_drafts(ok: torch.Tensor) -> torch.Tensor:
    """[K, m] acceptance of draft j of chain s (bool, or a probability) -> [m] accepted drafts of each chain
    (expected, positions taken as independent, for probabilities): a chain stops at its first rejected draft.
    The one place a chain's length is counted, for served-like drafting chains
    (`trainers.builds.eagle_eval.chain_acceptance`) and for logged records (`chain_tokens`) alike."""
    return ok.float().cumprod(0).sum(0)


def chain_tokens(acceptance: torch.Tensor, k: int) -> float:
    """Σ over start positions t of the tokens a K-draft step started at t emits: 1 + the accepted drafts among
    positions t .. t + K - 1 (a chain stops at the response's end). Divided by the number of positions it is the
    expected tokens per drafting step at K of a record's per-position `acceptance` (`record_acceptance`), every
    start weighing alike. Teacher-forced on greedy text it is exact for a drafter that reads tokens only: an
    accepted draft is the very token it would read next."""
    n = int(acceptance.numel())
    if k <= 0 or n == 0:
        return float(n)
    padded = torch.cat([acceptance.float().cpu(), torch.zeros(k - 1)])
    return float(n + accepted_drafts(padded.unfold(0, k, 1).T).sum())  # unfold: [n, k], row t = positions t..t+k-1


def served_temperature(temperature: float | None) -> float:
    """The temperature a record was served at: tiny (or NaN) temperatures were served greedy (0.0)."""
    t = float(temperature or 0.0)
    return t if t >= GREEDY_BELOW_TEMPERATURE else 0.0


def shadow_alpha(
    logits_fn: LogitsFn,
    records: Iterable[FeedbackRecord],
    device: torch.device | str = "cpu",
    max_positions: int | None = None,
) -> ShadowEstimate:
    """Estimated α of the drafter behind ``logits_fn`` on logged records.

    Every generated position counts (not only those that were drafted live), so the estimate
    does not depend on which K the live engine happened to use. An eagle head is scored on the
    records that carry the target's features (teacher-forced: true features at every input).
    """
    scores = record_scores(logits_fn, records, device, max_positions)
    hits = sum(h for _, h, _ in scores)
    total = sum(n for _, _, n in scores)
    return ShadowEstimate(alpha=acceptance_rate(hits, total), positions=total, records=len(scores))


Scores = list[tuple[FeedbackRecord, float, int]]
"""What `record_scores` returns: (record, expected accepted positions, positions) per scored record."""
