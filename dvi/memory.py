"""What a dvi process does with its memory, server and trainer alike: glibc's `malloc_trim` (freed heap back to the
OS: glibc keeps what was freed inside its heaps while a live block above pins them, `serving.memory` has the
server's numbers), the process's resident size, and the cap on oneDNN's primitive cache (one compiled primitive per
matmul shape: every new sequence length and batch width adds one, and oneDNN keeps 1024)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from collections.abc import Callable

__all__ = ["glibc_trim", "rss_bytes", "cap_onednn_cache", "ONEDNN_CACHE_ENV"]


def glibc_trim() -> Callable[[], int] | None:
    """glibc's `malloc_trim(0)` (returns 1 when it gave memory back), or None where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: int(fn(0))


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def cap_onednn_cache(entries: int) -> str | None:
    """Bound oneDNN's primitive cache (bf16 matmuls on CPU: one compiled primitive per shape, so one per new
    prefill length and batch width, ~0.3 MiB each by our estimate; oneDNN keeps 1024). oneDNN reads the variable at
    its first use, so call this before the process's first forward; a value already in the environment wins,
    `entries` 0 leaves oneDNN's default. Returns the capacity in force (None: oneDNN's default)."""
    if entries > 0:
        os.environ.setdefault(ONEDNN_CACHE_ENV, str(entries))
    return os.environ.get(ONEDNN_CACHE_ENV)


def rss_bytes() -> int | None:
    """This process's resident set size (Linux `/proc/self/statm`), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
