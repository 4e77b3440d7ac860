"""The CPU matmul paths a lean forward takes beside F.linear (`dvi.decode.lean.LeanModel.linear`, `_logits`): the LM
head in blocks that stay in cache, and from how many rows that is faster on this CPU; oneDNN's prepacked weights, and
which forwards take them (`pack_plan`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["AMX_ALIKE_ROWS", "HEAD_BLOCK", "NO_PACKS", "PackPlan", "blockwise", "head_block_rows", "pack_plan",
           "packed_linear"]

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


class PackPlan(NamedTuple):
    """Which forwards take oneDNN's packs (`LeanModel.pack_multirow`), and how."""

    rows: int  # the GEMM rows the weights are reordered for
    from_rows: int  # matmuls of at least this many rows take the packs (fewer: F.linear)
    alike: int  # matmuls of up to this many rows round each row as the row alone does (0: not promised); wider ones
    # run in pieces of this many, so that every row of every forward has a lone row's bits


NO_PACKS = PackPlan(0, 2, 0)
AMX_ALIKE_ROWS = 128
"""Rows up to which oneDNN's AMX bf16 GEMM on weights packed for one row gives each row a lone row's bits (measured on
an Intel Xeon with AMX for the embedded pair's shapes: 129; checked at start-up, `dvi.decode.target.target_runner`)."""


def pack_plan(device: torch.device, dtype: torch.dtype, rows: int, flags: frozenset[str]) -> PackPlan | None:
    """fp32: forwards of more than one row on weights reordered for `rows`-row GEMMs (one-row steps keep MKL's GEMV,
    faster than its GEMM on AVX2 CPUs). bf16 on a CPU with AMX (`flags`): every forward, on weights reordered for
    one-row GEMMs, whose AMX kernels stream the weights at about a one-row step's cost up to a few dozen rows (a
    verify or a batch row nearly free) and keep each row's bits those of the row alone (`AMX_ALIKE_ROWS`); torch's
    unpacked bf16 path costs more at every row count there. None elsewhere (nothing packed)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if dtype == torch.float32:
        return PackPlan(rows, 2, 0)
    if dtype == torch.bfloat16 and "amx_bf16" in flags:
        return PackPlan(1, 1, AMX_ALIKE_ROWS)
    return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, alike: int = 0) -> torch.Tensor:
    """F.linear on a weight `LeanModel.pack_multirow` reordered for oneDNN; rows past `alike` in pieces (`PackPlan`)."""
    if alike and x.numel() > alike * x.shape[-1]:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.cat([_packed(p, packed, bias) for p in rows.split(alike)])
        return out.view(*x.shape[:-1], out.shape[-1])
    return _packed(x.contiguous(), packed, bias)


def _packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
