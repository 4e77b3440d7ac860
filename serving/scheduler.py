"""Continuous batching: one engine thread runs the engine's step loop for every request.

Requests join the running batch between steps (up to `max_batch_size` rows) and leave it the
moment they finish, so a short request never waits for a long one. Each step's new tokens are
handed to the request's asyncio queue at once (streaming), and a finished request resolves at
once. The engine has one front door: everything that changes it (new drafter, new target weights, other
replicas' outputs, a cut) is a typed command (`serving.engine_client`) the engine thread applies between steps
(`command`), and everything other threads read of it (/metrics, /health, /admin/status, the swapper) is the
`EngineSnapshot` the engine thread publishes after every step and command (`snapshot`, `serving.engine_client`). So
the engine, its proposer and its suffix cache are never touched by another thread (`dvi.decode.owner` checks
it when `$DVI_ENGINE_OWNER_CHECK=1`). A step's events reach the endpoints after its snapshot is published: a
client holding its answer never reads an older snapshot.

Failure isolation: an exception while adding one request fails only that request (a ValueError
from the engine is the client's fault -> 400); an exception inside `engine.step()` fails the
rows that were active in that step (500 for them, logged) and the loop keeps serving.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dvi.decode import owner
from dvi.engine.speculative import GenerationResult, Request, SamplingParams, StepOutput
from dvi.memory import HeapTrimmer

from .detok import TextStream
from .engine_client import (
    AddHistory,
    Command,
    CutAll,
    Engine,
    EngineSnapshot,
    SampleOutbox,
    SetAdapter,
    SetDrafter,
    UpdateTarget,
    take_snapshot,
)
from .finished import Ending, Finished, FinishedFeed, final_reason
from .handle import Delta, Event, Handle, new_handles, send_events
from .protocol import ApiError, shutting_down

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at `serve.queue_limit`; the app answers 429."""


def check_room(waiting: int, n: int, limit: int) -> None:
    """QueueFull unless `n` more choices fit beside `waiting` under `limit` (a request is queued whole or refused)."""
    if waiting + n > limit:
        raise QueueFull(f"queue is full ({limit} waiting requests)" if n == 1 else
                        f"queue has no room for {n} choices ({waiting} of {limit} waiting)")


class Scheduler:
    """Owns the engine thread; the app submits requests and awaits their events."""

    def __init__(self, engine: Engine, tokenizer: Any, max_batch_size: int, queue_limit: int,
                 num_threads: int = 1, heap: HeapTrimmer | None = None, eos_ids: Sequence[int] | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.queue_limit = queue_limit
        self.num_threads = num_threads
        self.heap = heap or HeapTrimmer(0)  # freed heap back to the OS (`dvi.memory`); off unless given
        self.finished = FinishedFeed()  # each request's final record, published once (`serving.finished`)
        self.step_observers: list[Callable[[float, int], None]] = []
        # where each iteration's events go once its snapshot is out: the endpoints' queues (None), or an engine
        # process's pipe to its server (`serving.engine_core`), called every iteration, events or not
        self.outbox: Callable[[list[tuple[Handle, Event]]], None] | None = None
        self._waiting: collections.deque[Handle] = collections.deque()
        self._active: dict[str, Handle] = {}
        self._controls: collections.deque[tuple[Command, concurrent.futures.Future]] = collections.deque()
        self._events: list[tuple[Handle, Event]] = []  # this iteration's, sent once its snapshot is out (`_publish`)
        self._cv = threading.Condition()
        self._stop = False
        self._retry_after: float | None = None  # set by `close`: new submits get a 503 with this Retry-After
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.busy_s = 0.0  # in engine.step(), failed steps included
        self.step_errors = 0
        self.request_errors = 0
        self.completed = 0
        self.last_step_at = time.time()
        # every id that ends a request: the model's eos ids and the tokenizer's (`ModelPair.stop_ids`), else the
        # tokenizer's alone
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids: tuple[int, ...] = (tuple(int(i) for i in eos_ids) if eos_ids
                                         else (int(eos),) if eos is not None else ())
        self.suffix_step_seconds = SampleOutbox()  # per-step samples, handed over once each (/metrics drains)
        self.snapshot: EngineSnapshot = self._take_snapshot(0)  # replaced (never changed) by the engine thread

    # -- public API (event loop side) --------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dvi-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pid(self) -> int:
        """The engine's process: this one (`serving.engine_process.EngineProcess` has its own)."""
        return os.getpid()

    @property
    def lost(self) -> str | None:
        """Why the engine is gone beyond a stopped loop (an engine process's death; never here)."""
        return None

    def queue_depth(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._active)

    def submit(self, prompt_ids: list[int], params: SamplingParams, domain: str = "default",
               stop: list[str] | None = None, stream: bool = False, client: str = "", group: str = "",
               arm: str = "learned") -> Handle:
        """Queue a request (call from the event loop); raises QueueFull at the queue limit."""
        return self.submit_choices([(prompt_ids, params)], domain, stop, stream, client, group, arm)[0]

    def submit_choices(self, choices: list[tuple[list[int], SamplingParams]], domain: str = "default",
                       stop: list[str] | None = None, stream: bool = False, client: str = "", group: str = "",
                       arm: str = "learned") -> list[Handle]:
        """Queue one request's choices (a prompt and its sampling each), whole or not at all (QueueFull where they
        do not all fit): each is a row of its own, and all put their events on one queue, tagged with the
        choice's number (`Handle.choice`)."""
        handles = new_handles(choices, domain, stop, stream, client, group, arm)
        self.enqueue(handles)
        return handles

    def enqueue(self, handles: list[Handle]) -> None:
        """Queue handles built elsewhere (an engine process's, `serving.engine_core`), whole or not at all."""
        with self._cv:
            if self._stop or self._retry_after is not None:
                raise shutting_down(self._retry_after or 1)
            check_room(len(self._waiting), len(handles), self.queue_limit)
            self._waiting.extend(handles)
            self._cv.notify_all()

    def close(self, retry_after_s: float) -> None:
        """Draining: refuse new requests (503, `Retry-After`); those submitted keep running."""
        with self._cv:
            self._retry_after = retry_after_s

    def busy(self) -> bool:
        """Requests running or waiting for a slot."""
        with self._cv:
            return bool(self._active or self._waiting)

    def cut(self) -> concurrent.futures.Future:
        """End every request now (between steps), each answered with the 503 and the running ones logged with
        finish_reason "shutdown"; the future holds (running, waiting) cut."""
        return self.command(CutAll())

    def cancel(self, handle: Handle) -> None:
        """The client went away: free its slot at the next step boundary."""
        with self._cv:
            if handle.done:
                return
            handle.cancelled = True
            self._cv.notify_all()

    def command(self, cmd: Command) -> concurrent.futures.Future:
        """Apply `cmd` (`serving.engine_client`) on the engine thread between two steps; the future holds its result and
        resolves after the snapshot that shows it is published."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stop or not self.alive:
                fut.set_exception(RuntimeError("engine loop is not running"))
                return fut
            self._controls.append((cmd, fut))
            self._cv.notify_all()
        return fut

    # -- engine thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self.num_threads)
        owner.claim(self.engine)  # debug runs: any other thread touching the engine now raises
        try:
            self._serve()
        finally:
            owner.release(self.engine)

    def _serve(self) -> None:
        while True:
            with self._cv:
                while (not self._stop and not self._controls and not self._waiting
                       and not self._active and not self.heap.idle_due()):
                    self._cv.wait(timeout=self.heap.wait_s(1.0))
                if self._stop:
                    break
                controls = list(self._controls)
                self._controls.clear()
                idle = not (controls or self._waiting or self._active)
            if idle and self.heap.idle_due():
                self.heap.trim()
            while controls:  # popped, never a loop variable: a command (a target update holds the whole state dict
                self._run(*controls.pop(0))  # it loaded, 513 MiB for SmolLM2 in fp32) must not outlive its run
            self._reap_cancelled()
            self._admit()
            if self._active:
                self._step()
                self.heap.after_step()
            self._publish()
        self._shutdown()
        self._publish()

    def _run(self, cmd: Command, fut: concurrent.futures.Future) -> None:
        """One between-step command; its snapshot is published before its future resolves."""
        if not fut.set_running_or_notify_cancel():
            return
        result, error = None, None
        try:
            result = self._apply(cmd)
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            error = exc
        owner.claim(self.engine)  # a swap may bring a new proposer: it is the engine thread's too
        self._publish()
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def _apply(self, cmd: Command) -> Any:
        if isinstance(cmd, SetDrafter):
            return self.engine.set_drafter(cmd.drafter, cmd.version)
        if isinstance(cmd, SetAdapter):
            return self.engine.set_adapter(cmd.group, cmd.factors, cmd.version)
        if isinstance(cmd, UpdateTarget):
            return self.engine.update_target_weights(cmd.weights, cmd.version, complete=cmd.complete)
        if isinstance(cmd, AddHistory):
            for seq_id, tokens in cmd.items:
                self.engine.add_history(seq_id, list(tokens))
            return len(cmd.items)
        if isinstance(cmd, CutAll):
            return self._cut()
        raise TypeError(f"not an engine command: {cmd!r}")

    def _take_snapshot(self, seq: int) -> EngineSnapshot:
        with self._cv:
            queue = len(self._waiting)
        return take_snapshot(self.engine, seq, heap=self.heap.status(), queue=queue, running=len(self._active),
                             steps=self.steps,
                             busy_seconds=self.busy_s, completed=self.completed, step_errors=self.step_errors,
                             request_errors=self.request_errors)

    def _publish(self) -> None:
        """Engine thread: the step timings handed over, a new snapshot published (one reference assignment), then
        the events held since the last one sent."""
        try:
            self.suffix_step_seconds.put(self.engine.take_suffix_step_seconds())
            self.snapshot = self._take_snapshot(self.snapshot.seq + 1)
        except Exception:  # noqa: BLE001 - a stale snapshot costs a scrape's freshness, never a request
            log.exception("engine snapshot failed")
        events, self._events = self._events, []
        if self.outbox is not None:
            self.outbox(events)
        elif events:
            send_events(events)

    def _send(self, h: Handle, ev: Event) -> None:
        """Engine thread: `ev` goes to `h`'s endpoint once this iteration's snapshot is published."""
        self._events.append((h, ev))

    def _admit(self) -> None:
        while len(self._active) < self.max_batch_size:
            with self._cv:
                if not self._waiting:
                    return
                h = self._waiting.popleft()
            if h.cancelled:
                self._finish_cancelled(h)
                continue
            try:
                self.engine.add_request(Request(request_id=h.request_id, prompt_ids=h.prompt_ids,
                                                params=h.params, domain=h.domain,
                                                group=h.group if h.arm == "learned" else "", cohort=h.cohort))
            except ValueError as exc:  # the client's input; InvalidParam names the field
                self._fail(h, ApiError(400, str(exc), param=getattr(exc, "param", "prompt")))
                continue
            except Exception as exc:  # noqa: BLE001 - one request must not kill the loop
                log.exception("engine.add_request failed for %s", h.request_id)
                self._fail(h, ApiError(500, f"engine error: {exc}", type_="server_error"))
                continue
            h.added = True
            self._active[h.request_id] = h

    def _reap_cancelled(self) -> None:
        for h in [h for h in self._active.values() if h.cancelled]:
            result = self._abort(h)
            self._active.pop(h.request_id, None)
            self._complete(h, result, "cancelled", notify=False)

    def _abort(self, h: Handle) -> GenerationResult | None:
        try:
            return self.engine.abort(h.request_id)
        except Exception:  # noqa: BLE001
            log.exception("engine.abort failed for %s", h.request_id)
            return None

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the rows of this step, keep serving
            self.busy_s += time.perf_counter() - t0
            self.step_errors += 1
            log.exception("engine.step failed; failing %d active request(s)", len(self._active))
            for h in list(self._active.values()):
                self._abort(h)
                self._active.pop(h.request_id, None)
                self._fail(h, ApiError(500, f"engine error: {exc}", type_="server_error"))
            return
        dt = time.perf_counter() - t0
        self.busy_s += dt
        self.steps += 1
        self.last_step_at = time.time()
        ntok = 0
        for out in outs:
            h = self._active.get(out.request_id)
            if h is None:
                continue
            if out.error is not None:  # a remote engine failed this request alone
                self._active.pop(h.request_id, None)
                self._fail(h, ApiError(502, f"engine error: {out.error}", type_="server_error"))
                continue
            try:
                ntok += len(out.new_token_ids)
                self._on_tokens(h, out)
            except Exception as exc:  # noqa: BLE001
                log.exception("post-processing failed for %s", h.request_id)
                if not out.finished:
                    self._abort(h)
                self._active.pop(h.request_id, None)
                self._fail(h, ApiError(500, f"server error: {exc}", type_="server_error"))
        for obs in self.step_observers:
            try:
                obs(dt, ntok)
            except Exception:  # noqa: BLE001
                log.exception("step observer failed")

    def _on_tokens(self, h: Handle, out: StepOutput) -> None:
        new = out.new_token_ids
        if new and h.first_token_at is None:
            h.first_token_at = time.perf_counter()
        h.token_ids.extend(new)
        finished = out.finished
        result = out.result if finished else None
        ending: Ending = "engine"
        if h.stop or h.stream:
            if h.detok is None:
                h.detok = TextStream(self.tokenizer)
            h.detok.add(new)
            h.text = h.detok.final_text() if finished else h.detok.text
            if h.stop:
                cut = self._find_stop(h)
                if cut is not None:
                    h.text = h.text[:cut]
                    if not finished:
                        result = self._abort(h)
                    finished, ending = True, "stop_string"
            if h.stream:
                safe = len(h.text) if finished else self._safe_len(h)
                if safe > h.sent_chars:
                    self._send(h, Delta(h.text[h.sent_chars:safe]))
                    h.sent_chars = safe
        if finished:
            self._active.pop(h.request_id, None)
            if not (h.stop or h.stream):
                h.text = self._decode(h.token_ids)
            self._complete(h, result, ending)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _find_stop(self, h: Handle) -> int | None:
        """First stop-string hit in the text not searched yet (plus an overlap for a hit across steps)."""
        longest = max(len(s) for s in h.stop)
        start = max(0, h.stop_scanned - longest + 1)
        h.stop_scanned = len(h.text)
        hits = [i for i in (h.text.find(s, start) for s in h.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_len(self, h: Handle) -> int:
        """Chars that can be streamed: not a partial UTF-8 char, not a possible stop prefix."""
        n = len(h.text)
        while n > h.sent_chars and h.text[n - 1] == "\ufffd":
            n -= 1
        for s in h.stop:
            for k in range(min(len(s) - 1, n), 0, -1):
                if h.text[n - k:n] == s[:k]:
                    n -= k
                    break
        return max(n, h.sent_chars)

    def _complete(self, h: Handle, result: GenerationResult | None, ending: Ending, notify: bool = True) -> None:
        """The request's one final record: its finish reason decided (`final_reason`, also written onto the
        result), sent to its endpoint (unless `notify` is off: a cut answers with an error), then published
        once to the subscribers (telemetry, feedback log, swapper: `serving.wiring`)."""
        reason = final_reason(ending, result.finish_reason if result is not None else None)
        if result is not None:
            result.finish_reason = reason
        now = time.perf_counter()
        fin = Finished(
            request_id=h.request_id, text=h.text, token_ids=list(h.token_ids), prompt_len=len(h.prompt_ids),
            finish_reason=reason, domain=h.domain, result=result, latency_s=now - h.submitted_at,
            ttft_s=(h.first_token_at - h.submitted_at) if h.first_token_at is not None else None,
            client=h.client, transformed=h.params.transforms_logits(), group=h.group, arm=h.arm,
        )
        h.done = True
        self.completed += 1
        if notify:
            self._send(h, fin)
        self.finished.publish(fin)

    def _finish_cancelled(self, h: Handle) -> None:
        h.done = True

    def _fail(self, h: Handle, err: ApiError) -> None:
        h.done = True
        self.request_errors += 1
        self._send(h, err)

    def _cut(self) -> tuple[int, int]:
        running = list(self._active.values())
        for h in running:
            result = self._abort(h)
            self._active.pop(h.request_id, None)
            self._complete(h, result, "cut", notify=False)  # the record and metrics: what was cut
            self._send(h, shutting_down(self._retry_after or 1))
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
        for h in waiting:
            h.done = True
            self._send(h, shutting_down(self._retry_after or 1))
        return len(running), len(waiting)

    def _shutdown(self) -> None:
        for h in list(self._active.values()):
            self._abort(h)
            self._fail(h, shutting_down(self._retry_after or 1))
        self._active.clear()
        with self._cv:
            waiting = list(self._waiting)
            self._waiting.clear()
            controls = list(self._controls)
            self._controls.clear()
        for h in waiting:
            self._fail(h, shutting_down(self._retry_after or 1))
        for _cmd, fut in controls:
            fut.cancel()
