"""Several replicas on one feedback dir: each one's suffix index also learns the others' finished outputs.

`SuffixTailer` tails the shared `feedback.dir` (a `dvi.feedback.FeedbackReader` with an in-memory cursor: this
is not the trainer's exactly-once consumption) and hands other writers' records (their shard names carry
their pid) to the engine thread (an `AddHistory` command, `serving.engine_client`), which adds them to the suffix
index between two steps (the index is the engine thread's). Bounded: at most `max_records` records per poll, newest shards first; shards
present before the server started are skipped except the newest of them (a warm start of the same size).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from dvi.feedback.reader import FeedbackReader
from dvi.feedback.storage import SHARD_RE

log = logging.getLogger("dvi.serving")

__all__ = ["SuffixTailer", "foreign_shards"]


def foreign_shards(names: list[str], pid: int) -> list[str]:
    """Shard names written by another process than `pid` (the shard name's second field)."""
    out = []
    for n in names:
        m = SHARD_RE.match(n)
        if m is not None and int(m.group(2)) != pid:
            out.append(n)
    return out


class SuffixTailer:
    """Polls the feedback dir every `interval` seconds; `send(items)` hands each poll's (seq id, tokens) to the
    engine thread (a server: `Scheduler.command(AddHistory(...))`; a future, waited for) to add to the suffix
    index."""

    def __init__(self, root: str, send: Callable[[list[tuple[str, tuple[int, ...]]]], Any],
                 interval: float = 5.0, max_records: int = 256, pid: int | None = None):
        self.reader = FeedbackReader(root, cursor_path=None)
        self.send = send
        self.interval, self.max_records = float(interval), int(max_records)
        self.pid = os.getpid() if pid is None else int(pid)
        self.records_added = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _take(self) -> tuple[list[tuple[str, tuple[int, ...]]], str | None]:
        """Up to `max_records` (seq id, output tokens) of other writers' unread shards (newest first) and the
        newest shard name polled (everything up to it is then read)."""
        polled = self.reader.poll()
        if not polled:
            return [], None
        out: list[tuple[str, tuple[int, ...]]] = []
        for name in reversed(foreign_shards(polled, self.pid)):
            for rec in self.reader.iter_records([name]):
                if rec.token_ids:
                    out.append((f"{name}/{rec.request_id}", tuple(int(t) for t in rec.token_ids)))
            if len(out) >= self.max_records:
                break
        return out[: self.max_records], polled[-1]

    def poll_once(self) -> int:
        """Read new shards and add their outputs to the index (on the engine thread); returns how many."""
        items, last = self._take()
        if items:
            fut = self.send(items)
            if hasattr(fut, "result"):
                fut.result(timeout=60)
            self.records_added += len(items)
        if last is not None:
            self.reader.commit(last)
        return len(items)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a bad shard or a stopped engine costs hits, never the server
                self.errors += 1
                log.exception("suffix tailer poll failed")

    def start(self) -> None:
        # Shards already there: only the newest `max_records` records' worth are read (the first poll).
        self._thread = threading.Thread(target=self._run, name="dvi-suffix-tail", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No more polls; wait up to `timeout` for the thread (0: do not)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
