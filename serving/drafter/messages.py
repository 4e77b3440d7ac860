"""What crosses the drafter wing's door (`serving.drafter.client`): typed messages in, a frozen snapshot out.

- In: `Pin` and `Rollback` (the admin API), each a small frozen dataclass answered through a future, and
  `Observed` (the engine thread: a finished request's drafted / accepted counts and its feedback record; no answer).
  They wait on the door's one inbox; the drafter thread applies them between two of its steps.
- Out: after every batch of messages and every step, the drafter thread builds a `DrafterSnapshot` (frozen; its
  mappings are read-only copies) and publishes it by one reference assignment. /health, /metrics and /admin read only
  that; what one lane (the shared drafter's, or a traffic group's) shows is its `LaneView`.
- What happened to a version (promoted, refused, rolled back, pinned, restored, kept, alert) is a `VersionEvent`:
  logged, counted on /metrics, appended to the swap event log and shown on /health.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["Command", "DrafterSnapshot", "LaneView", "Observed", "Pin", "Rollback", "VersionEvent"]

_EMPTY: Mapping[Any, Any] = MappingProxyType({})
LANE_INFO = ("live_version", "serving", "good", "pinned", "watch", "latest", "heldout_positions", "waiting",
             "gates", "counts", "events", "alpha_diagnosis")
"""What /health shows of a traffic group's lane (the shared lane shows all of `LaneView.info`)."""


@dataclass(frozen=True)
class Pin:
    """Serve exactly `version` (0: the startup drafter) until unpinned (None); the future holds the version served
    (`serving.drafter.lane.Lane.pin`). AdapterRejected when it does not load, ValueError when it does not exist."""

    version: int | None


@dataclass(frozen=True)
class Rollback:
    """Back to the last version that passed its watch; the future holds it. ValueError under a pin or with
    nothing to roll back to (`serving.drafter.lane.Lane.rollback`)."""

    reason: str = "admin rollback"


Command = Pin | Rollback


@dataclass(frozen=True)
class Observed:
    """A finished request, from the engine thread: the learned drafter's drafted / accepted tokens under
    `drafter_version` (the live-α window) and its feedback record (None: nothing to judge on), at `at`
    (`time.monotonic()`: a watch's idle clock counts from when the request finished, not from when it was read)."""

    drafted: int
    accepted: int
    drafter_version: int
    record: Any = None
    at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class VersionEvent:
    """One promotion / refusal / rollback / pin / alert, as logged, counted and shown on /health (`event` names which;
    its JSON key, in the events log and on /health, stays "kind")."""

    event: str  # "promoted" | "refused" | "rolled_back" | "pinned" | "restored" | "kept" | "alert" | "alpha_move"
    version: int
    previous: int | None
    reason: str
    at: float
    # refusals: one of dvi.registry.store.REFUSAL_CATEGORIES (a bounded metrics label); an alpha_move: its cause
    # (`serving.drafter.diagnosis.CAUSES`)
    category: str = ""
    publish_to_verdict_s: float | None = None  # a version's first verdict (promoted / refused): since its publish
    group: str = ""  # a traffic group's adapter version (issue 40); "" the shared drafter's

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.event, "version": self.version, "previous": self.previous,
                "reason": self.reason, "at": self.at, "category": self.category,
                "publish_to_verdict_s": self.publish_to_verdict_s, "group": self.group}


@dataclass(frozen=True)
class LaneView:
    """One lane's versions as of one moment on the drafter thread (`serving.drafter.lane.Lane.view`)."""

    group: str = ""  # "" the shared drafter's lane, else the traffic group's
    live_version: int = 0  # what the lane decided is served
    serving: int = 0  # what the engine serves (its snapshot; equal to live_version once a swap ran)
    good: int = 0  # the newest version that passed its watch
    pinned: int | None = None
    watch: Mapping[str, int] | None = None  # {"version", "against", "records", "of"}
    latest: int | None = None  # LATEST as the lane last read it
    heldout_positions: int = 0
    waiting: Mapping[str, int] | None = None  # a version waiting for held-out evidence: {"version", "heldout_positions", "of"}
    heldout: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # `HeldOutSet.info()`: records, groups, unfit
    verdicts: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # the last `Verdict` of each gate
    refused: Mapping[int, str] = field(default_factory=lambda: _EMPTY)  # the newest refusals, with their reasons
    counts: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # events by `VersionEvent.event` (a Counter: 0 for none)
    versions: Mapping[int, str] = field(default_factory=lambda: _EMPTY)  # the newest versions' lifecycle states
    live_alpha: Mapping[int, float | None] = field(default_factory=lambda: _EMPTY)  # per kept version, live
    events: tuple[VersionEvent, ...] = ()  # the newest, oldest first
    diagnosis: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # why live α moved (`Diagnosis.info`)

    def info(self) -> dict[str, Any]:
        """The lane on /health (plain JSON)."""
        return {
            "live_version": self.live_version, "serving": self.serving, "good": self.good, "pinned": self.pinned,
            "watch": None if self.watch is None else dict(self.watch), "latest": self.latest,
            "heldout_positions": self.heldout_positions,
            "waiting": None if self.waiting is None else dict(self.waiting),
            "heldout": dict(self.heldout),
            "gates": {name: {"outcome": v.outcome, "groups": v.group_summary()} for name, v in self.verdicts.items()},
            "refused": {str(k): v for k, v in self.refused.items()},
            "counts": dict(self.counts),
            "versions": {str(v): s for v, s in self.versions.items()},
            "live_alpha": self.live_alpha.get(self.live_version),
            "events": [e.as_dict() for e in self.events[-10:]],
            "alpha_diagnosis": dict(self.diagnosis),
        }


@dataclass(frozen=True)
class DrafterSnapshot:
    """The drafter wing as of one moment on the drafter thread (`seq`: how many were published before)."""

    seq: int = 0
    at: float = field(default_factory=time.time)
    shared: LaneView = field(default_factory=LaneView)  # the shared drafter's lane
    groups: Mapping[str, LaneView] | None = None  # per traffic group (trainer.adapter_key; None: no groups)
    adapter_key: str = "none"
    max_adapters: int = 0
    over_cap: tuple[str, ...] = ()  # groups with a registry but no room (they draft with the shared drafter)
    dropped: int = 0  # finished requests not observed: the inbox held too many

    def adapters(self) -> dict[str, Any] | None:
        """The traffic groups' lanes on /health (None without groups)."""
        if self.groups is None:
            return None
        return {"adapter_key": self.adapter_key, "max_adapters": self.max_adapters,
                "groups": {g: {k: v for k, v in lane.info().items() if k in LANE_INFO}
                           for g, lane in sorted(self.groups.items())},
                "over_cap": list(self.over_cap)}
