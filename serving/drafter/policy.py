"""What the drafter swapper (`serving.drafter.lane`) follows, `SwapPolicy` (its part of the config, and the gates'
rules, `dvi.feedback.verdict`), and what it reports, `SwapEvent` (logged, counted on /metrics, shown on /health).

Its own module so the swapper reads as the promotion and rollback sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dvi.config import DviConfig
from dvi.feedback.heldout import adapter_group
from dvi.feedback.verdict import Rule, promotion_rule, watch_rule


@dataclass
class SwapEvent:
    """One promotion / refusal / rollback / pin / alert, as logged, counted and shown on /health."""

    kind: str  # "promoted" | "refused" | "rolled_back" | "pinned" | "restored" | "kept" | "alert"
    version: int
    previous: int | None
    reason: str
    at: float
    category: str = ""  # refusals: one of dvi.registry.store.REFUSAL_KINDS (a bounded metrics label)
    publish_to_verdict_s: float | None = None  # a version's first verdict (promoted / refused): since its publish
    group: str = ""  # a traffic group's adapter version (issue 40); "" the shared drafter's

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": self.version, "previous": self.previous,
                "reason": self.reason, "at": self.at, "category": self.category,
                "publish_to_verdict_s": self.publish_to_verdict_s, "group": self.group}


@dataclass(frozen=True)
class SwapPolicy:
    """When the swapper looks, promotes and rolls back (module docstring)."""

    poll_seconds: float
    shadow_margin: float
    rollback_window: int
    rollback_margin: float
    shadow_records: int = 128
    heldout_fraction: float = 0.1
    min_positions: int = 256
    rollback_z: float = 2.0
    group_margin: float = 0.02
    min_group_records: int = 4
    watch_idle_s: float = 2.0
    group_z: float = 2.0

    @classmethod
    def of(cls, cfg: DviConfig) -> SwapPolicy:
        """From a `DviConfig` (serve.registry_poll_seconds, serve.rollback_* / watch_idle_s, trainer.shadow_* /
        heldout_fraction / gate_*)."""
        t, sv = cfg.trainer, cfg.serve
        return cls(poll_seconds=sv.registry_poll_seconds, shadow_margin=t.shadow_margin,
                   rollback_window=sv.rollback_window, rollback_margin=sv.rollback_margin,
                   shadow_records=t.shadow_records, heldout_fraction=t.heldout_fraction,
                   min_positions=t.shadow_min_positions, rollback_z=sv.rollback_z, group_margin=t.gate_group_margin,
                   min_group_records=t.gate_min_group_records, watch_idle_s=sv.watch_idle_s, group_z=t.gate_z)

    @property
    def promotion(self) -> Rule:
        return promotion_rule(self.shadow_margin, self.group_margin, self.min_group_records, self.min_positions,
                              self.group_z)

    @property
    def watch(self) -> Rule:
        return watch_rule(self.rollback_margin, self.rollback_z, self.min_group_records)


@dataclass(frozen=True)
class SwapLane:
    """What makes a swapper a traffic group's (issue 40): the group whose adapter versions it promotes, the records
    it judges them on (that group's only), and the base drafter's shapes its versions are read as per-row factors
    with (`dvi.registry.codec.load_group_version`)."""

    group: str
    key: str  # trainer.adapter_key
    sizes: dict[str, int] = field(default_factory=dict)  # the base drafter's projection sizes
    num_layers: int = 0

    def accepts(self, record: Any) -> bool:
        return adapter_group(self.key, record.domain, getattr(record, "client", "")) == self.group
