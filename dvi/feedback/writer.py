"""`FeedbackWriter`: buffers records on the engine thread and writes whole-or-absent shards.

Its own module because only the server writes shards, and the writer's concerns (bounded
buffer, background flushing, outage reporting, retention, shard naming) are shared by neither
the reader nor the record schema.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import secrets
import threading
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from dvi.feedback.consumed import MARKER, read_state
from dvi.feedback.record import FeedbackRecord, record_nbytes, records_to_table
from dvi.feedback.storage import _fs, _is_local, _list_shards, is_disk_full, shard_name, shard_time_ns
from dvi.fsutil import TMP_PREFIX, access_modes, fsync_path, make_dirs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """How much feedback a writer keeps: the oldest shards go once there are more than `shards`,
    more than `bytes` in all, or once they are older than `age_s` (None: no bound of that kind)."""

    bytes: int | None = None
    shards: int | None = None
    age_s: float | None = None


class FeedbackWriter:
    """Buffers records and flushes them as atomically renamed parquet shards.

    `write()` only appends to a list under a lock (records validate themselves when built), so
    the engine loop pays about a microsecond per record. Flushing (parquet encoding + IO) runs either in a background
    thread (`background=True`) or inline in `write()`/`maybe_flush()` once `shard_records`
    records are buffered or the oldest is `flush_seconds` old. If storage keeps failing, at most
    `max_pending` records and `max_pending_bytes` (estimated, `record_nbytes`) are held; the oldest
    beyond either are dropped and counted (`dropped_records`). `failing` is True from a failed
    shard write until the next successful one (`last_error` says what failed), so a server can
    report it; records held meanwhile are written in order once storage works again. A write that
    finds the disk full first deletes shards the trainer has consumed (`_make_room`) and tries once more.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        shard_records: int = 256,
        flush_seconds: float = 30.0,
        retention: Retention | None = None,
        background: bool = False,
        max_pending: int = 100_000,
        max_pending_bytes: int | None = None,
        access: str = "private",
    ) -> None:
        if shard_records < 1:
            raise ValueError("shard_records must be >= 1")
        if flush_seconds <= 0:
            raise ValueError("flush_seconds must be > 0")
        self.root = os.fspath(root)
        self.fs, self.path = _fs(self.root)
        # every prompt and completion lands here: private by default (`files.access`; local dirs only)
        self.dir_mode, self.file_mode = access_modes(access)
        if _is_local(self.fs):
            make_dirs(self.path, access)
        else:
            self.fs.makedirs(self.path, exist_ok=True)
        self._clean_stale_tmp()
        self.writer_id = secrets.token_hex(6)  # shard names carry it with a gapless count (`storage.shard_name`)
        self.seq = 0  # shards renamed into place so far
        self._last_ns = 0
        self.shard_records = shard_records
        self.flush_seconds = flush_seconds
        self.retention = retention or Retention()
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
        self.reclaimed_shards = 0  # consumed shards deleted to make room on a full disk
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
        """The name of the next shard: taken right before its rename, so names sort roughly by appearance; the
        count advances only once the rename succeeded (`_write_shard`), so a writer's numbers have no gaps."""
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return shard_name(self._last_ns, os.getpid(), self.writer_id, self.seq + 1)

    def _write_shard(self, batch: list[FeedbackRecord]) -> str:
        """One shard, encoded in memory first (its size is the room a full disk must make), then `_put`."""
        buf = pa.BufferOutputStream()
        pq.write_table(records_to_table(batch), buf)
        data = buf.getvalue().to_pybytes()
        with self._io_lock:
            try:
                name = self._put(data)
            except OSError as exc:
                if not is_disk_full(exc) or not self._make_room(len(data)):
                    raise
                name = self._put(data)
            self.seq += 1
            self.records_written += len(batch)
            self.shards_written += 1
            self._apply_retention()
        return name

    def _put(self, data: bytes) -> str:
        """Write `data` under a temp name (fsynced), rename it to the next shard name; no temp file is left
        behind on failure (on a full disk it would hold the very room a retry needs)."""
        tmp = posixpath.join(self.path, f"{TMP_PREFIX}{os.getpid()}-{threading.get_ident()}.parquet")
        try:
            if _is_local(self.fs):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if self.file_mode is None else self.file_mode)
                if self.file_mode is not None:
                    os.fchmod(fd, self.file_mode)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                name = self._next_name()
                os.replace(tmp, posixpath.join(self.path, name))
                fsync_path(self.path)
            else:
                with self.fs.open(tmp, "wb") as f:
                    f.write(data)
                name = self._next_name()
                self.fs.mv(tmp, posixpath.join(self.path, name))
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm(tmp)
            raise
        return name

    def _make_room(self, need: int) -> bool:
        """The disk is full: delete consumed shards, oldest first, until twice `need` bytes are free. What is
        consumed comes from the trainer's state in the feedback dir (`consumed.json`), shared by every replica
        writing here; with none, nothing is deleted (records stay buffered until the trainer publishes one)."""
        state = read_state(self.fs, posixpath.join(self.path, MARKER))
        if state is None:
            return False
        freed = 0
        for name, size in _list_shards(self.fs, self.path):
            if freed >= 2 * need:
                break
            if not state.is_consumed(name):
                continue
            try:
                self.fs.rm(posixpath.join(self.path, name))
            except FileNotFoundError:
                continue  # another replica made room first
            freed += size
            self.reclaimed_shards += 1
            self.deleted_shards += 1
            self.deleted_bytes += size
        if freed:
            log.warning("feedback dir %s is full: deleted consumed shards (%d bytes) to make room", self.root, freed)
        return freed > 0

    def _apply_retention(self) -> None:
        keep = self.retention
        if keep.bytes is None and keep.shards is None and keep.age_s is None:
            return
        shards = _list_shards(self.fs, self.path)
        total = sum(s for _, s in shards)
        oldest_ns = None if keep.age_s is None else time.time_ns() - int(keep.age_s * 1e9)
        # Always keep the newest shard, even if it alone exceeds retention.bytes.
        while len(shards) > 1 and (
            (keep.shards is not None and len(shards) > keep.shards)
            or (keep.bytes is not None and total > keep.bytes)
            or (oldest_ns is not None and shard_time_ns(shards[0][0]) < oldest_ns)
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
