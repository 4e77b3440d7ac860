"""What the online trainer decided, as the loop, the RL trainer and the tests read it: one training round
(`RoundStats`, from `OnlineTrainer.train_on_records` / `train_on_replay`) and one publish check
(`PublishDecision`, from `OnlineTrainer.maybe_publish`).

Typed records rather than dicts read by key in other modules: a renamed field fails at import, not in a log
line three modules away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dvi.feedback.verdict import Verdict

__all__ = ["PublishDecision", "RoundStats"]


@dataclass
class RoundStats:
    """One round: how many records were new, held out (never trained on) or dropped as stale, how many replayed
    ones joined them, the optimizer steps taken and their mean losses (`losses`: loss, kl, reward,
    reward_weight, feature, tokens and seconds per step; empty when no step ran). `budget_deferred`: new records
    beyond the step budget (they join the replay buffer untrained)."""

    steps: int
    seconds: float
    losses: dict[str, float] = field(default_factory=dict)
    new: int = 0
    heldout: int = 0
    dropped_stale: int = 0
    replayed: int = 0
    target_version: int = 0
    budget_deferred: int = 0
    trained_ids: list[str] = field(default_factory=list)
    heldout_ids: list[str] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)
    # read but trained by no adapter, ever (trainer.adapter_key: no group, past the cap, a gathering group evicted)
    untrained_ids: list[str] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """The mean loss of the round's steps (nan without a step)."""
        return self.losses.get("loss", math.nan)


@dataclass
class PublishDecision:
    """One publish check at `step`: the held-out shadow α of the candidate and of the served `parent_version`
    (None when the check could not run), on how many records and positions, why (`reason`, logged) and the
    version published (None: not published)."""

    step: int
    parent_version: int
    time: float
    reason: str = ""
    heldout_alpha: float | None = None
    parent_heldout_alpha: float | None = None
    heldout_records: int = 0
    heldout_positions: int = 0
    published: int | None = None
    verdict: Verdict | None = None  # the comparison behind it (per group); None when it could not run
