"""Buffers on transparent huge pages, for the weights a CPU decode step streams whole.

A step of a few rows reads every packed weight once from memory; on 4 KiB pages that stream crosses a page boundary
every 4 KiB, where the CPU's prefetchers stop and a TLB walk may start, so it runs below the memory's rate. Linux
backs an anonymous range with 2 MiB pages where the range is 2 MiB-aligned and advised `MADV_HUGEPAGE` (THP mode
"madvise", the usual default) or always (mode "always"); mode "never", another OS or a failed `madvise` leave plain
pages, which is only slower. Measured: docs/design.md, "Weights on huge pages".
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import cache
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE", "buffer", "enable", "enabled", "thp_mode"]

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_state = {"enabled": True}
log = logging.getLogger(__name__)


def enable(flag: bool) -> None:
    """Whether later `buffer` calls ask for huge pages (process-wide; benchmarks compare the two)."""
    _state["enabled"] = bool(flag)


def enabled() -> bool:
    return _state["enabled"]


def thp_mode() -> str:
    """This kernel's THP mode ("always", "madvise" or "never"); "" where there is none (not Linux)."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], untouched until the caller fills it; where THP serves advised ranges, its start is 2 MiB-aligned
    and every 2 MiB of it advised `MADV_HUGEPAGE` before a page is touched (the faults then map huge pages)."""
    nbytes = max(0, int(nbytes))
    madvise = _madvise()
    if not enabled() or madvise is None or thp_mode() not in ("madvise", "always") or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)  # large: mmapped by the allocator, pages not yet touched
    start = -raw.data_ptr() % HUGE_PAGE
    if madvise(raw.data_ptr() + start, span, _MADV_HUGEPAGE) != 0:
        log.info("madvise(MADV_HUGEPAGE) failed (errno %d): weights stay on 4 KiB pages", ctypes.get_errno())
        return raw[:nbytes]
    return raw[start:start + nbytes]
