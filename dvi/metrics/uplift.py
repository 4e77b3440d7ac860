"""The learned arm against the control arm, per request: the samples, the pooled rates and the uplift's interval.

A control group (issue 59) answers "did learning make serving faster" the way an A/B test does: each request
draws its arm from a hash, so the two arms see the same traffic at the same time in the same batches, and the
ratio of their means is the uplift. The interval is the delta method on the log of the ratio of two independent
means (normal quantile), which is what an operator reads as "learned is 1.3x control, 1.2x-1.4x": with few
requests in an arm the interval is wide and says so, and below `MIN_SAMPLES` in either arm there is none.
The server's telemetry, `/admin/status`, the demo and benchmarks all compute it here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dvi.decode.results import acceptance_rate

ARMS = ("learned", "control")
"""A request's arm: drafted by its traffic group's served drafter, or by the reference (the frozen base)."""

MEASURES = ("tokens_per_pass", "decode_tokens_per_s")
"""What the uplift is taken of: tokens per target pass (1 + accepted / steps, speed in the engine's own units) and
decode tokens per second as the engine measured the request (first token to last; queueing and prefill left out)."""

MIN_SAMPLES = 3
Z95 = 1.959964


@dataclass(frozen=True)
class ArmSample:
    """One finished request's numbers, as its arm's mean is made of them."""

    arm: str
    adapter_version: int
    drafted: int
    accepted: int
    steps: int
    drafting_steps: int  # steps that drafted at least one token (the rest decoded plainly)
    tokens_per_pass: float | None
    decode_tokens_per_s: float | None

    @classmethod
    def of(cls, arm: str, adapter_version: int, counts: Any, tokens: int, latency_s: float | None,
           ttft_s: float | None) -> ArmSample:
        """From a request's `DraftCounts` (its result), its completion tokens and the server's timing of it."""
        steps, dr_pos = int(counts.num_steps), counts.drafted_per_position
        return cls(arm=arm, adapter_version=int(adapter_version), drafted=int(counts.num_drafted),
                   accepted=int(counts.num_accepted), steps=steps,
                   drafting_steps=int(dr_pos[0]) if dr_pos else (steps if counts.num_drafted else 0),
                   tokens_per_pass=1.0 + counts.num_accepted / steps if steps else None,
                   decode_tokens_per_s=decode_rate(tokens, latency_s, ttft_s))


def sample_of_response(block: dict[str, Any]) -> ArmSample | None:
    """An `ArmSample` from a response's `dvi` block (what a client sees); None for a request of no traffic group."""
    if not block.get("arm"):
        return None
    dr_pos, steps = block.get("drafted_per_position") or [], int(block.get("steps") or 0)
    return ArmSample(arm=block["arm"], adapter_version=int(block.get("adapter_version") or 0),
                     drafted=int(block.get("drafted") or 0), accepted=int(block.get("accepted") or 0), steps=steps,
                     drafting_steps=int(dr_pos[0]) if dr_pos else 0,
                     tokens_per_pass=block.get("mean_accepted_length"),
                     decode_tokens_per_s=block.get("decode_tokens_per_s"))


def decode_rate(tokens: int, latency_s: float | None, ttft_s: float | None) -> float | None:
    """A request's tokens after its first per second after it (None under two tokens or without timing)."""
    if tokens < 2 or latency_s is None or ttft_s is None or latency_s <= ttft_s:
        return None
    return (tokens - 1) / (latency_s - ttft_s)


@dataclass(frozen=True)
class Uplift:
    """learned mean / control mean, with its 95% interval (None: too few samples in an arm)."""

    ratio: float
    low: float | None
    high: float | None
    n_learned: int
    n_control: int

    @property
    def significant(self) -> bool:
        """The interval excludes 1.0."""
        return self.low is not None and self.high is not None and (self.low > 1.0 or self.high < 1.0)

    def as_dict(self) -> dict[str, Any]:
        return {"ratio": _round(self.ratio), "low": _round(self.low), "high": _round(self.high),
                "n_learned": self.n_learned,
                "n_control": self.n_control, "significant": self.significant}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    return m, sum((x - m) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0


def uplift(learned: Sequence[float], control: Sequence[float]) -> Uplift | None:
    """The ratio of the arms' means and its 95% interval; None when an arm has no sample or a mean is not positive."""
    if not learned or not control:
        return None
    (ml, vl), (mc, vc) = _mean_var(learned), _mean_var(control)
    if ml <= 0 or mc <= 0:
        return None
    ratio = ml / mc
    if min(len(learned), len(control)) < MIN_SAMPLES:
        return Uplift(ratio, None, None, len(learned), len(control))
    se = math.sqrt(vl / (len(learned) * ml * ml) + vc / (len(control) * mc * mc))
    return Uplift(ratio, ratio * math.exp(-Z95 * se), ratio * math.exp(Z95 * se), len(learned), len(control))


def arm_summary(samples: Iterable[ArmSample]) -> dict[str, Any]:
    """One arm's pooled α and accepted length (ratios of sums) and its mean tokens per pass and decode tok/s."""
    s = list(samples)
    drafted, accepted = sum(x.drafted for x in s), sum(x.accepted for x in s)
    drafting = sum(x.drafting_steps for x in s)
    tpp = [x.tokens_per_pass for x in s if x.tokens_per_pass is not None]
    dps = [x.decode_tokens_per_s for x in s if x.decode_tokens_per_s is not None]
    return {"requests": len(s), "alpha": acceptance_rate(accepted, drafted),
            "accepted_length": accepted / drafting if drafting else None,
            "tokens_per_pass": sum(tpp) / len(tpp) if tpp else None,
            "decode_tokens_per_s": sum(dps) / len(dps) if dps else None}


def compare(samples: Iterable[ArmSample]) -> dict[str, Any]:
    """Both arms' summaries and the learned arm's uplift per measure (None where it cannot be taken)."""
    s = list(samples)
    by_arm = {a: [x for x in s if x.arm == a] for a in ARMS}
    out: dict[str, Any] = {a: arm_summary(by_arm[a]) for a in ARMS}
    out["uplift"] = {}
    for m in MEASURES:
        u = uplift([v for x in by_arm["learned"] if (v := getattr(x, m)) is not None],
                   [v for x in by_arm["control"] if (v := getattr(x, m)) is not None])
        out["uplift"][m] = u.as_dict() if u is not None else None
    return out
