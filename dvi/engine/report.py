"""What an engine reports to the server driving it between steps, beside its versions and greedy contract: the one
shape dvi's engine and a remote one (`serving.vllm_engine.VllmEngine`) both fill, so the server's snapshot reads
fields, never probes for them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineReport"]


@dataclass(frozen=True)
class EngineReport:
    proposer_stats: Mapping[str, Any] = field(default_factory=dict)  # the drafter kind's counters (suffix index size)
    draft_vocab_size: int | None = None  # a learned drafter's reduced draft vocabulary (None: the full one, or none)
    info: Mapping[str, Any] = field(default_factory=dict)  # a remote engine's own state (vLLM: its url, restarts)
    prefix_cache: Mapping[str, int] = field(default_factory=dict)  # `PrefixCache.stats()` ({}: none)
    # what real steps measured against adaptive K's calibrated prices, "<bucket>/<part>" (`MeasuredCosts.values`; {}:
    # none measured, fixed K, or a remote engine)
    step_costs: Mapping[str, float] = field(default_factory=dict)
