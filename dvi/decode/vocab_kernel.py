"""A step's passes over the vocabulary on x86-64 CPUs with AVX2 and FMA (`vocab_kernel.c`): the greedy token, and the
emitted positions' log-denominator and top k.

Why its own kernel: every step runs them over every row's full vocabulary, and torch does it in separate calls (max
with indices, a copy to fp32, logsumexp, topk), each its own pass: ~2 ms of a 21 ms 16-row bf16 step on SmolLM2
(docs/design.md, "Where a plain step goes"). `load()` is None where it cannot run (the reason logged once); the
callers then keep torch's calls.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from dvi.decode.native import loaded_once

__all__ = ["VocabKernel", "load"]

SOURCE = Path(__file__).with_name("vocab_kernel.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class VocabKernel:
    """Rows of logits [..., V] (last dim contiguous, fp32 or bf16, on the CPU): `argmax`, `stats`."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._argmax, self._stats = {}, {}
        for dtype, sfx in _SUFFIX.items():
            a = getattr(lib, f"dvi_argmax_{sfx}")
            a.argtypes, a.restype = [ptr, i64, i64, i64, ptr], None
            s = getattr(lib, f"dvi_vocab_stats_{sfx}")
            s.argtypes, s.restype = [ptr, i64, i64, i64, i64, ptr, ptr, ptr], None
            self._argmax[dtype], self._stats[dtype] = a, s

    @staticmethod
    def serves(x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _SUFFIX and x.dim() >= 1 and x.shape[-1] > 0 and x.stride(-1) == 1

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., V] -> [...] int64: the first index of each row's largest logit (as `x.max(-1).indices`)."""
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], dtype=torch.long)
        if rows.shape[0]:
            self._argmax[x.dtype](rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), out.data_ptr())
        return out.view(x.shape[:-1])

    def stats(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, V] -> (logsumexp [M] fp32, top-k logits [M, k] fp32 descending, their ids [M, k]); 1 <= k <= V."""
        m, v = x.shape
        if not 1 <= k <= v:
            raise ValueError(f"top k must be in [1, {v}], got {k}")
        lse = torch.empty(m, dtype=torch.float32)
        vals, ids = torch.empty(m, k, dtype=torch.float32), torch.empty(m, k, dtype=torch.long)
        if m:
            self._stats[x.dtype](x.data_ptr(), m, v, x.stride(0), k, lse.data_ptr(), vals.data_ptr(), ids.data_ptr())
        return lse, vals, ids


_loaded = loaded_once(SOURCE, FLAGS, frozenset({"avx2", "fma"}), VocabKernel, "torch's max / logsumexp / topk serve")


def load() -> VocabKernel | None:
    """The kernel, built on first use; None where it cannot run (logged once)."""
    return _loaded()[0]
