"""The engine's per-row host state between steps: the request, its `GenerationResult`, its own RNG
(`g_rand` draws its uniforms), its stop set and token budget (its draft state lives in its `dvi.proposers` proposer).

Kept apart from `dvi.engine` (which batches rows and runs the step) so a row's bookkeeping reads on its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dvi.acceptance import AcceptanceEMA
from dvi.request import Request, SamplingParams
from dvi.results import GenerationResult, Versions

__all__ = ["Seq", "BatchParams", "row_generator", "g_rand"]


class Seq:
    """Per-row bookkeeping (host side)."""

    __slots__ = ("req", "res", "gen", "stop", "remaining", "acc")

    def __init__(self, req: Request, res: GenerationResult, gen, acc: AcceptanceEMA):
        self.req, self.res, self.gen, self.acc = req, res, gen, acc
        self.stop = frozenset(int(t) for t in req.params.stop_token_ids or ())
        self.remaining = int(req.params.max_new_tokens)

    def tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.res.token_ids

    def close(self, reason: str, versions: Versions) -> GenerationResult:
        """Seal the row's result: why it ended, when, the weights that decoded it (its proposer has already
        added its own fields, e.g. eagle features)."""
        self.res.finish_reason = reason
        self.res.finished_at = time.time()
        self.res.target_version, self.res.drafter_version = versions
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

    @classmethod
    def of(cls, seqs: list[Seq], device: torch.device) -> BatchParams:
        ps = [s.req.params for s in seqs]
        tk, tp = [int(p.top_k) for p in ps], [float(p.top_p) for p in ps]
        return cls(
            temp=torch.tensor([float(p.temperature) for p in ps], dtype=torch.float32, device=device),
            top_k=torch.tensor(tk, dtype=torch.long, device=device) if any(tk) else None,
            top_p=torch.tensor(tp, dtype=torch.float32, device=device) if any(x < 1.0 for x in tp) else None,
            all_greedy=all(p.temperature == 0 for p in ps), all_t1=all(p.temperature in (0, 1) for p in ps),
            gens=[s.gen for s in seqs])


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
