"""dvi's matmul for the rows of a decode step on x86-64 CPUs: fp32 with AVX-512 (`rows_kernel_avx512.c`) or else
AVX2 and FMA (`rows_kernel.c`; the two give the same bits), bf16 with AMX (`rows_kernel_amx.c`) or else AVX512-BF16
(`rows_kernel_bf16.c`; each its own bits), built with the system's C compiler.

Why its own kernel: a decode step or a verify multiplies 1-64 rows by every weight of the target, so its cost is
streaming the weights while the arithmetic hides behind it; MKL's one-row GEMV streams them well, but its GEMMs of
2-64 rows and oneDNN's on prepacked weights (fp32 or bf16) neither stream them at that rate nor reach the core's
arithmetic rate, so every verified position and every batch row costs (docs/design.md, "Where a plain step goes").
This kernel reads the weights once, packed in panels at start-up, and multiplies each into several rows at a time; a
row rounds alike alone or beside others.

Built on first use (`dvi.decode.native`); `load(dtype)` is None where it cannot run (not x86-64 Linux, the CPU lacks
the instructions, no compiler, a failed build: the reason is logged once), and the caller keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from dvi.decode import huge_pages
from dvi.decode.native import load_library

__all__ = ["EVERY_ROW", "KERNEL_ROWS", "Panels", "RowsKernel", "builds", "kernel_rows_from_ratios", "kernel_rows_measured",
           "load", "option_rows", "unavailable_reason"]

log = logging.getLogger(__name__)


class _Build(NamedTuple):
    """One build of a dtype's kernel: its source, compiler flags, the CPU flags it needs, its entry point and panel
    shape."""

    isa: str  # the instructions it runs on, as the log names them
    source: Path
    flags: tuple[str, ...]
    needs: frozenset[str]
    symbol: str
    panel: int  # weight rows a panel holds
    pair: int  # consecutive k a panel's line holds per weight row (vdpbf16ps multiplies pairs)
    align: int  # bytes the panels' aligned loads need
    kstep: int = 1  # the panels' K is zero-padded to a multiple of this (AMX tiles multiply 32 columns a step)


_HERE = Path(__file__).parent
# every build: the fused helpers' AVX2 + FMA code (`rows_fused.h`), no implicit fma contraction (torch's roundings)
_COMMON = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fPIC", "-shared")
_AVX2 = frozenset({"avx2", "fma"})
_BUILDS = {  # per dtype, the builds in the order tried: the first this CPU runs serves
    torch.float32: (
        _Build("AVX-512", _HERE / "rows_kernel_avx512.c", ("-mavx512f", *_COMMON), _AVX2 | {"avx512f"},
               "dvi_panels_linear_f32", 32, 1, 64),
        _Build("AVX2", _HERE / "rows_kernel.c", _COMMON, _AVX2, "dvi_panels_linear_f32", 16, 1, 32)),
    torch.bfloat16: (
        _Build("AMX-BF16", _HERE / "rows_kernel_amx.c",
               ("-mavx512f", "-mavx512bf16", "-mavx512bw", "-mavx512vl", "-mamx-tile", "-mamx-bf16", *_COMMON),
               _AVX2 | {"avx512f", "avx512_bf16", "avx512bw", "avx512vl", "amx_tile", "amx_bf16"},
               "dvi_panels_linear_bf16", 32, 2, 64, 32),
        _Build("AVX512-BF16", _HERE / "rows_kernel_bf16.c", ("-mavx512f", "-mavx512bf16", *_COMMON),
               _AVX2 | {"avx512f", "avx512_bf16"}, "dvi_panels_linear_bf16", 32, 2, 64),),
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")


class Panels:
    """A weight w [N, K] packed for one build of its dtype's kernel (`RowsKernel.pack`): panel i holds rows
    P i .. P i + P - 1 of w, zero-padded past N, column by column, in two halves of P / 2 rows one after the other, so
    the kernel reads a panel as two streams: AVX2 fp32 as [ceil(N / 16), 2, K, 8]; AVX-512 fp32 as [ceil(N / 32), 2,
    K, 16], a 64-byte line carrying 16 rows of a column; bf16 as [ceil(N / 32), 2, K / 2, 16, 2], a line carrying 16
    rows' pair of columns."""

    __slots__ = ("build", "data", "in_features", "out_features")

    def __init__(self, data: torch.Tensor, out_features: int, in_features: int, build: _Build):
        self.data, self.out_features, self.in_features, self.build = data, out_features, in_features, build

    def refill(self, w: torch.Tensor) -> None:
        """New values of the same weight (a target update loads weights in place): packed again into this buffer."""
        self.data.copy_(_panel_view(w, self.build))


_HALVES = 2  # every build reads a panel as two streams, one per half of its rows (the kernels' sources say why)


def _padding(w: torch.Tensor, b: _Build) -> tuple[int, int]:
    """Zero rows and columns a weight's panels add (rows to whole panels, columns to whole k-steps)."""
    return -w.shape[0] % b.panel, -w.shape[1] % b.kstep


def _panel_view(w: torch.Tensor, b: _Build) -> torch.Tensor:
    pad, kpad = _padding(w, b)
    if pad or kpad:
        w = torch.nn.functional.pad(w, (0, kpad, 0, pad))
    return w.view(-1, _HALVES, b.panel // _HALVES, w.shape[1] // b.pair, b.pair).permute(0, 1, 3, 2, 4)


class RowsKernel:
    """F.linear for x [..., K] and a w [N, K] of the kernel's dtype (fp32 or bf16) on the CPU: `linear` checks its
    inputs and packs w for the one call; the lean forward's matmuls pack each weight once (`pack`, after
    `check_weights`) and call `rows`."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, build: _Build):
        fn = getattr(lib, build.symbol)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64]
        fn.restype = ctypes.c_int
        fused = getattr(lib, build.symbol.replace("_linear_", "_fused_"))
        fused.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64, ptr, ctypes.c_float, ctypes.c_int32, ptr, i64]
        fused.restype = ctypes.c_int
        rope = getattr(lib, build.symbol.replace("_panels_linear_", "_rope_store_"))
        rope.argtypes, rope.restype = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64], ctypes.c_int
        pro = getattr(lib, build.symbol.replace("_panels_linear_", "_rows_prologue_"))
        pro.argtypes, pro.restype = [ptr, i64, i64, i64, ptr, ctypes.c_float, ctypes.c_int32, ptr], None
        self._fn, self._fused, self._rope, self._prologue = fn, fused, rope, pro
        self.dtype, self._build = dtype, build
        self.isa = build.isa

    def check_weights(self, *ws: torch.Tensor) -> None:
        for w in ws:
            if w.dtype != self.dtype or w.device.type != "cpu" or w.dim() != 2:
                raise ValueError(f"the {_name(self.dtype)} rows kernel takes 2-d {_name(self.dtype)} CPU weights, got "
                                 f"{w.dtype} {tuple(w.shape)} on {w.device}")
            if w.shape[1] % self._build.pair:
                raise ValueError(f"the {_name(self.dtype)} rows kernel takes weights of an even input width, got "
                                 f"{tuple(w.shape)}")

    def pack(self, w: torch.Tensor) -> Panels:
        """w [N, K] in panels (a copy: the kernel's layout; torch's allocations are 64-byte aligned, as its aligned
        loads need)."""
        self.check_weights(w)
        data = _panel_view(w, self._build).contiguous()
        if data.data_ptr() % self._build.align:
            raise ValueError(f"the rows kernel's panels must be {self._build.align}-byte aligned")
        return Panels(data, int(w.shape[0]), int(w.shape[1]), self._build)

    def pack_all(self, weights: list[torch.Tensor]) -> list[Panels]:
        """Each of `weights` packed (`pack`), all in one buffer on huge pages where the OS gives them
        (`dvi.decode.huge_pages`): a step streams every one of them."""
        b, size = self._build, torch.empty((), dtype=self.dtype).element_size()
        for w in weights:
            self.check_weights(w)
        nbytes = [(w.shape[0] + pad) * (w.shape[1] + kpad) * size for w in weights for pad, kpad in [_padding(w, b)]]
        spans = [-(-n // b.align) * b.align for n in nbytes]
        arena = huge_pages.buffer(sum(spans) + b.align)
        at = -arena.data_ptr() % b.align
        out = []
        for w, n, span in zip(weights, nbytes, spans, strict=True):
            view = _panel_view(w, b)  # one weight's padded copy at a time, where it needs one
            data = arena[at:at + n].view(self.dtype).view(view.shape)
            data.copy_(view)
            out.append(Panels(data, int(w.shape[0]), int(w.shape[1]), b))
            at += span
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.check_weights(w)
        if x.dtype != self.dtype or x.device.type != "cpu":
            raise ValueError(f"the {_name(self.dtype)} rows kernel takes {_name(self.dtype)} CPU tensors, got "
                             f"{x.dtype} x on {x.device}")
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.shape[1]}")
        return self.rows(x.reshape(-1, x.shape[-1]), self.pack(w), bias).view(*x.shape[:-1], w.shape[0])

    def rows(self, x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] of the kernel's dtype through packed weights, with a few microseconds of Python around the call (a
        step makes ~120 of them). A bias is added in the output's dtype (after the product's rounding)."""
        if x.dtype != self.dtype:  # the kernel would read the buffer as its own dtype
            raise ValueError(f"the {_name(self.dtype)} rows kernel got {x.dtype} rows")
        if x.dim() != 2 or x.stride(1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        if panels.build is not self._build:
            raise ValueError(f"weights packed for the {panels.build.isa} build reach the {self._build.isa} build")
        m, n = x.shape[0], panels.out_features
        y = torch.empty(m, n, dtype=self.dtype)
        if m and self._fn(x.data_ptr(), x.stride(0), panels.data.data_ptr(), n, panels.in_features, y.data_ptr(), n, m):
            raise MemoryError(f"the rows kernel's scratch for {m} x {panels.in_features} rows")
        return y if bias is None else y.add_(bias)

    def fused(self, x: torch.Tensor, panels: Panels, norm: tuple[torch.Tensor, float] | None = None,
              swiglu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`rows` with a decoder layer's elementwise work folded into its one call (`rows_fused.h`): x [M, K]'s rows
        RMS-normed and scaled by `norm` = (weight [K], eps) first, or x [M, 2K] = [gate | up] through
        silu(gate) * up first (`swiglu`); then `residual` [M, N] added. Each row from its own row alone."""
        if x.dtype != self.dtype or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"the {_name(self.dtype)} rows kernel takes 2-d {_name(self.dtype)} rows, got {x.dtype} "
                             f"{tuple(x.shape)}")
        if panels.build is not self._build:
            raise ValueError(f"weights packed for the {panels.build.isa} build reach the {self._build.isa} build")
        m, n, k = x.shape[0], panels.out_features, panels.in_features
        if x.shape[1] != (2 * k if swiglu else k):
            raise ValueError(f"rows of {x.shape[1]} for a weight of {k} inputs{' (swiglu: gate and up)' if swiglu else ''}")
        w = norm[0] if norm is not None else None
        if w is not None and (w.dtype != self.dtype or not w.is_contiguous() or w.numel() != k):
            raise ValueError(f"the norm's weight must be {k} contiguous {_name(self.dtype)} values")
        if residual is not None and (residual.dtype != self.dtype or tuple(residual.shape) != (m, n)
                                     or residual.stride(1) != 1):
            raise ValueError(f"the residual must be [{m}, {n}] {_name(self.dtype)} rows")
        y = torch.empty(m, n, dtype=self.dtype)
        if m and self._fused(x.data_ptr(), x.stride(0), panels.data.data_ptr(), n, k, y.data_ptr(), n, m,
                             w.data_ptr() if w is not None else None, norm[1] if norm is not None else 0.0,
                             int(swiglu), residual.data_ptr() if residual is not None else None,
                             residual.stride(0) if residual is not None else 0):
            raise MemoryError(f"the rows kernel's scratch for {m} x {k} rows")
        return y

    def prologue(self, x: torch.Tensor, norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
        """`fused`'s work before its matmul, alone (`rows_fused.h` ROWS_PROLOGUE): x [M, K]'s rows RMS-normed and
        scaled by `norm` = (weight [K], eps), or without `norm` x [M, 2K] = [gate | up] through silu(gate) * up: [M, K],
        each row from its own row alone, the same bits as `fused` feeds its matmul."""
        if x.dtype != self.dtype or x.dim() != 2 or x.stride(1) != 1:
            raise ValueError(f"the {_name(self.dtype)} rows kernel takes 2-d {_name(self.dtype)} rows, got {x.dtype} "
                             f"{tuple(x.shape)}")
        m, k = x.shape[0], x.shape[1] if norm is not None else x.shape[1] // 2
        w = norm[0] if norm is not None else None
        if (w is not None and (w.dtype != self.dtype or not w.is_contiguous() or w.numel() != k)) or \
                (w is None and x.shape[1] % 2):
            raise ValueError(f"a norm's weight of {k} contiguous {_name(self.dtype)} values, or [gate | up] rows")
        out = torch.empty(m, k, dtype=self.dtype)
        if m:
            self._prologue(x.data_ptr(), x.stride(0), k, m, w.data_ptr() if w is not None else None,
                           norm[1] if norm is not None else 0.0, int(w is None), out.data_ptr())
        return out

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, q_width: int,
                   kv: torch.Tensor, slot: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        """A layer's fused q|k|v rows [n, W] rotated as `qkv * cos + qkv.flip_halves * sin` (the same bits as torch's
        calls) and their k|v part (after `q_width`) stored to the layer's cache `kv` [slots, capacity, 2, kv_heads, D]
        at (slot[i], col[i]), in one call; returns the rotated rows [n, W]."""
        n, w = qkv.shape[0], qkv.numel() // max(qkv.shape[0], 1)
        ok = all(t.dtype == self.dtype and t.is_contiguous() for t in (qkv, cos, sin, kv))
        if not ok or cos.numel() != qkv.numel() or sin.numel() != qkv.numel() or w % head_dim \
                or kv.shape[2] * kv.shape[3] * kv.shape[4] != w - q_width:
            raise ValueError(f"rope_store takes contiguous {_name(self.dtype)} rows, tables and cache of one width")
        slot, col = slot.contiguous(), col.contiguous()
        out = torch.empty(n, w, dtype=self.dtype)
        if n and self._rope(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), n, w, head_dim, out.data_ptr(),
                            kv.data_ptr(), slot.data_ptr(), col.data_ptr(), kv.shape[0], kv.shape[1], q_width):
            raise IndexError(f"rope_store: a slot or column outside the cache ({kv.shape[0]} slots x {kv.shape[1]})")
        return out


@cache
def _build_loaded(build: _Build, dtype: torch.dtype) -> tuple[RowsKernel | None, str | None]:
    lib, why = load_library(build.source, build.flags, build.needs)
    if lib is not None and hasattr(lib, "dvi_amx_ready") and not lib.dvi_amx_ready():
        lib, why = None, "Linux refused this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM)"
    return (RowsKernel(lib, dtype, build), None) if lib is not None else (None, f"{build.isa}: {why}")


@cache
def _loaded(dtype: torch.dtype = torch.float32) -> tuple[RowsKernel | None, str | None]:
    builds = _BUILDS.get(dtype)
    if builds is None:
        return None, f"no rows kernel for {dtype} (fp32 and bf16 have one)"
    whys = []
    for build in builds:
        kernel, why = _build_loaded(build, dtype)
        if kernel is not None:
            return kernel, None
        whys.append(why)
    return None, "; ".join(whys)


def builds(dtype: torch.dtype = torch.float32) -> list[RowsKernel]:
    """Every build of `dtype`'s kernel this CPU runs, the one `load` serves first (tests hold them to the same bits)."""
    return [k for k in (_build_loaded(b, dtype)[0] for b in _BUILDS.get(dtype, ())) if k is not None]


_TOLD: set[torch.dtype] = set()


def load(dtype: torch.dtype = torch.float32) -> RowsKernel | None:
    """The kernel for `dtype`, built on first use; None where it cannot run (`unavailable_reason` says why, logged
    once per dtype)."""
    kernel, why = _loaded(dtype)
    if kernel is None and dtype not in _TOLD:
        _TOLD.add(dtype)
        log.info("%s rows kernel unavailable (torch's kernels serve every matmul): %s", _name(dtype), why)
    return kernel


def unavailable_reason(dtype: torch.dtype = torch.float32) -> str | None:
    return _loaded(dtype)[1]


KERNEL_ROWS = 16
"""Rows up to which the rows kernel serves forwards when asked to without timing (`use_rows_kernel`)."""

def option_rows(option: bool | str) -> int | None:
    """`serve.cpu_rows_kernel` as `LeanModel.use_rows_kernel`'s argument: "auto" None (timed), true `KERNEL_ROWS`,
    false 0."""
    return None if option == "auto" else KERNEL_ROWS if option else 0


EVERY_ROW = 1 << 62
"""`kernel_rows_measured` where the kernel wins at every probed count: it serves every forward, the widest prefill
too, so each row of every matmul is computed alike whatever else the forward carries (a batch's greedy answers are
then each request's alone: no kernel choice by row count parts them)."""

KERNEL_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
"""Row counts at which `kernel_rows_measured` times the rows kernel against torch's path: decode steps and verifies,
then the prefills a step's prompt-token budget makes (`serve.max_prefill_tokens`)."""


KERNEL_TOLERANCE = 1.02
"""A probed count the rows kernel takes at up to this many times torch's path: within it the two are even, and the
kernel's other gains (rows alike whatever the batch, one copy of the weights) decide."""


def kernel_rows_from_ratios(rows: tuple[int, ...], ratios: list[float], tolerance: float = KERNEL_TOLERANCE) -> int:
    """The threshold `kernel_rows_measured` serves from the kernel's time over torch's path at each probed count
    (`ratios[i]` at `rows[i]`): 0 where the kernel loses alone at the first count, else the count up to which its
    summed log time ratio (each over `tolerance`) is least, every count weighted alike, the larger count on a tie.

    Not the first count it loses at: a server keeps this for its lifetime, and at a count where the two paths are
    even a best-of-few timing is a coin toss; stopping there cut the kernel from the wider steps it wins by far
    (docs/design.md, "The kernel's start-up probe")."""
    if not ratios or ratios[0] > tolerance:
        return 0
    best, best_i, total = math.inf, 0, 0.0
    for i, r in enumerate(ratios):
        total += math.log(max(r, 1e-9) / tolerance)
        if total <= best + 1e-12:
            best, best_i = total, i
    return rows[best_i]


@torch.inference_mode()
def kernel_rows_measured(lean: Any, rows: tuple[int, ...] = KERNEL_PROBE_ROWS, reps: int = 3) -> int:
    """The most rows up to which the rows kernel runs every matmul of a forward (all layers and the head: the weights
    streamed as a step streams them) rather than the path the forward takes without it (MKL's GEMV for one row,
    oneDNN's packs or MKL's GEMM for more): each count timed with the arms interleaved, best of `reps`, a count the
    kernel measured slower at timed `reps` more, the threshold chosen by `kernel_rows_from_ratios` (`EVERY_ROW`
    where that is the last count; 0 where the kernel loses at one row). Timed once per model shape, packing, build
    and thread count in a process (`lean`: a `dvi.decode.lean.LeanModel` holding the kernel and its panels,
    `LeanModel.use_rows_kernel`)."""
    key = (lean.hidden, len(lean.layers), tuple(lean.layers[0].gate_up.shape), tuple(lean.head.shape), lean.dtype,
           lean.packs is not None, lean.head_module is None, lean.kernel.isa, torch.get_num_threads())
    if key in _KERNEL_ROWS:
        return _KERNEL_ROWS[key]
    was = lean.kernel_rows
    inner = int(lean.layers[0].down.shape[1])

    def weights_pass(m: int, k_rows: int) -> float:
        x, xi = torch.randn(m, lean.hidden, dtype=lean.dtype), torch.randn(m, inner, dtype=lean.dtype)
        lean.kernel_rows = k_rows
        t = time.perf_counter()
        for lw in lean.layers:
            lean.linear(x, lw.qkv), lean.linear(x, lw.o), lean.linear(x, lw.gate_up), lean.linear(xi, lw.down)
        lean._logits(x)
        return time.perf_counter() - t

    def ratio(times: list[tuple[float, float]]) -> float:
        return min(k for k, _ in times) / min(t for _, t in times)

    ratios: list[float] = []
    try:
        for m in rows:
            weights_pass(m, m), weights_pass(m, 0)  # warm both paths
            times = [(weights_pass(m, m), weights_pass(m, 0)) for _ in range(reps)]
            if ratio(times) > 1.0:  # a second look where the kernel measured slower
                times += [(weights_pass(m, m), weights_pass(m, 0)) for _ in range(reps)]
            ratios.append(ratio(times))
            if m == rows[0] and ratios[0] > KERNEL_TOLERANCE:
                break  # it loses alone at one row: torch's kernels serve every forward
    finally:
        lean.kernel_rows = was
    best = kernel_rows_from_ratios(rows, ratios)
    if best == rows[-1] >= KERNEL_PROBE_ROWS[-1]:
        best = EVERY_ROW
    _KERNEL_ROWS[key] = best
    log.info("%s rows kernel (%s), %d-layer model: %s (its time over torch's kernels at %s rows: %s)",
             _name(lean.dtype), lean.kernel.isa, len(lean.layers),
             "every forward" if best == EVERY_ROW else f"forwards of up to {best} rows", rows,
             " ".join(f"{r:.2f}" for r in ratios))
    return best


_KERNEL_ROWS: dict[tuple, int] = {}
