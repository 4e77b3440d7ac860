"""Per-result spec-decode stats: what one finished request drafted and accepted, rolled up.

Kept apart from the Prometheus collectors so the trainer, the rollout hook and benchmarks can
roll results up (`ResultStats`, `AlphaWindow`, `summarize_results`) without touching
prometheus_client. The rates themselves come from `dvi.decode.results` (None = no data).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dvi.decode.results import (
    DraftCounts,
    GenerationResult,
    acceptance_rate,
    mean_accepted_length,
    pooled_rates,
)
from dvi.metrics.names import (
    ACCEPTANCE_RATE,
    ACCEPTANCE_RATE_PER_POS,
    GENERATION_TOKENS,
    LOW_ACCEPTANCE,
    MEAN_ACCEPTED_LENGTH,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    REQUESTS,
    SOURCE_ACCEPTANCE_RATE,
    SOURCE_MEAN_ACCEPTED_LENGTH,
)


def low_acceptance(c: DraftCounts) -> bool:
    """A request whose drafts kept failing (`dvi.metrics.names.LOW_ACCEPTANCE`): counted on /metrics, logged."""
    drafted, alpha = LOW_ACCEPTANCE
    return c.num_drafted >= drafted and c.num_accepted <= alpha * c.num_drafted


@dataclass
class ResultStats(DraftCounts):
    """The spec-decode numbers of one `GenerationResult`, light enough to keep hundreds in a window.

    A result holds its top-k rows (tens of KB); the rolling windows and the telemetry log keep only
    its `DraftCounts` and these few fields.
    """

    domain: str
    drafter_version: int
    num_drafts: int
    num_tokens: int
    finish_reason: str
    latency: float | None
    ttft: float | None
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [drafts, drafted, accepted]

    @classmethod
    def of(cls, result: GenerationResult, *, domain: str | None = None, finish_reason: str | None = None,
           latency: float | None = None, ttft: float | None = None) -> ResultStats:
        """`domain`, `finish_reason`, `latency` and `ttft` override the result's (the server measures
        latency from submission and may end a sequence on a stop string the engine never saw)."""
        r = result
        if latency is None and r.finished_at >= r.started_at > 0:
            latency = r.finished_at - r.started_at
        dr_pos = list(r.drafted_per_position)
        # drafted_per_position[0] counts the steps in which at least one token was drafted.
        num_drafts = dr_pos[0] if dr_pos else (r.num_steps if r.num_drafted else 0)
        return cls(
            domain=str(domain if domain is not None else (r.domain or "default")),
            drafter_version=int(r.drafter_version),
            num_drafts=int(num_drafts),
            num_drafted=int(r.num_drafted),
            num_accepted=int(r.num_accepted),
            num_steps=int(r.num_steps),
            num_tokens=len(r.token_ids),
            accepted_per_position=[int(x) for x in r.accepted_per_position],
            drafted_per_position=[int(x) for x in dr_pos],
            accepted_by_rank=[int(x) for x in r.accepted_by_rank],
            finish_reason=str(finish_reason or r.finish_reason or "unknown"),
            latency=latency,
            ttft=ttft,
            by_source={k: list(v) for k, v in getattr(r, "by_source", {}).items()},
        )


class AlphaWindow:
    """Rolling α, mean accepted length and per-position acceptance per (domain, drafter_version)."""

    def __init__(self, window: int = 200) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._q: dict[tuple[str, int], deque[ResultStats]] = {}

    def observe(self, result: GenerationResult | ResultStats, domain: str | None = None) -> tuple[str, int]:
        """Add a result (or its stats); returns its (domain, version) key."""
        s = result if isinstance(result, ResultStats) else ResultStats.of(result, domain=domain)
        key = (s.domain, s.drafter_version)
        self._q.setdefault(key, deque(maxlen=self.window)).append(s)
        return key

    def keys(self) -> list[tuple[str, int]]:
        return list(self._q)

    def forget_version(self, drafter_version: int) -> None:
        for key in [k for k in self._q if k[1] == drafter_version]:
            del self._q[key]

    def count(self, domain: str, drafter_version: int) -> int:
        return len(self._q.get((domain, drafter_version), ()))

    def rates(self, domain: str, drafter_version: int) -> tuple[float | None, float | None]:
        """(α, mean accepted length) over the window, in one pass."""
        return pooled_rates(self._q.get((domain, drafter_version), ()))

    def alpha(self, domain: str, drafter_version: int) -> float | None:
        return self.rates(domain, drafter_version)[0]

    def mean_accepted_length(self, domain: str, drafter_version: int) -> float | None:
        return self.rates(domain, drafter_version)[1]

    def per_position(self, domain: str, drafter_version: int) -> list[float | None]:
        q = self._q.get((domain, drafter_version)) or ()
        n = max((len(s.drafted_per_position) for s in q), default=0)
        acc, dr = [0] * n, [0] * n
        for s in q:
            for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position, strict=False)):
                acc[i] += a
                dr[i] += d
        return [acceptance_rate(a, d) for a, d in zip(acc, dr, strict=True)]

    def summary(self) -> dict[tuple[str, int], dict[str, Any]]:
        """{(domain, version): {ACCEPTANCE_RATE, MEAN_ACCEPTED_LENGTH, ACCEPTANCE_RATE_PER_POS, n}}."""
        return {
            k: {
                ACCEPTANCE_RATE: self.alpha(*k),
                MEAN_ACCEPTED_LENGTH: self.mean_accepted_length(*k),
                ACCEPTANCE_RATE_PER_POS: self.per_position(*k),
                "n": self.count(*k),
            }
            for k in self._q
        }


def summarize_results(results: Iterable[GenerationResult | ResultStats], domain: str | None = None
                      ) -> dict[str, float]:
    """Aggregate a batch of results into {metric name: number} (for JSONL / wandb / benchmarks);
    the rates are left out when there is no data for them."""
    stats = [r if isinstance(r, ResultStats) else ResultStats.of(r, domain=domain) for r in results]
    drafted = sum(s.num_drafted for s in stats)
    accepted = sum(s.num_accepted for s in stats)
    steps = sum(s.num_steps for s in stats)
    out: dict[str, float] = {
        REQUESTS: len(stats),
        NUM_DRAFTS: sum(s.num_drafts for s in stats),
        NUM_DRAFT_TOKENS: drafted,
        NUM_ACCEPTED_TOKENS: accepted,
        GENERATION_TOKENS: sum(s.num_tokens for s in stats),
    }
    alpha, mal = acceptance_rate(accepted, drafted), mean_accepted_length(accepted, steps)
    if alpha is not None:
        out[ACCEPTANCE_RATE] = alpha
    if mal is not None:
        out[MEAN_ACCEPTED_LENGTH] = mal
    out.update(source_rates(stats))
    return out


def source_totals(stats: Iterable[ResultStats]) -> dict[str, list[int]]:
    """Per draft source: [drafts, drafted tokens, accepted tokens] summed over results."""
    tot: dict[str, list[int]] = {}
    for s in stats:
        for src, c in s.by_source.items():
            t = tot.setdefault(src, [0, 0, 0])
            for j in range(3):
                t[j] += int(c[j])
    return tot


def source_rates(stats: Iterable[ResultStats]) -> dict[str, float]:
    """α and mean accepted length per draft source, keyed `<metric name>/<source>` (JSONL / wandb)."""
    out: dict[str, float] = {}
    for src, (drafts, drafted, accepted) in source_totals(stats).items():
        a, m = acceptance_rate(accepted, drafted), mean_accepted_length(accepted, drafts)
        if a is not None:
            out[f"{SOURCE_ACCEPTANCE_RATE}/{src}"] = a
        if m is not None:
            out[f"{SOURCE_MEAN_ACCEPTED_LENGTH}/{src}"] = m
    return out

