"""The demo's reference, like for like: each window's own responses replayed through the frozen drafter and
through the drafter version that served them (`replay_windows`), and the PNG drawn from it (`plot_windows`).

Why not decode some prompts with the frozen drafter and compare α: on the real pair the server's adaptive K
leaves speculation off on about nine steps in ten, so the α a response reports (accepted / drafted) counts a
handful of probe drafts (78-153 drafted tokens per 16 requests), at positions the K controller's state picks.
A separate decode of the same 16 code prompts with the same v0 drafter read 0.141 where the server read 0.203
(sql 0.146 vs 0.110), and the served windows of one drafter ranged 0.14-0.25: the reference said more about
the controller than about the drafter. Replayed teacher-forced over every generated token (the held-out judge
the trainer and the swapper use, `dvi.feedback.shadow.record_scores`) the same responses read 0.309 code,
0.150 sql, and both drafters are scored on the very same tokens, so the gain is 0 before the first promotion
and what a promotion bought after it.

Offline: runs in the demo's process after the server stopped (its feedback log is flushed then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from dvi.config import DviConfig
from dvi.decode.results import acceptance_rate
from dvi.feedback.record import FeedbackRecord

Scorer = Callable[[list[FeedbackRecord]], dict[str, tuple[float, int]]]
"""Records -> {request_id: (expected accepted positions, positions)} of those it could score."""

LEGEND = ("α live: accepted / drafted as the responses' `dvi` blocks report it (adaptive K drafts on few steps: "
          "`drafted` tokens; acc. len: tokens per step). α̂ served / α̂ frozen: the window's own responses "
          "replayed teacher-forced (top-1 agreement with the target over every generated token: the trainer's "
          "and the swapper's held-out judge) through the drafter version that served each response and through "
          "the frozen v0 drafter, on the same tokens; gain = α̂ served - α̂ frozen (0 until a promotion).")


def read_records(feedback_dir: str | Path) -> dict[str, FeedbackRecord]:
    """Every record under a run's feedback dir, by request id."""
    from dvi.feedback.reader import FeedbackReader

    reader = FeedbackReader(feedback_dir)
    return {r.request_id: r for r in reader.iter_records(reader.list_shards())}


def drafter_scorers(cfg: DviConfig, registry_dir: str | Path) -> Callable[[int], Scorer | None]:
    """Version -> scorer: v0 the drafter the server starts with, later ones loaded from the run's registry the
    way the swapper loads them (`dvi.registry.codec.load_drafter_version`); None for a version that does not load (pruned) or
    for a pair with no learned drafter."""
    from dvi.feedback.shadow import hf_logits_fn, record_scores
    from dvi.registry.codec import load_drafter_version, scoring_module
    from dvi.registry.store import AdapterRejected, DrafterRegistry

    from .loading import load_serving_pair

    base = load_serving_pair(cfg).drafter
    registry = DrafterRegistry(registry_dir)
    cache: dict[int, Scorer | None] = {}

    def scorer(version: int) -> Scorer | None:
        if version in cache:
            return cache[version]
        model = base
        if base is not None and version != 0:
            try:
                model, _ = load_drafter_version(registry, version, base)
            except (AdapterRejected, OSError):
                model = None
        if model is None:
            cache[version] = None
            return None
        fn = hf_logits_fn(scoring_module(model))

        def score(records: list[FeedbackRecord]) -> dict[str, tuple[float, int]]:
            return {r.request_id: (h, n) for r, h, n in record_scores(fn, records)}

        cache[version] = score
        return score

    return scorer


def _pooled(scores: Iterable[tuple[float, int]]) -> float | None:
    pairs = list(scores)
    return acceptance_rate(sum(h for h, _ in pairs), sum(n for _, n in pairs))


def replay_window(records: Sequence[FeedbackRecord], scorer: Callable[[int], Scorer | None]) -> dict[str, Any]:
    """α̂ of the serving drafter (each record through the version that served it) and of the frozen v0 drafter,
    over the records both could score (paired: the same tokens), and the gain."""
    frozen_fn = scorer(0)
    frozen = frozen_fn(list(records)) if frozen_fn is not None else {}
    served: dict[str, tuple[float, int]] = {}
    for version in sorted({r.drafter_version for r in records}):
        fn = scorer(version)
        if fn is not None:
            served.update(fn([r for r in records if r.drafter_version == version]))
    both = [rid for rid in served if rid in frozen]
    a_served, a_frozen = _pooled(served[i] for i in both), _pooled(frozen[i] for i in both)
    return {"replay_alpha": a_served, "frozen_alpha": a_frozen,
            "gain": None if a_served is None or a_frozen is None else a_served - a_frozen,
            "replay_records": len(both), "replay_positions": sum(frozen[i][1] for i in both)}


def replay_windows(rows: list[dict[str, Any]], records: dict[str, FeedbackRecord],
                   scorer: Callable[[int], Scorer | None]) -> None:
    """Add `replay_window`'s figures to every timeline row, from the records of the row's `request_ids`."""
    for row in rows:
        recs = [records[i] for i in row.get("request_ids", ()) if i in records and len(records[i].token_ids)]
        row.update(replay_window(recs, scorer))


def plot_windows(rows: Sequence[dict[str, Any]], out_png: str | Path) -> Path:
    """α per window of requests: α̂ of the serving drafter and of the frozen v0 drafter on the same responses
    (lines), the live α the responses reported (dots), drafter promotions (dashed) and phases (shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    x = [r["requests"] for r in rows]
    for key, label, style in (("replay_alpha", "α̂ serving drafter (replayed on the window's responses)", "-o"),
                              ("frozen_alpha", "α̂ frozen v0 drafter (same responses)", "--s"),
                              ("alpha", "α live (probe drafts, adaptive K)", ".")):
        pts = [(xi, r.get(key)) for xi, r in zip(x, rows, strict=True) if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, alpha=0.5 if key == "alpha" else 1.0)
    start, shade = 0, False
    for i, r in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1]["phase"] != r["phase"]:  # the phase ends here
            if shade:
                ax.axvspan(start, r["requests"], color="grey", alpha=0.08)
            ax.annotate(r["phase"], ((start + r["requests"]) / 2, 0.98), xycoords=("data", "axes fraction"),
                        ha="center", va="top", fontsize=8)
            start, shade = r["requests"], not shade
        if i and r["drafter_version"] != rows[i - 1]["drafter_version"]:
            mid = (rows[i - 1]["requests"] + r["requests"]) / 2
            ax.axvline(mid, color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(f"v{r['drafter_version']}", (mid, 0.92), xycoords=("data", "axes fraction"), fontsize=7,
                        color="grey", ha="left")
    top = max([r.get(k) or 0.0 for r in rows for k in ("replay_alpha", "frozen_alpha", "alpha")], default=0.0)
    ax.set_ylim(0, min(1.0, max(0.5, top + 0.15)))  # room for the phase labels; α of these pairs is well below 1
    ax.set_xlabel("requests served")
    ax.set_ylabel("acceptance rate α")
    ax.set_title("α per window: the serving drafter against the frozen one on the same responses")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, fontsize=8)  # below: never over the data
    ax.grid(alpha=0.3)
    out = Path(out_png)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
