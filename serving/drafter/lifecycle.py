"""A drafter version's way to being served, as a pure state machine: no thread, no file, no model.

    candidate ──validated──▶ validated ──judged──▶ judged ──swapped──▶ watched ──▶ kept | rolled_back
        │                        │                    │
        └────────────────────────┴──── refused ◀──────┘       (pinned / restored: served, not watched)

`Lifecycle` decides and remembers, all of it: what is served, the last good version, the pin, the watch, refusals,
the candidate validated and waiting for its check (`pending`), the check it passed (`passed`: swapped in at the next
step unless a pin came first), the version waiting for held-out evidence (`waiting`), the versions that had their
first verdict, and the versions held loaded (`loaded`: the served one and the startup one). What it holds of a
loaded version (`loaded`, `pending`) is the lane's object, never read here but for its `version`. The lane
(`serving.drafter.lane.Lane`, on the drafter thread) does what it is told (load and validate a version, score it,
send the engine command, write the ledger) and reports back what came of it. Every transition is a method here, so
the lifecycle is tested without threads (`tests/test_lifecycle.py`). Version 0 is the startup drafter: always good,
never refused.

The watched state's evidence is a `Watch`: the records finished since the promotion, replayed through the version
and the last good one by THE comparison (`dvi.feedback.verdict.compare`, rule `gates(cfg).watch`: per group, a fall
beyond `serve.rollback_margin` that is also `serve.rollback_z` standard errors rolls back). A watch ends when it
holds `serve.rollback_window` records, or early when a newer version waits and the server has been idle for
`serve.watch_idle_s` (issue 36 §8); an early end judges the records it has, and groups with too few are listed as
unjudged in the verdict, never silently passed over.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Literal

from dvi.feedback.heldout import unfit_reason
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.verdict import Verdict

__all__ = ["GOOD_HISTORY", "MAX_REFUSED_SHOWN", "Lifecycle", "Passed", "Step", "Watch"]

MAX_REFUSED_SHOWN = 64  # refusals kept in memory for /health (all of them are in the ledger's REFUSED)
GOOD_HISTORY = 8  # versions that passed their watch, newest last: where successive admin rollbacks go

State = Literal["candidate", "validated", "judged", "watched", "kept", "served", "refused", "rolled_back"]


@dataclasses.dataclass(frozen=True)
class Step:
    """What the lane does next for LATEST: nothing ("idle"), "validate" it (load and check), leave it waiting
    ("hold": a watch runs; "wait": too few held-out positions; `news`: it began waiting now), "judge" it (the shadow
    check), or "swap" it in (it passed its check against what is served, and no pin stands)."""

    action: Literal["idle", "validate", "hold", "wait", "judge", "swap"]
    version: int | None = None
    news: bool = False


@dataclasses.dataclass(frozen=True)
class Passed:
    """A shadow check passed: `version` against the served `against`, in words (`reason`)."""

    version: int
    against: int
    reason: str


@dataclasses.dataclass
class Watch:
    """A promoted version on probation: the fit records finished since (at most `window`), to replay through it
    and `good`."""

    version: int
    good: int
    window: int
    records: list[FeedbackRecord] = dataclasses.field(default_factory=list)
    started: float = dataclasses.field(default_factory=time.monotonic)
    last_record: float = dataclasses.field(default_factory=time.monotonic)
    unfit: int = 0

    def add(self, record: FeedbackRecord, at: float | None = None) -> None:
        """A finished request's record (finished at `at`, `time.monotonic()`; default now): kept while the window
        is not full, unless it is no evidence (`dvi.feedback.heldout.unfit_reason`: counted)."""
        self.last_record = max(self.last_record, time.monotonic() if at is None else at)
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
        return list(self.records)

    def describe(self, verdict: Verdict, early: str = "") -> str:
        """The swap event's reason: kept ("not worse on the same records") or rolled back, per group."""
        head = f"{verdict.records} records since the promotion" + (f", {early}" if early else "")
        if verdict.failed:
            return f"worse than the last good version on the same records: {verdict.reason}; {head}"
        return f"not worse on the same records ({verdict.group_summary()}); {head}"


class Lifecycle:
    """A lane's decisions about its versions, and everything they rest on (the drafter thread's alone)."""

    def __init__(self, rollback_window: int, startup: Any) -> None:
        self.rollback_window = rollback_window
        self.live = 0
        self.good = 0  # the newest version that passed its rollback watch (0: the startup drafter)
        self.good_history: collections.deque[int] = collections.deque([0], maxlen=GOOD_HISTORY)
        self.pinned: int | None = None
        self.watch: Watch | None = None
        self.refused: collections.OrderedDict[int, str] = collections.OrderedDict()  # newest MAX_REFUSED_SHOWN
        self.retry: set[int] = set()  # refused for a reason that may pass later (dir not there yet)
        self.state: collections.OrderedDict[int, State] = collections.OrderedDict({0: "kept"})  # bounded (`_mark`)
        self.loaded: dict[int, Any] = {0: startup}  # versions held loaded: the served one and the startup one
        self.pending: Any = None  # LATEST, validated and loaded (its `version`), waiting for its check
        self.passed: Passed | None = None  # the check `pending` passed, its swap the next step
        self.waiting: int | None = None  # the version waiting for held-out evidence
        self.waiting_scored: int | None = None  # the positions its last check scored (None: too few to try)
        self.verdict_seen: collections.OrderedDict[int, None] = collections.OrderedDict()  # versions with a verdict

    # -- a candidate's way -------------------------------------------------------------------------
    def next_step(self, latest: int | None, positions: int, min_positions: int, stopping: bool = False) -> Step:
        """What to do with `latest` now (`positions`: what the held-out set holds, `min_positions` what a check
        needs)."""
        if (latest is None or latest == self.live or self.pinned is not None or stopping
                or (latest in self.refused and latest not in self.retry)):
            self.waiting = None
            return Step("idle")
        if latest not in self.state:
            self._mark(latest, "candidate")
        if self.pending is None or self.pending.version != latest:
            self.pending, self.passed = None, None  # an older candidate's drafter goes before the next load
            return Step("validate", latest)
        if self.watch is not None:
            return Step("hold", latest)
        if self.passed is not None and (self.passed.version, self.passed.against) == (latest, self.live):
            return Step("swap", latest)
        if positions < min_positions:
            news, self.waiting, self.waiting_scored = self.waiting != latest, latest, None
            return Step("wait", latest, news)
        self.waiting = None
        return Step("judge", latest)

    def validated(self, version: int, loaded: Any) -> None:
        """`loaded` (the lane's object for `version`) passed its load and checks: it waits for its shadow check."""
        self.pending, self.passed = loaded, None
        self._mark(version, "validated")

    def waits(self, version: int, scored: int) -> None:
        """The check could not decide (too little evidence where it counts, or the server stops): it is tried
        again at a later step."""
        self.waiting, self.waiting_scored = version, scored

    def judged(self, version: int, passed: bool, reason: str = "") -> None:
        """The shadow check's verdict against what is served: passed, it is swapped in at the next step (`swapped`)
        unless a pin comes first; else the lane refuses it (`refuse`)."""
        self.passed = Passed(version, self.live, reason) if passed else None
        self._mark(version, "judged" if passed else "refused")

    def _verdict(self, version: int) -> None:
        """`version` was promoted or refused: its first verdict, if it had none (the lane measures its
        publish-to-verdict time then: `version not in verdict_seen` before the transition)."""
        self.verdict_seen[version] = None
        while len(self.verdict_seen) > MAX_REFUSED_SHOWN:
            self.verdict_seen.popitem(last=False)

    def refuse(self, version: int, reason: str, transient: bool = False) -> None:
        """Never promote `version` again (transient: retried at every poll; the lane reports a transient refusal
        once, while `version not in retry`)."""
        self._verdict(version)
        if self.pending is not None and self.pending.version == version:
            self.pending, self.passed = None, None
        self._remember(version, reason + (" (will retry)" if transient else ""))
        if transient:
            self.retry.add(version)
        else:
            self.retry.discard(version)
            self._mark(version, "refused")

    def remember_refusal(self, version: int, reason: str) -> None:
        """A refusal the ledger already holds (this server refused it before a restart)."""
        self._remember(version, reason)
        self._mark(version, "refused")

    def _mark(self, version: int, state: State) -> None:
        self.state[version] = state
        self.state.move_to_end(version)
        while len(self.state) > 4 * MAX_REFUSED_SHOWN:
            self.state.popitem(last=False)

    def _remember(self, version: int, reason: str) -> None:
        self.refused[version] = reason
        self.refused.move_to_end(version)
        while len(self.refused) > MAX_REFUSED_SHOWN:
            self.refused.popitem(last=False)

    def swapped(self, version: int, event: str, loaded: Any) -> int:
        """The engine serves `version` (the lane's `loaded`) now (`event`: promoted, rolled_back, pinned, restored);
        returns the version it served before. A promotion is watched; anything else is served as it is. No promotion
        while a pin stands (`next_step` never says "swap" then; this refuses a caller that did not ask)."""
        if event == "promoted" and self.pinned is not None:
            raise ValueError(f"v{version} cannot be promoted: the drafter is pinned to v{self.pinned}")
        prev, self.live = self.live, version
        self.loaded[version] = loaded
        keep = {version, 0}  # the last good version is loaded again when a watch or a rollback needs it
        self.loaded = {v: m for v, m in self.loaded.items() if v in keep}
        if self.pending is not None and self.pending.version == version:
            self.pending = None
        self.passed = None
        if version in self.retry:  # a retried version made it after all
            self.retry.discard(version)
            self.refused.pop(version, None)
        promoted = event == "promoted"
        if promoted:
            self._verdict(version)
        self.watch = Watch(version, self.good, self.rollback_window) if promoted else None
        if promoted or self.state.get(version) not in ("kept", "refused", "rolled_back"):
            self._mark(version, "watched" if promoted else "served")
        return prev

    # -- the rollback watch ------------------------------------------------------------------------
    def watch_ends(self, idle_s: float, busy: bool) -> tuple[Watch, str] | None:
        """The running watch and why it ends early ("" when full; a validated version waits behind it, `pending`),
        if it ends now."""
        w = self.watch
        if w is None:
            return None
        early = "" if w.full else w.ends_early(self.pending.version if self.pending is not None else None, idle_s, busy)
        return (w, early) if (w.full or early) else None

    def watch_judged(self, w: Watch, failed: bool) -> Literal["kept", "alert", "rollback"]:
        """A watch's verdict: not worse makes its version the last good one; worse rolls back unless pinned."""
        self.watch = None
        if not failed:
            self.good = w.version
            self.good_history.append(w.version)
            self._mark(w.version, "kept")
            return "kept"
        return "alert" if self.pinned is not None else "rollback"

    def drop_watch(self) -> None:
        self.watch = None

    def rollback_plan(self) -> tuple[int, int]:
        """(bad, target): from the live version back to the last version that passed its watch (from a good version:
        the one before it). ValueError under a pin, or with nothing to roll back to."""
        if self.pinned is not None:
            raise ValueError(f"the drafter is pinned to v{self.pinned}; unpin it before a rollback")
        bad = self.live
        if bad == 0:
            raise ValueError("nothing to roll back to: the startup drafter is served")
        history = [v for v in self.good_history if v != bad]
        return bad, (self.good if self.good != bad else (history[-1] if history else 0))

    def rolled_back(self, bad: int, target: int, reason: str) -> None:
        """`bad` is refused for good and `target` is the last good version (the swap follows)."""
        self._remember(bad, f"rolled back: {reason}")
        self._mark(bad, "rolled_back")
        self.good = target
        self.good_history = collections.deque([v for v in self.good_history if v != bad], maxlen=GOOD_HISTORY)

    # -- pins and restarts -------------------------------------------------------------------------
    def pin(self, version: int | None) -> int | None:
        """Serve exactly `version` until unpinned (None); returns the pin it replaced. A watch of another version
        ends without a verdict; a check passed meanwhile is forgotten: once unpinned, it is judged again against
        what is served then."""
        old, self.pinned = self.pinned, version
        if self.passed is not None:
            self._mark(self.passed.version, "validated")
            self.passed = None
        if version is not None and self.watch is not None and self.watch.version != version:
            self.watch = None
        return old

    def restore(self, refusals: dict[int, str], pinned: int | None, good: int) -> int:
        """At start, from the ledger: its refusals, then the version to serve: the pin, else the last good version
        unless it was refused since (then the startup drafter)."""
        for v, reason in sorted(refusals.items())[-MAX_REFUSED_SHOWN:]:
            self.remember_refusal(v, reason)
        want = pinned if pinned is not None else good
        return 0 if (want in self.refused and pinned is None) else want

    def restored(self, version: int, pinned: int | None) -> None:
        """What the restore serves (`version`, 0 when the wanted one would not load): the pin holds only if it is
        what is served."""
        self.pinned = pinned if (pinned is None or version == pinned) else None
        self.good = version
        self.good_history.append(version)
        if version:
            self._mark(version, "kept")
