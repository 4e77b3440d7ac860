"""Reading a run's `metrics.jsonl` back and plotting α from it; backs `dvi report RUN_DIR`.

Offline only (the CLI, the demo): nothing on the serving or training path imports matplotlib,
which is imported lazily inside `plot_alpha`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dvi.metrics.names import ACCEPTANCE_RATE
from dvi.rundir import RunDir


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def plot_alpha(jsonl_path: str | os.PathLike, out_png: str | os.PathLike, step_label: str = "step") -> Path:
    """α per domain over steps (or time), with a vertical line wherever the drafter version changes;
    `step_label` names what a row's `step` counts (trainer steps, requests served, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(jsonl_path) if isinstance(r.get(ACCEPTANCE_RATE), int | float)]
    use_step = bool(rows) and all(r.get("step") is not None for r in rows)
    t0 = min((r["time"] for r in rows), default=0.0)

    def x_of(r: dict[str, Any]) -> float:
        return r["step"] if use_step else r["time"] - t0

    rows.sort(key=x_of)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    by_domain: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        by_domain.setdefault(r.get("domain") or "all", []).append((x_of(r), r[ACCEPTANCE_RATE]))
    for dom, pts in sorted(by_domain.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=dom)
    prev = None
    for r in rows:
        v = r.get("drafter_version")
        if v is None:
            continue
        if prev is not None and v != prev:
            ax.axvline(x_of(r), color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(f"v{v}", (x_of(r), 1.0), fontsize=7, color="grey", ha="left", va="top")
        prev = v
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(step_label if use_step else "seconds")
    ax.set_ylabel("acceptance rate α")
    ax.set_title("α by domain (dashed: drafter version change)")
    if by_domain:
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no α rows in metrics.jsonl", ha="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(run_dir: str | os.PathLike) -> Path:
    """Backs `dvi report RUN_DIR`: plots run_dir/metrics.jsonl to run_dir/alpha.png."""
    run_dir = Path(run_dir)
    src = RunDir(run_dir).metrics_path
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found (is {run_dir} a dvi run directory?)")
    return plot_alpha(src, run_dir / "alpha.png")
