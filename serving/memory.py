"""Giving freed heap memory back to the OS while serving (glibc `malloc_trim`).

Why: a serving process allocates and frees tensors of a new size at every prefill length, batch size and
draft width. glibc keeps what was freed inside its heaps (a live block above the free ones pins them), so the
server's resident memory climbed ~30-50 MiB per 12 requests on the real pair with every Python-visible tensor
constant (issue 25: 1220 -> 1804 MiB over 264 requests, trainer off); `malloc_trim(0)` returned 90-200 MiB of
it each time, in 10-30 ms. The engine thread trims once the server has been idle for `IDLE_S` (no client
waits on it then) and, under unbroken load, between two steps every `serve.malloc_trim_seconds`. A no-op off
glibc.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dvi.memory import ONEDNN_CACHE_ENV, cap_onednn_cache, glibc_trim

__all__ = ["HeapTrimmer", "IDLE_S", "glibc_trim", "cap_onednn_cache", "ONEDNN_CACHE_ENV"]

log = logging.getLogger("dvi.serving")


IDLE_S = 0.25  # no step for this long: the server is idle, and a trim now delays no client


class HeapTrimmer:
    """Engine thread. `after_step()` after every step (trims when `every_s` passed since the last trim: unbroken
    load); the loop trims when `idle_due()` (steps ran since the last trim, none for `IDLE_S`), waiting at most
    `wait_s()` for it. `every_s` 0 (or no glibc) turns it off; `trims` counts them, `seconds` their cost."""

    def __init__(self, every_s: float, trim: Callable[[], int] | None = None) -> None:
        self.every_s = float(every_s)
        self._trim = trim if trim is not None else glibc_trim()
        self.trims = 0
        self.seconds = 0.0
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
        t0 = time.monotonic()
        try:
            self._trim()
        except Exception:  # noqa: BLE001 - releasing memory must never cost a request
            log.exception("malloc_trim failed")
        self._last = time.monotonic()
        self.seconds += self._last - t0
        self.trims += 1
        self._dirty = False
