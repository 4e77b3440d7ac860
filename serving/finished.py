"""A request's one final record (`Finished`), its finish reason decided in one place, published once.

Every consumer of a finished request reads the same record: the endpoint answers from it, and the
subscribers of `FinishedFeed` (the telemetry, the feedback log, the swapper: `serving.wiring`) each get it
once, on the engine thread. Its feedback projection (`FeedbackRecord.from_result`) is built on first use and
shared, so the feedback log writes the record the swapper keeps. `final_reason` is the only place a finish
reason is decided: the engine says why a row ended ("stop": a stop token, "length": its budget), and the
server's own endings (a stop string, a client gone, a drain cut) override it; the result carries that same
reason, so the response, /metrics, the stored record and the swapper never disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dvi.decode.results import GenerationResult
from dvi.feedback import FeedbackRecord
from dvi.metrics.uplift import decode_rate

log = logging.getLogger(__name__)

Ending = Literal["engine", "stop_string", "cancelled", "cut"]
"""Who ended a request: the engine (a stop token or the token budget), or the server (a stop string matched,
the client went away, a shutdown cut it after the drain window)."""

_SERVER_ENDINGS = {"stop_string": "stop", "cancelled": "abort", "cut": "shutdown"}


def final_reason(ending: Ending, engine_reason: str | None) -> str:
    """The finish_reason a request ends with, everywhere: "stop", "length", "abort" or "shutdown"."""
    return _SERVER_ENDINGS.get(ending) or engine_reason or "length"


@dataclass
class Finished:
    """What a request ends with: the engine's `GenerationResult` plus what only the server knows (the
    text after stop strings, the reason it ended, latency measured from submission)."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_len: int
    finish_reason: str
    domain: str
    result: GenerationResult | None  # None when the engine gave none (the request never reached it)
    latency_s: float
    ttft_s: float | None
    client: str = ""  # the request's client (`dvi.feedback.heldout.client_key` of its `user`)
    transformed: bool = False  # served under a logit_bias or penalty (`SamplingParams.transforms_logits`)
    group: str = ""  # its traffic group (trainer.adapter_key; "": none)
    arm: str = "learned"  # "control": drafted by the frozen base instead of the group's adapter (`serving.control`)
    _record: FeedbackRecord | None = field(default=None, init=False, repr=False, compare=False)

    def feedback_record(self) -> FeedbackRecord | None:
        """The stored projection of the result, built once for every subscriber; None without a result."""
        if self.result is not None and self._record is None:
            self._record = FeedbackRecord.from_result(self.result)
            self._record.client, self._record.transformed = self.client, self.transformed
            self._record.arm = self.arm if self.group else ""
        return self._record

    def stats(self) -> dict[str, Any]:
        """The response's `dvi` block (α and mean accepted length None when there is no data). `request_id` is
        the request's feedback record's: a client (the demo) can replay its own responses from the log."""
        r = self.result or GenerationResult(request_id=self.request_id, prompt_ids=[])
        return {
            "request_id": self.request_id,
            "drafted": r.num_drafted,
            "accepted": r.num_accepted,
            "alpha": r.alpha,
            "mean_accepted_length": r.mean_accepted_length,
            "steps": r.num_steps,
            "accepted_per_position": list(r.accepted_per_position),
            "drafted_per_position": list(r.drafted_per_position),
            "accepted_by_rank": list(r.accepted_by_rank),  # a draft tree's: 0 the chain's drafts, 1-3 siblings
            "drafter_version": r.drafter_version,
            "adapter_version": r.adapter_version,
            "target_version": r.target_version,
            "domain": self.domain,
            "arm": self.arm if self.group else None,  # a traffic group's learned or control arm (`serving.control`)
            "decode_tokens_per_s": decode_rate(len(self.token_ids), self.latency_s, self.ttft_s),
        }


class FinishedFeed:
    """Publishes each final record once to every subscriber, in subscription order; a failing subscriber is
    logged and never costs the request or the other subscribers."""

    def __init__(self) -> None:
        self._subscribers: list[Callable[[Finished], None]] = []

    def subscribe(self, fn: Callable[[Finished], None]) -> None:
        self._subscribers.append(fn)

    def publish(self, fin: Finished) -> None:
        for fn in self._subscribers:
            try:
                fn(fin)
            except Exception:  # noqa: BLE001
                log.exception("finished-request subscriber %r failed for %s", fn, fin.request_id)
