"""`FeedbackReader`: tails complete shards for the online trainer, with a persisted cursor.

Its own module because the trainer side needs only this (cursor, grace window, quarantine of
unreadable shards), never the writer's buffering and retention.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dvi.feedback.record import OPTIONAL_FIELDS, SCHEMA, FeedbackRecord
from dvi.feedback.storage import SHARD_RE, _atomic_write_bytes, _fs, _list_shards, shard_time_ns

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
    """Tails complete shards under `root` for the trainer, with a persisted cursor.

    Cursor semantics: `commit(name)` marks every shard returned by `poll()` with a name <= `name`
    as consumed (call it only after training on them). Shard names start with the wall-clock
    time of their rename, so a shard from another writer process can appear slightly after a
    later-named one; shards within `grace_seconds` of the newest committed one are therefore
    tracked by name, and only older unseen ones are treated as consumed.
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
        self.grace_ns = int(grace_seconds * 1e9)
        self.last: str | None = None
        self.recent: set[str] = set()
        self.missed_shards = 0
        self.quarantined_shards = 0  # by this reader; `quarantined_total()` counts the dir
        self._polled: list[str] = []
        self._load_cursor()

    def _load_cursor(self) -> None:
        if self.cursor_path is None:
            return
        cfs, cpath = _fs(self.cursor_path)
        try:
            with cfs.open(cpath, "rb") as f:
                state = json.loads(f.read().decode())
        except FileNotFoundError:
            return
        self.last = state.get("last")
        self.recent = set(state.get("recent", []))

    @property
    def cursor(self) -> str | None:
        """Name of the newest consumed shard (None before the first commit)."""
        return self.last

    def _consumed(self, name: str) -> bool:
        if name in self.recent:
            return True
        if self.last is None or name > self.last:
            return False
        return shard_time_ns(name) < shard_time_ns(self.last) - self.grace_ns

    def list_shards(self) -> list[str]:
        """All complete shard names currently present, oldest first."""
        return [n for n, _ in _list_shards(self.fs, self.path)]

    def poll(self) -> list[str]:
        """Complete shards not yet consumed, oldest first."""
        self._polled = [n for n in self.list_shards() if not self._consumed(n)]
        return list(self._polled)

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

    def quarantined_total(self) -> int:
        """Shards in `quarantine/` (by any reader, any run)."""
        try:
            return len(self.fs.ls(posixpath.join(self.path, QUARANTINE_DIR), detail=False))
        except FileNotFoundError:
            return 0

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

    def read_records(self, shards: Iterable[str]) -> list[FeedbackRecord]:
        """The shards' records, validated as `read(validate=True)` validates them (built once, not twice)."""
        return list(self.iter_records(shards))

    def _load(self, name: str, validate: bool) -> tuple[pa.Table, list[FeedbackRecord]] | None:
        """One shard as (table, its validated records, [] unless `validate`); None when it vanished (retention,
        counted) or was quarantined (unreadable, foreign schema, or an invalid record when validating)."""
        try:
            with self.fs.open(self.shard_path(name), "rb") as f:
                table = _complete_table(pq.read_table(f, schema=SCHEMA))
            records = [FeedbackRecord.from_row(row) for row in table.to_pylist()] if validate else []
            return table, records
        except FileNotFoundError:
            self.missed_shards += 1
            log.warning("feedback shard %s vanished before it was read (retention)", name)
        except (pa.ArrowException, ValueError) as exc:
            self.quarantine(name, f"{type(exc).__name__}: {exc}")
        return None

    def iter_records(self, shards: Iterable[str]) -> Iterator[FeedbackRecord]:
        """`read_records`, one shard at a time (an invalid shard is quarantined and skipped, as there)."""
        for name in shards:
            if (loaded := self._load(name, True)) is not None:
                yield from loaded[1]

    def as_dataset(self, shards: Iterable[str]) -> Any:
        """The shards as a `datasets.Dataset` (in memory, arrow-backed)."""
        import datasets

        return datasets.Dataset(self.read(shards))

    def commit(self, cursor: str) -> None:
        """Mark `cursor` and every polled shard up to it consumed; persist atomically."""
        if not SHARD_RE.match(cursor):
            raise ValueError(f"cursor must be a shard name, got {cursor!r}")
        done = {n for n in self._polled if n <= cursor}
        done.add(cursor)
        self.recent |= done
        if self.last is None or cursor > self.last:
            self.last = cursor
        floor = shard_time_ns(self.last) - self.grace_ns
        self.recent = {n for n in self.recent if shard_time_ns(n) >= floor}
        self._polled = [n for n in self._polled if n not in done]
        if self.cursor_path is not None:
            state = {"last": self.last, "recent": sorted(self.recent), "updated_at": time.time()}
            cfs, cpath = _fs(self.cursor_path)
            _atomic_write_bytes(cfs, cpath, json.dumps(state).encode())
