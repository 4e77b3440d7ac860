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
and what a promotion bought after it. The same per-position agreement chained at the configured K
(`dvi.feedback.shadow.chain_tokens`) gives both drafters' tokens per drafting step: the gain in the unit a
user's tokens/s follows, where α̂ alone hides how agreement clusters along a response.

Offline: runs in the demo's process after the server stopped (its feedback log is flushed then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from dvi.config import DviConfig
from dvi.decode.results import acceptance_rate
from dvi.feedback.record import FeedbackRecord


class Replayed(NamedTuple):
    """One record replayed through one drafter: what α̂ and the tokens per drafting step pool."""

    hits: float  # expected accepted positions
    positions: int  # generated positions, each one start of a drafting step
    chain_tokens: float  # tokens a K-draft step started at each position emits, summed (`shadow.chain_tokens`)


Scorer = Callable[[list[FeedbackRecord]], dict[str, Replayed]]
"""Records -> {request_id: Replayed} of those it could score."""

LEGEND = ("α live: accepted / drafted as the responses' `dvi` blocks report it (adaptive K drafts on few steps: "
          "`drafted` tokens; acc. len: tokens per engine step, undrafted steps included; siblings: accepted drafts "
          "that were a draft tree's siblings, the drafter's next candidates beside its chain). tok/s: the window's "
          "completion tokens over the wall time its requests took (first sent to last answered, as the client "
          "measures it: the responses report no time). α̂ served / α̂ frozen: the window's own responses "
          "replayed teacher-forced (top-1 agreement with the target over every generated token: the trainer's "
          "and the swapper's held-out judge) through the drafter version that served each response and through "
          "the frozen v0 drafter, on the same tokens; gain = α̂ served - α̂ frozen (0 until a promotion). "
          "tpp L/C, dec tok/s L/C: live, per request, the learned arm (the group's adapter drafts) and the "
          "control arm (the frozen base drafts; serve.control_share) of the window: tokens per target pass and "
          "decode tokens per second as the engine timed it. "
          "len srv/frz (served / frozen): the same replay as tokens per drafting step at K = "
          "speculation.num_draft_tokens (a step started at each generated position keeps its drafts up to the "
          "first disagreement, plus the target's token): what either drafter buys when every step drafts.")


def read_records(feedback_dir: str | Path) -> dict[str, FeedbackRecord]:
    """Every record under a run's feedback dir, by request id."""
    from dvi.feedback.reader import FeedbackReader

    reader = FeedbackReader(feedback_dir)
    return {r.request_id: r for r in reader.iter_records(reader.list_shards())}


Served = tuple[int, str, int]
"""What drafted a record: (shared drafter version, traffic group, that group's adapter version; 0: none)."""


def served_by(record: FeedbackRecord, adapter_key: str) -> Served:
    from dvi.feedback.heldout import adapter_group

    adapter = int(getattr(record, "adapter_version", 0) or 0)
    group = adapter_group(adapter_key, record.domain, getattr(record, "client", "")) if adapter else ""
    return int(record.drafter_version), group, adapter


def drafter_scorers(cfg: DviConfig, registry_dir: str | Path) -> Callable[[Served], Scorer | None]:
    """(version, group, adapter) -> scorer: v0 the drafter the server starts with, later ones loaded from the run's
    registry the way the swapper loads them (`dvi.registry.codec.load_drafter_version`; a group's adapter version
    from the group's registry, over the startup drafter, as its swapper loads it); None for a version that does not
    load (pruned) or for a pair with no learned drafter. Chains are scored at the configured K."""
    from dvi.feedback.shadow import chain_tokens, hf_logits_fn, record_acceptance
    from dvi.registry.codec import load_drafter_version, scoring_module
    from dvi.registry.groups import group_registry
    from dvi.registry.store import AdapterRejected, DrafterRegistry
    from serving.loading import load_serving_pair

    base = load_serving_pair(cfg).drafter
    k = cfg.speculation.num_draft_tokens
    cache: dict[Served, Scorer | None] = {}

    def scorer(key: Served | int) -> Scorer | None:
        key = (key, "", 0) if isinstance(key, int) else key
        if key in cache:
            return cache[key]
        version, group, adapter = key
        model = base
        if base is not None and (version != 0 or adapter):
            registry = group_registry(registry_dir, group) if adapter else DrafterRegistry(registry_dir)
            try:
                model, _ = load_drafter_version(registry, adapter or version, base)
            except (AdapterRejected, OSError):
                model = None
        if model is None:
            cache[key] = None
            return None
        fn = hf_logits_fn(scoring_module(model))

        def score(records: list[FeedbackRecord]) -> dict[str, Replayed]:
            return {r.request_id: Replayed(float(acc.sum()), int(acc.numel()), chain_tokens(acc, k))
                    for r, acc in record_acceptance(fn, records)}

        cache[key] = score
        return score

    return scorer


def _pooled(scores: Iterable[Replayed]) -> tuple[float | None, float | None]:
    """(α̂, tokens per drafting step) over many records: sums first, then one division each."""
    got = list(scores)
    positions = sum(s.positions for s in got)
    return (acceptance_rate(sum(s.hits for s in got), positions),
            sum(s.chain_tokens for s in got) / positions if positions else None)


def replay_window(records: Sequence[FeedbackRecord], scorer: Callable[[Any], Scorer | None],
                  adapter_key: str = "none") -> dict[str, Any]:
    """α̂ and tokens per drafting step at K of the serving drafter (each record through the version that served
    it) and of the frozen v0 drafter, over the records both could score (paired: the same tokens), and the gain."""
    frozen_fn = scorer(0)
    frozen = frozen_fn(list(records)) if frozen_fn is not None else {}
    served: dict[str, Replayed] = {}
    for key in sorted({served_by(r, adapter_key) for r in records}):
        fn = scorer(key)
        if fn is not None:
            served.update(fn([r for r in records if served_by(r, adapter_key) == key]))
    both = [rid for rid in served if rid in frozen]
    (a_served, len_served), (a_frozen, len_frozen) = _pooled(served[i] for i in both), _pooled(frozen[i] for i in both)
    return {"replay_alpha": a_served, "frozen_alpha": a_frozen,
            "gain": None if a_served is None or a_frozen is None else a_served - a_frozen,
            "replay_len": len_served, "frozen_len": len_frozen,
            "replay_records": len(both), "replay_positions": sum(frozen[i].positions for i in both)}


def replay_windows(rows: list[dict[str, Any]], records: dict[str, FeedbackRecord],
                   scorer: Callable[[Any], Scorer | None], adapter_key: str = "none") -> None:
    """Add `replay_window`'s figures to every timeline row, from the records of the row's `request_ids`."""
    for row in rows:
        recs = [records[i] for i in row.get("request_ids", ()) if i in records and len(records[i].token_ids)]
        row.update(replay_window(recs, scorer, adapter_key))


_ALPHA = (("replay_alpha", "α̂ serving drafter (replayed on the window's responses)", "-o"),
          ("frozen_alpha", "α̂ frozen v0 drafter (same responses)", "--s"),
          ("alpha", "α live (probe drafts, adaptive K)", "."))
_LENGTH = (("replay_len", "serving drafter, replayed at K", "-o"), ("frozen_len", "frozen v0 drafter, replayed at K", "--s"),
           ("mean_accepted_length", "live acc. len (adaptive K)", "."),
           ("learned_tpp", "live tokens / pass, learned arm", "-^"),
           ("control_tpp", "live tokens / pass, control arm (frozen)", ":v"))
_RATE = (("tok_s", "live tok/s (client side, window)", "-^"),
         ("learned_dtps", "decode tok/s per request, learned arm", "-o"),
         ("control_dtps", "decode tok/s per request, control arm", ":v"))


def _curves(ax: Any, rows: Sequence[dict[str, Any]], series: Sequence[tuple[str, str, str]]) -> None:
    """One line per (row key, label, style); a window without the figure leaves a gap, never a 0."""
    for key, label, style in series:
        pts = [(r["requests"], r.get(key)) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, alpha=0.5 if style == "." else 1.0)


def _mark(ax: Any, rows: Sequence[dict[str, Any]], labels: bool) -> None:
    """Phases shaded in turn (named when `labels`) and drafter promotions dashed, so the panels line up."""
    start, shade = 0, False
    for i, r in enumerate(rows):
        if i + 1 == len(rows) or rows[i + 1]["phase"] != r["phase"]:  # the phase ends here
            if shade:
                ax.axvspan(start, r["requests"], color="grey", alpha=0.08)
            if labels:
                ax.annotate(r["phase"], ((start + r["requests"]) / 2, 0.98), xycoords=("data", "axes fraction"),
                            ha="center", va="top", fontsize=8)
            start, shade = r["requests"], not shade
        prev = rows[i - 1] if i else None
        changed = prev is not None and (r["drafter_version"] != prev["drafter_version"] or (
            r.get("adapter_version") and r.get("adapter_version") != prev.get("adapter_version")))
        if changed:
            mid = (prev["requests"] + r["requests"]) / 2
            ax.axvline(mid, color="grey", linestyle="--", linewidth=0.8)
            if labels:
                name = f"{r.get('domain')} v{r['adapter_version']}" if r.get("adapter_version") else \
                    f"v{r['drafter_version']}"
                ax.annotate(name, (mid, 0.92), xycoords=("data", "axes fraction"), fontsize=7, color="grey",
                            ha="left")


def plot_windows(rows: Sequence[dict[str, Any]], out_png: str | Path) -> Path:
    """Per window of requests, three panels on one x axis: α (α̂ of the serving drafter and of the frozen v0
    drafter on the same responses, lines; the live α, dots), tokens per drafting step at K replayed for both
    beside the live acc. len, and the live tok/s; drafter promotions dashed, phases shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_len, ax_rate) = plt.subplots(3, 1, figsize=(13, 10), sharex=True,
                                              gridspec_kw={"height_ratios": [3, 2, 1.5]})
    for a, series, ylabel in ((ax, _ALPHA, "acceptance rate α"), (ax_len, _LENGTH, "tokens per step"),
                              (ax_rate, _RATE, "tokens / s")):
        _curves(a, rows, series)
        _mark(a, rows, labels=a is ax)
        a.set_ylabel(ylabel)
        a.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)  # beside: never over the data
        a.grid(alpha=0.3)
    top = max([r.get(k) or 0.0 for r in rows for k in ("replay_alpha", "frozen_alpha", "alpha")], default=0.0)
    ax.set_ylim(0, min(1.0, max(0.5, top + 0.15)))  # room for the phase labels; α of these pairs is well below 1
    ax.set_title("per window: the serving drafter against the frozen one on the same responses")
    ax_len.set_ylim(bottom=1.0)  # a step emits at least the target's token
    ax_rate.set_ylim(bottom=0.0)
    ax_rate.set_xlabel("requests served")
    out = Path(out_png)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
