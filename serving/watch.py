"""The rollback watch of a promoted version: the records finished since its promotion, replayed through it and the
last good version by THE comparison (`dvi.feedback.verdict.compare`, rule `gates(cfg).watch`: per group, a fall
beyond `serve.rollback_margin` that is also `serve.rollback_z` standard errors rolls back).

A watch ends when it holds `serve.rollback_window` records, or early when a newer version waits and the server
has been idle for `serve.watch_idle_s` (issue 36 §8: on an idle server the next 32 requests never come, and
the newer version waited for them without a verdict). An early end judges the records it has; groups with too
few are listed as unjudged in the verdict, never silently passed over.

Its own module so the swapper (`serving.swap`) reads as the promotion policy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dvi.feedback.heldout import unfit_reason
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.verdict import Verdict


@dataclass
class Watch:
    """A promoted version on probation: the fit records finished since (at most `window`), to replay through it
    and `good`."""

    version: int
    good: int
    window: int
    records: list[FeedbackRecord] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    last_record: float = field(default_factory=time.monotonic)
    unfit: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, record: FeedbackRecord) -> None:
        """A finished request's record (engine thread): kept while the window is not full, unless it is no
        evidence (`dvi.feedback.heldout.unfit_reason`: counted)."""
        with self._lock:
            self.last_record = time.monotonic()
            if unfit_reason(record) is not None:
                self.unfit += 1
            elif len(self.records) < self.window:
                self.records.append(record)

    @property
    def full(self) -> bool:
        return len(self.records) >= self.window

    def idle_for(self) -> float:
        """Seconds since the last finished request (or the promotion)."""
        return time.monotonic() - self.last_record

    def ends_early(self, waiting: int | None, idle_s: float, busy: bool) -> str:
        """Why this watch, not full, ends now ("" when it does not): version `waiting` waits behind it and the
        server has been idle `idle_s` (nothing running or queued, no request finished since)."""
        if waiting is None or waiting == self.version or busy or self.idle_for() < idle_s:
            return ""
        return f"ended early: v{waiting} waits and no request for {self.idle_for():.1f}s"

    def snapshot(self) -> list[FeedbackRecord]:
        with self._lock:
            return list(self.records)

    def describe(self, verdict: Verdict, early: str = "") -> str:
        """The swap event's reason: kept ("not worse on the same records") or rolled back, per group."""
        head = f"{verdict.records} records since the promotion" + (f", {early}" if early else "")
        if verdict.failed:
            return f"worse than the last good version on the same records: {verdict.reason}; {head}"
        return f"not worse on the same records ({verdict.group_summary()}); {head}"
