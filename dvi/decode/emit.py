"""What one verify step emits, per row: its accepted drafts d_1..d_n and the target's token after them
(the correction at the first rejection, or the bonus after K accepted), with their log-probs and the
target's top-k (tensor side, once per step), and how they land on the row's `GenerationResult`.

Row i's emitted tokens are columns 0..n_i of the [B, K + 1] grid `tokens`: d_1..d_{n_i}, then the
target's token at column n_i.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from dvi.decode import vocab_kernel
from dvi.decode.sources import source_code

if TYPE_CHECKING:
    from dvi.decode.results import GenerationResult

__all__ = ["Emitted", "emitted", "count_drafts", "append_tokens"]


@dataclass
class Emitted:
    """One step's emitted tokens on the host, as lists indexed [row][column]."""

    n: list[int]  # [B] drafts accepted, in [0, K]
    tokens: list[list[int]]  # [B, K + 1]; columns past n_i are rejected drafts, not emitted
    logprobs: list[list[float]]  # [B, n_i + 1] (K + 1 off a CPU) target log-prob of each token, log_softmax(logits / T)
    drafts: list[list[int]] | None  # [B, K]; None when K = 0
    topk_ids: list[list[list[int]]] | None  # [B, n_i + 1 (K + 1 off a CPU), top_k] target raw top-k; None: top_k 0
    topk_logprobs: list[list[list[float]]] | None  # the same shape


def emitted(draft_ids: torch.Tensor | None, n: torch.Tensor, nxt: torch.Tensor, logits: torch.Tensor,
            temp: torch.Tensor, all_t1: bool, top_k: int) -> Emitted:
    """draft_ids [B, K] (None: K = 0), n [B], nxt [B], logits [B, K + 1, V], temp [B] (0: greedy, scored at T = 1).

    On a CPU only the emitted positions (row i's columns 0..n_i) are scored for log-probs and the top-k: a verify's
    rejected positions are never read, and scoring them cost a drafting step a full-vocabulary pass per verified
    position, so the step's host work grew with its width, not with what it emitted. Elsewhere every position is
    scored (no transfer before the step's one)."""
    if draft_ids is None:
        logits = logits[:, :1]
    b, k1, v = logits.shape[0], logits.shape[1], logits.shape[-1]
    # Emitted tokens per row: d_1..d_n then nxt at column n.
    if draft_ids is None:
        tok = nxt.view(b, 1)  # [B, 1]
    else:
        tok = torch.cat([draft_ids, nxt.unsqueeze(1)], 1)  # [B, K + 1]
        tok = tok.scatter(1, n.unsqueeze(1), nxt.unsqueeze(1))
    cpu = logits.device.type == "cpu"
    counts = [int(c) + 1 for c in n.tolist()] if cpu and draft_ids is not None else [k1] * b
    lf, toks = logits.reshape(b * k1, v), tok.reshape(-1)  # every position; on a CPU the emitted ones: [M, V]
    if cpu:
        idx = torch.tensor([i * k1 + j for i, c in enumerate(counts) for j in range(c)], dtype=torch.long)
        lf, toks = lf.index_select(0, idx), toks.index_select(0, idx)
    kt = min(top_k, v) if top_k > 0 else 0
    kernel = vocab_kernel.load() if cpu and all_t1 and kt else None
    if kernel is not None and kernel.serves(lf):  # one pass for the log-denominator and the top k together
        lse_m, tv, ti = kernel.stats(lf, kt)  # lf: the emitted rows, gathered contiguous above
        tok_lp = lf.gather(-1, toks.unsqueeze(-1)).squeeze(-1).float() - lse_m
        return _unpack(b, k1, draft_ids, counts, [n.view(b), tok.reshape(-1)], tok_lp, (ti, tv - lse_m.unsqueeze(-1)))
    lf = lf.float()
    lse = torch.logsumexp(lf, -1, keepdim=True)  # [M, 1]: one pass over the vocabulary serves both below
    if all_t1:
        tok_lp = (lf.gather(-1, toks.unsqueeze(-1)) - lse).squeeze(-1)  # [M]
    else:
        t = torch.where(temp > 0, temp, 1.0).repeat_interleave(torch.tensor(counts, device=temp.device))
        scaled = lf / t.unsqueeze(-1)
        tok_lp = scaled.gather(-1, toks.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, -1)
    top = None
    if kt:
        tv, ti = lf.topk(kt, dim=-1)  # [M, top_k]: the raw logits' order is the log-probs'
        top = (ti, tv - lse)
    return _unpack(b, k1, draft_ids, counts, [n.view(b), tok.reshape(-1)], tok_lp, top)


def _unpack(b: int, k1: int, draft_ids: torch.Tensor | None, counts: list[int], head: list[torch.Tensor],
            tok_lp: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None) -> Emitted:
    """The step's one device -> host transfer (n, tokens, drafts, log-probs, top k: ids and log-probs [M, k] in one
    tensor), unpacked per row."""
    parts = head + ([draft_ids.reshape(-1)] if draft_ids is not None else []) + [tok_lp]
    kt = 0 if top is None else top[0].shape[-1]
    if top is not None:
        parts += [top[0].reshape(-1), top[1].reshape(-1)]
    flat = torch.cat([x.reshape(-1).double() for x in parts]).tolist()
    n_l = [int(x) for x in flat[:b]]
    at = b + b * k1
    tok_l = [[int(x) for x in flat[b + i * k1 : b + (i + 1) * k1]] for i in range(b)]
    draft_l = None
    if draft_ids is not None:
        kd = draft_ids.shape[1]
        draft_l = [[int(x) for x in flat[at + i * kd : at + (i + 1) * kd]] for i in range(b)]
        at += b * kd
    starts = [0, *accumulate(counts)]
    m = starts[-1]
    lp_l = [flat[at + starts[i] : at + starts[i + 1]] for i in range(b)]
    at += m
    topk_i = topk_v = None
    if kt:
        ids, vals = flat[at : at + m * kt], flat[at + m * kt : at + 2 * m * kt]
        topk_i = [[[int(x) for x in ids[p * kt : (p + 1) * kt]] for p in range(starts[i], starts[i + 1])]
                  for i in range(b)]
        topk_v = [[vals[p * kt : (p + 1) * kt] for p in range(starts[i], starts[i + 1])] for i in range(b)]
    return Emitted(n_l, tok_l, lp_l, draft_l, topk_i, topk_v)


def count_drafts(res: GenerationResult, k: int, n: int, source: str | None = None,
                 ranks: list[int] | None = None, sources: list[str | None] | None = None) -> None:
    """A step with K > 0 drafts of `source` (a `dvi.decode.sources.SOURCES` entry), n of them accepted, on the
    row's acceptance counts (also per source: [steps, drafted, accepted]; per draft position where a tree's path
    mixed proposers, `sources`); by sibling rank, `ranks` the accepted nodes' in a draft tree, else the chain's."""
    by_rank = res.accepted_by_rank
    for r in (ranks[:n] if ranks is not None else [0] * n):
        by_rank[min(r, len(by_rank) - 1)] += 1
    if sources is not None:
        for src in dict.fromkeys(s for s in sources[:k] if s is not None):
            res.by_source.setdefault(src, [0, 0, 0])[0] += 1
        for j, src in enumerate(sources[:k]):
            if src is not None:
                c = res.by_source[src]
                c[1], c[2] = c[1] + 1, c[2] + (j < n)
    elif source is not None:
        c = res.by_source.setdefault(source, [0, 0, 0])
        c[0], c[1], c[2] = c[0] + 1, c[1] + k, c[2] + n
    res.num_drafted += k
    res.num_accepted += n
    for j in range(k):
        res.drafted_per_position[j] += 1
    for j in range(n):
        res.accepted_per_position[j] += 1


def append_tokens(res: GenerationResult, e: Emitted, i: int, k: int, stop: frozenset[int],
                  remaining: int, source: str | None | list[str | None] = None) -> tuple[list[int], str | None]:
    """Row i's emitted tokens (and their feedback fields) onto its result, up to and including the first
    stop token or the last of its `remaining` budget; returns them and the finish reason (None: running).
    k: row i's real drafts this step; source: who proposed them (recorded per drafted token; a list: per draft
    position, a tree's path through several proposers' nodes)."""
    ni = e.n[i]
    codes = [source_code(s) for s in source] if isinstance(source, list) else [source_code(source)] * k
    new: list[int] = []
    for j in range(ni + 1):
        t = e.tokens[i][j]
        new.append(t)
        res.token_ids.append(t)
        res.token_logprobs.append(e.logprobs[i][j])
        res.drafted_ids.append(e.drafts[i][j] if j < k else -1)
        res.draft_source.append(codes[j] if j < k else 0)
        res.accepted.append(j < ni)
        if e.topk_ids is not None:
            res.topk_ids.append(e.topk_ids[i][j])
            res.topk_logprobs.append(e.topk_logprobs[i][j])
        if t in stop:
            return new, "stop"
        if remaining - len(new) <= 0:
            return new, "length"
    return new, None
