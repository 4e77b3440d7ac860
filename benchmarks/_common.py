"""What every benchmark shares: the goal record of DESIGN.md ("Measuring") and JSON-safe output."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any


def goal(name: str, value: float | None, target: float, higher_is_better: bool = True) -> dict:
    """One entry of a benchmark's `goals` list; a missing or NaN value is never met."""
    ok = value is not None and not math.isnan(value) and (
        value >= target if higher_is_better else value <= target)
    return {"name": name, "value": value, "target": target, "higher_is_better": higher_is_better, "met": bool(ok)}


def goal_line(g: dict) -> str:
    """One `goal` entry as the goal lists at the end of every benchmark print it."""
    v = "n/a" if g["value"] is None else f"{g['value']:.3f}"
    return f"  [{'met' if g['met'] else 'NOT met'}] {g['name']}: {v} (target {'>=' if g['higher_is_better'] else '<='} {g['target']})"


def print_goals(goals: list[dict]) -> None:
    """The goal list every benchmark ends with."""
    print("\ngoals:")
    for g in goals:
        print(goal_line(g))


def clean_json(x: Any) -> Any:
    """JSON-safe copy: NaN/inf -> None, recursively."""
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {k: clean_json(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean_json(v) for v in x]
    return x


def cpu_name() -> str:
    """The CPU a benchmark ran on, as its numbers should be quoted: the model name, the bf16 features that decide
    the served dtype and a verify's cost (AMX, AVX512-BF16), and the cores this process may use."""
    import os
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    feats = "AMX" if "amx_bf16" in flags else "avx512_bf16, no AMX" if "avx512_bf16" in flags else \
        "no native bf16" if flags else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({feats}), {cores} cores" if feats else f"{model}, {cores} cores"


def write_json(path: str | Path, result: dict) -> None:
    """A benchmark's JSON (NaN/inf as null) at `path`, its folder made; says where."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json(result), indent=1))
    print(f"\nwrote {path}")


def built_pair(preset: str, pair_dir: Path | None) -> tuple[Path, Any]:
    """The pair dir (`pair_dir`, else the preset's cache dir) and its tokenizer; exits with what to run if unbuilt."""
    from dvi.models.embedded import embedded_dir, read_manifest
    from dvi.models.loading import load_tokenizer

    pair_dir = pair_dir or embedded_dir(preset)
    if read_manifest(pair_dir) is None:
        sys.exit(f"no built pair at {pair_dir}: run `dvi bootstrap --preset {preset}` first")
    return pair_dir, load_tokenizer(pair_dir / "tokenizer")
