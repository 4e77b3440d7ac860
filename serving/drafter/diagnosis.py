"""Why a lane's live α moved (issue 59 §2): each window of its records measured four ways, and the cause named.

A window is `WINDOW` finished records of the lane (its traffic group's, or all of them for the shared drafter). For
each the drafter thread measures:

- live α: the model's drafts accepted / drafted, as served (the learned arm's records: a control row drafts with
  the frozen base);
- α̂ served and α̂ reference: the same records replayed teacher-forced (top-1 agreement with the target at every
  position, the gates' measure) through the version that served them and through the frozen base (version 0);
- consistency: of the model's drafts on greedy records, the share equal to the drafting version's own
  teacher-forced argmax at that position. For a chain every such draft IS that argmax (an accepted draft is the
  target's token, so the drafter read the same prefix); near-ties across kernels, a draft tree's siblings and a
  reduced draft vocabulary keep it a little under 1. Far under it, the engine drafted something its weights do not
  say: a corrupted draft cache, stale adapter factors (the class of vllm#41838, "only a restart resets it").

Comparing a window with the one before, a move of live α is explained by the first cause that holds, with its
numbers: **serving disagrees** (consistency fell far below its running level: checked first, and also without a
move), **drafter changed** (a promotion or rollback between them, unless the frozen base's α̂ on the same records
moved with live α by more than the versions' lead over the base changed: a promotion that lands as the traffic
shifts is named by the shift, the version change beside it), **target changed** (records of a newer target
version, the drafter not yet caught up), **traffic changed** (the reference's α̂ on the same records moved with it),
else **unexplained**. A person acts on each differently: restart or report the engine; nothing (a rollback watch
judges a promotion); wait for the trainer; nothing, or an adapter per group; look at the records.

A window whose records the model drafted nothing for (speculation off, or priced out under load) has no live α to
explain: it is counted and skipped without its replays, a teacher-forced forward per record and version on the
drafter thread, which share the machine with the engine exactly when it is busiest (sampled GRPO groups through
`dvi serve`, 12 rows at T = 1: the replays ran at up to half a core in bursts of seconds).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dvi.decode.results import acceptance_rate
from dvi.decode.sources import SOURCE_MODEL, source_code
from dvi.feedback import FeedbackRecord
from dvi.feedback.shadow import served_temperature
from dvi.feedback.verdict import Scorer

WINDOW = 32
"""Records a window holds: what a move is measured between (the rollback watch's default window too)."""
MIN_MOVE = 0.05
"""A move of live α smaller than this (or than `MOVE_Z` standard errors: a false move in ~0.3% of window pairs) is noise."""
MOVE_Z = 3.0
CONSISTENCY_DROP = 0.25
"""Serving disagrees with itself when a window's consistency falls this far under the lane's running level..."""
CONSISTENCY_FLOOR = 0.6
"""... or under this, whatever the level (a lane's first windows have no level yet)."""
MIN_CONSISTENCY_DRAFTS = 32
"""Model drafts on greedy records a window needs before its consistency counts."""
CAUSES = ("serving_disagrees", "drafter_changed", "target_changed", "traffic_changed", "unexplained")
"""The `cause` label of `dvi_alpha_moves_total` and the causes named in /admin/status and the log."""

_MODEL = source_code(SOURCE_MODEL)  # its code in a record's draft_source


@dataclass(frozen=True)
class WindowStats:
    """One window of a lane's records, measured."""

    index: int
    records: int
    drafted: int
    accepted: int
    alpha_live: float | None
    alpha_served: float | None  # replay through the versions that served the records
    alpha_reference: float | None  # replay through the frozen base (version 0), same records
    consistency: float | None  # model drafts equal to the drafting version's argmax (greedy records)
    consistency_drafts: int
    versions: tuple[int, ...]  # the versions that drafted the learned arm's records
    target_versions: tuple[int, ...]


@dataclass(frozen=True)
class AlphaMove:
    """A window whose live α moved (or whose drafts disagree with its weights), and why."""

    group: str
    cause: str
    before: WindowStats | None
    after: WindowStats
    message: str

    def as_dict(self) -> dict[str, Any]:
        return {"group": self.group, "cause": self.cause, "window": self.after.index, "message": self.message,
                "before": asdict(self.before) if self.before else None, "after": asdict(self.after)}


def drafted_version(record: FeedbackRecord, group_lane: bool) -> int:
    """The version that drafted a record in a lane: a group's adapter (0: its control arm or no promotion yet), or
    the shared drafter's."""
    if group_lane:
        return 0 if record.arm == "control" else int(record.adapter_version)
    return int(record.drafter_version)


def _model_drafts(rec: FeedbackRecord) -> list[int]:
    """Positions whose draft the model proposed (a record without sources: every drafted position)."""
    src = list(rec.draft_source)
    return [j for j, d in enumerate(rec.drafted_ids) if d >= 0 and (not src or src[j] == _MODEL)]


def _unnamed_rejections(rec: FeedbackRecord, counts: tuple[int, int] | None) -> bool:
    """The engine rejected drafts the record does not name (vLLM: only accepted drafts have ids)."""
    if counts is None or counts[0] <= counts[1]:
        return False
    return not any(d >= 0 and not a for d, a in zip(rec.drafted_ids, rec.accepted, strict=True))


@torch.inference_mode()
def _argmax(logits_fn: Callable, rec: FeedbackRecord) -> torch.Tensor | None:
    """[n] the drafter's teacher-forced argmax at the record's generated positions, or None (nothing to score)."""
    prompt, tokens = list(rec.prompt_ids), list(rec.token_ids)
    if not prompt or not tokens or getattr(logits_fn, "needs_features", False):
        return None
    ids = torch.tensor([prompt + tokens[:-1]], device=getattr(logits_fn, "device", "cpu"))
    return logits_fn(ids, keep=len(tokens))[0, -len(tokens):].float().argmax(-1).cpu()


def measure(index: int, records: Sequence[FeedbackRecord], scorers: dict[int, Scorer],
            logits_fns: dict[int, Callable], group_lane: bool,
            counts: Sequence[tuple[int, int] | None] | None = None) -> WindowStats:
    """A window's four numbers. `scorers` / `logits_fns`: the loaded versions' (version 0 the frozen base); records
    of a version no longer loaded count in live α only. `counts`: each record's (drafted, accepted) model drafts as
    the engine counted them (None: counted from the record's named drafts). One teacher-forced forward per record
    and version: a greedy record's argmax gives both its α̂ and its consistency. A record that does not name all its
    drafts (behind vLLM, which never says which token it rejected) has no consistency: its named drafts are the
    accepted ones only, the target's own tokens."""
    counted = {id(r): c for r, c in zip(records, counts or [None] * len(records), strict=True)}
    learned = [r for r in records if not (group_lane and r.arm == "control")]
    mine = {id(r) for r in learned}
    drafted, accepted = live_counts(records, counts, group_lane)
    by_version: dict[int, list[FeedbackRecord]] = {}
    for r in records:
        by_version.setdefault(drafted_version(r, group_lane), []).append(r)
    hits = total = ref_hits = ref_total = 0.0
    agree = drafts = 0
    ref_rest: list[FeedbackRecord] = []  # records whose reference α̂ the loop below does not get for free
    for v, recs in by_version.items():
        fn = logits_fns.get(v)
        if fn is None:
            ref_rest += recs
            continue
        sampled = [r for r in recs if id(r) in mine and served_temperature(r.temperature) > 0.0]
        if sampled and v in scorers:  # a sampled record's α̂ is Σ min(p, q), not an argmax
            for _, h, n in scorers[v](sampled):
                hits, total = hits + h, total + n
        for r in recs:
            if served_temperature(r.temperature) > 0.0 or (top := _argmax(fn, r)) is None:
                ref_rest.append(r)
                continue  # sampled drafts are draws, not the argmax
            agreed = float((top == torch.tensor(list(r.token_ids))).sum())
            if v == 0:  # the frozen base drafted it: its argmax is the reference's too, one forward for both
                ref_hits, ref_total = ref_hits + agreed, ref_total + len(top)
            else:
                ref_rest.append(r)
            if id(r) in mine:
                hits, total = hits + agreed, total + len(top)
            if _unnamed_rejections(r, counted[id(r)]):
                continue  # its named drafts are the accepted ones only: they agree with the target by construction
            for j in _model_drafts(r):
                drafts += 1
                agree += int(r.drafted_ids[j]) == int(top[j])
    for _, h, n in scorers[0](ref_rest) if 0 in scorers and ref_rest else ():
        ref_hits, ref_total = ref_hits + h, ref_total + n
    return WindowStats(
        index=index, records=len(records), drafted=drafted, accepted=accepted,
        alpha_live=acceptance_rate(accepted, drafted), alpha_served=hits / total if total else None,
        alpha_reference=ref_hits / ref_total if ref_total else None,
        consistency=agree / drafts if drafts >= MIN_CONSISTENCY_DRAFTS else None, consistency_drafts=drafts,
        versions=tuple(sorted({drafted_version(r, group_lane) for r in learned})),
        target_versions=tuple(sorted({int(r.target_version) for r in records})))


def live_counts(records: Sequence[FeedbackRecord], counts: Sequence[tuple[int, int] | None] | None,
                group_lane: bool) -> tuple[int, int]:
    """The learned arm's model drafts in `records` and how many were accepted (the engine's counts where given, else
    the records' named drafts)."""
    total = [0, 0]
    for r, c in zip(records, counts or [None] * len(records), strict=True):
        if group_lane and r.arm == "control":
            continue
        d, a = c or (len(_model_drafts(r)), sum(bool(r.accepted[j]) for j in _model_drafts(r)))
        total[0], total[1] = total[0] + d, total[1] + a
    return total[0], total[1]


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def _gap(w: WindowStats) -> float | None:
    """The serving versions' replayed α̂ over the frozen base's on the same records: what the drafter adds."""
    return _delta(w.alpha_reference, w.alpha_served)


def _moved(a: WindowStats, b: WindowStats) -> bool:
    if a.alpha_live is None or b.alpha_live is None:
        return False
    se = math.sqrt(sum(x.alpha_live * (1 - x.alpha_live) / max(x.drafted, 1) for x in (a, b)))
    return abs(b.alpha_live - a.alpha_live) >= max(MIN_MOVE, MOVE_Z * se)


def explain(group: str, before: WindowStats | None, after: WindowStats, level: float | None) -> AlphaMove | None:
    """The cause of live α's move from `before` to `after` (None: no move, nothing wrong). `level`: the lane's
    running consistency before `after` (None: none yet)."""
    name = f"traffic group {group!r}" if group else "the shared drafter"
    if after.consistency is not None and (after.consistency < CONSISTENCY_FLOOR or (
            level is not None and after.consistency < level - CONSISTENCY_DROP)):
        return AlphaMove(group, "serving_disagrees", before, after, (
            f"{name}: serving disagrees with itself: {after.consistency:.2f} of {after.consistency_drafts} live drafts "
            f"are the drafting version's own choice (running level {_f(level)}); live α {_f(after.alpha_live)} while "
            f"replaying the same records through the same weights gives α̂ {_f(after.alpha_served)}. The engine drafts "
            "something its weights do not say (a corrupted draft cache, stale adapter factors): output stays lossless, "
            "speed does not; restart the server or report the engine"))
    if before is None or not _moved(before, after):
        return None
    move = f"live α {_f(before.alpha_live)} -> {_f(after.alpha_live)} (window {after.index}, {after.records} records)"
    d_live, d_ref = after.alpha_live - before.alpha_live, _delta(before.alpha_reference, after.alpha_reference)
    with_base = d_ref is not None and d_ref * d_live > 0 and abs(d_ref) >= 0.5 * abs(d_live)  # the base moved too
    versions = f"versions {list(before.versions)} -> {list(after.versions)}"
    beside = ", the drafter is unchanged"  # what the traffic's message says of the drafter
    if after.versions != before.versions:
        d_gap = _delta(_gap(before), _gap(after))  # what the new versions changed beyond what the base did
        if not (with_base and d_gap is not None and abs(d_ref) > abs(d_gap)):
            return AlphaMove(group, "drafter_changed", before, after, (
                f"{name}: {move}: the drafter changed ({versions}); replayed α̂ of the serving versions "
                f"{_f(before.alpha_served)} -> {_f(after.alpha_served)}"))
        beside = f"; the drafter changed too ({versions}), its lead over the base {_f(_gap(before))} -> {_f(_gap(after))}"
    if max(after.target_versions, default=0) > max(before.target_versions, default=0):
        return AlphaMove(group, "target_changed", before, after, (
            f"{name}: {move}: the target changed (versions {list(before.target_versions)} -> "
            f"{list(after.target_versions)}), the drafter not yet caught up: the trainer learns the new target's "
            f"records; the frozen base's α̂ {_f(before.alpha_reference)} -> {_f(after.alpha_reference)}"))
    if with_base:
        return AlphaMove(group, "traffic_changed", before, after, (
            f"{name}: {move}: the traffic changed: the frozen base's α̂ on the same records moved "
            f"{_f(before.alpha_reference)} -> {_f(after.alpha_reference)} too{beside}"))
    return AlphaMove(group, "unexplained", before, after, (
        f"{name}: {move}: no version changed, the frozen base's α̂ {_f(before.alpha_reference)} -> "
        f"{_f(after.alpha_reference)} did not move with it and the drafts agree with their weights "
        f"({_f(after.consistency)}): look at the window's records (feedback log, `dvi report`)"))


class Diagnosis:
    """A lane's windows and the moves they explained; the lane's thread alone calls it."""

    def __init__(self, group: str, group_lane: bool, window: int = WINDOW) -> None:
        self.group, self.group_lane, self.window = group, group_lane, window
        self.pending: list[tuple[FeedbackRecord, tuple[int, int] | None]] = []
        self.windows: deque[WindowStats] = deque(maxlen=8)
        self.moves: deque[AlphaMove] = deque(maxlen=16)
        self.causes: Counter[str] = Counter()
        self.level: float | None = None  # the running consistency of healthy windows
        self.index = 0
        self.skipped = 0  # windows whose records drafted nothing: no live α to explain, nothing replayed

    def add(self, record: FeedbackRecord, counts: tuple[int, int] | None = None) -> None:
        """A record of the lane, with the engine's (drafted, accepted) count of its model drafts where known."""
        self.pending.append((record, counts))
        if len(self.pending) > 4 * self.window:  # a drafter thread busy for long: keep the newest
            del self.pending[: len(self.pending) - 4 * self.window]

    def due(self) -> bool:
        return len(self.pending) >= self.window

    def run(self, scorers: dict[int, Scorer], logits_fns: dict[int, Callable]) -> AlphaMove | None:
        """Measure the next window and explain it against the one before."""
        batch, self.pending = self.pending[: self.window], self.pending[self.window:]
        records, counts = [r for r, _ in batch], [c for _, c in batch]
        if live_counts(records, counts, self.group_lane)[0] == 0:
            self.skipped += 1  # speculation off or priced out (a loaded engine): the replays would only cost it
            return None
        self.index += 1
        stats = measure(self.index, records, scorers, logits_fns, self.group_lane, counts)
        move = explain(self.group, self.windows[-1] if self.windows else None, stats, self.level)
        self.windows.append(stats)
        if stats.consistency is not None and (move is None or move.cause != "serving_disagrees"):
            self.level = stats.consistency if self.level is None else 0.8 * self.level + 0.2 * stats.consistency
        if move is not None:
            self.moves.append(move)
            self.causes[move.cause] += 1
        return move

    def info(self) -> dict[str, Any]:
        """For /admin/status: the newest windows, the moves explained and their counts by cause."""
        return {"windows": [asdict(w) for w in list(self.windows)[-3:]], "consistency_level": self.level,
                "moves": [m.as_dict() for m in self.moves], "causes": dict(self.causes),
                "windows_without_drafts": self.skipped}
