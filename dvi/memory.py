"""Giving freed heap memory back to the OS, server and trainer alike (glibc `malloc_trim`), the process's resident
size, and the cap on oneDNN's primitive cache (one compiled primitive per matmul shape: every new sequence length and
batch width adds one, and oneDNN keeps 1024).

Why: a serving process allocates and frees tensors of a new size at every prefill length, batch size and draft width,
a trainer at every batch's sequence lengths. glibc keeps what was freed inside its heaps (a live block above the free
ones pins them), so the server's resident memory climbed ~30-50 MiB per 12 requests on the real pair with every
Python-visible tensor constant (issue 25: 1220 -> 1804 MiB over 264 requests, trainer off); `malloc_trim(0)` returned
90-200 MiB of it each time, in 10-30 ms. The server's engine thread trims once the server has been idle for `IDLE_S`
(no client waits on it then) and, under unbroken load, between two steps every `serve.malloc_trim_seconds`; the
trainer between rounds every `trainer.malloc_trim_seconds`. A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import platform
import time
from collections.abc import Callable
from typing import Any

__all__ = ["glibc_trim", "rss_bytes", "cap_onednn_cache", "ONEDNN_CACHE_ENV", "HeapTrimmer", "IDLE_S", "freeze_long_lived"]

log = logging.getLogger("dvi.memory")


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


def freeze_long_lived() -> int:
    """Collect once, then move every object alive now into the cyclic collector's permanent generation; returns how
    many it holds. Why: a server's imports, models and tokenizer are hundreds of thousands of tracked objects that
    live as long as the process, and every full collection walks them all on whichever thread triggers it (the
    engine's, mid-step, as often as not): a stall for every row in flight. Frozen, they are never walked again;
    objects made later are collected as before. For a process that owns its heap (`dvi serve`), not a library's
    caller."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def rss_bytes() -> int | None:
    """This process's resident set size (Linux `/proc/self/statm`), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


IDLE_S = 0.25  # no step for this long: the server is idle, and a trim now delays no client


class HeapTrimmer:
    """One thread's (the server's engine thread, the trainer's loop). `after_step()` after every step or round (trims
    when `every_s` passed since the last trim: unbroken load); a server's loop also trims when `idle_due()` (steps ran
    since the last trim, none for `IDLE_S`), waiting at most `wait_s()` for it. `every_s` 0 (or no glibc) turns it
    off; `trims` counts them, `seconds` their cost, and `status()` the resident size before and after the last one and
    what trims gave back: what separates memory glibc held freed from memory the process still uses."""

    def __init__(self, every_s: float, trim: Callable[[], int] | None = None) -> None:
        self.every_s = float(every_s)
        self._trim = trim if trim is not None else glibc_trim()
        self.trims = 0
        self.seconds = 0.0
        self.released = self.last_released = 0
        self.rss_before = self.rss_after = None
        self._last = self._last_step = time.monotonic()
        self._dirty = False  # steps ran since the last trim

    @property
    def enabled(self) -> bool:
        return self._trim is not None and self.every_s > 0

    def after_step(self) -> None:
        self._dirty, self._last_step = True, time.monotonic()
        if self.enabled and self._last_step - self._last >= self.every_s:
            self.trim()

    def idle_due(self) -> bool:
        return self.enabled and self._dirty and time.monotonic() - self._last_step >= IDLE_S

    def wait_s(self, most: float) -> float:
        """How long an idle loop may sleep before `idle_due` could turn true."""
        if not (self.enabled and self._dirty):
            return most
        return min(most, max(0.0, self._last_step + IDLE_S - time.monotonic()) + 0.01)

    def trim(self) -> None:
        before = rss_bytes()
        t0 = time.monotonic()
        try:
            self._trim()
        except Exception:  # noqa: BLE001 - releasing memory must never cost a request or a round
            log.exception("malloc_trim failed")
        self._last = time.monotonic()
        self.seconds += self._last - t0
        self.trims += 1
        self._dirty = False
        after = rss_bytes()
        if before is not None and after is not None:
            self.last_released = max(0, before - after)
            self.released += self.last_released
        self.rss_before, self.rss_after = before, after

    def status(self) -> dict[str, Any]:
        return {"trims": self.trims, "released_bytes": self.released, "last_released_bytes": self.last_released,
                "rss_before_trim_bytes": self.rss_before, "rss_bytes": self.rss_after}
