"""One request's choice as the server holds it (`Handle`: the endpoint's queue, the engine thread's state of it) and
the events that reach its endpoint (`Delta`s as text streams, then one `Finished` or one `ApiError`), handed over by
the engine thread once its iteration's snapshot is out (`serving.scheduler`), each as (choice, event): a request's
choices share one queue."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from dvi.engine.speculative import SamplingParams

from .detok import TextStream
from .finished import Finished
from .protocol import ApiError, new_id

__all__ = ["Delta", "Event", "Handle", "new_handles", "send_events"]


@dataclass(frozen=True)
class Delta:
    """New text of a streaming request (after stop-string holdback)."""

    text: str


Event = Delta | Finished | ApiError
"""What a request's queue carries to its endpoint: text as it streams, then one `Finished` or one `ApiError`."""


@dataclass
class Handle:
    """One choice's state (a request of n choices has n): shared between the event loop (queue) and the engine
    thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str
    stop: list[str]
    stream: bool
    loop: asyncio.AbstractEventLoop
    client: str = ""
    group: str = ""  # the traffic group whose drafter adapter drafts for it (trainer.adapter_key)
    arm: str = "learned"  # "control": the frozen base drafts for it, not its group's adapter (`serving.control`)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # (choice, Event), shared by the request's choices
    choice: int = 0  # its index among the request's choices
    cohort: str = ""  # a request of several choices: its first choice's id, shared (they join the batch together)
    submitted_at: float = field(default_factory=time.perf_counter)
    # engine-thread state
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    stop_scanned: int = 0  # chars of `text` already searched for stop strings
    detok: TextStream | None = None
    first_token_at: float | None = None
    added: bool = False
    done: bool = False
    cancelled: bool = False


def new_handles(choices: list[tuple[list[int], SamplingParams]], domain: str, stop: list[str] | None, stream: bool,
                client: str, group: str, arm: str) -> list[Handle]:
    """One request's choices (a prompt and its sampling each) as handles on one queue of the running event loop: a
    request of several choices is one cohort, its rows joining the batch in one step (`Request.cohort`)."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    rids = [new_id("req") for _ in choices]
    cohort = rids[0] if len(rids) > 1 else ""
    return [Handle(request_id=rid, prompt_ids=list(ids), params=params, domain=domain, stop=list(stop or []),
                   stream=stream, loop=loop, client=client, group=group, arm=arm, queue=queue, choice=i, cohort=cohort)
            for i, (rid, (ids, params)) in enumerate(zip(rids, choices, strict=True))]


def send_events(events: list[tuple[Handle, Event]]) -> None:
    """Engine thread: hand an iteration's events to their requests' queues, one wake-up of each event loop for all
    of them (not one per row: each is a write to the loop's self-pipe and a turn of the loop, taken while the engine
    thread waits for the GIL), each request's events in their order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Handle, Event]]] = {}
    for h, ev in events:
        by_loop.setdefault(h.loop, []).append((h, ev))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # loop closed: its clients are gone
            pass


def _put_all(batch: list[tuple[Handle, Event]]) -> None:
    for h, ev in batch:
        h.queue.put_nowait((h.choice, ev))
