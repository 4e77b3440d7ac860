"""An fp32 matmul for x86-64 CPUs with AVX2 and FMA (`rows_kernel.c`), built with the system's C compiler.

Why its own kernel: a decode step or a verify multiplies 1-64 rows by every weight of the target, so its cost is
streaming the weights while the arithmetic hides behind it; MKL's one-row GEMV streams them well, but its GEMMs of
2-64 rows and oneDNN's on prepacked weights neither stream them at that rate nor reach the core's arithmetic rate,
so every verified position and every batch row costs (docs/design.md, "Where a plain step goes"). This kernel reads
the weights once, packed in panels of 16 rows at start-up, and multiplies each into up to 6 rows at a time; a row
rounds alike alone or beside others.

Built once per source and compiler into `$XDG_CACHE_HOME/dvi/kernels` (default `~/.cache`) and loaded with ctypes;
`load()` is None where it cannot run (not x86-64 Linux with avx2 and fma, no compiler, a failed build: the reason is
logged once), and the caller keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

from dvi.decode.numerics import cpu_flags

__all__ = ["KERNEL_ROWS", "Panels", "RowsKernel", "kernel_rows_measured", "load", "unavailable_reason"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("rows_kernel.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared")


PANEL = 16  # weight rows a panel holds (rows_kernel.c)


class Panels:
    """A weight w [N, K] packed for the kernel: [ceil(N / 16), K, 16], panel i holding rows 16 i .. 16 i + 15 of w
    column by column (zero-padded), so a 64-byte line carries one column of a panel (`RowsKernel.pack`)."""

    __slots__ = ("data", "out_features")

    def __init__(self, data: torch.Tensor, out_features: int):
        self.data, self.out_features = data, out_features

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    def refill(self, w: torch.Tensor) -> None:
        """New values of the same weight (a target update loads weights in place): packed again into this buffer."""
        self.data.copy_(_panel_view(w))


def _panel_view(w: torch.Tensor) -> torch.Tensor:
    pad = -w.shape[0] % PANEL
    if pad:
        w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
    return w.view(-1, PANEL, w.shape[1]).transpose(1, 2)


class RowsKernel:
    """F.linear for fp32 x [..., K] and an fp32 w [N, K] on the CPU: `linear` checks its inputs and packs w for the one
    call; the lean forward's matmuls pack each weight once (`pack`, after `check_weights`) and call `rows`."""

    def __init__(self, lib: ctypes.CDLL):
        fn = lib.dvi_panels_linear_f32
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, i64, i64]
        fn.restype = None
        self._fn = fn

    @staticmethod
    def check_weights(*ws: torch.Tensor) -> None:
        for w in ws:
            if w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2:
                raise ValueError(f"the rows kernel takes 2-d fp32 CPU weights, got {w.dtype} {tuple(w.shape)} on "
                                 f"{w.device}")

    @staticmethod
    def pack(w: torch.Tensor) -> Panels:
        """w [N, K] in panels (a copy: the kernel's layout; torch's allocations are 64-byte aligned, as its aligned
        loads need)."""
        RowsKernel.check_weights(w)
        data = _panel_view(w).contiguous()
        if data.data_ptr() % 32:
            raise ValueError("the rows kernel's panels must be 32-byte aligned")
        return Panels(data, int(w.shape[0]))

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.check_weights(w)
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"the rows kernel takes fp32 CPU tensors, got {x.dtype} x on {x.device}")
        if x.shape[-1] != w.shape[1]:
            raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.shape[1]}")
        return self.rows(x.reshape(-1, x.shape[-1]), self.pack(w), bias).view(*x.shape[:-1], w.shape[0])

    def rows(self, x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] fp32 through packed weights, with a few microseconds of Python around the call (a step makes
        ~120 of them): a wrong dtype here would read past a buffer, so only callers that hold fp32 rows call it."""
        if x.dim() != 2 or x.stride(1) != 1:
            x = x.reshape(-1, x.shape[-1]).contiguous()
        m, n = x.shape[0], panels.out_features
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._fn(x.data_ptr(), x.stride(0), panels.data.data_ptr(), n, panels.in_features, y.data_ptr(), n, m)
        return y if bias is None else y.add_(bias)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dvi" / "kernels"


def _build(compiler: str) -> Path:
    """The shared library for this source and compiler, compiled once (a temp name renamed into place, so processes
    building it at once each load a whole file)."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out = _cache_dir() / f"rows_kernel-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-rows_kernel-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


@cache
def _loaded() -> tuple[RowsKernel | None, str | None]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    missing = {"avx2", "fma"} - cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (cc, gcc or $CC) to build it"
    try:
        return RowsKernel(ctypes.CDLL(str(_build(compiler)))), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building it failed: {e}"


def load() -> RowsKernel | None:
    """The kernel, built on first use; None where it cannot run (`unavailable_reason` says why, logged once)."""
    kernel, why = _loaded()
    if kernel is None and not getattr(load, "_told", False):
        load._told = True  # type: ignore[attr-defined]
        log.info("fp32 rows kernel unavailable (torch's kernels serve every matmul): %s", why)
    return kernel


def unavailable_reason() -> str | None:
    return _loaded()[1]


KERNEL_ROWS = 16
"""Rows up to which the rows kernel serves forwards when asked to without timing (`use_rows_kernel`)."""

KERNEL_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 256)
"""Row counts at which `kernel_rows_measured` times the rows kernel against torch's path: decode steps and verifies,
then the prefills a step's prompt-token budget makes (`serve.max_prefill_tokens`)."""


@torch.inference_mode()
def kernel_rows_measured(lean: Any, rows: tuple[int, ...] = KERNEL_PROBE_ROWS, reps: int = 3) -> int:
    """The most rows up to which the rows kernel runs every matmul of a forward (all layers and the head: the weights
    streamed as a step streams them) no slower than the path the forward takes without it (MKL's GEMV for one row,
    oneDNN's packs or MKL's GEMM for more), arms interleaved, best of `reps`, within 2%; 0 where it loses at one
    row. Timed once per model shape, packing and thread count in a process (`lean`: a `dvi.decode.lean.LeanModel`
    holding the kernel and its panels, `LeanModel.use_rows_kernel`)."""
    key = (lean.hidden, len(lean.layers), tuple(lean.layers[0].gate_up.shape), tuple(lean.head.shape),
           lean.packs is not None, lean.head_module is None, torch.get_num_threads())
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

    best = 0
    try:
        for m in rows:
            weights_pass(m, m), weights_pass(m, 0)  # warm both paths
            times = [(weights_pass(m, m), weights_pass(m, 0)) for _ in range(reps)]
            if min(k for k, _ in times) > 1.02 * min(t for _, t in times):
                break
            best = m
    finally:
        lean.kernel_rows = was
    _KERNEL_ROWS[key] = best
    log.info("fp32 rows kernel: forwards of up to %d rows (timed against torch's kernels at %s rows)", best, rows)
    return best


_KERNEL_ROWS: dict[tuple, int] = {}
