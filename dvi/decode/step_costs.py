"""What a step costs: the calibrated and online seconds per batch-size bucket (`CostModel`), and what a bucket's real
steps measured against the price adaptive K read for them (`MeasuredCosts`).

Adaptive K (`dvi.decode.adaptive.AdaptiveK`) prices a step from a short calibration of bare forwards per bucket; a
real step also pays what the calibration cannot see: the acceptance rule's host work (at a temperature above 0 the
target's and drafter's distributions over the vocabulary at every verified position; a draft tree's walk), the
drafter's sampled proposals, the emitted tokens' bookkeeping. `MeasuredCosts` keeps each bucket's measured / priced
ratio per part of a step, so a drafting step is priced at what such steps cost here.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["CostModel", "MeasuredCosts", "batch_bucket"]


class CostModel:
    """Measured seconds per drafter forward and per verify step with K drafts, keyed by batch size.

    Each figure is a low quantile (default: 25th percentile) of its last `window` samples. On a CPU
    shared with other processes, step times double for stretches of several steps when we are
    descheduled; a mean or even a median then depends on which K happened to run during the stall,
    while a low quantile tracks the uncontended cost that the choice between K values depends on.
    """

    def __init__(
        self,
        window: int = 31,
        quantile: float = 0.25,
        verify_slope_prior: float = 0.12,
        draft_ratio_prior: float = 0.25,
    ):
        self.window = window
        self.quantile = quantile
        self.verify_slope_prior = verify_slope_prior
        self.draft_ratio_prior = draft_ratio_prior
        self.verify: dict[int, dict[int, float]] = {}
        self.draft: dict[int, float] = {}
        self._samples: dict[tuple, deque] = {}

    def _robust(self, key: tuple, new: float) -> float:
        d = self._samples.get(key)
        if d is None:
            d = self._samples[key] = deque(maxlen=self.window)
        d.append(new)
        xs = sorted(d)
        return xs[int(self.quantile * (len(xs) - 1))]

    def record_verify(self, batch: int, k: int, seconds: float) -> None:
        self.verify.setdefault(batch, {})[k] = self._robust(("v", batch, k), seconds)

    def record_overhead(self, batch: int, seconds: float) -> float:
        """Record one step's host work outside the model forwards; returns the robust figure."""
        return self._robust(("o", batch), seconds)

    def record_draft(self, batch: int, seconds_per_forward: float) -> None:
        self.draft[batch] = self._robust(("d", batch), seconds_per_forward)

    def _nearest(self, table: dict, batch: int):
        if not table:
            return None
        return table[min(table, key=lambda b: (abs(b - batch), b))]

    def has_verify(self, batch: int, k: int) -> bool:
        return k in self.verify.get(batch, {})

    def verify_cost(self, batch: int, k: int) -> float | None:
        """Measured or interpolated cost of a verify step with k drafts (k = 0: plain step)."""
        d = self.verify.get(batch) or self._nearest(self.verify, batch)
        if not d:
            return None
        if k in d:
            return d[k]
        ks = sorted(d)
        if len(ks) >= 2:
            lo = max([x for x in ks if x < k], default=ks[0])
            hi = min([x for x in ks if x > k], default=ks[-1])
            if lo == hi:
                lo, hi = (ks[-2], ks[-1]) if k > ks[-1] else (ks[0], ks[1])
            slope = (d[hi] - d[lo]) / (hi - lo)
            return max(d[lo] + slope * (k - lo), 1e-9)
        k0 = ks[0]
        s = self.verify_slope_prior
        return d[k0] * (1 + s * k) / (1 + s * k0)

    def draft_cost(self, batch: int) -> float | None:
        if batch in self.draft:
            return self.draft[batch]
        near = self._nearest(self.draft, batch)
        if near is not None:
            return near
        plain = self.verify_cost(batch, 0)
        return None if plain is None else plain * self.draft_ratio_prior


def batch_bucket(batch: int) -> int:
    """Nearest power of two: batch sizes whose costs are calibrated together."""
    return 1 << max(0, round(math.log2(max(1, batch))))


class MeasuredCosts:
    """Per batch-size bucket, what real steps measured against their calibrated price, per part of a step: "plain"
    (a plain step's verify and host work: measured / priced), "draft" (a drafter forward: measured / priced) and
    "position" (a drafting step's verify beyond the plain factor's price of its positions, in seconds per drafted
    position: the acceptance rule's work at each one, a draft tree's walk). Each is the median of the last `window`
    samples once `least` steps measured it (a single stalled step must not price drafting out of a bucket for good:
    a bucket that stops drafting stops measuring it), and moves only by more than `step` of itself (or 1 us), so the
    prices built from it are not rebuilt every step."""

    NEUTRAL = {"plain": 1.0, "draft": 1.0, "position": 0.0}

    def __init__(self, window: int = 15, least: int = 3, step: float = 0.02):
        self.window, self.least, self.step = window, least, step
        self._samples: dict[tuple[int, str], deque] = {}
        self._value: dict[tuple[int, str], float] = {}

    def observe(self, b: int, part: str, sample: float) -> bool:
        """One step's sample of `part` in bucket `b`; whether the part's value moved."""
        if not math.isfinite(sample):
            return False
        d = self._samples.get((b, part))
        if d is None:
            d = self._samples[(b, part)] = deque(maxlen=self.window)
        d.append(sample)
        if len(d) < self.least:
            return False
        m, old = statistics.median(d), self._value.get((b, part))
        if old is not None and abs(m - old) <= max(self.step * abs(old), 1e-6):
            return False
        self._value[(b, part)] = m
        return True

    def value(self, b: int, part: str) -> float:
        return self._value.get((b, part), self.NEUTRAL[part])

    def values(self) -> dict[str, float]:
        """Every measured value, "<bucket>/<part>" (reports, tests)."""
        return {f"{b}/{part}": v for (b, part), v in sorted(self._value.items())}
