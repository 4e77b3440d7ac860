"""Per-result spec-decode stats: what one finished request drafted and accepted, rolled up.

Kept apart from the Prometheus collectors so the trainer, the rollout hook and benchmarks can
compute α and mean accepted length (`ResultStats`, `AlphaWindow`, `summarize_results`)
without touching prometheus_client. Results are duck-typed: a GenerationResult, a dict, or
anything with the same attribute names.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dvi.metrics.names import (
    ACCEPTANCE_RATE,
    ACCEPTANCE_RATE_PER_POS,
    GENERATION_TOKENS,
    MEAN_ACCEPTED_LENGTH,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTS,
    REQUESTS,
)


def _get(result: Any, name: str, default: Any = None) -> Any:
    if isinstance(result, Mapping):
        return result.get(name, default)
    return getattr(result, name, default)


@dataclass
class ResultStats:
    """The spec-decode numbers of one GenerationResult-like object (duck-typed)."""

    domain: str
    drafter_version: int
    num_drafts: int
    num_drafted: int
    num_accepted: int
    num_steps: int
    num_tokens: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    finish_reason: str
    latency: float | None
    ttft: float | None

    @classmethod
    def of(cls, result: Any, domain: str | None = None) -> ResultStats:
        acc_pos = list(_get(result, "accepted_per_position", None) or [])
        dr_pos = list(_get(result, "drafted_per_position", None) or [])
        drafted = _get(result, "num_drafted", None)
        if drafted is None:
            drafted = sum(1 for d in _get(result, "drafted_ids", None) or [] if d >= 0)
        accepted = _get(result, "num_accepted", None)
        if accepted is None:
            accepted = sum(1 for a in _get(result, "accepted", None) or [] if a)
        steps = int(_get(result, "num_steps", 0) or 0)
        # drafted_per_position[0] counts the steps in which at least one token was drafted.
        num_drafts = dr_pos[0] if dr_pos else (steps if drafted else 0)
        started, finished = _get(result, "started_at", None), _get(result, "finished_at", None)
        latency = (
            finished - started
            if started is not None and finished is not None and finished >= started
            else None
        )
        first = _get(result, "first_token_at", None)
        ttft = first - started if first is not None and started is not None and first >= started else None
        if ttft is None:
            ttft = _get(result, "ttft", None)
        return cls(
            domain=str(domain if domain is not None else (_get(result, "domain", None) or "default")),
            drafter_version=int(_get(result, "drafter_version", 0) or 0),
            num_drafts=int(num_drafts),
            num_drafted=int(drafted),
            num_accepted=int(accepted),
            num_steps=steps,
            num_tokens=len(_get(result, "token_ids", None) or []),
            accepted_per_position=[int(x) for x in acc_pos],
            drafted_per_position=[int(x) for x in dr_pos],
            finish_reason=str(_get(result, "finish_reason", None) or "unknown"),
            latency=latency,
            ttft=ttft,
        )


class AlphaWindow:
    """Rolling α, mean accepted length and per-position acceptance per (domain, drafter_version)."""

    def __init__(self, window: int = 200) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._q: dict[tuple[str, int], deque[ResultStats]] = {}

    def observe(self, result: Any, domain: str | None = None) -> tuple[str, int]:
        """Add a result (GenerationResult-like or ResultStats); returns its (domain, version) key."""
        s = result if isinstance(result, ResultStats) else ResultStats.of(result, domain)
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

    def alpha(self, domain: str, drafter_version: int) -> float | None:
        q = self._q.get((domain, drafter_version))
        drafted = sum(s.num_drafted for s in q) if q else 0
        return sum(s.num_accepted for s in q) / drafted if drafted else None

    def mean_accepted_length(self, domain: str, drafter_version: int) -> float | None:
        q = self._q.get((domain, drafter_version))
        steps = sum(s.num_steps for s in q) if q else 0
        return 1.0 + sum(s.num_accepted for s in q) / steps if steps else None

    def per_position(self, domain: str, drafter_version: int) -> list[float | None]:
        q = self._q.get((domain, drafter_version)) or ()
        n = max((len(s.drafted_per_position) for s in q), default=0)
        acc, dr = [0] * n, [0] * n
        for s in q:
            for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position, strict=False)):
                acc[i] += a
                dr[i] += d
        return [a / d if d else None for a, d in zip(acc, dr, strict=True)]

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


def summarize_results(results: Iterable[Any], domain: str | None = None) -> dict[str, float]:
    """Aggregate a batch of results into {metric name: number} (for JSONL / wandb / benchmarks)."""
    stats = [r if isinstance(r, ResultStats) else ResultStats.of(r, domain) for r in results]
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
    if drafted:
        out[ACCEPTANCE_RATE] = accepted / drafted
    if steps:
        out[MEAN_ACCEPTED_LENGTH] = 1.0 + accepted / steps
    return out

