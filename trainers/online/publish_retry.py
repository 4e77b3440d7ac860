"""`PublishBackoff`: when to try again after a publish the registry could not take.

Issue 36 §6: a full registry filesystem raised ENOSPC out of `maybe_publish` and killed the trainer at every
publish (2 restarts in 20 s, the rounds since the last checkpoint lost each time). A publish that fails with
an OSError (disk full, quota, read-only, I/O) is now logged and counted; the trainer keeps training and the
same candidate is tried again after `first_s`, doubling up to `max_s` while it keeps failing. The registry
writes a version under a temp name and renames it in whole (`dvi.registry.store`), so a failed publish leaves
no version behind, half-written or otherwise.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("dvi.trainer")


class PublishBackoff:
    """Failed publishes: how many (`failures`), whether one is still owed (`pending`) and when it may run."""

    def __init__(self, first_s: float = 5.0, max_s: float = 300.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0  # every failed publish (a gauge on /metrics)
        self.consecutive = 0
        self.retry_at = 0.0  # monotonic
        self.last_error: str | None = None

    @property
    def pending(self) -> bool:
        """The last publish failed and has not been retried successfully yet."""
        return self.consecutive > 0

    def waiting(self) -> bool:
        """Too early to try again."""
        return self.pending and time.monotonic() < self.retry_at

    def failed(self, exc: OSError, step: int) -> str:
        """Count a failed publish and schedule the retry; returns the reason for the publish decision."""
        self.failures += 1
        self.consecutive += 1
        delay = min(self.max_s, self.first_s * 2 ** (self.consecutive - 1))
        self.retry_at = time.monotonic() + delay
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.error("trainer: publishing at step %d failed (%s); training on, retrying in %.0f s (failure %d in a row)",
                  step, self.last_error, delay, self.consecutive)
        return f"the registry refused the write ({self.last_error}); retrying in {delay:.0f} s"

    def succeeded(self) -> None:
        if self.pending:
            log.info("trainer: publishing works again after %d failed attempt(s)", self.consecutive)
        self.consecutive, self.retry_at, self.last_error = 0, 0.0, None
