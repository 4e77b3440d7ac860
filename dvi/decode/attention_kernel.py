"""Decode attention for fp32 and bf16 slot caches on x86-64 CPUs with AVX2 and FMA (`attention_kernel.c`), widened to
16 lanes where the CPU has AVX-512 (`attention_kernel_avx512.c`).

Why its own kernel: a step's queries are a few a row, each over its own row's cached columns; torch's SDPA pays a
call's setup per layer, computes the padded columns a mask then hides, and rounds a query with what it shares the
call with. Here each query reads exactly its row's visible columns: a verify row rounds like the step it stands
for and a batch row like its lone decode, at a fraction of SDPA's cost (docs/design.md, "Where a plain step goes").
`load()` is None where it cannot run (the reason logged once): torch's SDPA serves.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from dvi.decode.native import loaded_once

__all__ = ["AttentionKernel", "KernelPlan", "builds", "load", "prefix_plan", "unavailable_reason"]

SOURCE = Path(__file__).with_name("attention_kernel.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")
SOURCE_AVX512 = Path(__file__).with_name("attention_kernel_avx512.c")  # 16 lanes where the CPU has AVX-512
FLAGS_AVX512 = ("-O3", "-mavx512f", "-mavx2", "-mfma", "-fPIC", "-shared")
MAX_HEAD_DIM = 256  # attention_kernel.c's stack buffers


class KernelPlan(NamedTuple):
    """Which columns each of a forward's n queries attends (int64 CPU tensors, contiguous; the caller's promise: the
    kernel reads what they say): query i reads batch row rows[i]'s columns 0 .. prefix[i] - 1, then (a draft tree's
    nodes) extra[i, :counts[i]], its ancestors' columns and its own in depth order; `most` bounds prefix + counts."""

    rows: torch.Tensor
    prefix: torch.Tensor
    most: int
    extra: torch.Tensor  # [n, width]
    counts: torch.Tensor  # [n]


def prefix_plan(rows: torch.Tensor, prefix: torch.Tensor) -> KernelPlan:
    """Query i over row rows[i]'s columns 0 .. prefix[i] - 1 only."""
    none = torch.zeros(rows.shape[0], dtype=torch.long)  # no extra columns (every query has a count: zero)
    return KernelPlan(rows, prefix, int(prefix.max()) if prefix.numel() else 0, none.view(-1, 1), none)


class AttentionKernel:
    """Queries over the rows of a slot cache's strided key / value views, each over its first `visible` columns."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fns = {}
        for dtype, name in ((torch.float32, "dvi_attend_f32"), (torch.bfloat16, "dvi_attend_bf16")):
            fn = getattr(lib, name)
            fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, i64,
                           ctypes.c_float, ptr, ptr]
            fn.restype = None
            self._fns[dtype] = fn

    @staticmethod
    def supports(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str | None:
        """None where the kernel attends this shape, else why not."""
        if dtype not in (torch.float32, torch.bfloat16):
            return f"{dtype} caches"
        if head_dim % 8 or head_dim > MAX_HEAD_DIM:
            return f"head_dim {head_dim} (a multiple of 8 up to {MAX_HEAD_DIM})"
        if heads % kv_heads:
            return f"{heads} heads over {kv_heads} kv heads"
        return None

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: KernelPlan,
               scale: float) -> torch.Tensor:
        """q [n, heads, D] (rows strided, heads and D contiguous) over keys / values [B, kv_heads, columns, D] (the
        same strides, D contiguous), each query over the columns `plan` gives it -> [n, heads * D]."""
        n, heads, d = q.shape
        kvh = keys.shape[1]
        if q.stride(2) != 1 or q.stride(1) != d or keys.stride() != values.stride() or keys.stride(3) != 1:
            raise ValueError("attention kernel: q's heads and the caches' head_dim must be contiguous")
        out = torch.empty(n, heads * d, dtype=q.dtype)
        if n:  # the scores' scratch per call: an engine and its drafter, or two engines' threads, never share it
            scratch = torch.empty(heads * (2 * d + plan.most) + 8, dtype=torch.float32)  # `ATTEND`'s layout
            self._fns[q.dtype](q.data_ptr(), q.stride(0), heads, kvh, d, keys.data_ptr(), values.data_ptr(),
                               keys.stride(0), keys.stride(1), keys.stride(2), plan.rows.data_ptr(),
                               plan.prefix.data_ptr(), plan.extra.data_ptr(), plan.extra.stride(0),
                               plan.counts.data_ptr(), n, scale, out.data_ptr(), scratch.data_ptr())
        return out


_loaded = loaded_once(SOURCE, FLAGS, frozenset({"avx2", "fma"}), AttentionKernel, "torch's SDPA serves")
_loaded_avx512 = loaded_once(SOURCE_AVX512, FLAGS_AVX512, frozenset({"avx512f", "avx2", "fma"}), AttentionKernel,
                             "the AVX2 build serves")


def builds() -> list[AttentionKernel]:
    """Every build this CPU runs, the one `load` serves first: the AVX-512 build where it has AVX-512, the AVX2 one."""
    return [k for k in (_loaded_avx512()[0], _loaded()[0]) if k is not None]


def load() -> AttentionKernel | None:
    """The kernel, built on first use (AVX-512 where the CPU has it, else AVX2: one build a process, so every forward
    rounds alike); None where neither can run (`unavailable_reason` says why, logged once)."""
    found = builds()
    return found[0] if found else None


def unavailable_reason() -> str | None:
    return None if builds() else _loaded()[1]
