"""The one record of a decoded sequence, `GenerationResult`, and the one place α is computed.

The engine emits a `GenerationResult` per sequence; the scheduler (`serving.scheduler.Finished` wraps it
with the text and latency), telemetry (`dvi.metrics.ResultStats.of`), the feedback writer
(`FeedbackRecord.from_result`, its on-disk projection), the trainer's collation (which reads those
records) and RL rollouts (`dvi.rollout.Rollout` is a view of it) all consume this type, not look-alikes.

α (accepted / drafted) and mean accepted length (1 + accepted / steps) are computed by
`acceptance_rate` and `mean_accepted_length` below and nowhere else. "No data" (nothing drafted, no
step yet) is None everywhere, never 0.0 (a false "the drafter is useless") or NaN (which poisons sums
and JSON): a dashboard shows a gap.

Kept apart from `dvi.engine.speculative` so the result types can be read, built and imported without the engine's
machinery; `dvi.engine.speculative` re-exports them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from dvi.decode.sources import SOURCE_MODEL

__all__ = ["GenerationResult", "StepOutput", "Versions", "DraftCounts", "Counted", "acceptance_rate", "mean_accepted_length",
           "pooled_rates", "fmt_rate"]


def acceptance_rate(accepted: int, drafted: int) -> float | None:
    """α = accepted / drafted; None when nothing was drafted."""
    return accepted / drafted if drafted else None


def mean_accepted_length(accepted: int, steps: int) -> float | None:
    """Tokens per engine step, 1 + accepted / steps; None before the first step."""
    return 1.0 + accepted / steps if steps else None


class Counted(Protocol):
    """Anything that counts drafts: a result, its stats, a rollout, an RL step log."""

    num_drafted: int
    num_accepted: int
    num_steps: int


TREE_RANKS = 4
"""Sibling ranks counted apart in `accepted_by_rank` (a bounded /metrics label: 0, 1, 2, 3 = 3 or later)."""


@dataclass(kw_only=True)
class DraftCounts:
    """What one sequence drafted and kept: the counts α and mean accepted length are made of.

    Position j of the per-position lists counts the steps that drafted at least j + 1 tokens (drafted)
    and those whose first j + 1 drafts were all accepted (accepted)."""

    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    # accepted drafts by sibling rank in a draft tree (0: the chain's own draft; the last entry: that rank or later)
    accepted_by_rank: list[int] = field(default_factory=lambda: [0] * TREE_RANKS)

    @property
    def alpha(self) -> float | None:
        return acceptance_rate(self.num_accepted, self.num_drafted)

    @property
    def mean_accepted_length(self) -> float | None:
        return mean_accepted_length(self.num_accepted, self.num_steps)


def pooled_rates(items: Iterable[Counted]) -> tuple[float | None, float | None]:
    """Token-weighted (α, mean accepted length) over many sequences: sums first, then one division."""
    drafted = accepted = steps = 0
    for it in items:
        drafted += it.num_drafted
        accepted += it.num_accepted
        steps += it.num_steps
    return acceptance_rate(accepted, drafted), mean_accepted_length(accepted, steps)


def fmt_rate(x: float | None, digits: int = 3) -> str:
    """A rate for a log line: 'n/a' for no data."""
    return "n/a" if x is None else f"{x:.{digits}f}"


@dataclass
class GenerationResult(DraftCounts):
    """A decoded sequence (finished or in flight): its tokens and log-probs, per-position draft/accept
    feedback and the target's top-k (what the trainer learns from), versions, timing; its `DraftCounts`."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    token_logprobs: list[float] = field(default_factory=list)
    drafted_ids: list[int] = field(default_factory=list)
    # per emitted token, who proposed its draft: 0 none, 1 model, 2 suffix_request, 3 suffix_global (dvi.decode.emit)
    draft_source: list[int] = field(default_factory=list)
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [steps, drafted, accepted]
    accepted: list[bool] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    target_version: int = 0
    drafter_version: int = 0
    adapter_version: int = 0  # its traffic group's drafter adapter (issue 40; 0: the shared drafter alone)
    domain: str = "default"
    started_at: float = 0.0
    finished_at: float = 0.0
    temperature: float = 0.0
    hidden: Any = None  # eagle drafters: the target's features f_0..f_{L-2}, fp16 tensor [L - 1, H]

    def model_counts(self) -> tuple[int, int]:
        """(drafted, accepted) of the learned drafter's own drafts (`hybrid`: suffix drafts left out); a result
        without per-source counts drafted from the model only."""
        if not self.by_source:
            return self.num_drafted, self.num_accepted
        c = self.by_source.get(SOURCE_MODEL, [0, 0, 0])
        return c[1], c[2]


class Versions(NamedTuple):
    """The (target, drafter) weights versions a sequence was decoded with; every record carries both (and the
    version of its traffic group's adapter, 0 for none)."""

    target: int = 0
    drafter: int = 0
    adapter: int = 0


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    result: GenerationResult | None = None
    error: str | None = None  # the engine failed this row alone (a remote engine's request: `serving.vllm_engine`)
