"""Stopping without failing requests silently: drain on the signal, then cut with an answer.

uvicorn alone, on SIGTERM/SIGINT, closes the listener at once (new clients: connection refused),
waits `timeout_graceful_shutdown` for the handlers, then cancels them (a plain-text 500, a stream
cut without `[DONE]`), and only then runs the app's lifespan shutdown, when no client is left to
tell. So the drain starts on the signal itself, before uvicorn's shutdown: `DrainingServer` runs
`drain` as soon as `should_exit` is set (by a signal or by an embedding caller), and only then lets
uvicorn go on. A second signal cuts at once.

The drain also tells the trainer, the registry watcher and the suffix tailer to stop (`ServerState.begin_stop`),
so that their own stop runs during the drain; the lifespan shutdown then waits for them, each for a bounded time
(`serving.wiring.TRAINER_STOP_S`), and flushes the feedback.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, NoReturn

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from .wiring import ServerState

log = logging.getLogger("dvi.serving")

HANDLER_GRACE_S = 5.0
"""After the cut, how long the handlers get to write their last bytes (the 503s, the SSE error events)."""


async def drain(state: ServerState, tasks: set[asyncio.Task], timeout_s: float,
                cut_now: Callable[[], bool] = lambda: False) -> tuple[int, int]:
    """Refuse new work, let what is in flight finish for up to `timeout_s`, then cut the rest (503 / SSE
    error event, logged "shutdown", counted on /metrics). `tasks`: the HTTP handlers still running.
    Returns (running, waiting) requests cut."""
    t0 = time.monotonic()
    state.draining = True
    state.scheduler.close(retry_after_s=max(timeout_s, 1.0))
    state.begin_stop()  # the trainer's own stop (last round, checkpoint, publish) overlaps the drain
    log.info("draining: %d running, %d waiting, %d handlers; up to %.1fs", state.scheduler.num_running(),
             state.scheduler.queue_depth(), len(tasks), timeout_s)
    deadline = t0 + timeout_s
    while (state.scheduler.busy() or tasks) and time.monotonic() < deadline and not cut_now():
        await asyncio.sleep(0.05)
    cut = (0, 0)
    if state.scheduler.busy():
        try:
            cut = await asyncio.wrap_future(state.scheduler.cut())
        except RuntimeError:  # the engine loop is gone: its own shutdown answers what it held
            log.exception("could not cut the remaining requests")
        for stage, n in zip(("running", "waiting"), cut, strict=True):
            state.metrics.observe_cut(stage, n)
    grace = time.monotonic() + HANDLER_GRACE_S
    while tasks and time.monotonic() < grace:
        await asyncio.sleep(0.05)
    log.info("drained in %.1fs: cut %d running and %d waiting request(s)", time.monotonic() - t0, *cut)
    return cut


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains the app's requests (`drain`) before its own shutdown starts, and exits
    normally (status 0) after a handled signal instead of re-raising it."""

    def __init__(self, config: uvicorn.Config, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self._drained = False
        self._signals = 0

    def handle_exit(self, sig: int, frame: Any) -> None:
        """First signal: drain. A second one: cut now (uvicorn's force exit on a second SIGINT stays)."""
        self._signals += 1
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.should_exit and not self._drained:
            self._drained = True
            state = getattr(self.config.app.state, "dvi", None) if hasattr(self.config.app, "state") else None
            if state is not None:
                await drain(state, self.server_state.tasks, self.drain_timeout_s, lambda: self._signals > 1)
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, without re-raising the signal at the end: a drained stop is a clean exit."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


THREAD_JOIN_S = 2.0
"""`exit_process`: how long non-daemon threads still running are waited for, in all."""


def exit_process(code: int) -> NoReturn:
    """End `dvi serve`'s process once its state is stopped (trainer, watcher, engine) and its feedback flushed,
    without the interpreter's teardown.

    That teardown is one full garbage collection per module-clearing pass over every object left (torch,
    transformers: ~470k objects here), 4-6 s after the last answer on the loaded 2-core machine (issue 42: a
    drained server that then took 11-15 s to exit). What a normal exit does before it still happens: non-daemon
    threads are joined (bounded: `THREAD_JOIN_S`), the atexit handlers run (logging's flush among them), stdio
    is flushed."""
    deadline = time.monotonic() + THREAD_JOIN_S
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("exiting with thread %s still running", t.name)
    try:
        getattr(atexit, "_run_exitfuncs", logging.shutdown)()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
