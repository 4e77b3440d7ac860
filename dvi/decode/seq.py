"""The engine's per-row host state between steps: the request, its `GenerationResult`, its own RNG
(`g_rand` draws its uniforms), its stop set and token budget (its draft state lives in its `dvi.drafters.proposer.Proposer`).

Kept apart from `dvi.engine.speculative` (which batches rows and runs the step) so a row's bookkeeping reads on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dvi.decode.acceptance import AcceptanceEMA
from dvi.decode.request import Request, SamplingParams
from dvi.decode.results import GenerationResult, Versions
from dvi.decode.sampling import Penalties, penalize

__all__ = ["Seq", "BatchParams", "row_generator", "g_rand", "fill_order"]


class Seq:
    """Per-row bookkeeping (host side)."""

    __slots__ = ("req", "res", "gen", "stop", "remaining", "acc", "pool")

    def __init__(self, req: Request, res: GenerationResult, gen, acc: AcceptanceEMA, pool: str = ""):
        self.req, self.res, self.gen, self.acc = req, res, gen, acc
        # its acceptance pool (`dvi.decode.acceptance.AcceptanceTracker`): rows of one domain drafted by one drafter
        # (its traffic group's adapter, or the base: a group's control rows and rows before its first adapter)
        self.pool = pool or req.domain
        self.stop = frozenset(int(t) for t in req.params.stop_token_ids or ())
        self.remaining = int(req.params.max_new_tokens)

    def tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.res.token_ids

    def close(self, reason: str, versions: Versions) -> GenerationResult:
        """Seal the row's result: why it ended, when, the weights that decoded it (its proposer has already
        added its own fields, e.g. eagle features)."""
        self.res.finish_reason = reason
        self.res.finished_at = time.time()
        self.res.target_version, self.res.drafter_version, self.res.adapter_version = versions
        return self.res


@dataclass
class BatchParams:
    """The batch's sampling parameters as tensors, rebuilt whenever rows join or leave."""

    temp: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor | None  # [B] long, None when no row uses top-k
    top_p: torch.Tensor | None  # [B] float32, None when no row uses top-p
    all_greedy: bool
    all_t1: bool  # every row at temperature 0 or 1 (log-probs need no rescaling)
    gens: list  # per-row torch.Generator (None for greedy rows)
    pen: Penalties | None = None  # None when no row has a penalty or a logit_bias
    _seen_cache: tuple | None = None  # (output lengths, counts, prompt_seen) of the current step
    seqs: list = field(default_factory=list, repr=False)  # the rows (their outputs feed the penalties)

    @classmethod
    def of(cls, seqs: list[Seq], device: torch.device, vocab_size: int = 0) -> BatchParams:
        ps = [s.req.params for s in seqs]
        tk, tp = [int(p.top_k) for p in ps], [float(p.top_p) for p in ps]
        return cls(
            temp=torch.tensor([float(p.temperature) for p in ps], dtype=torch.float32, device=device),
            top_k=torch.tensor(tk, dtype=torch.long, device=device) if any(tk) else None,
            top_p=torch.tensor(tp, dtype=torch.float32, device=device) if any(x < 1.0 for x in tp) else None,
            all_greedy=all(p.temperature == 0 for p in ps), all_t1=all(p.temperature in (0, 1) for p in ps),
            gens=[s.gen for s in seqs], pen=_penalties(ps, vocab_size, device), seqs=list(seqs))

    def transform(self, logits: torch.Tensor, drafts: torch.Tensor | list[torch.Tensor] | None = None,
                  ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """Each row's penalties and logit_bias on `logits` (`dvi.decode.sampling.penalize`); `logits` itself when no
        row has any. logits [B, S, V]: position s follows drafts d_1..d_s of `drafts` [B, >= S - 1] (the
        verify step; a draft tree's node s follows its ancestors', `ancestors` [B, S, S] bool); or [B, V]: follows
        every draft of `drafts` (a list of [B], the draft step so far)."""
        if self.pen is None:
            return logits
        flat = logits.dim() == 2
        x = logits.unsqueeze(1) if flat else logits  # [B, S, V]
        b, s, v = x.shape
        d = (torch.stack(drafts, 1) if drafts else None) if isinstance(drafts, list) else drafts  # [B, J] or None
        counts, prompt_seen = self._seen(self.seqs, v, x.device)  # [B, V] each
        counts = counts.unsqueeze(1).repeat(1, s, 1)  # [B, S, V]
        if d is not None and d.numel():
            step = torch.zeros(b, s, v, device=x.device)
            if flat:
                step[:, 0].scatter_add_(-1, d, torch.ones(d.shape, device=x.device))
            else:  # position j counts d_1..d_j
                step[:, 1:].scatter_add_(-1, d[:, : s - 1].unsqueeze(-1), torch.ones(b, s - 1, 1, device=x.device))
                step = step.cumsum(1) if ancestors is None else torch.bmm(ancestors.float(), step)
            counts = counts + step
        out = penalize(x, counts, prompt_seen, self.pen)
        return out.squeeze(1) if flat else out

    def _seen(self, seqs: list[Seq], v: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the counts [B, V] of its output tokens and its prompt's tokens [B, V] (bool); built once per
        step (the rows' outputs only grow between steps, and a new batch gets new BatchParams)."""
        key = tuple(len(sq.res.token_ids) for sq in seqs)
        if self._seen_cache is None or self._seen_cache[0] != key:
            counts = torch.zeros(len(seqs), v, device=device)
            prompt_seen = torch.zeros(len(seqs), v, dtype=torch.bool, device=device)
            for i, sq in enumerate(seqs):
                if sq.res.token_ids:
                    out = torch.tensor(sq.res.token_ids, device=device)
                    counts[i].scatter_add_(0, out, torch.ones(out.numel(), device=device))
                prompt_seen[i, torch.tensor(sq.req.prompt_ids, device=device)] = True
            self._seen_cache = (key, counts, prompt_seen)
        return self._seen_cache[1], self._seen_cache[2]


def _penalties(ps: list[SamplingParams], vocab_size: int, device: torch.device) -> Penalties | None:
    """The batch's logit transforms as tensors; None when no row has one."""
    if not any(p.transforms_logits() for p in ps):
        return None
    bias = None
    if any(p.logit_bias for p in ps):
        bias = torch.zeros(len(ps), vocab_size, device=device)
        for i, p in enumerate(ps):
            for t, val in (p.logit_bias or {}).items():
                bias[i, int(t)] = float(val)
    return Penalties(
        presence=torch.tensor([float(p.presence_penalty) for p in ps], device=device),
        frequency=torch.tensor([float(p.frequency_penalty) for p in ps], device=device),
        repetition=torch.tensor([float(p.repetition_penalty) for p in ps], device=device), bias=bias)


def row_generator(p: SamplingParams) -> torch.Generator | None:
    """A sampled row's own CPU generator (seeded when the request is), so its draws do not depend on its
    batch-mates; None for a greedy row."""
    if p.temperature <= 0:
        return None
    gen = torch.Generator(device="cpu")
    if p.seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(p.seed))
    return gen


def g_rand(gen: torch.Generator | None, n: int) -> torch.Tensor:
    if gen is None:
        return torch.zeros(n)
    return torch.rand(n, generator=gen)


def fill_order(rows: int, leaving: set[int]) -> list[int]:
    """The rows that stay when `leaving` go, as the new batch order: each leaving row's place taken by one of the
    last rows, the rest where they were. The caches then copy one row per leaving row, not every row behind it
    (in a continuous batch whose rows finish one at a time, shifting them all cost a full KV copy per finish)."""
    size = rows - len(leaving)
    keep = list(range(size))
    tail = (i for i in range(size, rows) if i not in leaving)
    for hole in (i for i in range(size) if i in leaving):
        keep[hole] = next(tail)
    return keep
