"""The engine's per-row host state between steps: the request, its `GenerationResult`, its own RNG
(`g_rand` draws its uniforms), the tokens its drafter cache still lacks, its stop set and token budget.

Kept apart from `dvi.engine` (which batches rows and runs the step) so a row's bookkeeping reads on its own.
"""

from __future__ import annotations

import torch

from dvi.adaptive import AcceptanceEMA
from dvi.request import Request
from dvi.results import GenerationResult

__all__ = ["Seq", "g_rand"]


class Seq:
    """Per-row bookkeeping (host side)."""

    __slots__ = ("req", "res", "gen", "pending", "stop", "remaining", "acc")

    def __init__(self, req: Request, res: GenerationResult, gen, acc: AcceptanceEMA):
        self.req, self.res, self.gen, self.acc = req, res, gen, acc
        self.pending: list[int] = []
        self.stop = frozenset(int(t) for t in req.params.stop_token_ids or ())
        self.remaining = int(req.params.max_new_tokens)

    def tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.res.token_ids


def g_rand(gen: torch.Generator | None, n: int) -> torch.Tensor:
    if gen is None:
        return torch.zeros(n)
    return torch.rand(n, generator=gen)
