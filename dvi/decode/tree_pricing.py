"""How many of a learned drafter's next candidates join its chain as siblings: a draft tree's shape, priced per step.

A chain stops at its first miss, though the target's token is often the drafter's second or third guess there
(teacher-forced on the shipped drafter, unseen chat: top-1 0.26, top-2 0.36, top-4 0.45). A sibling costs no
drafter forward (the chain's forward already scored it), only a verify one node wider; it pays where the
tokens it is expected to add outweigh that width at the calibrated verify cost of this machine and batch: an
Intel AMX CPU verifies 9 nodes for about one step, an fp32 Zen3 does not, and then the shape stays a chain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dvi.decode.sources import SOURCE_MODEL

__all__ = ["HIT_PRIOR", "SiblingStats", "choose_siblings"]

HIT_PRIOR = (0.135, 0.07, 0.07, 0.05, 0.05, 0.04, 0.04, 0.03)
"""P(the sibling of rank r + 1 is the target's token | the chain's draft and the siblings before it missed), from
the shipped drafter's top-k coverage on unseen chat ((0.36 - 0.26) / 0.74 for the first; the next two share
(0.45 - 0.36) / 0.64), shrinking beyond. Measured rates replace it as steps come in (`SiblingStats`)."""


class SiblingStats:
    """Per sibling rank, how often it was tried (the chain's draft at its depth and every earlier sibling were
    rejected) and accepted; shrunk toward `HIT_PRIOR` by `weight` pseudo-trials, decayed so a drift shows."""

    def __init__(self, ranks: int = len(HIT_PRIOR), weight: float = 16.0, decay: float = 0.998):
        self.tried = [0.0] * ranks
        self.hits = [0.0] * ranks
        self.weight, self.decay = float(weight), float(decay)

    def observe(self, tried: int, hit: int | None) -> None:
        """A rejected chain draft whose `tried` siblings were tested in rank order, `hit` (0-based) accepted."""
        for r in range(min(tried, len(self.tried))):
            self.tried[r] = self.decay * self.tried[r] + 1.0
            self.hits[r] = self.decay * self.hits[r] + (1.0 if r == hit else 0.0)

    def rates(self) -> list[float]:
        prior = list(HIT_PRIOR) + [HIT_PRIOR[-1]] * max(0, len(self.tried) - len(HIT_PRIOR))
        return [(h + self.weight * p) / (t + self.weight) for h, t, p in zip(self.hits, self.tried, prior, strict=False)]

    def snapshot(self) -> dict[str, list[float]]:
        return {"tried": [round(t, 1) for t in self.tried], "hit_rate": [round(r, 4) for r in self.rates()]}


def choose_siblings(alphas: Sequence[float], k: int, rates: Sequence[float], step_cost: Callable[[int], float],
                    max_width: int) -> list[int]:
    """Siblings per depth 1..k (the same for every row, so a batch's trees share their width) that maximise the
    batch's expected tokens per second: the chain of k drafts yields sum_i (1 - a_i^(k + 1)) / (1 - a_i); a
    sibling of rank r at depth d adds sum_i a_i^(d - 1) (1 - a_i) prod_{r' < r} (1 - h_r') h_r (its row reaches
    the depth, the chain misses there, the earlier siblings miss, it hits: one more token). `step_cost(w)` is the
    seconds of a step verifying w draft nodes (drafter forwards included)."""
    a = [min(max(float(x), 0.0), 1.0 - 1e-9) for x in alphas]
    width = min(max_width, len(rates))
    if k <= 0 or width <= 0 or not a:
        return []
    tokens = sum((1.0 - x ** (k + 1)) / (1.0 - x) for x in a)
    miss = [sum(x ** (d - 1) * (1.0 - x) for x in a) for d in range(1, k + 1)]
    reach = [1.0] * width  # prod_{r' < r} (1 - h_r')
    for r in range(1, width):
        reach[r] = reach[r - 1] * (1.0 - rates[r - 1])
    counts, nodes = [0] * k, k
    rate = tokens / max(step_cost(nodes), 1e-12)
    while True:
        best, gain = None, 0.0
        for d in range(k):
            r = counts[d]
            if r < width and miss[d] * reach[r] * rates[r] > gain:
                best, gain = d, miss[d] * reach[r] * rates[r]
        if best is None:
            return counts
        new = (tokens + gain) / max(step_cost(nodes + 1), 1e-12)
        if new <= rate * 1.0001:
            return counts
        counts[best] += 1
        nodes, tokens, rate = nodes + 1, tokens + gain, new


def sibling_outcomes(parents: list[list[int]], spine: list[int], spine_kept: list[int], ranks: list[list[int]],
                     column_sources: list[list[str | None]] | None = None,
                     path_sources: list[list[str | None]] | None = None) -> list[tuple[int, int | None]]:
    """Per row whose chain draft was rejected where the drafter's siblings stood beside it: (siblings tested, the
    0-based one accepted or None). `ranks[i]` are the sibling ranks of row i's accepted nodes (0: the chain's), in
    path order; where a tree mixes proposers, `column_sources` (tree columns) and `path_sources` (path order) say
    who proposed each node: a history branch beside the drafter's nodes is no sibling of the drafter's."""
    out = []
    for i, (par, s, kept, rk) in enumerate(zip(parents, spine, spine_kept, ranks, strict=True)):
        if kept >= s:
            continue
        cols = column_sources[i] if column_sources is not None else None
        siblings = sum(1 for j, p in enumerate(par) if p == kept and j != kept and (cols is None or cols[j] == SOURCE_MODEL))
        if siblings == 0:
            continue
        mine = path_sources is None or (len(path_sources[i]) > kept and path_sources[i][kept] == SOURCE_MODEL)
        hit = rk[kept] - 1 if len(rk) > kept and mine else None
        out.append((siblings if hit is None else min(hit + 1, siblings), hit))
    return out
