"""The engine's own process (`serve.engine_process`): dvi's engine and its scheduler loop, alone with one pipe to the
server (`serving.engine_process.EngineProcess`, the server's side of it).

Why a process: in the server's process the engine thread shares one interpreter lock with the event loop, the
feedback writer and the drafter thread; every kernel drops the lock and the engine waits to take it back, and a
drafting step (host work between small kernels) waits most. Here the engine thread competes with nothing but this
process's pipe reader, which wakes once per submit, cancel or command (vLLM's EngineCore split, for the same reason).

The scheduler runs unchanged (`serving.scheduler.Scheduler`): stop strings, detokenising and finish reasons are
decided here as in one process. What crosses the pipe, each message pickled whole:

- in: `("submit", [spec, ...])` one request's choices, `("cancel", request_id)`, `("close", retry_after_s)`,
  `("command", id, cmd)` (`serving.engine_client`: a drafter, adapter factors or target weights travel by value),
  `("stop",)`;
- out: `("ready", info)` or `("failed", reason)` once; then after every scheduler iteration `("batch", snapshot,
  events, finished, steps, suffix_seconds)`: its published snapshot, its events by request id, the final records
  published (`FinishedFeed`, for the server's subscribers), each step's (seconds, tokens) and the suffix lookups'
  host seconds; and `("done", id, ok, result)` per command, after the batch whose snapshot shows it.

The process ignores SIGINT and SIGTERM (the server drains, then sends "stop") and ends when its pipe closes: a server
killed outright leaves no engine behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch

from .finished import Finished
from .handle import Handle

log = logging.getLogger("dvi.engine")

SPEC_FIELDS = ("request_id", "prompt_ids", "params", "domain", "stop", "stream", "client", "group", "arm", "choice",
               "cohort", "submitted_at")
"""What of a `Handle` crosses the pipe with "submit" (the rest is the engine thread's state of it)."""


PRUNE_AT = 1024
"""Handles this process holds before the ended ones are dropped (a cancelled waiting request sends no event)."""


def handle_spec(h: Handle) -> tuple:
    return tuple(getattr(h, f) for f in SPEC_FIELDS)


class Pipe:
    """One end of the server-engine pipe: whole messages pickled by value (tensors too: no shared-memory handles to
    leak), sends serialised by a lock (the engine thread and the reader both send)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple:
        return pickle.loads(self.conn.recv_bytes())


class EngineCore:
    """The engine process's side: applies the server's messages to its scheduler and sends what the scheduler
    publishes."""

    def __init__(self, scheduler: Any, pipe: Pipe) -> None:
        self.scheduler = scheduler
        self.pipe = pipe
        self.handles: dict[str, Handle] = {}
        self._finished: list[Finished] = []
        self._steps: list[tuple[float, int]] = []
        scheduler.outbox = self._outbox
        scheduler.finished.subscribe(self._finished.append)
        scheduler.step_observers.append(lambda dt, n: self._steps.append((dt, n)))

    def _outbox(self, events: list) -> None:
        """Engine thread, after every iteration: its snapshot, events, final records and step timings, one message."""
        fins, self._finished[:] = list(self._finished), []
        steps, self._steps[:] = list(self._steps), []
        out = [(h.request_id, ev) for h, ev in events]
        self._send(("batch", self.scheduler.snapshot, out, fins, steps, self.scheduler.suffix_step_seconds.drain()))

    def _send(self, msg: tuple) -> None:
        """To the server; a server gone (its end of the pipe closed) is not the engine's error: its main thread
        sees the pipe's end and stops the loop."""
        try:
            self.pipe.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def serve(self) -> None:
        """The process's main thread: the server's messages until "stop" or the pipe's end."""
        while True:
            try:
                msg = self.pipe.recv()
            except (EOFError, OSError):
                log.warning("the server's pipe closed; the engine stops")
                break
            if msg[0] == "stop":
                break
            try:
                self._apply(msg)
            except Exception:  # noqa: BLE001 - one bad message must not end the engine
                log.exception("engine message %r failed", msg[0])
        self.scheduler.stop()

    def _apply(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            self._submit(msg[1])
        elif kind == "cancel":
            h = self.handles.get(msg[1])
            if h is not None:
                self.scheduler.cancel(h)
        elif kind == "close":
            self.scheduler.close(msg[1])
        elif kind == "command":
            cid = msg[1]
            self.scheduler.command(msg[2]).add_done_callback(lambda fut: self._done(cid, fut))
        else:
            raise ValueError(f"not an engine message: {kind!r}")

    def _submit(self, specs: list[tuple]) -> None:
        handles = [Handle(**dict(zip(SPEC_FIELDS, spec, strict=True)), loop=None, queue=None) for spec in specs]
        if len(self.handles) > PRUNE_AT:  # ended handles (answered, cancelled, cut) leave in bulk, on this thread
            self.handles = {rid: h for rid, h in self.handles.items() if not h.done}
        for h in handles:
            self.handles[h.request_id] = h
        try:
            self.scheduler.enqueue(handles)
        except Exception as exc:  # noqa: BLE001 - QueueFull or a draining scheduler's 503: the request's answer
            for h in handles:
                self.handles.pop(h.request_id, None)
            self._send(("refused", [h.request_id for h in handles], exc))

    def _done(self, cid: int, fut: Any) -> None:
        try:
            ok, value = True, fut.result()
        except BaseException as exc:  # noqa: BLE001 - the command's own failure, the server's future raises it
            ok, value = False, exc
        try:
            self.pipe.send(("done", cid, ok, value))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle still resolves the command
            self._send(("done", cid, False, RuntimeError(f"command result not sendable: {exc!r}")))


def main(cfg: Any, conn: Any, log_level: int) -> None:
    """The engine process: build the engine as a server would, report ready, serve the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pipe = Pipe(conn)
    try:
        scheduler, info = build_engine_side(cfg)
    except BaseException as exc:  # noqa: BLE001 - the server reports it and does not start
        log.exception("the engine process could not start")
        pipe.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    core = EngineCore(scheduler, pipe)
    from dvi.memory import freeze_long_lived

    freeze_long_lived()
    scheduler.start()
    pipe.send(("ready", info | {"snapshot": scheduler.snapshot}))
    core.serve()


def build_engine_side(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """The engine and its scheduler as a one-process server builds them (`serving.engine_build`), and what the server
    needs to know of them."""
    from dvi.memory import cap_onednn_cache
    from dvi.rundir import RunDir

    from .engine_build import local_scheduler
    from .loading import load_serving_pair

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.serve.num_threads)
    cap_onednn_cache(cfg.serve.onednn_primitive_cache)
    scheduler = local_scheduler(cfg, load_serving_pair(cfg), RunDir.of(cfg))
    engine = scheduler.engine
    log.info("engine process %d ready in %.1fs", os.getpid(), time.perf_counter() - t0)
    return scheduler, {"eos_ids": scheduler.eos_ids, "uses_history": bool(engine.proposer.uses_history),
                       "pid": os.getpid()}
