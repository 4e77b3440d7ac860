"""Logits warping and lossless acceptance rules for speculative decoding.

Everything here is batched over rows that may each carry their own temperature / top-k / top-p.
Greedy rows (temperature 0) are represented as one-hot distributions, so the single rejection-sampling
rule below is exact for them too (accept iff the draft equals the argmax, else emit the argmax); an
all-greedy batch takes the cheaper argmax fast path (`greedy_accept`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dvi.decode import vocab_kernel

__all__ = [
    "Penalties",
    "penalize",
    "warp_probs",
    "sample_from",
    "greedy_accept",
    "acceptance_prob",
    "residual_distribution",
    "rejection_accept",
    "tie_bound",
    "TIE_ULPS",
    "first_divergence",
    "point_mass_accept",
    "draft_mask",
]


GREEDY_BELOW_TEMPERATURE = 1e-3
"""Temperatures in (0, this) are served as greedy (logits / 1e-45 overflow: NaN probabilities)."""


@dataclass
class Penalties:
    """One batch's logit transforms, one value per row (rows without any: 0, 0, 1, zero bias)."""

    presence: torch.Tensor  # [N] float32
    frequency: torch.Tensor  # [N] float32
    repetition: torch.Tensor  # [N] float32, 1 = off
    bias: torch.Tensor | None  # [N, V] float32 added to the logits; None when no row has a logit_bias


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """The target's logits as the request asked for them (OpenAI / vLLM semantics), before warping:
    + logit_bias; then the repetition penalty r on every token of the prompt or the output so far
    (logit / r if positive, * r if not); then - frequency * count - presence * (count > 0) over the
    output so far. A transform of the distribution: speculation stays lossless when drafts are
    judged against it (the engine passes, at draft position j, counts that include d_1..d_{j-1}).

    logits [N, S, V]; counts [N, S, V] (float) output-token counts each position has seen;
    prompt_seen [N, V] bool. Returns float32 [N, S, V]; -inf stays -inf.
    """
    n = logits.shape[0]
    x = logits.float()
    if pen.bias is not None:
        x = x + pen.bias.view(n, 1, -1)
    seen = (counts > 0) | prompt_seen.view(n, 1, -1)
    r = pen.repetition.view(n, 1, 1)
    x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    return x - pen.frequency.view(n, 1, 1) * counts - pen.presence.view(n, 1, 1) * (counts > 0).float()


def warp_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row temperature -> top-k -> top-p (HF order), returning probabilities.

    `logits` is [N, V] or [N, S, V]; `temperature`, `top_k`, `top_p` are [N] (one value per row).
    Rows with temperature 0 get a one-hot at the argmax so that greedy decoding is the same rule.
    `top_k`/`top_p` may be None when no row uses them (skips the sort).
    """
    squeeze = logits.dim() == 2
    x = logits.float()
    if squeeze:
        x = x.unsqueeze(1)
    n, s, v = x.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float().view(n, 1, 1)
    x = x / t
    if top_k is not None or top_p is not None:
        sorted_x, sorted_idx = x.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if top_k is not None:
            k = top_k.view(n, 1, 1).clamp(min=0, max=v)  # k >= V keeps everything
            ranks = torch.arange(v, device=x.device).view(1, 1, v)
            # k == 0 disables top-k; ties at the k-th value are kept (as in HF).
            kth = sorted_x.gather(-1, (k - 1).clamp(min=0).expand(n, s, 1))
            remove |= (k > 0) & (ranks >= k) & (sorted_x < kth)
        if top_p is not None:
            sp = torch.softmax(sorted_x.masked_fill(remove, float("-inf")), dim=-1)
            before = sp.cumsum(-1) - sp  # mass strictly before this token
            remove |= before >= top_p.view(n, 1, 1).float()
            remove[..., 0] = False  # always keep the top token
        mask = torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)
        x = x.masked_fill(mask, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.float().view(n, s, v).argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.view(n, 1, 1), onehot, probs)
    return probs.squeeze(1) if squeeze else probs


TIE_ULPS = 16
"""How many of the dtype's relative rounding steps (eps) at the top logit's magnitude two forwards of the
same tokens may disagree by. A 1-ulp difference in one layer's attention grows through a deep residual
stream: SmolLM2-135M in bf16, a verify's logits against the 1-token steps' before width-invariant
attention, up to 6.1 eps x |top logit| (0.81 logit, measured before the folded attention); 16 keeps a 2.6x
margin. bf16: |top| / 8; fp32: ~4e-5 at |top| 20."""


def tie_bound(top_logit: torch.Tensor | float, dtype: torch.dtype) -> float:
    """The top-2 logit gap below which `dtype`'s rounding may decide the argmax (a near-tie): a greedy
    decode that parts from another one of the same target only where the gap is this small is as exact as
    the dtype allows."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(1.0, abs(float(top_logit)))


def first_divergence(ref: list[int], other: list[int], ref_logits: list[torch.Tensor], dtype: torch.dtype
                     ) -> dict | None:
    """Where `other` first leaves the greedy decode `ref` (None if never), judged on the reference's logits
    there (`ref_logits[i]` [V]): `gap` = its top logit minus its logit of the token `other` chose (at least
    the top-2 gap), `bound` = `tie_bound`, `near_tie` = gap <= bound (the only place a lossless engine in
    `dtype` may part from the target's own decode)."""
    i = next((j for j, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b), None)
    if i is None:
        return None
    lg = ref_logits[i].float()
    top2 = lg.topk(2).values
    gap = float(top2[0] - lg[other[i]])
    bound = tie_bound(top2[0], dtype)
    return {"index": i, "ref": ref[i], "other": other[i], "top": float(top2[0]), "top2_gap": float(top2[0] - top2[1]),
            "gap": gap, "bound": bound, "near_tie": gap <= bound}


SAMPLE_BLOCK = 1024
"""Tokens a block of `sample_from`'s first level sums (vocabularies of at least four blocks sample in two levels)."""


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample one token per row from (unnormalised) `probs` [N, V] with uniforms `u` [N] in [0, 1).

    Drawing the uniforms from per-request generators up front keeps seeded runs reproducible while
    the sampling itself stays vectorised. A large vocabulary is searched in two levels, the same inverse CDF: the
    block of `SAMPLE_BLOCK` tokens the uniform falls in from the blocks' sums, then the token within it (a
    cumulative sum over the whole vocabulary costs several times a sum: 0.56 ms a step for 15 rows of 49,152 on AMD
    Zen 5, most of a sampled step's host work).
    """
    n, v = probs.shape
    if v < 4 * SAMPLE_BLOCK:
        cdf = probs.cumsum(-1)
        x = (u.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
        idx = torch.searchsorted(cdf, x, right=True).clamp_(max=v - 1)
    else:
        nb = -(-v // SAMPLE_BLOCK)
        padded = probs if nb * SAMPLE_BLOCK == v else torch.nn.functional.pad(probs, (0, nb * SAMPLE_BLOCK - v))
        blocks = padded.view(n, nb, SAMPLE_BLOCK)
        outer = blocks.sum(-1).cumsum(-1)  # [N, nb]: the mass up to each block's end
        x = (u.to(outer.dtype) * outer[:, -1]).unsqueeze(-1)
        b = torch.searchsorted(outer, x, right=True).clamp_(max=nb - 1)  # [N, 1]
        before = torch.where(b > 0, outer.gather(-1, (b - 1).clamp_(min=0)), torch.zeros_like(x))
        inner = blocks.gather(1, b.unsqueeze(-1).expand(n, 1, SAMPLE_BLOCK)).squeeze(1).cumsum(-1)  # [N, block]
        j = torch.searchsorted(inner, x - before, right=True).clamp_(max=SAMPLE_BLOCK - 1)
        idx = (b * SAMPLE_BLOCK + j).clamp_(max=v - 1)
    # Guard float edge cases (u*total rounding up to total): never return a zero-probability token.
    bad = probs.gather(-1, idx) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(-1, keepdim=True), idx)
    return idx.squeeze(-1)


def draft_mask(lens: torch.Tensor | None, b: int, k: int, device: torch.device) -> torch.Tensor | None:
    """[B, K] True where column j < lens[i] (row i's real drafts; padding after them is never accepted)."""
    if lens is None:
        return None
    return torch.arange(k, device=device).view(1, k) < lens.view(b, 1)


def real_positions(lens: list[int], k1: int, device: torch.device | None = None) -> torch.Tensor:
    """Flat indices (i * k1 + j, j <= lens[i]) of a ragged verify's scored positions: each row's last token and its
    real drafts, of k1 = K + 1 a row."""
    idx = [i * k1 + j for i, n in enumerate(lens) for j in range(min(int(n), k1 - 1) + 1)]
    return torch.tensor(idx, dtype=torch.long, device=device)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dim (the first of equal maxima, as `argmax`): on a CPU through dvi's vocabulary kernel
    (one vectorized pass), else `max`, which torch's CPU runs ~2.8x faster than `argmax` (fp32, one thread, Intel
    AMX: 5.4 against 1.9 ms for 16 x 5 x 49,152), every step of a batch verify."""
    kernel = vocab_kernel.load() if logits.device.type == "cpu" else None
    if kernel is not None and kernel.serves(logits):
        return kernel.argmax(logits)
    return logits.max(-1).indices


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor,
                  lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept the longest prefix of drafts equal to the target's argmax.

    draft_ids [B, K], target_logits [B, K+1, V], lens [B] real drafts per row (None: all K) ->
    (num_accepted [B], next_token [B]) where next_token is the target's argmax right after the accepted
    prefix (correction or bonus token). With `lens` only each row's positions up to its drafts are read (a ragged
    verify leaves the others unset): one row drafting deep costs an argmax per real position, not per row.
    """
    b, k = draft_ids.shape
    if lens is None:
        tgt = greedy_tokens(target_logits)
    else:
        idx = draft_mask(lens + 1, b, k + 1, draft_ids.device).view(-1).nonzero().squeeze(1)  # (`real_positions`)
        flat = greedy_tokens(target_logits.reshape(b * (k + 1), -1).index_select(0, idx))
        tgt = torch.zeros(b * (k + 1), dtype=flat.dtype, device=flat.device).index_copy_(0, idx, flat).view(b, k + 1)
    match = (draft_ids == tgt[:, :k])
    valid = draft_mask(lens, b, k, draft_ids.device)
    if valid is not None:
        match = match & valid
    match = match.to(torch.int64)
    n = match.cumprod(1).sum(1)
    return n, tgt.gather(1, n.unsqueeze(1)).squeeze(1)


def acceptance_prob(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d)/q(d)) for drafts `draft` [...] under target p and draft q [..., V]."""
    pd = p.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    qd = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    return torch.where(qd > 0, (pd / qd.clamp_min(1e-30)).clamp(max=1.0), torch.ones_like(pd))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Normalised (p - q)+, the distribution to resample from after a rejection (falls back to p if p == q)."""
    r = (p - q).clamp_min(0)
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / z.clamp_min(1e-30), p)


def _accepted_run(accept: torch.Tensor, lens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row the length of the leading run of accepted drafts: accept [B, K] bool, lens [B] real drafts per
    row (None: all K). Returns (n [B], the valid-drafts mask [B, K] or None)."""
    b, k = accept.shape
    valid = draft_mask(lens, b, k, accept.device)
    if valid is not None:
        accept = accept & valid
    return accept.to(torch.int64).cumprod(1).sum(1), valid


def rejection_accept(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan/Chen speculative sampling for a batch.

    draft_ids [B, K] were sampled from draft_probs q [B, K, V]; target_probs p [B, K+1, V] are the target's
    warped distributions at the K+1 verified positions. Draft j is accepted when u_accept[:, j] < p/q;
    the first rejection resamples from (p - q)+, and if all K survive the bonus token is drawn from p[:, K].
    `lens` [B] (None: all K): row i drafted only its first lens[i] columns; at column lens[i] its next token is
    the bonus, drawn from p (a step with K = lens[i]). Returns (num_accepted [B], next_token [B]); every
    emitted token is distributed exactly as p.
    """
    b, k = draft_ids.shape
    pd = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    qd = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    n, valid = _accepted_run(u_accept[:, :k].to(pd.dtype) * qd < pd, lens)
    if valid is not None:
        draft_probs = draft_probs * valid.unsqueeze(-1).to(draft_probs.dtype)  # q = 0 past a row's drafts
    rows = torch.arange(b, device=draft_ids.device)
    p_n = target_probs[rows, n]
    q_ext = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    q_n = q_ext[rows, n]  # zeros at the bonus position -> residual == p
    return n, sample_from(residual_distribution(p_n, q_n), u_sample)


def point_mass_accept(
    draft_ids: torch.Tensor,
    target_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of point-mass drafts (suffix proposals: q one-hot at the draft), without the
    [B, K, V] one-hot: draft x is accepted with probability p(x) (min(1, p/q) with q(x) = 1), and the first
    rejection samples from (p - q)+ = p with x removed.

    draft_ids [B, K], target_probs p [B, K+1, V], u_accept [B, >= K], u_sample [B], lens [B] (None: all K;
    row i's bonus at column lens[i] is drawn from p). Returns (num_accepted [B], next_token [B]).
    """
    b, k = draft_ids.shape
    pd = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)  # [B, K]
    n, _ = _accepted_run(u_accept[:, :k].to(pd.dtype) < pd, lens)  # [B]
    rows = torch.arange(b, device=draft_ids.device)
    p_n = target_probs[rows, n].clone()  # [B, V]
    rejected = n < (lens if lens is not None else torch.full_like(n, k))  # [B]: stopped at a draft, not the bonus
    x = torch.cat([draft_ids, draft_ids[:, :1]], 1)[rows, n]  # [B] the rejected draft (ignored for bonus rows)
    removed = p_n.scatter(1, x.unsqueeze(1), 0.0)
    ok = rejected & (removed.sum(-1) > 0)  # p(x) = 1 is never rejected; guard float edge cases anyway
    p_n = torch.where(ok.unsqueeze(1), removed, p_n)
    return n, sample_from(p_n, u_sample)
