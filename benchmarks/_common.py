"""What every benchmark shares: the goal record of DESIGN.md ("Measuring") and JSON-safe output."""

from __future__ import annotations

import math
from typing import Any


def goal(name: str, value: float | None, target: float, higher_is_better: bool = True) -> dict:
    """One entry of a benchmark's `goals` list; a missing or NaN value is never met."""
    ok = value is not None and not math.isnan(value) and (
        value >= target if higher_is_better else value <= target)
    return {"name": name, "value": value, "target": target, "higher_is_better": higher_is_better, "met": bool(ok)}


def clean_json(x: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, recursively."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    return x
