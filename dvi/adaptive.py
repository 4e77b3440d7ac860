"""Adaptive number of draft tokens K from measured costs and per-sequence acceptance rates.

Speed of one step with K drafts: E[tokens/step] / (K * c_draft + c_verify(K)), where
E[tokens/step] = (1 - a^(K+1)) / (1 - a) for acceptance rate a, and K = 0 is plain decoding
(1 token per c_verify(0)). On CPU c_verify grows with K and with batch size (a (K+1)-token verify is
~1.6x a one-token step at batch 1, ~(K+1)x at batch 16), so speculation must switch itself off there.
Costs are running low quantiles of measured step timings keyed by batch size; unmeasured K are interpolated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["expected_tokens", "choose_k", "predicted_speedup", "CostModel", "AcceptanceEMA", "AdaptiveK"]


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens emitted by one step with k drafts at per-token acceptance alpha (bonus included)."""
    if k <= 0:
        return 1.0
    a = min(max(float(alpha), 0.0), 1.0)
    if a >= 1.0 - 1e-9:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(
    alphas: Sequence[float],
    draft_cost: float,
    verify_cost: Callable[[int], float] | Sequence[float],
    k_max: int,
    margin: float = 1.0,
) -> int:
    """K in [0, k_max] maximising batch tokens/second; `verify_cost(0)` is a plain decoding step.

    Speculation must beat plain decoding by `margin` (e.g. 1.05) to be chosen: the cost model has
    errors (per-step overheads it does not see, timing noise) and a marginal win is not worth them.
    """
    vc = verify_cost if callable(verify_cost) else (lambda k: verify_cost[k])
    plain = sum(1.0 for _ in alphas) / max(vc(0), 1e-12)
    best_k, best = 0, plain * margin
    for k in range(1, k_max + 1):
        t = k * draft_cost + vc(k)
        rate = sum(expected_tokens(a, k) for a in alphas) / max(t, 1e-12)
        if rate > best * 1.0001:
            best_k, best = k, rate
    return best_k


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float, plain_cost: float) -> float:
    """Speedup over plain decoding that alpha, K and the measured costs allow."""
    if k <= 0:
        return 1.0
    return expected_tokens(alpha, k) / (k * draft_cost + verify_cost) * plain_cost


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


class AcceptanceEMA:
    """Per-sequence acceptance rate from decayed counts of accepted / tried draft positions."""

    __slots__ = ("acc", "tried", "decay")

    def __init__(self, prior: float = 0.5, weight: float = 2.0, decay: float = 0.9):
        self.acc, self.tried, self.decay = prior * weight, weight, decay

    def update(self, k: int, n: int) -> None:
        if k <= 0:
            return
        # Positions tried: the n accepted plus the first rejected one (if any).
        self.acc = self.decay * self.acc + n
        self.tried = self.decay * self.tried + n + (1 if n < k else 0)

    @property
    def alpha(self) -> float:
        return self.acc / self.tried if self.tried > 0 else 0.0


class AdaptiveK:
    """Chooses K each step; measures K=0 and the default K first at each batch size, probes when K=0."""

    def __init__(self, k_max: int, k_default: int, probe_every: int = 16, probe_k: int | None = None,
                 max_probe_every: int = 256, margin: float = 1.05):
        self.margin = margin
        self.k_max = k_max
        self.k_default = max(1, min(k_default, k_max)) if k_max > 0 else 0
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.probe_k = probe_k
        self.costs = CostModel()
        self._zero_streak = 0
        self._interval = probe_every
        self._next_probe = probe_every
        self.last_choice = self.k_default

    def _near(self, batch: int) -> int | None:
        """Nearest batch size (within 25%) with a plain step, a default-K step and a draft step measured."""
        c, kd = self.costs, self.k_default
        known = [
            b for b, d in c.verify.items()
            if 0 in d and kd in d and b in c.draft and abs(b - batch) <= max(1, batch // 4)
        ]
        return min(known, key=lambda b: (abs(b - batch), b)) if known else None

    def choose(self, batch: int, alphas: Sequence[float]) -> int:
        if self.k_max <= 0 or not alphas:
            return 0
        c = self.costs
        # Explore (a plain step, then the default K) only where no measured neighbour exists: rows
        # finishing one by one must not each trigger expensive exploration steps.
        near = self._near(batch)
        if near is None:
            return 0 if not c.has_verify(batch, 0) else self.k_default
        k = choose_k(alphas, c.draft_cost(near), lambda kk: c.verify_cost(near, kk), self.k_max, self.margin)
        if k == 0:
            self._zero_streak += 1
            if self._zero_streak >= self._next_probe:
                # Keep alpha (and the K>0 costs) from going stale while speculation is off; back off
                # exponentially while probes keep confirming K = 0 (each probe costs a drafter catch-up).
                k = self.probe_k or max(1, min(2, self.k_max))
                self._interval = min(2 * self._interval, self.max_probe_every)
                self._next_probe = self._zero_streak + self._interval
        else:
            self._zero_streak = 0
            self._interval = self._next_probe = self.probe_every
        self.last_choice = k
        return k
