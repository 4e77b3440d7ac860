"""The CPU matmul paths a lean forward takes beside F.linear (`dvi.decode.lean.LeanModel.linear`, `_logits`): the LM
head in blocks that stay in cache, and from how many rows that is faster on this CPU; oneDNN's prepacked weights.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

__all__ = ["HEAD_BLOCK", "blockwise", "head_block_rows", "packed_linear"]

HEAD_BLOCK = 1024
"""Rows of the LM head per GEMM when a forward scores several rows on a CPU (`LeanModel._logits`)."""


def head_block_rows(head: torch.Tensor, blocks: tuple[torch.Tensor, ...], rows: tuple[int, ...] = (2, 3, 5, 9, 17),
                    reps: int = 3) -> int | None:
    """The fewest rows from which the LM head runs faster blockwise than as one GEMM on this CPU (None: never),
    timed at `rows`, arms interleaved, best of `reps`: from the first probed count where the blocks win by 3% and
    keep winning at every larger one. The two agree to the GEMM's rounding, which is not promised bitwise on every
    CPU: the greedy contract is measured on the path chosen (`dvi.decode.invariance`)."""
    faster = []
    for m in rows:
        x = torch.randn(m, head.shape[1], dtype=head.dtype, device=head.device)
        _timed(F.linear, x, head), _timed(blockwise, x, blocks)  # warm both paths
        times = [(_timed(F.linear, x, head), _timed(blockwise, x, blocks)) for _ in range(reps)]
        faster.append(min(t[1] for t in times) < 0.97 * min(t[0] for t in times))
    for i, m in enumerate(rows):
        if all(faster[i:]):
            return m
    return None


def blockwise(x: torch.Tensor, blocks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([F.linear(x, w) for w in blocks], -1)


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear on a weight `LeanModel.pack_multirow` reordered for oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
