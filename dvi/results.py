"""What the engine hands back per request: `GenerationResult` (a finished or in-flight sequence's tokens,
log-probs, acceptance counts, versions) and `StepOutput` (one row's tokens from one `step()`).

Kept apart from `dvi.engine` so the result types can be read, built and imported (`dvi.emit`, serving,
tests) without the engine's machinery; `dvi.engine` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GenerationResult", "StepOutput"]


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_steps: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    drafted_ids: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    target_version: int = 0
    drafter_version: int = 0
    domain: str = "default"
    started_at: float = 0.0
    finished_at: float = 0.0
    temperature: float = 0.0
    hidden: Any = None  # eagle drafters: the target's features f_0..f_{L-2}, fp16 tensor [L - 1, H]

    @property
    def alpha(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 0.0


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    result: GenerationResult | None = None
