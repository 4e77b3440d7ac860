"""THE comparison of a candidate drafter with the one it would replace: `compare(candidate, incumbent,
held_out, rule) -> Verdict`, used by the trainer's publish check, the server's promotion check and its rollback
watch, each with its own `Rule` (`publish_rule`, `promotion_rule`, `watch_rule`: the one place a margin gets its
sign; `gates(cfg)` builds all three).

Both versions score the same records (`dvi.feedback.shadow.record_scores`: teacher-forced, no target run), so
every difference is the drafters'. The verdict is per group (`dvi.feedback.heldout.group_of`: domain x
temperature class x client): a candidate fails when ANY group with at least `min_group_records` records gets
worse by more than `group_margin` (issue 36 §3: a pooled α weighted by traffic let a majority client's gain
hide a minority group's fall to 0). Groups with fewer records are not judged but listed (`Verdict.unjudged`,
counted on /metrics), never silently dropped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dvi.decode.results import acceptance_rate, fmt_rate
from dvi.feedback.heldout import group_of
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.shadow import LogitsFn, Scores, record_scores, shadow_passes

Scorer = Callable[[Sequence[FeedbackRecord]], Scores]
"""Records -> `record_scores` of one drafter version on them."""


def scorer(logits_fn: LogitsFn, device: Any = "cpu") -> Scorer:
    """A `Scorer` for a drafter's teacher-forced logits (`dvi.feedback.shadow.hf_logits_fn`)."""
    return lambda records: record_scores(logits_fn, records, device)


@dataclass(frozen=True)
class Rule:
    """What a gate asks of a candidate. `min_gain`: its pooled α minus the incumbent's must be at least this
    (positive: better by; negative: worse by at most; None: no pooled test). `group_margin`: no judged group may
    fall by more. `z`: ... and must pass the margin by this many standard errors of its per-record differences (a
    confidence bound: the fall's upper bound is below -group_margin; a group's few records are noisy). `min_positions`: fewer scored positions and the verdict waits."""

    name: str
    min_gain: float | None
    group_margin: float
    min_group_records: int = 4
    min_positions: int = 0
    z: float | None = None


@dataclass(frozen=True)
class Gates:
    """The three rules, built from a config by `gates`."""

    publish: Rule
    promotion: Rule
    watch: Rule


def publish_rule(publish_margin: float, group_margin: float, min_group_records: int, min_positions: int,
                 group_z: float = 0.0) -> Rule:
    """The trainer publishes a candidate better than the served version by `publish_margin` (a negative one: worse
    by at most that much, a deliberate reset; a group may then fall as far). A group refuses it when it falls by
    more than its margin and, with `group_z` > 0, past it by that many standard errors."""
    return Rule("publish", min_gain=publish_margin, group_margin=max(group_margin, -publish_margin),
                min_group_records=min_group_records, min_positions=min_positions, z=group_z or None)


def promotion_rule(shadow_margin: float, group_margin: float, min_group_records: int, min_positions: int,
                   group_z: float = 0.0) -> Rule:
    """The server promotes a candidate worse than the served version by at most `shadow_margin` pooled and
    `group_margin` in any group (or `shadow_margin`, when that is wider: a gate loosened on purpose loosens every
    group alike); a group's fall past its margin refuses only beyond `group_z` standard errors (0: any)."""
    return Rule("promotion", min_gain=-shadow_margin, group_margin=max(group_margin, shadow_margin),
                min_group_records=min_group_records, min_positions=min_positions, z=group_z or None)


def watch_rule(rollback_margin: float, rollback_z: float, min_group_records: int) -> Rule:
    """The server rolls back a version whose fresh records fall by more than `rollback_margin` in a group, z
    `rollback_z` standard errors (no pooled test: traffic mixes change between windows)."""
    return Rule("watch", min_gain=None, group_margin=rollback_margin, min_group_records=min_group_records, z=rollback_z)


def gates(cfg: Any) -> Gates:
    """The three rules of a `dvi.config.DviConfig` (trainer.publish_margin, trainer.shadow_margin,
    serve.rollback_margin / rollback_z; publish and promotion also refuse a fall of more than
    `trainer.gate_group_margin` in any group of at least `trainer.gate_min_group_records` records)."""
    t, s = cfg.trainer, cfg.serve
    evidence = (t.gate_group_margin, t.gate_min_group_records, t.shadow_min_positions, t.gate_z)
    return Gates(publish=publish_rule(t.publish_margin, *evidence), promotion=promotion_rule(t.shadow_margin, *evidence),
                 watch=watch_rule(s.rollback_margin, s.rollback_z, t.gate_min_group_records))


@dataclass
class GroupResult:
    """One group's comparison: pooled α of both versions on its records, and the z of the per-record differences."""

    group: str
    records: int
    positions: int
    new_alpha: float | None
    old_alpha: float | None
    z: float
    judged: bool
    worse: bool

    @property
    def change(self) -> float | None:
        if self.new_alpha is None or self.old_alpha is None:
            return None
        return self.new_alpha - self.old_alpha

    def describe(self) -> str:
        z = f", z {self.z:.1f}" if math.isfinite(self.z) else ""
        change = self.change
        return (f"{self.group}: α {fmt_rate(self.old_alpha)} -> {fmt_rate(self.new_alpha)} "
                f"({'n/a' if change is None else f'{change:+.3f}'}{z}) over {self.records} records")


@dataclass
class Verdict:
    """`outcome`: "pass", "fail" or "wait" (too little evidence to decide); `reason` says why, in words."""

    rule: str
    outcome: str
    new_alpha: float | None = None
    old_alpha: float | None = None
    records: int = 0
    positions: int = 0
    groups: list[GroupResult] = field(default_factory=list)
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "pass"

    @property
    def failed(self) -> bool:
        return self.outcome == "fail"

    @property
    def unjudged(self) -> list[GroupResult]:
        """Groups with too few records to judge (listed in `reason`, counted on /metrics)."""
        return [g for g in self.groups if not g.judged]

    def group_summary(self) -> str:
        """Every group's change, judged ones first, for a log line or a swap event."""
        judged = [f"{g.group} {g.change:+.3f} ({g.records})" if g.change is not None else f"{g.group} n/a"
                  for g in self.groups if g.judged]
        out = "groups " + (", ".join(judged) if judged else "none judged")
        if self.unjudged:
            out += "; unjudged (too few records): " + ", ".join(f"{g.group} ({g.records})" for g in self.unjudged)
        return out


def compare(candidate: Scorer, incumbent: Scorer, held_out: Iterable[FeedbackRecord], rule: Rule) -> Verdict:
    """Score `held_out` with both versions and judge them by `rule` (`judge`). The incumbent is not scored when
    the candidate's scores hold fewer than `rule.min_positions` positions (the verdict waits)."""
    records = list(held_out)
    new = candidate(records)
    positions = sum(n for _, _, n in new)
    if positions < rule.min_positions:
        return Verdict(rule.name, "wait", records=len(new), positions=positions,
                       reason=f"{positions} held-out positions of the {rule.min_positions} a check needs")
    return judge(new, incumbent(records), rule)


def _group_result(key: str, pairs: list[tuple[float, float, int]], rule: Rule) -> GroupResult:
    hn, ho, n = (sum(p[i] for p in pairs) for i in range(3))
    new_a, old_a = acceptance_rate(hn, n), acceptance_rate(ho, n)
    diffs = [(a - b) / m for a, b, m in pairs]
    mean = float(np.mean(diffs))
    se = float(np.std(diffs, ddof=1)) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    z = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    judged = len(pairs) >= rule.min_group_records
    fell = new_a is None or not math.isfinite(new_a) or (old_a is not None and new_a < old_a - rule.group_margin)
    # a confidence bound: the fall is past the margin by `rule.z` standard errors (its upper bound is below -margin)
    beyond = se == 0 or mean + rule.group_margin + (rule.z or 0.0) * se < 0
    worse = judged and fell and (rule.z is None or beyond)
    return GroupResult(key, len(pairs), int(n), new_a, old_a, z, judged, worse)


def judge(new: Scores, old: Scores, rule: Rule) -> Verdict:
    """The verdict on two versions' scores of the same records (`record_scores`, in the same order)."""
    by_group: dict[str, list[tuple[float, float, int]]] = {}
    for (rec, h_new, n), (rec_old, h_old, n_old) in zip(new, old, strict=True):
        if rec is not rec_old or n != n_old:
            raise ValueError("compare needs both versions' scores of the same records")
        by_group.setdefault(group_of(rec), []).append((h_new, h_old, n))
    groups = [_group_result(k, v, rule) for k, v in sorted(by_group.items())]
    positions = sum(n for _, _, n in new)
    new_a = acceptance_rate(sum(h for _, h, _ in new), positions)
    old_a = acceptance_rate(sum(h for _, h, _ in old), positions)
    v = Verdict(rule.name, "pass", new_a, old_a, len(new), positions, groups)
    why = _pooled_failure(new_a, old_a, rule)
    worse = [g.describe() for g in groups if g.worse]
    if worse:
        bound = f" (by {rule.z:g} standard errors)" if rule.z else ""
        why = (why + "; " if why else "") + (f"worse by more than {rule.group_margin}{bound} in " + "; ".join(worse))
    v.outcome = "fail" if why else "pass"
    v.reason = why
    return v


def _pooled_failure(new_a: float | None, old_a: float | None, rule: Rule) -> str:
    """Why the pooled α fails `rule.min_gain` ("" when it does not): the margin's sign lives here."""
    if new_a is not None and not math.isfinite(new_a):
        return "not finite"
    if rule.min_gain is None:
        return ""
    if new_a is None:
        return "no scored position"
    if shadow_passes(new_a, old_a, -rule.min_gain):  # new >= old + min_gain
        return ""
    return f"not better by {rule.min_gain}" if rule.min_gain > 0 else f"worse by more than {-rule.min_gain}"
