"""`FeedbackReader`: tails complete shards for the online trainer, with a persisted consumed state.

Its own module because the trainer side needs only this (listing, the consumed state's persistence,
quarantine of unreadable shards), never the writer's buffering and retention.
"""

from __future__ import annotations

import logging
import os
import posixpath
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dvi.feedback.consumed import MARKER, ConsumedState, read_state, write_state
from dvi.feedback.record import OPTIONAL_FIELDS, SCHEMA, FeedbackRecord
from dvi.feedback.storage import _fs, _list_shards, is_disk_full, parse_shard

log = logging.getLogger(__name__)

QUARANTINE_DIR = "quarantine"  # unreadable shards are moved here by the reader (never deleted)


def _complete_table(table: pa.Table) -> pa.Table:
    """Reading with `schema=SCHEMA` fills a column the file lacks with nulls; every field is
    required, so a null means a foreign or damaged file (ValueError -> quarantined)."""
    for f, col in zip(SCHEMA, table.columns, strict=True):
        if col.null_count and f.name not in OPTIONAL_FIELDS:
            raise ValueError(f"column {f.name} is missing or has nulls")
    return table


class FeedbackReader:
    """Tails complete shards under `root` for the trainer, with a persisted consumed state.

    What is consumed is a `ConsumedState` (`dvi.feedback.consumed`): per writer, its own gapless
    sequence numbers, never a writer's clock, so a replica whose clock runs fast or is stepped back
    neither hides shards nor has its own hidden. `commit_shards(names)` marks shards consumed (call it
    only after training on them), in any order; `commit(name)` marks every polled shard named up to
    `name`. A shard that appears already counted consumed is counted as skipped and logged; shards
    gone before they were read (retention) are counted as lost (`state.lost`, `state.skipped`).

    With a `cursor_path` (the trainer's) the state is persisted there on every commit, and a copy goes
    to `<root>/consumed.json` (`MARKER`) for the writers' retention on a full disk.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        cursor_path: str | os.PathLike | None = None,
        grace_seconds: float = 60.0,
    ) -> None:
        self.root = os.fspath(root)
        self.fs, self.path = _fs(self.root)
        self.cursor_path = os.fspath(cursor_path) if cursor_path is not None else None
        self.grace_seconds = grace_seconds  # an old cursor's grace window (its legacy names only)
        self.state = ConsumedState()
        self.missed_shards = 0  # chosen, then gone before they were read (also in `state.lost`)
        self.quarantined_shards = 0  # by this reader; `quarantined_total()` counts the dir
        self._polled: list[str] = []
        self._first_listed: dict[str, float] = {}  # name -> this reader's monotonic clock when first listed
        self._polls = 0
        self._marker_failing = False
        self._load_cursor()

    def _load_cursor(self) -> None:
        if self.cursor_path is None:
            return
        cfs, cpath = _fs(self.cursor_path)
        state = read_state(cfs, cpath, self.grace_seconds)
        if state is not None:
            self.state = state

    @property
    def cursor(self) -> str | None:
        """Name of the newest-named consumed shard (None before the first commit); informational."""
        return self.state.last

    def list_shards(self) -> list[str]:
        """All complete shard names currently present, oldest first."""
        return [n for n, _ in _list_shards(self.fs, self.path)]

    def poll(self, in_flight: Iterable[str] = ()) -> list[str]:
        """Complete shards not yet consumed, oldest-named first. `in_flight`: shards read and trained, not yet
        committed; one that retention deletes meanwhile is not lost (its commit comes)."""
        listed = self.list_shards()
        self.state.observe(listed, lambda: [*self._quarantined_names(), *in_flight])
        now, first_poll = time.monotonic(), self._polls == 0
        for name in listed:
            if name in self._first_listed:
                continue
            self._first_listed[name] = now
            if not first_poll and self.state.is_consumed(name):
                self.state.skipped += 1
                log.error("feedback shard %s appeared after its writer's later shards were consumed; it will not be "
                          "trained (counted as skipped)", name)
        self._first_listed = {n: self._first_listed[n] for n in listed}
        self._polls += 1
        self._polled = [n for n in listed if not self.state.is_consumed(n)]
        return list(self._polled)

    def waiting_seconds(self, names: Iterable[str]) -> float:
        """How long the longest-listed of `names` has been listed, by this reader's own clock (0 if none)."""
        firsts = [self._first_listed[n] for n in names if n in self._first_listed]
        return time.monotonic() - min(firsts) if firsts else 0.0

    def shard_path(self, name: str) -> str:
        return posixpath.join(self.path, name)

    def quarantine(self, name: str, why: str) -> None:
        """Move an unreadable shard to `quarantine/` (kept for a person to look at), so a reader
        skips it instead of failing on it forever; it is then neither pending nor retried."""
        qdir = posixpath.join(self.path, QUARANTINE_DIR)
        try:
            self.fs.makedirs(qdir, exist_ok=True)
            self.fs.mv(self.shard_path(name), posixpath.join(qdir, name))
        except FileNotFoundError:
            return  # another reader moved it first
        self.quarantined_shards += 1
        log.error("feedback shard %s is unreadable (%s); moved to %s/", name, why, qdir)

    def _quarantined_names(self) -> list[str]:
        try:
            return self.fs.ls(posixpath.join(self.path, QUARANTINE_DIR), detail=False)
        except FileNotFoundError:
            return []

    def quarantined_total(self) -> int:
        """Shards in `quarantine/` (by any reader, any run)."""
        return len(self._quarantined_names())

    def num_rows(self, name: str) -> int | None:
        """Records in a shard from its footer; None if it vanished or was quarantined as unreadable."""
        try:
            with self.fs.open(self.shard_path(name), "rb") as f:
                return int(pq.ParquetFile(f).metadata.num_rows)
        except FileNotFoundError:
            return None
        except (pa.ArrowException, ValueError) as exc:
            self.quarantine(name, f"{type(exc).__name__}: {exc}")
            return None

    def read(self, shards: Iterable[str], validate: bool = False) -> pa.Table:
        """Concatenate shards into one table; shards deleted by retention are skipped (counted),
        unreadable ones (bad parquet, wrong schema) are quarantined (counted) and skipped.

        `validate=True` also checks every record (`FeedbackRecord.validate`), so a shard whose
        per-position lists disagree is quarantined instead of failing a training step.
        """
        tables = [loaded[0] for name in shards if (loaded := self._load(name, validate)) is not None]
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()

    def read_records(self, shards: Iterable[str], unread: bool = True) -> list[FeedbackRecord]:
        """The shards' records, validated as `read(validate=True)` validates them (built once, not twice).
        `unread=False`: shards consumed already (a replay warm-up), so one that vanished is not lost."""
        return list(self.iter_records(shards, unread))

    def _load(self, name: str, validate: bool, unread: bool = True) -> tuple[pa.Table, list[FeedbackRecord]] | None:
        """One shard as (table, its validated records, [] unless `validate`); None when it vanished (retention,
        counted as lost when `unread`) or was quarantined (unreadable, foreign schema, or an invalid record
        when validating)."""
        try:
            with self.fs.open(self.shard_path(name), "rb") as f:
                table = _complete_table(pq.read_table(f, schema=SCHEMA))
            records = [FeedbackRecord.from_row(row) for row in table.to_pylist()] if validate else []
            return table, records
        except FileNotFoundError:
            if unread:
                self.missed_shards += 1
                self.state.lost += 1
                log.warning("feedback shard %s vanished before it was read (retention); counted as lost", name)
        except (pa.ArrowException, ValueError) as exc:
            self.quarantine(name, f"{type(exc).__name__}: {exc}")
        return None

    def iter_records(self, shards: Iterable[str], unread: bool = True) -> Iterator[FeedbackRecord]:
        """`read_records`, one shard at a time (an invalid shard is quarantined and skipped, as there)."""
        for name in shards:
            if (loaded := self._load(name, True, unread)) is not None:
                yield from loaded[1]

    def as_dataset(self, shards: Iterable[str]) -> Any:
        """The shards as a `datasets.Dataset` (in memory, arrow-backed)."""
        import datasets

        return datasets.Dataset(self.read(shards))

    def commit(self, cursor: str) -> None:
        """Mark `cursor` and every polled shard named up to it consumed; persist atomically."""
        if parse_shard(cursor) is None:
            raise ValueError(f"cursor must be a shard name, got {cursor!r}")
        self.commit_shards({n for n in self._polled if n <= cursor} | {cursor})

    def commit_shards(self, names: Iterable[str]) -> None:
        """Mark these shards consumed, in any order (after training on them); persist atomically."""
        done = set(names)
        if self._polls == 0:
            self.poll(done)  # the state folds against a listing: take one first
        self.state.mark(done)
        self._polled = [n for n in self._polled if n not in done]
        if self.cursor_path is not None:
            cfs, cpath = _fs(self.cursor_path)
            write_state(cfs, cpath, self.state)
            self._publish_marker()

    def _publish_marker(self) -> None:
        """Copy the state to `<root>/consumed.json` for the writers. On a full disk, first delete the oldest
        consumed shard (the writers make the rest of the room once they can read what is consumed)."""
        path = posixpath.join(self.path, MARKER)
        for attempt in range(2):
            try:
                write_state(self.fs, path, self.state)
            except OSError as exc:
                if attempt == 0 and is_disk_full(exc) and self._delete_oldest_consumed():
                    continue
                if not self._marker_failing:
                    log.warning("cannot publish the consumed state to %s (%s); writers keep the last one", path, exc)
                self._marker_failing = True
                return
            if self._marker_failing:
                log.info("the consumed state is published to %s again", path)
            self._marker_failing = False
            return

    def _delete_oldest_consumed(self) -> bool:
        for name, _ in _list_shards(self.fs, self.path):
            if self.state.is_consumed(name):
                try:
                    self.fs.rm(self.shard_path(name))
                except FileNotFoundError:
                    continue
                log.warning("feedback dir is full: deleted the consumed shard %s", name)
                return True
        return False
