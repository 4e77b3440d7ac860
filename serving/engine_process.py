"""The server's side of the engine's own process (`serve.engine_process`, `serving.engine_core`): `EngineProcess`, the
engine's front door (`serving.engine_client.EngineClient`) as `serving.scheduler.Scheduler` is in one process.

Endpoints submit and cancel as before; a reader thread receives each iteration's batch from the engine process,
publishes its snapshot, runs the final records' subscribers here (telemetry, feedback log, drafter wing: off the
engine's interpreter), then hands the events to the endpoints' queues; commands resolve once the engine process has
applied them and sent the snapshot that shows it. The engine process dying fails every request in flight with a
500 and every command waiting, and /health reads the engine down: nothing hangs.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from collections.abc import Callable
from typing import Any

from dvi.engine.speculative import SamplingParams
from dvi.memory import HeapTrimmer

from .engine_client import Command, CutAll, EngineSnapshot, SampleOutbox
from .engine_core import Pipe, handle_spec, main
from .finished import Finished, FinishedFeed
from .handle import Event, Handle, new_handles, send_events
from .protocol import ApiError, shutting_down
from .scheduler import QueueFull, check_room

log = logging.getLogger("dvi.serving")

START_TIMEOUT_S = 1800.0
"""How long the engine process may take to load and calibrate before the server gives up on it."""


class EngineProcess:
    """The engine in a child process, behind the scheduler's public surface (module docstring)."""

    def __init__(self, cfg: Any) -> None:
        # this process's freed heap back to the OS (`dvi.memory`), as the engine thread's trimmer does the engine's
        self.heap = HeapTrimmer(cfg.serve.malloc_trim_seconds)
        self.max_batch_size = cfg.serve.max_batch_size
        self.queue_limit = cfg.serve.queue_limit
        self.finished = FinishedFeed()
        self.step_observers: list[Callable[[float, int], None]] = []
        self.suffix_step_seconds = SampleOutbox()
        self.snapshot = EngineSnapshot()
        self.eos_ids: tuple[int, ...] = ()
        self.uses_history = False
        self._pending: dict[str, Handle] = {}  # submitted, not yet answered (nor cancelled)
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._retry_after: float | None = None
        self._stopping = False
        self._dead: str | None = None  # why the engine process is gone
        ctx = multiprocessing.get_context("spawn")  # a fork would copy the server's threads' locks mid-hold
        ours, theirs = ctx.Pipe(duplex=True)
        self._pipe = Pipe(ours)
        self._proc = ctx.Process(target=main, args=(cfg, theirs, logging.getLogger().getEffectiveLevel()),
                                 name="dvi-engine", daemon=True)
        self._proc.start()
        theirs.close()
        self._reader: threading.Thread | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Block until the engine process has built its engine; RuntimeError naming why it could not."""
        conn = self._pipe.conn
        deadline = time.monotonic() + timeout
        while not conn.poll(1.0):
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited (code {self._proc.exitcode}) before it was ready; "
                                   "its log lines above say why")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the engine process was not ready after {timeout:.0f}s")
        msg = self._pipe.recv()
        if msg[0] != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process could not start: {msg[1]}")
        info = msg[1]
        self.eos_ids, self.uses_history, self.snapshot = tuple(info["eos_ids"]), info["uses_history"], info["snapshot"]
        log.info("engine process %d serving", info["pid"])

    # -- the door ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="dvi-engine-pipe", daemon=True)
            self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine process (its loop fails what is left with the 503) and wait for it; then kill it."""
        with self._lock:
            self._stopping = True
        if self._proc.is_alive():
            try:
                self._pipe.send(("stop",))
            except OSError:
                pass
            self._proc.join(timeout)
            if self._proc.is_alive():
                log.warning("the engine process did not stop in %.0fs; killed", timeout)
                self._proc.kill()
                self._proc.join(5)
        if self._reader is not None:
            self._reader.join(timeout)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive() and self._reader is not None and self._reader.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def lost(self) -> str | None:
        """Why the engine process is gone (None: it is not)."""
        return self._dead

    def queue_depth(self) -> int:
        return self.snapshot.queue

    def num_running(self) -> int:
        return self.snapshot.running

    def busy(self) -> bool:
        return bool(self._pending)

    def submit_choices(self, choices: list[tuple[list[int], SamplingParams]], domain: str = "default",
                       stop: list[str] | None = None, stream: bool = False, client: str = "", group: str = "",
                       arm: str = "learned") -> list[Handle]:
        """As `Scheduler.submit_choices`: queued whole or refused whole (QueueFull, or the drain's 503)."""
        handles = new_handles(choices, domain, stop, stream, client, group, arm)
        with self._lock:
            if self._stopping or self._retry_after is not None or self._dead is not None:
                raise shutting_down(self._retry_after or 1)
            # at most what the engine process will hold waiting (it admits up to a batch at its next iteration, and
            # refuses exactly: "refused"); not the snapshot's queue, a step old
            check_room(max(0, len(self._pending) - self.max_batch_size), len(handles), self.queue_limit)
            for h in handles:
                self._pending[h.request_id] = h
        self._send(("submit", [handle_spec(h) for h in handles]))
        return handles

    def close(self, retry_after_s: float) -> None:
        self._retry_after = retry_after_s
        self._send(("close", retry_after_s))

    def cancel(self, handle: Handle) -> None:
        if handle.done or handle.cancelled:
            return
        handle.cancelled = True
        self._pending.pop(handle.request_id, None)
        self._send(("cancel", handle.request_id))

    def cut(self) -> concurrent.futures.Future:
        return self.command(CutAll())

    def command(self, cmd: Command) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping or not self.alive:
                fut.set_exception(RuntimeError("engine loop is not running"))
                return fut
            cid = next(self._ids)
            self._futures[cid] = fut
        self._send(("command", cid, cmd))
        return fut

    def _send(self, msg: tuple) -> None:
        try:
            self._pipe.send(msg)
        except (OSError, ValueError) as exc:  # the engine process is gone: the reader fails what waits
            log.warning("engine message %r not sent: %s", msg[0], exc)

    # -- the reader thread -------------------------------------------------------------------
    def _read(self) -> None:
        conn = self._pipe.conn
        while True:
            try:
                if not conn.poll(self.heap.wait_s(1.0)):
                    if self.heap.idle_due():
                        self.heap.trim()
                    continue
                msg = self._pipe.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "batch":
                self.heap.after_step()
            try:
                self._on_message(msg)
            except Exception:  # noqa: BLE001 - one bad batch must not stop the rest
                log.exception("engine message %r failed", msg[0])
        self._proc.join(5)
        self._lost(f"the engine process exited (code {self._proc.exitcode})")

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "batch":
            _, snap, events, fins, steps, suffix = msg
            self.snapshot = snap
            self.suffix_step_seconds.put(suffix)
            for dt, n in steps:
                for obs in self.step_observers:
                    obs(dt, n)
            for fin in fins:
                self.finished.publish(fin)
            self._deliver(events)
        elif kind == "done":
            _, cid, ok, value = msg
            fut = self._futures.pop(cid, None)
            if fut is not None and fut.set_running_or_notify_cancel():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(value)
        elif kind == "refused":
            _, rids, exc = msg
            err = ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") if isinstance(exc, QueueFull) \
                else exc if isinstance(exc, ApiError) else ApiError(500, f"engine error: {exc}", type_="server_error")
            self._deliver([(rid, err) for rid in rids])

    def _deliver(self, events: list[tuple[str, Event]]) -> None:
        out = []
        for rid, ev in events:
            h = self._pending.get(rid)
            if h is None:
                continue
            if isinstance(ev, Finished | ApiError):
                h.done = True
                self._pending.pop(rid, None)
            out.append((h, ev))
        if out:
            send_events(out)

    def _lost(self, why: str) -> None:
        """The engine process is gone: every request in flight fails, every command waiting too."""
        with self._lock:
            stopping = self._stopping
            self._dead = why
            pending, self._pending = self._pending, {}
            futures, self._futures = self._futures, {}
        if not stopping:
            log.error("%s: %d requests in flight failed; the server answers 503 until restarted", why, len(pending))
        err = shutting_down(self._retry_after or 1) if stopping else ApiError(500, why, type_="server_error")
        for h in pending.values():
            h.done = True
        send_events([(h, err) for h in pending.values()])
        for fut in futures.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError(why))
