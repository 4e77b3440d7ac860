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

    __slots__ = ("req", "res", "gen", "pending", "stop", "remaining", "acc", "feats")

    def __init__(self, req: Request, res: GenerationResult, gen, acc: AcceptanceEMA):
        self.req, self.res, self.gen, self.acc = req, res, gen, acc
        self.pending: list[int] = []
        # eagle drafters: the target's features f_0..f_{L-2} of the row's L tokens, as chunks [n, H]
        self.feats: list[torch.Tensor] = []
        self.stop = frozenset(int(t) for t in req.params.stop_token_ids or ())
        self.remaining = int(req.params.max_new_tokens)

    def tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.res.token_ids

    def pending_features(self, hidden_size: int) -> torch.Tensor:
        """Features F [m, H] of the m pending tokens (the row's last m): F_j = f_{j-1}, F_0 = 0."""
        m, rows, have = len(self.pending), [], 0
        for chunk in reversed(self.feats):
            rows.append(chunk[max(0, chunk.shape[0] - (m - have)):])
            have += rows[-1].shape[0]
            if have >= m:
                break
        if have < m:  # the pending tokens include x_0, which no feature precedes
            ref = self.feats[0] if self.feats else None
            rows.append(torch.zeros(m - have, hidden_size) if ref is None else ref.new_zeros(m - have, hidden_size))
        return torch.cat(rows[::-1]) if len(rows) > 1 else rows[0]


def g_rand(gen: torch.Generator | None, n: int) -> torch.Tensor:
    if gen is None:
        return torch.zeros(n)
    return torch.rand(n, generator=gen)
