"""What a K is worth: the pure arithmetic adaptive K (`dvi.decode.adaptive.AdaptiveK`) chooses with.

Speed of one step with K drafts: E[tokens/step] / (K * c_draft + c_verify(K)), where
E[tokens/step] = (1 - a^(K+1)) / (1 - a) for acceptance rate a, and K = 0 is plain decoding (1 token per
c_verify(0)). `choose_k` and `choose_rows` run once an engine step, so each skips the Ks a bound shows cannot win
before it prices them row by row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["expected_tokens", "choose_k", "choose_rows", "choose_point_k", "predicted_speedup"]

_SLACK = 1e-9
"""Relative slack on the bounds that let `choose_k` / `choose_rows` skip a K: they must never skip one the full pass
would choose, whatever the float rounding."""


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
    remaining: Sequence[int] | None = None,
) -> int:
    """K in [0, k_max] maximising batch tokens/second; `verify_cost(0)` is a plain decoding step.

    Speculation must beat plain decoding by `margin` (e.g. 1.05) to be chosen: the cost model has
    errors (per-step overheads it does not see, timing noise) and a marginal win is not worth them.
    """
    vc = verify_cost if callable(verify_cost) else (lambda k: verify_cost[k])
    # Hot path (every engine step): alphas clamped once, E[tokens/step] inlined (same arithmetic as
    # `expected_tokens`, so the same choice).
    clamped = [min(max(float(a), 0.0), 1.0) for a in alphas]
    ones = 1.0 - 1e-9

    def tokens(k: int) -> list[float]:
        return [float(k + 1) if a >= ones else (1.0 - a ** (k + 1)) / (1.0 - a) for a in clamped]

    if remaining is not None:
        # Drain mode (no requests waiting to backfill finished rows): the batch is done when its slowest
        # row is, so minimise max_i(remaining_i / E_i[tokens/step]) * step time instead of throughput.
        rem = list(remaining)
        if len(rem) != len(clamped):
            raise ValueError("alphas and remaining differ in length")

        def drain(k: int) -> float:
            t = k * draft_cost + vc(k)
            if k <= 0:
                return max(r / 1.0 for r in rem) * t
            return max(r / e for r, e in zip(rem, tokens(k), strict=True)) * t

        best_k, best = 0, drain(0) / margin
        # The longest row alone, drafting at the best row's α, bounds drain(k) from below: a K it cannot win with is
        # skipped without its per-row pass (the hot path under load, where plain decoding wins every step).
        r_max, a_max = max(rem), max(clamped)
        for k in range(1, k_max + 1):
            t = k * draft_cost + vc(k)
            if r_max / expected_tokens(a_max, k) * t * (1.0 - _SLACK) >= best * 0.9999:
                continue
            d = drain(k)
            if d < best * 0.9999:
                best_k, best = k, d
        return best_k
    plain = len(clamped) / max(vc(0), 1e-12)
    best_k, best = 0, plain * margin
    a_max = max(clamped, default=0.0)
    for k in range(1, k_max + 1):
        t = max(k * draft_cost + vc(k), 1e-12)
        if len(clamped) * expected_tokens(a_max, k) / t * (1.0 + _SLACK) <= best * 1.0001:
            continue  # not even every row at the best row's α would win with this K
        rate = sum(tokens(k)) / t
        if rate > best * 1.0001:
            best_k, best = k, rate
    return best_k


def choose_rows(alphas: Sequence[float], draft_cost: float, verify: Sequence[float], rows: int, k_max: int,
                margin: float = 1.0) -> tuple[int, list[int]]:
    """K and the rows that draft it, where the target verifies only real drafts (a ragged verify): a row adds its K
    positions to the verify, priced at the bucket's calibrated seconds per position (`verify[k] - verify[0]` spread
    over its `rows` rows' K positions each), and is worth them while its expected accepted drafts raise the step's
    tokens per second. The drafter runs over every row (its cache stays current). Returns (0, []) where plain
    decoding wins by `margin`."""
    clamped = [min(max(float(a), 0.0), 1.0) for a in alphas]
    n, v0 = len(clamped), max(verify[0], 1e-12)
    best_k, best_rows, best = 0, [], n / v0 * margin
    a_max = max(clamped, default=0.0)
    for k in range(1, k_max + 1):
        per_position = max(verify[k] - verify[0], 0.0) / (rows * k)
        # m rows drafting at the best row's α bound every m-row choice; (n + m e) / (t0 + m c) is monotone in m, so
        # its best is at one row or all: a K neither wins with is skipped without its per-row pass (the hot path
        # under load, where plain decoding wins every step).
        e, t0, c = expected_tokens(a_max, k) - 1.0, k * draft_cost + v0, k * per_position
        if max((n + e) / (t0 + c), (n + n * e) / (t0 + n * c)) * (1.0 + _SLACK) <= best * 1.0001:
            continue
        extra = [expected_tokens(a, k) - 1.0 for a in clamped]  # drafts a row is expected to keep
        order = sorted(range(n), key=lambda i: -extra[i])
        tokens, t = float(n), k * draft_cost + v0
        for m, i in enumerate(order, 1):
            tokens, t = tokens + extra[i], t + k * per_position
            if tokens / t > best * 1.0001:
                best_k, best_rows, best = k, sorted(order[:m]), tokens / t
    return best_k, best_rows


def choose_point_k(probs: Sequence[Sequence[float]], batch: int, verify_cost: Callable[[int], float], k_max: int,
                   margin: float = 1.0) -> int:
    """Verify width K in [0, k_max] for suffix proposals, which cost no model pass: each row of `probs` holds a
    proposal's path probabilities (draft j is kept with probability probs[j], non-increasing: SuffixDecoding's
    estimate); the `batch` rows all emit one token a step, proposal rows also their expected accepted drafts
    sum(probs[:K]). K maximises tokens per second, `verify_cost(K)` the seconds of a step with K drafts; a K
    must beat plain decoding by `margin`."""
    gains = [0.0] * (k_max + 1)  # expected accepted drafts over all rows at K = index (increments)
    for row in probs:
        for j, pj in enumerate(row[:k_max]):
            gains[j + 1] += min(max(float(pj), 0.0), 1.0)
    best_k, best, total = 0, batch / max(verify_cost(0), 1e-12) * margin, 0.0
    for k in range(1, k_max + 1):
        total += gains[k]
        rate = (batch + total) / max(verify_cost(k), 1e-12)
        if rate > best * 1.0001:
            best_k, best = k, rate
    return best_k


def predicted_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float, plain_cost: float) -> float:
    """Speedup over plain decoding that alpha, K and the measured costs allow."""
    if k <= 0:
        return 1.0
    return expected_tokens(alpha, k) / (k * draft_cost + verify_cost) * plain_cost
