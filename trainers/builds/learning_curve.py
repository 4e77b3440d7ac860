"""The drafter build's learning curve: held-out top-1 agreement with the target against tokens trained.

Whether a bigger budget would buy a better drafter is the question a build's single end number cannot answer;
the curve can (still rising at the end: more tokens pay). The target's greedy tokens on a small held-out slice
are computed once, so a point costs one drafter pass over it; points fall on a geometric grid of the steps.
"""

from __future__ import annotations

from pathlib import Path

import torch

from trainers.builds.build_common import scoring_batches
from trainers.builds.pretrained_eval import draft_top

POINTS = 8  # points on the curve, the last at the end of training
SLICE_WINDOWS = 8  # held-out windows a domain contributes to each point


def probe_steps(steps: int, points: int = POINTS) -> set[int]:
    """Optimizer steps after which a point is taken: geometric from the first to the last step."""
    if steps <= 0:
        return set()
    grid = torch.logspace(0, torch.log10(torch.tensor(float(steps))).item(), points)
    return {min(steps, max(1, round(float(s)))) for s in grid}


class AgreementProbe:
    """Held-out agreement of a drafter with the target per domain, over `order[:size]` (0: full vocabulary)."""

    def __init__(self, target, heldout: tuple[dict, dict], order: torch.Tensor, size: int):
        evals, skips = heldout
        dev = next(target.parameters()).device
        self.sub = order[:size].to(dev) if size else None
        self.batches: dict[str, list[tuple]] = {}
        with torch.inference_mode():
            for d, windows in evals.items():
                w = windows[:SLICE_WINDOWS]
                skip = skips.get(d)
                cut = scoring_batches(w, skip[:SLICE_WINDOWS] if skip else None)
                on_dev = [(ids.to(dev), mask.to(dev), valid.to(dev)) for ids, mask, valid in cut]
                self.batches[d] = [(ids, mask, valid, target(input_ids=ids, attention_mask=mask).logits.argmax(-1))
                                   for ids, mask, valid in on_dev]

    @torch.inference_mode()
    def __call__(self, drafter) -> dict[str, float]:
        out = {}
        for d, batches in self.batches.items():
            hits = total = 0
            for ids, mask, valid, top in batches:
                logits = drafter(input_ids=ids, attention_mask=mask).logits
                hits += int(((draft_top(logits, self.sub) == top) & valid).sum())
                total += int(valid.sum())
            out[d] = hits / max(1, total)
        return out


def plot(curve: list[dict], path: Path, title: str) -> Path:
    """The curve as a PNG: agreement per domain against tokens trained (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    tokens = [p["tokens"] for p in curve]
    for d in curve[0]["agreement"]:
        ax.plot(tokens, [p["agreement"][d] for p in curve], marker="o", label=d)
    ax.set_xscale("log")
    ax.set_xlabel("tokens trained (token-passes)")
    ax.set_ylabel("top-1 agreement with the target (held-out)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
