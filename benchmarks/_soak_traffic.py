"""The long soak's traffic (`benchmarks/soak.py --minutes`): phases that drift the code / chat / sql mix and the
concurrency, and the clients, whose requests are answered whole, streamed, cut mid-stream or abandoned.

A phase is `--drift-minutes` long; its mix and concurrency move in lockstep through `MIXES` and `--concurrencies`,
so the schedule repeats every `len(MIXES)` phases and a run of twice that period has the same traffic shape in its
second and last quarter (what the quarter checks compare). Each phase starts on time: its clients start while the
last requests of the phase before are still answered. Every request is one row: when it was sent and ended,
its phase, domain and mode (its row's "kind"), what the client saw (status, outcome, latency, time to the first streamed token, the
`dvi` block's request id, tokens, drafted / accepted, finish reason).

Modes: ``plain`` (answered whole), ``stream`` (SSE to the end), ``cut`` (SSE closed after 1-4 content chunks),
``abandon`` (closed before any content: after the response headers or a short timer). Outcomes: ``answered``
(the final record reached the client), ``cut`` / ``abandoned`` (the client closed first; a ``cut`` that ended
before its cut point is ``answered``), ``http_4xx`` / ``http_5xx`` (an error status or an SSE error event; the
status is the row's), ``error`` (the transport failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

DOMAINS = ("code", "chat", "sql")
# each phase's traffic mix, in turn: code-heavy, chat-heavy, sql-heavy (each domain keeps a minority share, so α per
# group is measured in every phase)
MIXES = ({"code": 6, "chat": 2, "sql": 2}, {"code": 2, "chat": 6, "sql": 2}, {"code": 2, "chat": 2, "sql": 6})
MIX_NAMES = ("code-heavy", "chat-heavy", "sql-heavy")
MODES = ("plain", "stream", "cut", "abandon")


@dataclass(frozen=True)
class Phase:
    index: int
    start_s: float  # from the start of traffic
    end_s: float
    mix: dict[str, float]
    concurrency: int

    @property
    def shape(self) -> str:
        """The traffic shape (mix and concurrency); phases of one shape carry the same load."""
        return f"{MIX_NAMES[self.index % len(MIXES)]}@c{self.concurrency}"


def schedule(minutes: float, drift_minutes: float, concurrencies: tuple[int, ...]) -> list[Phase]:
    """The run's phases: `drift_minutes` each (the last one cut at `minutes`), mix and concurrency in lockstep."""
    total, step = minutes * 60.0, drift_minutes * 60.0
    phases, i = [], 0
    while i * step < total - 1e-9:
        phases.append(Phase(i, i * step, min(total, (i + 1) * step), dict(MIXES[i % len(MIXES)]),
                            concurrencies[i % len(concurrencies)]))
        i += 1
    return phases


def event_times(minutes: float, every_minutes: float | None) -> list[float]:
    """Seconds from the start at which a periodic event (target update, trainer kill) falls, before the end."""
    if not every_minutes or every_minutes <= 0:
        return []
    n = int((minutes - 1e-9) // every_minutes)
    return [k * every_minutes * 60.0 for k in range(1, n + 1)]


def domain_streams(tok: Any, prompt_tokens: int, seed: int) -> dict[str, Any]:
    """Endless held-out requests per domain: code prompts (token ids), chat and sql messages (rendered within
    `prompt_tokens`)."""
    from dvi.data import chat_instructions, prompt_stream, render_chat, sql_instructions

    def fits(stream: Any) -> Any:
        return (m for m in stream if len(render_chat(tok, m)) <= prompt_tokens)

    return {"code": prompt_stream("code", tok, split="heldout", prompt_tokens=(32, 96), seed=seed),
            "chat": fits(chat_instructions("heldout", seed=seed)),
            "sql": fits(sql_instructions("heldout", seed=seed))}


def request_body(domain: str, item: list, max_tokens: int, stream: bool) -> tuple[str, dict]:
    """(path, body) of one greedy request: code as a completion over token ids, chat and sql as chats."""
    chat = domain != "code"
    body = {"messages" if chat else "prompt": item, "max_tokens": max_tokens, "temperature": 0.0,
            "metadata": {"domain": domain}, "stream": stream}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _outcome_of_status(status: int) -> str:
    return "http_5xx" if status >= 500 else "http_4xx"


def _final(row: dict, obj: dict) -> None:
    """Fill `row` from a response's usage and `dvi` block (the final record, as the client got it)."""
    d = obj.get("dvi") or {}
    row.update(outcome="answered", request_id=d.get("request_id"), drafted=d.get("drafted") or 0,
               accepted=d.get("accepted") or 0, drafter_version=d.get("drafter_version"),
               target_version=d.get("target_version"),
               tokens=(obj.get("usage") or {}).get("completion_tokens", 0),
               finish_reason=(obj.get("choices") or [{}])[0].get("finish_reason"))


async def _plain(client: Any, path: str, body: dict, row: dict) -> None:
    r = await client.post(path, json=body)
    row["status"] = r.status_code
    if r.status_code != 200:
        row.update(outcome=_outcome_of_status(r.status_code), error=r.text[:200])
        return
    _final(row, r.json())


def _content(obj: dict) -> str:
    c = (obj.get("choices") or [{}])[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def _read_stream(r: Any, row: dict, cut_after: int | None, t0: float) -> None:
    """Read SSE events: content chunks counted (the first one's time is the TTFT), the final chunk's record kept;
    return early (closing the stream) once `cut_after` content chunks arrived."""
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if "error" in obj:  # an SSE error event (no status of its own): a server_error counts as a 5xx
            status = 500 if (obj["error"] or {}).get("type") == "server_error" else 400
            row.update(sse_error=True, status=status, outcome=_outcome_of_status(status), error=str(obj["error"])[:200])
            return
        if _content(obj):
            row["chunks"] = row.get("chunks", 0) + 1
            if row.get("ttft") is None:
                row["ttft"] = time.perf_counter() - t0
        if "dvi" in obj:
            _final(row, obj)
            return
        if cut_after is not None and row.get("chunks", 0) >= cut_after:
            row["outcome"] = "cut"
            return


async def _streamed(client: Any, path: str, body: dict, row: dict, cut_after: int | None, t0: float) -> None:
    async with client.stream("POST", path, json=body) as r:
        row["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            row.update(outcome=_outcome_of_status(r.status_code), error=r.text[:200])
            return
        await _read_stream(r, row, cut_after, t0)
        if row.get("outcome") is None:
            row.update(outcome="error", error="the stream ended without its final record")


async def _abandoned(client: Any, path: str, body: dict, row: dict, delay: float) -> None:
    """Send a streamed request and close it before reading any content: at its response headers or after
    `delay` seconds, whichever comes first."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay), client.stream("POST", path, json=body) as r:
            row["status"] = r.status_code
    row["outcome"] = "abandoned" if row.get("status") in (None, 200) else _outcome_of_status(row["status"])


@dataclass
class Shares:
    """How a request is sent: the share streamed (to its end), cut mid-stream, abandoned; the rest plain."""

    stream: float = 0.3
    cut: float = 0.05
    abandon: float = 0.05

    def draw(self, rng: random.Random) -> str:
        x = rng.random()
        for mode, share in (("cut", self.cut), ("abandon", self.abandon), ("stream", self.stream)):
            if x < share:
                return mode
            x -= share
        return "plain"


async def send_one(client: Any, domain: str, item: list, mode: str, max_tokens: int, rng: random.Random) -> dict:
    """One request sent in `mode` (`MODES`); its row (see the module docstring)."""
    import httpx

    path, body = request_body(domain, item, max_tokens, stream=mode != "plain")
    row: dict[str, Any] = {"domain": domain, "kind": mode, "t0": time.time(), "status": None, "outcome": None,
                           "ttft": None}
    t0 = time.perf_counter()
    try:
        if mode == "plain":
            await _plain(client, path, body, row)
        elif mode == "abandon":
            await _abandoned(client, path, body, row, rng.uniform(0.02, 0.3))
        else:
            await _streamed(client, path, body, row, rng.randint(1, 4) if mode == "cut" else None, t0)
    except (httpx.HTTPError, OSError, ValueError) as e:
        row.update(outcome="error", error=f"{type(e).__name__}: {e}"[:200])
    row["latency"] = time.perf_counter() - t0
    row["t1"] = time.time()
    return row


@dataclass
class Traffic:
    """The client side of a soak: the domain streams, the send shares, every request's row (in completion order)."""

    streams: dict[str, Any]
    shares: Shares
    max_tokens: int
    seed: int
    rows: list[dict]

    async def run_phase(self, client: Any, phase: Phase, t_start: float, stop: asyncio.Event) -> None:
        """`phase.concurrency` clients, each sending one request after another until the phase ends (or `stop`);
        requests in flight at the end are answered, not cut."""
        end = t_start + phase.end_s
        doms = [d for d in DOMAINS if phase.mix.get(d, 0) > 0]
        weights = [phase.mix[d] for d in doms]

        async def worker(w: int) -> None:
            rng = random.Random(f"soak/{self.seed}/{phase.index}/{w}")
            while time.monotonic() < end and not stop.is_set():
                dom = rng.choices(doms, weights=weights)[0]
                row = await send_one(client, dom, next(self.streams[dom]), self.shares.draw(rng),
                                     self.max_tokens, rng)
                self.rows.append({**row, "phase": phase.index, "shape": phase.shape})

        await asyncio.gather(*(worker(w) for w in range(phase.concurrency)))

    async def run(self, url: str, phases: list[Phase], t_start: float, stop: asyncio.Event) -> None:
        """Every phase from its scheduled time (the last requests of the phase before it still in flight: clients
        do not wait for each other), until the last one's requests end."""
        import httpx

        async def at_start(client: Any, phase: Phase) -> None:
            await asyncio.sleep(max(0.0, t_start + phase.start_s - time.monotonic()))
            await self.run_phase(client, phase, t_start, stop)

        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            await asyncio.gather(*(at_start(client, p) for p in phases))
