"""Feedback records: what the target said about each drafted token, logged as parquet shards.

The engine produces one `FeedbackRecord` per finished sequence. `FeedbackWriter` buffers them
and writes parquet shards that are whole or absent (temp name in the same dir, fsync, rename),
so a crash never leaves half a shard. `FeedbackReader` tails the shards for the online trainer
with a persisted cursor, so a killed and restarted trainer neither trains a record twice nor
skips one.

Retention wins over readers: a writer with `retention_bytes` / `retention_shards` deletes the
oldest shards even if no trainer consumed them yet. A trainer that falls behind by more than the
retention window misses that data; the writer counts and logs every deletion
(`FeedbackWriter.deleted_shards`) and the reader counts shards that vanished before it read them
(`FeedbackReader.missed_shards`).

Roots are local paths or any fsspec URL (`memory://`, `s3://...`); fsync only applies locally.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from dvi.fsutil import TMP_PREFIX, atomic_write_bytes, fsync_path

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("target_version", pa.int64(), nullable=False),
        pa.field("drafter_version", pa.int64(), nullable=False),
        pa.field("started_at", pa.float64(), nullable=False),
        pa.field("finished_at", pa.float64(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("drafted_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("accepted", pa.list_(pa.bool_()), nullable=False),
        pa.field("topk_ids", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("topk_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
    ]
)
"""Parquet schema of a shard; one column per `FeedbackRecord` field (docs/contracts.md)."""

# Per-process name state shared by all writers, so two writers in one process never collide.
_NAME_LOCK = threading.Lock()
_NAME_STATE = {"last_ns": 0, "seq": 0}

QUARANTINE_DIR = "quarantine"  # unreadable shards are moved here by the reader (never deleted)
SHARD_RE = re.compile(r"^shard-(\d{20})-(\d+)-(\d{6})\.parquet$")


def _as_list(x: Any) -> list:
    """Plain list from a list, tuple, numpy array or tensor (tensors via `.tolist()`)."""
    if type(x) is list:
        return x
    if hasattr(x, "tolist"):
        return x.tolist()
    return list(x)


def _or_empty(x: Any) -> Any:
    return [] if x is None else x


@dataclass
class FeedbackRecord:
    """One finished sequence with per-position draft/accept feedback (docs/contracts.md)."""

    request_id: str
    domain: str
    target_version: int
    drafter_version: int
    started_at: float
    finished_at: float
    temperature: float
    prompt_ids: list[int]
    token_ids: list[int]
    drafted_ids: list[int]
    accepted: list[bool]
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when per-position lists disagree with token_ids."""
        if not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a str, got {type(self.request_id).__name__}")
        if not isinstance(self.domain, str):
            raise ValueError(f"domain must be a str, got {type(self.domain).__name__}")
        n = len(self.token_ids)
        for name in ("drafted_ids", "accepted"):
            m = len(getattr(self, name))
            if m != n:
                raise ValueError(f"{name} has {m} entries but token_ids has {n}")
        nk, nl = len(self.topk_ids), len(self.topk_logprobs)
        if nk != nl:
            raise ValueError(f"topk_logprobs has {nl} positions but topk_ids has {nk}")
        if nk and nk != n:
            raise ValueError(f"topk_ids has {nk} positions but token_ids has {n} (must be equal or empty)")
        if nk and any(len(a) != len(b) for a, b in zip(self.topk_ids, self.topk_logprobs, strict=True)):
            j = next(j for j in range(nk) if len(self.topk_ids[j]) != len(self.topk_logprobs[j]))
            raise ValueError(
                f"topk_ids[{j}] has {len(self.topk_ids[j])} ids but topk_logprobs[{j}] "
                f"has {len(self.topk_logprobs[j])}"
            )
        bad = [
            j
            for j, (a, t, d) in enumerate(zip(self.accepted, self.token_ids, self.drafted_ids, strict=True))
            if a and t != d
        ]
        if bad:
            j = bad[0]
            raise ValueError(
                f"accepted[{j}] is true but token_ids[{j}]={self.token_ids[j]} != drafted_ids[{j}]={self.drafted_ids[j]}"
            )

    @classmethod
    def from_result(
        cls,
        result: Any,
        temperature: float = 0.0,
        domain: str | None = None,
        prompt_ids: Sequence[int] | None = None,
    ) -> FeedbackRecord:
        """Build from a GenerationResult-like object (duck-typed on the contract's field names).

        `temperature` is the request's sampling temperature (not on GenerationResult); `domain`
        and `prompt_ids` override the result's when given.
        """

        def get(name: str, default: Any = None) -> Any:
            if isinstance(result, dict):
                return result.get(name, default)
            return getattr(result, name, default)

        missing = [n for n in ("request_id", "token_ids", "drafted_ids", "accepted") if get(n) is None]
        if missing:
            raise ValueError(f"result lacks required field(s): {', '.join(missing)}")
        temp = get("temperature", None)
        return cls(
            request_id=str(get("request_id")),
            domain=str(domain if domain is not None else (get("domain") or "default")),
            target_version=int(get("target_version", 0) or 0),
            drafter_version=int(get("drafter_version", 0) or 0),
            started_at=float(get("started_at", 0.0) or 0.0),
            finished_at=float(get("finished_at", 0.0) or 0.0),
            temperature=float(temp if temp is not None else temperature),
            prompt_ids=_as_list(prompt_ids if prompt_ids is not None else _or_empty(get("prompt_ids"))),
            token_ids=_as_list(get("token_ids")),
            drafted_ids=_as_list(get("drafted_ids")),
            accepted=[bool(a) for a in _as_list(get("accepted"))],
            # Rows are shared, not copied: the result is finished, and copying 128x32 lists
            # would dominate the engine-side logging cost.
            topk_ids=_as_list(_or_empty(get("topk_ids"))),
            topk_logprobs=_as_list(_or_empty(get("topk_logprobs"))),
        )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> FeedbackRecord:
        """Inverse of the parquet row layout (as produced by `pyarrow.Table.to_pylist`)."""
        return cls(**{f.name: row[f.name] for f in fields(cls)})


FIELD_NAMES = tuple(f.name for f in fields(FeedbackRecord))
RECORD_OVERHEAD_BYTES = 512
BYTES_PER_VALUE = 36  # a list slot (8) + a boxed int/float (28-32) in CPython


def record_nbytes(r: FeedbackRecord) -> int:
    """Estimated memory of a buffered record (CPython lists of boxed numbers), for the buffer cap."""
    k = len(r.topk_ids[0]) if r.topk_ids else 0  # every position holds the same k (O(1), engine thread)
    n = len(r.prompt_ids) + 3 * len(r.token_ids) + 2 * k * len(r.topk_ids)
    return RECORD_OVERHEAD_BYTES + BYTES_PER_VALUE * n


def _wide(t: pa.DataType) -> pa.DataType:
    if pa.types.is_float32(t):
        return pa.float64()
    if pa.types.is_list(t):
        return pa.list_(_wide(t.value_type))
    return t


def records_to_table(records: Sequence[FeedbackRecord]) -> pa.Table:
    """Columnar conversion with the explicit schema (done off the engine's write path).

    Python floats go in as float64 and are cast to float32: pyarrow converts nested Python
    floats straight to float32 ~15x slower, and this runs in a thread that shares the GIL with
    the engine loop.
    """
    arrays = []
    for f in SCHEMA:
        col = [getattr(r, f.name) for r in records]
        wide = _wide(f.type)
        arr = pa.array(col, type=wide)
        arrays.append(arr.cast(f.type) if wide != f.type else arr)
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(os.fspath(root))
    return fs, path.rstrip("/") or "/"


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write to a temp name in the same dir, fsync (local) and rename over `path`."""
    d, base = posixpath.split(path)
    tmp = posixpath.join(d, f"{TMP_PREFIX}{base}-{os.getpid()}-{threading.get_ident()}")
    if _is_local(fs):
        os.makedirs(d, exist_ok=True)
        atomic_write_bytes(path, data)
    else:
        fs.makedirs(d, exist_ok=True)
        with fs.open(tmp, "wb") as f:
            f.write(data)
        if fs.exists(path):
            fs.rm(path)
        fs.mv(tmp, path)


def _list_shards(fs: fsspec.AbstractFileSystem, path: str) -> list[tuple[str, int]]:
    """Complete shards as (name, size), sorted by name; temp files are ignored."""
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = posixpath.basename(e["name"].rstrip("/"))
        if SHARD_RE.match(name):
            out.append((name, int(e.get("size") or 0)))
    out.sort()
    return out


def shard_time_ns(name: str) -> int:
    """The wall-clock timestamp (ns) embedded in a shard name."""
    m = SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1))


class FeedbackWriter:
    """Buffers records and flushes them as atomically renamed parquet shards.

    `write()` only appends to a list under a lock (records validate themselves when built), so
    the engine loop pays about a microsecond per record. Flushing (parquet encoding + IO) runs either in a background
    thread (`background=True`) or inline in `write()`/`maybe_flush()` once `shard_records`
    records are buffered or the oldest is `flush_seconds` old. If storage keeps failing, at most
    `max_pending` records and `max_pending_bytes` (estimated, `record_nbytes`) are held; the oldest
    beyond either are dropped and counted (`dropped_records`). `failing` is True from a failed
    shard write until the next successful one (`last_error` says what failed), so a server can
    report it; records held meanwhile are written in order once storage works again.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        shard_records: int = 256,
        flush_seconds: float = 30.0,
        retention_bytes: int | None = None,
        retention_shards: int | None = None,
        background: bool = False,
        max_pending: int = 100_000,
        max_pending_bytes: int | None = None,
    ) -> None:
        if shard_records < 1:
            raise ValueError("shard_records must be >= 1")
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be > 0")
        self.root = os.fspath(root)
        self.fs, self.path = _fs(self.root)
        self.fs.makedirs(self.path, exist_ok=True)
        self._clean_stale_tmp()
        self.shard_records = shard_records
        self.flush_seconds = flush_seconds
        self.retention_bytes = retention_bytes
        self.retention_shards = retention_shards
        self._buf: list[FeedbackRecord] = []
        self._buf_t0 = 0.0
        self._lock = threading.Lock()  # guards _buf
        self._io_lock = threading.Lock()  # serialises shard writes
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self._buf_bytes = 0
        self.failing = False
        self.last_error: str | None = None
        self._closed = False
        self.records_written = 0
        self.shards_written = 0
        self.deleted_shards = 0
        self.deleted_bytes = 0
        self.flush_errors = 0
        self.dropped_records = 0
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="dvi-feedback-flush", daemon=True)
            self._thread.start()

    def _clean_stale_tmp(self, age_s: float = 3600.0) -> None:
        """Remove temp files left by writers that crashed mid-shard (local roots only)."""
        if not _is_local(self.fs):
            return
        now = time.time()
        for name in os.listdir(self.path):
            if name.startswith(TMP_PREFIX):
                p = os.path.join(self.path, name)
                try:
                    if now - os.path.getmtime(p) > age_s:
                        os.remove(p)
                except OSError:
                    pass

    # -- write path (engine thread) ---------------------------------------------------------
    def write(self, record: FeedbackRecord) -> None:
        """Append one record; cheap. May flush inline when not in background mode."""
        if self._closed:
            raise RuntimeError("FeedbackWriter is closed")
        size = record_nbytes(record)
        with self._lock:
            if not self._buf:
                self._buf_t0 = time.monotonic()
            # Storage has been failing for a while: drop the oldest rather than grow forever.
            while self._buf and (len(self._buf) >= self.max_pending or (
                    self.max_pending_bytes is not None and self._buf_bytes + size > self.max_pending_bytes)):
                self._buf_bytes -= record_nbytes(self._buf.pop(0))
                self.dropped_records += 1
            self._buf.append(record)
            self._buf_bytes += size
            full = len(self._buf) >= self.shard_records
        if self._thread is not None:
            if full:
                self._wake.set()
        elif full:
            self.flush()

    def maybe_flush(self) -> bool:
        """Flush if the buffer is full or old enough; returns whether a shard was written."""
        with self._lock:
            due = bool(self._buf) and (
                len(self._buf) >= self.shard_records or time.monotonic() - self._buf_t0 >= self.flush_seconds
            )
        return self.flush() is not None if due else False

    def pending(self) -> int:
        with self._lock:
            return len(self._buf)

    def pending_bytes(self) -> int:
        with self._lock:
            return self._buf_bytes

    # -- flushing ---------------------------------------------------------------------------
    def flush(self) -> str | None:
        """Write everything buffered as shard(s); returns the last shard name or None."""
        last = None
        while True:
            with self._lock:
                batch = self._buf[: self.shard_records]
                del self._buf[: self.shard_records]
                nbytes = sum(record_nbytes(r) for r in batch)
                self._buf_bytes -= nbytes
                if self._buf:
                    self._buf_t0 = time.monotonic()
            if not batch:
                return last
            try:
                last = self._write_shard(batch)
            except Exception as exc:
                # Put the records back (in order) so nothing is lost; the caller sees the error.
                with self._lock:
                    self._buf[:0] = batch
                    self._buf_bytes += nbytes
                    self._buf_t0 = time.monotonic()
                self.flush_errors += 1
                if not self.failing:
                    log.error("feedback shard write to %s failed: %s: %s", self.root, type(exc).__name__, exc)
                self.failing, self.last_error = True, f"{type(exc).__name__}: {exc}"
                raise
            if self.failing:
                log.warning("feedback shard writes to %s work again", self.root)
            self.failing, self.last_error = False, None

    def _next_name(self) -> str:
        with _NAME_LOCK:
            ns = max(time.time_ns(), _NAME_STATE["last_ns"] + 1)
            _NAME_STATE["last_ns"] = ns
            _NAME_STATE["seq"] = seq = (_NAME_STATE["seq"] + 1) % 1_000_000
        return f"shard-{ns:020d}-{os.getpid()}-{seq:06d}.parquet"

    def _write_shard(self, batch: list[FeedbackRecord]) -> str:
        table = records_to_table(batch)
        with self._io_lock:
            tmp = posixpath.join(self.path, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}.parquet")
            if _is_local(self.fs):
                with open(tmp, "wb") as f:
                    pq.write_table(table, f)
                    f.flush()
                    os.fsync(f.fileno())
                # Name taken right before the rename, so names sort in order of appearance
                # (readers rely on that, with a grace window for other processes).
                name = self._next_name()
                os.replace(tmp, posixpath.join(self.path, name))
                fsync_path(self.path)
            else:
                with self.fs.open(tmp, "wb") as f:
                    pq.write_table(table, f)
                name = self._next_name()
                self.fs.mv(tmp, posixpath.join(self.path, name))
            self.records_written += len(batch)
            self.shards_written += 1
            self._apply_retention()
        return name

    def _apply_retention(self) -> None:
        if self.retention_bytes is None and self.retention_shards is None:
            return
        shards = _list_shards(self.fs, self.path)
        total = sum(s for _, s in shards)
        # Always keep the newest shard, even if it alone exceeds retention_bytes.
        while len(shards) > 1 and (
            (self.retention_shards is not None and len(shards) > self.retention_shards)
            or (self.retention_bytes is not None and total > self.retention_bytes)
        ):
            name, size = shards.pop(0)
            total -= size
            try:
                self.fs.rm(posixpath.join(self.path, name))
            except FileNotFoundError:
                continue  # another writer process deleted it first
            self.deleted_shards += 1
            self.deleted_bytes += size
            log.warning("feedback retention deleted %s (%d bytes); unread records in it are lost", name, size)

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(timeout=min(1.0, self.flush_seconds))
            self._wake.clear()
            try:
                self.maybe_flush()
            except Exception:  # logged once per outage by flush(); `failing` reports it meanwhile
                log.debug("feedback flush failed; records kept in memory for the next try", exc_info=True)
                time.sleep(min(1.0, self.flush_seconds))

    # -- lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the background thread and flush what is left."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
        self.flush()

    def __enter__(self) -> FeedbackWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete_table(table: pa.Table) -> pa.Table:
    """Reading with `schema=SCHEMA` fills a column the file lacks with nulls; every field is
    required, so a null means a foreign or damaged file (ValueError -> quarantined)."""
    for f, col in zip(SCHEMA, table.columns, strict=True):
        if col.null_count:
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

        `validate=True` (the trainer) also checks every record (`FeedbackRecord.validate`), so a
        shard whose per-position lists disagree is quarantined instead of failing a training step.
        """
        tables = []
        for name in shards:
            try:
                with self.fs.open(self.shard_path(name), "rb") as f:
                    table = _complete_table(pq.read_table(f, schema=SCHEMA))
                if validate:
                    for row in table.to_pylist():
                        FeedbackRecord.from_row(row)
                tables.append(table)
            except FileNotFoundError:
                self.missed_shards += 1
                log.warning("feedback shard %s vanished before it was read (retention)", name)
            except (pa.ArrowException, ValueError) as exc:
                self.quarantine(name, f"{type(exc).__name__}: {exc}")
        if not tables:
            return SCHEMA.empty_table()
        return pa.concat_tables(tables)

    def iter_records(self, shards: Iterable[str]) -> Iterator[FeedbackRecord]:
        for name in shards:
            for row in self.read([name]).to_pylist():
                yield FeedbackRecord.from_row(row)

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
