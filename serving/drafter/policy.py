"""What a drafter lane (`serving.drafter.lane`) follows: `LifecyclePolicy` (its part of the config, and the gates'
rules, `dvi.feedback.verdict`), and, for a traffic group's lane, its `GroupScope`.

Its own module so the lane reads as the promotion and rollback sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dvi.config import DviConfig
from dvi.feedback.heldout import adapter_group
from dvi.feedback.verdict import Rule, promotion_rule, watch_rule


@dataclass(frozen=True)
class LifecyclePolicy:
    """When a lane looks at LATEST, promotes and rolls back."""

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
    def of(cls, cfg: DviConfig) -> LifecyclePolicy:
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
class GroupScope:
    """What makes a lane a traffic group's (issue 40): the group whose adapter versions it promotes, the records
    it judges them on (that group's only), and the base drafter's shapes its versions are read as per-row factors
    with (`dvi.registry.codec.load_group_version`)."""

    group: str
    key: str  # trainer.adapter_key
    sizes: dict[str, int] = field(default_factory=dict)  # the base drafter's projection sizes
    num_layers: int = 0

    def accepts(self, record: Any) -> bool:
        return adapter_group(self.key, record.domain, getattr(record, "client", "")) == self.group
