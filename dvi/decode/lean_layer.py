"""A decoder layer's projections in `dvi.decode.lean.LeanModel.forward`, three ways: torch's calls around each matmul
(`TorchMath`); dvi's rows kernel with the RMS norms, the SwiGLU and the residual adds folded into its calls
(`FusedMath`, `dvi/decode/rows_fused.h`), RoPE and the cache write with them; or the kernel's elementwise calls around
another library's matmuls (`KernelMath`: oneDNN's packs).

Why both: at a decode step's few rows the elementwise work costs its calls' overhead, not its arithmetic (a norm is six
torch calls), so where the rows kernel serves a forward's every matmul the forward makes one call a projection;
per-row LoRA adapters read the normed input the fused calls never materialise, so forwards with them keep torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["FusedMath", "KernelMath", "TorchMath", "layer_math"]


class TorchMath:
    """lin(rms_norm(x)), x + lin(inp), x + lin(silu(gate) * up) as torch calls, per-row adapters (`ad`) added."""

    def __init__(self, lin: Callable, hidden: int, eps: float, ad: Any = None):
        self.lin, self.hidden, self.eps, self.ad = lin, hidden, eps, ad

    def normed(self, x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, i: int,
               name: str) -> torch.Tensor:
        h = F.rms_norm(x, (self.hidden,), ln, self.eps)
        y = self.lin(h, w, bias)
        return self.ad.add(i, name, h, y) if self.ad else y

    @staticmethod
    def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slot: torch.Tensor,
                   col: torch.Tensor, heads: int) -> torch.Tensor:
        """qkv [n, heads + 2 kv_heads, 2, D / 2] rotated (RoPE on q and k; v * 1 + 0), its k and v stored to the
        layer's cache `kv` at (slot, col)."""
        qkv = qkv * cos + qkv.flip(2) * sin
        n, kvh, d = qkv.shape[0], kv.shape[3], kv.shape[4]
        kv.index_put_((slot, col), qkv[:, heads:].view(n, 2, kvh, d))
        return qkv

    def added(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, i: int, name: str) -> torch.Tensor:
        y = self.lin(inp, w)
        return x + (self.ad.add(i, name, inp, y) if self.ad else y)

    def swiglu_added(self, x: torch.Tensor, gu: torch.Tensor, w: torch.Tensor, i: int, name: str) -> torch.Tensor:
        gate, up = gu.chunk(2, -1)
        return self.added(x, F.silu(gate) * up, w, i, name)


class KernelMath(TorchMath):
    """TorchMath's matmuls (oneDNN's packed weights, torch's GEMM) with the norms, the SwiGLU and RoPE through the rows
    kernel's elementwise calls (`RowsKernel.prologue`, `rope_store`): where the kernel serves no matmul (an AMX CPU's
    bf16 forwards run on oneDNN's packs), a forward still makes one call where torch makes six."""

    def __init__(self, kernel: Any, lin: Callable, hidden: int, eps: float, ad: Any = None):
        super().__init__(lin, hidden, eps, ad)
        self.kernel = kernel

    def normed(self, x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, i: int,
               name: str) -> torch.Tensor:
        h = self.kernel.prologue(x, (ln, self.eps))
        y = self.lin(h, w, bias)
        return self.ad.add(i, name, h, y) if self.ad else y

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slot: torch.Tensor,
                   col: torch.Tensor, heads: int) -> torch.Tensor:
        return _kernel_rope(self.kernel.rope_store, qkv, cos, sin, kv, slot, col, heads)

    def swiglu_added(self, x: torch.Tensor, gu: torch.Tensor, w: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return self.added(x, self.kernel.prologue(gu), w, i, name)


def layer_math(kernel: Any, elementwise: Any, panels_of: dict, lin: Callable, hidden: int, eps: float, ad: Any,
               fused: bool) -> TorchMath | KernelMath | FusedMath:
    """A forward's math: the rows kernel's fused calls where it serves every matmul (`fused`) and no adapter reads the
    normed rows; else its elementwise calls around `lin` where it loaded (`elementwise`); else torch's."""
    if fused and ad is None:
        return FusedMath(kernel, panels_of, eps)
    return KernelMath(elementwise, lin, hidden, eps, ad) if elementwise is not None else TorchMath(lin, hidden, eps, ad)


class FusedMath:
    """The same three through the rows kernel's fused calls (`RowsKernel.fused`) on its packed weights."""

    def __init__(self, kernel: Any, panels_of: dict, eps: float):
        self.fused, self.rope, self.panels_of, self.eps = kernel.fused, kernel.rope_store, panels_of, eps

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, slot: torch.Tensor,
                   col: torch.Tensor, heads: int) -> torch.Tensor:
        return _kernel_rope(self.rope, qkv, cos, sin, kv, slot, col, heads)

    def normed(self, x: torch.Tensor, ln: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, i: int,
               name: str) -> torch.Tensor:
        y = self.fused(x, self.panels_of[w.data_ptr()], norm=(ln, self.eps))
        return y if bias is None else y.add_(bias)

    def added(self, x: torch.Tensor, inp: torch.Tensor, w: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return self.fused(inp.reshape(inp.shape[0], -1), self.panels_of[w.data_ptr()], residual=x)

    def swiglu_added(self, x: torch.Tensor, gu: torch.Tensor, w: torch.Tensor, i: int, name: str) -> torch.Tensor:
        return self.fused(gu, self.panels_of[w.data_ptr()], swiglu=True, residual=x)


def _kernel_rope(rope: Callable, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                 slot: torch.Tensor, col: torch.Tensor, heads: int) -> torch.Tensor:
    """`TorchMath.rope_store` through the rows kernel's `rope_store` (`rope`): the same bits, one call."""
    d = kv.shape[4]
    return rope(qkv, cos, sin, d, heads * d, kv, slot, col).view(qkv.shape)
