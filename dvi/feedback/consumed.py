"""`ConsumedState`: which feedback shards the trainer has consumed, decided without any writer's clock.

Issue 36 §4: the cursor used to be the newest committed shard name, and every shard named more than a
grace window before it counted as consumed; one shard from a replica whose clock ran fast (or a clock
stepped back) then made everything written afterwards look consumed, silently. Now the state rests on
what each writer numbers itself (`dvi.feedback.storage`: a writer id and a gapless sequence, renamed into
place in order, so once seq s is listed every earlier seq of that writer was listed before or never will be):

* per writer, `upto` (every seq <= upto is consumed or gone for good), `done` (consumed seqs above it: the
  trainer trains the newest first, so it consumes out of order) and `seen` (the highest seq ever listed);
* a seq no longer listed was deleted (retention) or quarantined: when `upto` passes one that was neither
  consumed, quarantined nor trained (awaiting its commit) it is counted in `lost` (retention deleted it
  before the trainer read it, whether the trainer ever listed it or not);
* legacy names (no writer id) are kept by name (`legacy`), forgotten once they leave the dir.

Bounded by the dir, never by the records served: `done` and `legacy` hold shards still listed (or above a
listed pending one), and at most `MAX_WRITERS` writers are remembered (those unlisted longest go first; a
forgotten writer's next shard is simply new). The trainer's reader persists it as its cursor
(`<run_dir>/trainer/cursor.json`) and publishes a copy into the feedback dir (`MARKER`), from which every
replica's writer learns which shards it may delete when the disk is full.
"""

from __future__ import annotations

import json
import logging
import posixpath
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import fsspec

from dvi.feedback.storage import ShardName, _atomic_write_bytes, parse_shard

log = logging.getLogger(__name__)

MARKER = "consumed.json"  # in the feedback dir: the trainer's consumed state, for the writers' retention
MAX_WRITERS = 1024
FORMAT = 2


@dataclass
class WriterCursor:
    """One writer's shards: every seq <= `upto` consumed or gone, `done` consumed above it, `seen` the highest listed."""

    upto: int = 0
    done: set[int] = field(default_factory=set)
    seen: int = 0
    listed_at: float = 0.0  # the reader's clock when a shard of this writer was last listed (eviction order)

    def consumed(self, seq: int) -> bool:
        return seq <= self.upto or seq in self.done


class ConsumedState:
    """What is consumed: `is_consumed(name)`; `observe(listing)` after every listing, `mark(names)` after training."""

    def __init__(self) -> None:
        self.writers: dict[str, WriterCursor] = {}
        self.legacy: set[str] = set()
        self.lost = 0  # shards gone before they were consumed (retention), by the fold or a read that found none
        self.skipped = 0  # shards that appeared after the state already counted them consumed (never trained)
        self.last: str | None = None  # the newest-named shard marked (for logs; decides nothing)
        self._listed: dict[str, set[int]] = {}
        self._v1: tuple[str, set[str], int] | None = None  # an old cursor: (last, recent, grace_ns), for legacy names

    # -- queries ------------------------------------------------------------------------------------
    def is_consumed(self, name: str) -> bool:
        p = parse_shard(name)
        if p is None:
            return False
        if p.writer is None:
            return name in self.legacy or self._v1_consumed(name, p)
        cur = self.writers.get(p.writer)
        return cur is not None and cur.consumed(p.seq)

    def _v1_consumed(self, name: str, p: ShardName) -> bool:
        """The old cursor's rule, kept only for the legacy names it was written for (applied once, at the first listing)."""
        if self._v1 is None:
            return False
        last, recent, grace_ns = self._v1
        if name in recent:
            return True
        last_p = parse_shard(last)
        return name <= last and last_p is not None and p.time_ns < last_p.time_ns - grace_ns

    # -- updates ------------------------------------------------------------------------------------
    def observe(self, listed: Iterable[str], excused: Callable[[], Iterable[str]] = tuple) -> None:
        """Take a full listing of the dir: learn new writers, forget what left, count what left unconsumed as lost
        unless `excused()` names it (quarantined, or trained and about to be marked)."""
        by_writer: dict[str, set[int]] = {}
        legacy: set[str] = set()
        for name in listed:
            p = parse_shard(name)
            if p is None:
                continue
            if p.writer is None:
                legacy.add(name)
            else:
                by_writer.setdefault(p.writer, set()).add(p.seq)
        if self._v1 is not None:
            self.legacy |= {n for n in legacy if self.is_consumed(n)}
            self._v1 = None
        self.legacy &= legacy
        now = time.time()
        for w, seqs in by_writer.items():
            cur = self.writers.get(w)
            if cur is None:  # a writer first met here: what it wrote before is gone (or was consumed) already
                cur = self.writers[w] = WriterCursor(upto=min(seqs) - 1, seen=min(seqs) - 1)
            cur.seen, cur.listed_at = max(cur.seen, max(seqs)), now
        self._listed = by_writer
        for w, cur in self.writers.items():
            self._fold(w, cur, excused)
        self._evict()

    def mark(self, names: Iterable[str]) -> None:
        """Mark shards consumed (after they were trained, held out or quarantined record by record)."""
        touched = set()
        for name in names:
            p = parse_shard(name)
            if p is None:
                raise ValueError(f"not a shard name: {name!r}")
            self.last = name if self.last is None or name > self.last else self.last
            if p.writer is None:
                self.legacy.add(name)
                continue
            cur = self.writers.setdefault(p.writer, WriterCursor(upto=p.seq - 1, seen=p.seq - 1))
            if p.seq > cur.upto:
                cur.done.add(p.seq)
            cur.seen = max(cur.seen, p.seq)
            touched.add(p.writer)
        for w in touched:
            self._fold(w, self.writers[w], tuple)

    def _fold(self, writer: str, cur: WriterCursor, excused: Callable[[], Iterable[str]]) -> None:
        """Advance `upto` to just below the first listed seq not yet consumed; count what it passes unconsumed."""
        listed = self._listed.get(writer, set())
        stop = min((s for s in listed if s > cur.upto and s not in cur.done), default=cur.seen + 1)
        if stop - 1 <= cur.upto:
            return
        gone = stop - 1 - cur.upto - sum(1 for s in cur.done if s < stop)  # passed, neither consumed nor listed
        if gone > 0:
            q = {p.seq for n in excused() if (p := parse_shard(posixpath.basename(n))) and p.writer == writer
                 and cur.upto < p.seq < stop and p.seq not in cur.done}
            if gone > len(q):
                self.lost += gone - len(q)
                log.warning("%d feedback shard(s) of writer %s (seq %d..%d) were deleted before the trainer read "
                            "them (retention); counted as lost", gone - len(q), writer, cur.upto + 1, stop - 1)
        cur.upto = stop - 1
        cur.done = {s for s in cur.done if s > cur.upto}

    def _evict(self) -> None:
        extra = len(self.writers) - MAX_WRITERS
        if extra > 0:
            idle = sorted((c.listed_at, w) for w, c in self.writers.items() if w not in self._listed)
            for _, w in idle[:extra]:
                del self.writers[w]

    # -- persistence --------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "last": self.last, "lost": self.lost, "skipped": self.skipped,
                "legacy": sorted(self.legacy), "updated_at": time.time(),
                "writers": {w: {"upto": c.upto, "done": sorted(c.done), "seen": c.seen, "listed_at": c.listed_at}
                            for w, c in self.writers.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any], grace_seconds: float = 60.0) -> ConsumedState:
        """A state from `to_json`, or from an old cursor ({"last", "recent"}: its rule judges legacy names once)."""
        state = cls()
        state.last = data.get("last")
        state.lost, state.skipped = int(data.get("lost", 0)), int(data.get("skipped", 0))
        if data.get("format") != FORMAT:
            if state.last is not None:
                state._v1 = (state.last, set(data.get("recent", [])), int(grace_seconds * 1e9))
            return state
        state.legacy = set(data.get("legacy", []))
        state.writers = {w: WriterCursor(int(c["upto"]), set(c.get("done", [])), int(c.get("seen", c["upto"])),
                                         float(c.get("listed_at", 0.0))) for w, c in data.get("writers", {}).items()}
        return state


def read_state(fs: fsspec.AbstractFileSystem, path: str, grace_seconds: float = 60.0) -> ConsumedState | None:
    """The state saved at `path`; None when there is none or it cannot be read (torn, foreign)."""
    try:
        with fs.open(path, "rb") as f:
            data = json.loads(f.read().decode())
        return ConsumedState.from_json(data, grace_seconds) if isinstance(data, dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("consumed state %s is unreadable (%s)", path, exc)
        return None


def write_state(fs: fsspec.AbstractFileSystem, path: str, state: ConsumedState) -> None:
    """Replace `path` with the state, whole or not at all."""
    _atomic_write_bytes(fs, path, json.dumps(state.to_json()).encode())
