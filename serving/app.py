"""The OpenAI-compatible HTTP server: FastAPI app, server state, and `run_server`.

One process holds the models, one engine thread (`serving.scheduler`), the registry watcher
(`serving.swap`), the trainer supervisor (`serving.supervisor`) and the feedback writer. Every
request error is a 4xx with an OpenAI-style error body that names the field; a 500 only means a
bug or an engine failure, and it fails one request, never the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from dvi.adaptive import batch_bucket
from dvi.config import DviConfig
from dvi.engine import SamplingParams, SpeculativeEngine
from dvi.feedback import FeedbackWriter
from dvi.registry import DrafterRegistry

from .logprobs import chat_logprobs, completion_logprobs, token_logprobs
from .protocol import (
    FALLBACK_CHAT_FORMAT,
    FALLBACK_CHAT_SUFFIX,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    RequestLimits,
    error_body,
    limits_context,
    new_id,
    now,
)
from .scheduler import Finished, Handle, QueueFull, Scheduler
from .supervisor import TrainerSupervisor
from .swap import DrafterSwapper, SwapEvent
from .telemetry import ServerMetrics

log = logging.getLogger("dvi.serving")

DISCONNECT_POLL_S = 0.25


# -- models --------------------------------------------------------------------------------------
def pair_paths(cfg: DviConfig) -> tuple[Path, Path | None, Path | None]:
    """(target, drafter, tokenizer) paths: the config's, else the embedded preset's."""
    from dvi.embedded import embedded_paths

    m = cfg.models
    if m.target is not None:
        return Path(m.target), (Path(m.drafter) if m.drafter else None), (Path(m.tokenizer) if m.tokenizer else None)
    p = embedded_paths(m.preset)
    return p.target, (Path(m.drafter) if m.drafter else p.drafter), (Path(m.tokenizer) if m.tokenizer else p.tokenizer)


def ensure_pair(cfg: DviConfig) -> None:
    """Bootstrap the embedded pair in a subprocess if the config uses it and it is not built.

    A subprocess, because serving must not import trainers (DESIGN.md import arrows).
    """
    from dvi.embedded import embedded_dir, is_built

    if cfg.models.target is not None:
        return
    preset = cfg.models.preset
    if is_built(embedded_dir(preset), preset):
        return
    log.warning("embedded pair %r not built; running `dvi bootstrap --preset %s`", preset, preset)
    subprocess.run([sys.executable, "-m", "dvi.cli", "bootstrap", "--preset", preset], check=True)


def load_serving_pair(cfg: DviConfig) -> Any:
    """The `ModelPair` to serve; its drafter is of `models.drafter_kind`.

    separate: the drafter dir's HF model (reduced head if it has a draft vocabulary);
    early_exit: an `EarlyExitDrafter` on the loaded target (`dvi.models.load_early_exit_drafter`, the
    same one the online trainer builds, so its published versions fit).
    """
    from dvi.models import draft_vocab_size_for, load_early_exit_drafter, load_pair, serving_dtype

    m = cfg.models
    target_path, drafter_path, tok_path = pair_paths(cfg)
    early = m.drafter_kind == "early_exit"
    dtype = m.dtype if m.target is not None else serving_dtype(m.preset, m.dtype, m.device)
    pair = load_pair(target_path, None if early else drafter_path, tok_path, device=m.device, dtype=dtype,
                     draft_vocab_size=draft_vocab_size_for(m), draft_vocab=m.draft_vocab)
    if early:
        pair.drafter = load_early_exit_drafter(pair.target, target_path, cfg)
    return pair


# -- state -----------------------------------------------------------------------------------------
@dataclass
class ServerState:
    """Everything the endpoints need; built once per server."""

    cfg: DviConfig
    tokenizer: Any
    engine: Any
    scheduler: Scheduler
    swapper: DrafterSwapper | None
    supervisor: TrainerSupervisor
    feedback: FeedbackWriter | None
    metrics: ServerMetrics
    model_name: str
    context_len: int
    vocab_size: int
    started_at: float = field(default_factory=time.time)
    target_version: int = 0
    stopped: bool = False
    # one worker: tokenising a long prompt must not block the event loop (/health included), and
    # HF fast tokenizers are not meant for concurrent encodes
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dvi-tokenize"))

    @property
    def limits(self) -> RequestLimits:
        sv = self.cfg.serve
        return RequestLimits(max_prompt_chars=sv.max_prompt_chars, max_stop_strings=sv.max_stop_strings,
                             max_stop_chars=sv.max_stop_chars, vocab_size=self.vocab_size,
                             domains=tuple(sv.domains))

    def start(self) -> None:
        self.scheduler.start()
        if self.swapper is not None:
            self.swapper.start()
        self.supervisor.start()

    def stop(self) -> None:
        """Stop in dependency order: trainer, watcher, engine loop, then flush the feedback."""
        if self.stopped:
            return
        self.stopped = True
        self.supervisor.stop()
        if self.swapper is not None:
            self.swapper.stop()
        self.scheduler.stop()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.feedback is not None:
            try:
                self.feedback.close()
            except Exception:  # noqa: BLE001
                log.exception("final feedback flush failed")
        self.metrics.close()


def build_state(cfg: DviConfig) -> ServerState:
    """Load the pair, build engine, scheduler, feedback writer, swapper, supervisor, metrics."""
    torch.set_num_threads(cfg.serve.num_threads)
    pair = load_serving_pair(cfg)
    tokenizer = pair.tokenizer
    spec = cfg.speculation
    engine = SpeculativeEngine(
        pair.target, pair.drafter if spec.num_draft_tokens > 0 or spec.adaptive else None,
        num_draft_tokens=spec.num_draft_tokens, adaptive=spec.adaptive,
        max_draft_tokens=spec.max_draft_tokens, feedback_top_k=cfg.feedback.top_k,
        target_version=0, drafter_version=0, greedy_below_temperature=cfg.sampling.greedy_below_temperature,
    )
    if spec.adaptive and pair.drafter is not None:
        # Measure draft/verify costs for every batch bucket now, so no request pays for a
        # calibration the first time the running batch reaches a new size.
        buckets = sorted({batch_bucket(n) for n in range(1, cfg.serve.max_batch_size + 1)})
        t0 = time.perf_counter()
        engine.calibrate(buckets)
        log.info("adaptive K calibrated for batch sizes %s in %.1fs", buckets, time.perf_counter() - t0)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fb = cfg.feedback
    feedback = FeedbackWriter(fb.dir, shard_records=fb.shard_records, flush_seconds=fb.flush_seconds,
                              retention_bytes=fb.retention_bytes, retention_shards=fb.retention_shards,
                              background=True, max_pending_bytes=fb.max_buffer_bytes)
    metrics = ServerMetrics(cfg, domains=cfg.serve.domains, max_versions=cfg.serve.metrics_versions)
    scheduler = Scheduler(engine, tokenizer, cfg.serve.max_batch_size, cfg.serve.queue_limit,
                          feedback=feedback, num_threads=cfg.serve.num_threads)
    supervisor = TrainerSupervisor(cfg)
    swapper = None
    if pair.drafter is not None:
        swapper = DrafterSwapper(
            DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last), scheduler, pair.drafter,
            poll_seconds=cfg.serve.registry_poll_seconds, shadow_margin=cfg.trainer.shadow_margin,
            rollback_window=cfg.serve.rollback_window, rollback_margin=cfg.serve.rollback_margin,
            on_event=lambda ev: _on_swap_event(metrics, ev), event_log=str(run_dir / "swap_events.jsonl"),
        )
    state = ServerState(
        cfg=cfg, tokenizer=tokenizer, engine=engine, scheduler=scheduler, swapper=swapper,
        supervisor=supervisor, feedback=feedback, metrics=metrics, model_name=cfg.serve.model_name,
        context_len=int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30),
        vocab_size=int(pair.target.get_output_embeddings().weight.shape[0]),
    )
    scheduler.observers.append(lambda fin: _on_finished(state, fin))
    return state


def _on_finished(state: ServerState, fin: Finished) -> None:
    """Engine thread: per-request metrics and the swapper's live-α window and shadow records."""
    state.metrics.observe_request(fin)
    if state.swapper is not None and fin.result is not None:
        state.swapper.observe(fin.drafted, fin.accepted, fin.drafter_version)
        if fin.record is not None and fin.record.token_ids:
            state.swapper.observe_record(fin.record)


def _on_swap_event(metrics: Any, ev: SwapEvent) -> None:
    metrics.observe_swap(ev.kind, ev.version, ev.reason, category=ev.category)


# -- request handling -----------------------------------------------------------------------------
# pydantic puts the union member that failed into `loc` ("str", "list[int]",
# "function-after[_unicode(), str]"); the client's parameter is the field path without them.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def _validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
    errs = exc.errors()
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        msg = f"missing required field '{param}'"
    elif param:
        msg = f"invalid '{param}': {msg}"
    return ApiError(400, msg, param=param)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) as soon as it passes `limit` bytes: never buffer 10 MB."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"request body exceeds this server's limit of {limit} bytes",
                       code="body_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(request: Request, model: type, allow_empty: bool = False) -> Any:
    """Validate a JSON body against a pydantic model; errors are 400s that name the field.

    The config's limits (prompt characters, stop strings, top_k <= vocabulary, the domain
    allowlist) reach the model's validators as pydantic context.
    """
    state: ServerState = request.app.state.dvi
    body = await read_body(request, state.cfg.serve.max_body_bytes)
    try:
        data = {} if allow_empty and not body.strip() else json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data, context=limits_context(state.limits))
    except ValidationError as exc:
        raise _validation_error(exc) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None


def _check_auth(state: ServerState, request: Request) -> None:
    key = state.cfg.serve.api_key
    if key is None or not key.get_secret_value():
        return
    auth = request.headers.get("authorization", "")
    if not (auth.startswith("Bearer ") and key == auth[len("Bearer "):]):  # Secret.__eq__: constant time
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                       type_="authentication_error", code="invalid_api_key")


async def _tokenize(state: ServerState, fn: Any, *args: Any) -> list[int]:
    """Run a tokenizer call on the tokenize thread, so the event loop keeps answering."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(state.tokenize_pool, fn, *args)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=True)


def _chat_prompt(tokenizer: Any, messages: list) -> list[int]:
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    text = "".join(FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in msgs)
    return tokenizer.encode(text + FALLBACK_CHAT_SUFFIX, add_special_tokens=True)


def _prepare(state: ServerState, req: Any, prompt_ids: list[int]) -> SamplingParams:
    """Config-dependent checks (model, limits, context) and the engine's sampling params."""
    cfg = state.cfg
    if req.stream and req.wants_logprobs():
        raise ApiError(400, "logprobs are not supported with stream=true", param="logprobs")
    if _echoes(req) and req.wants_logprobs():
        raise ApiError(400, "echo with logprobs is not supported (the prompt's log-probs are not computed)",
                       param="echo")
    if req.model is not None and req.model != state.model_name:
        raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{state.model_name}'",
                       param="model", code="model_not_found")
    if not prompt_ids:
        raise ApiError(400, "prompt is empty after tokenization", param="prompt")
    bad = [t for t in prompt_ids if not 0 <= t < state.vocab_size]
    if bad:
        raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                       param="prompt")
    limit = cfg.serve.max_tokens_limit
    if req.max_tokens is not None and req.max_tokens > limit:
        raise ApiError(400, f"max_tokens {req.max_tokens} exceeds this server's limit of {limit}",
                       param="max_tokens")
    room = state.context_len - len(prompt_ids)
    if room <= 0:
        raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the model's context is "
                            f"{state.context_len} tokens", param="prompt", code="context_length_exceeded")
    max_tokens = req.max_tokens if req.max_tokens is not None else min(cfg.sampling.max_new_tokens, room, limit)
    if max_tokens > room:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                            f"model's context of {state.context_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    temperature = req.temperature if req.temperature is not None else cfg.sampling.temperature
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature,
        top_k=req.top_k if req.top_k is not None else cfg.sampling.top_k,
        top_p=req.top_p if req.top_p is not None else cfg.sampling.top_p,
        seed=req.seed, stop_token_ids=state.scheduler.eos_ids,
    )


def _usage(fin: Finished) -> dict[str, int]:
    n = len(fin.token_ids)
    return {"prompt_tokens": fin.prompt_len, "completion_tokens": n, "total_tokens": fin.prompt_len + n}


async def _next_event(state: ServerState, h: Handle, request: Request) -> tuple:
    """The request's next event; cancels it (frees the slot) if the client disconnects."""
    while True:
        try:
            return await asyncio.wait_for(h.queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                state.scheduler.cancel(h)
                raise asyncio.CancelledError from None


def _submit(state: ServerState, req: Any, prompt_ids: list[int], params: SamplingParams) -> Handle:
    try:
        h = state.scheduler.submit(prompt_ids, params, domain=req.domain(), stop=req.stop_list(),
                                   stream=req.stream)
    except QueueFull as exc:  # counted by the ApiError handler (reason queue_full)
        raise ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") from None
    return h


def _echoes(req: Any) -> bool:
    return bool(getattr(req, "echo", False))


def _echo_text(state: ServerState, req: Any, prompt_ids: list[int]) -> str:
    """The prompt, returned before the completion when a completions request sets `echo`."""
    if not _echoes(req):
        return ""
    if isinstance(req.prompt, str):
        return req.prompt
    return state.tokenizer.decode(prompt_ids, skip_special_tokens=True)


async def _complete(state: ServerState, request: Request, req: Any, prompt_ids: list[int],
                    chat: bool) -> Response:
    params = _prepare(state, req, prompt_ids)
    h = _submit(state, req, prompt_ids, params)
    rid = new_id("chatcmpl" if chat else "cmpl")
    created = now()
    echo = _echo_text(state, req, prompt_ids)
    if req.stream:
        return StreamingResponse(_stream(state, request, h, rid, created, chat, echo),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        while True:
            ev = await _next_event(state, h, request)
            if ev[0] == "error":
                raise ev[1]
            if ev[0] == "done":
                fin: Finished = ev[1]
                break
    except asyncio.CancelledError:
        state.scheduler.cancel(h)
        raise
    lps = _logprobs(state, fin, chat) if req.wants_logprobs() else None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": fin.text}, "logprobs": lps,
                  "finish_reason": fin.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": echo + fin.text, "logprobs": lps, "finish_reason": fin.finish_reason}
        obj = "text_completion"
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                         "choices": [choice], "usage": _usage(fin), "dvi": fin.stats()})


def _logprobs(state: ServerState, fin: Finished, chat: bool) -> dict[str, Any]:
    """The chosen tokens' target log-probs in the endpoint's OpenAI shape."""
    lps = list(getattr(fin.result, "token_logprobs", None) or [])
    cut = len(fin.text) if fin.finish_reason == "stop" else None
    items = token_logprobs(state.tokenizer, fin.token_ids, lps, cut_at=cut)
    return chat_logprobs(items) if chat else completion_logprobs(items)


async def _stream(state: ServerState, request: Request, h: Handle, rid: str, created: int,
                  chat: bool, echo: str = "") -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta: str | None, finish: str | None = None, extra: dict | None = None,
              first: bool = False) -> bytes:
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": 0, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice]}
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body)}\n\n".encode()

    try:
        if chat:
            yield chunk(None, first=True)
        elif echo:
            yield chunk(echo)
        while True:
            ev = await _next_event(state, h, request)
            if ev[0] == "delta":
                yield chunk(ev[1])
            elif ev[0] == "done":
                fin: Finished = ev[1]
                yield chunk(None, fin.finish_reason, {"usage": _usage(fin), "dvi": fin.stats()})
                yield b"data: [DONE]\n\n"
                return
            else:
                err: ApiError = ev[1]
                count_refusal(state, err.status, err.code)
                yield f"data: {json.dumps(err.body())}\n\n".encode()
                yield b"data: [DONE]\n\n"
                return
    finally:
        if not h.done:
            state.scheduler.cancel(h)


# -- app -------------------------------------------------------------------------------------------
def create_app(cfg: DviConfig, state: ServerState | None = None) -> FastAPI:
    """The FastAPI app; builds (and on shutdown stops) its ServerState unless one is given."""
    from .admin import admin_router

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st = state if state is not None else await asyncio.to_thread(build_state, cfg)
        app.state.dvi = st
        st.start()
        log.info("dvi serving %s (context %d, batch %d, trainer %s)", st.model_name, st.context_len,
                 cfg.serve.max_batch_size, cfg.serve.trainer)
        try:
            yield
        finally:
            await asyncio.to_thread(st.stop)

    app = FastAPI(title="dvi", version="0.1.0", lifespan=lifespan)

    def st(request: Request) -> ServerState:
        return request.app.state.dvi

    def refused(request: Request, status: int, code: str | None) -> None:
        s = getattr(request.app.state, "dvi", None)
        if s is not None:
            count_refusal(s, status, code)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        refused(request, exc.status, exc.code)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _req_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        refused(request, err.status, err.code)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        refused(request, exc.status_code, None)
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        s = st(request)
        _check_auth(s, request)
        req = await _parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            ids = await _tokenize(s, _encode, s.tokenizer, req.prompt)
        else:
            ids = list(req.prompt)
        return await _complete(s, request, req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        s = st(request)
        _check_auth(s, request)
        req = await _parse(request, ChatCompletionRequest)
        ids = await _tokenize(s, _chat_prompt, s.tokenizer, req.messages)
        return await _complete(s, request, req, ids, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        s = st(request)
        _check_auth(s, request)
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": int(s.started_at), "owned_by": "dvi",
            "max_model_len": s.context_len}]}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return JSONResponse(health_info(st(request)))

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        s = st(request)
        s.metrics.update_gauges(s)
        body, content_type = s.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    app.include_router(admin_router())
    return app


def _draft_vocab_size(engine: Any) -> int | None:
    """N of the live drafter's reduced draft vocabulary; None for the full vocabulary or no drafter."""
    ids = getattr(getattr(engine, "drafter", None), "draft_vocab", None)
    return None if ids is None else int(ids.numel())


REJECTION_REASONS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                     405: "method_not_allowed", 409: "conflict", 413: "body_too_large", 422: "invalid_request",
                     429: "queue_full", 503: "unavailable"}


def rejection_reason(status: int, code: str | None) -> str:
    """A bounded label for a refused request: our own error code, else one per HTTP status."""
    return code or REJECTION_REASONS.get(status, "other")


def count_refusal(s: ServerState, status: int, code: str | None) -> None:
    """Count a request the server refused (a 500 is a failure, not a refusal)."""
    if status != 500:
        s.metrics.observe_rejected(rejection_reason(status, code))


def degraded_reasons(s: ServerState, trainer: dict[str, Any]) -> list[str]:
    """Why /health is not ok (empty: ok); each line is what an operator must look at."""
    reasons = []
    if not s.scheduler.alive:
        reasons.append("engine loop is not running")
    if trainer["state"] == "restarting":
        reasons.append(f"trainer is restarting (last exit code {trainer['last_exit_code']}, "
                       f"restarts {trainer['restarts']})")
    if trainer.get("stale"):
        reasons.append(f"trainer heartbeat is {trainer['heartbeat_age_s']:.0f}s old "
                       f"(limit {s.cfg.serve.trainer_stale_s:g}s)")
    fb = s.feedback
    if fb is not None and fb.failing:
        reasons.append(f"feedback writes failing ({fb.last_error}); {fb.pending()} records buffered, "
                       f"{fb.dropped_records} dropped")
    return reasons


def health_info(s: ServerState) -> dict[str, Any]:
    alive = s.scheduler.alive
    sw = s.swapper.info() if s.swapper is not None else None
    trainer = s.supervisor.info()
    reasons = degraded_reasons(s, trainer)
    fb = s.feedback
    return {
        "status": "ok" if not reasons else ("degraded" if alive else "down"),
        "reasons": reasons,
        "model": s.model_name,
        "uptime_s": round(time.time() - s.started_at, 3),
        "engine": {"alive": alive, "running": s.scheduler.num_running(), "queue": s.scheduler.queue_depth(),
                   "steps": s.scheduler.steps, "completed": s.scheduler.completed,
                   "step_errors": s.scheduler.step_errors, "request_errors": s.scheduler.request_errors,
                   "max_batch_size": s.cfg.serve.max_batch_size, "queue_limit": s.cfg.serve.queue_limit},
        "drafter_version": sw["live_version"] if sw else None,
        "target_version": s.target_version,
        "drafter": sw,
        "drafter_kind": s.cfg.models.drafter_kind,
        "draft_vocab_size": _draft_vocab_size(s.engine),
        "trainer": trainer,
        "feedback": {"dir": s.cfg.feedback.dir, "records_written": getattr(fb, "records_written", 0),
                     "pending": fb.pending() if fb is not None else 0,
                     "pending_bytes": fb.pending_bytes() if fb is not None else 0,
                     "write_errors": getattr(fb, "flush_errors", 0),
                     "dropped": getattr(fb, "dropped_records", 0),
                     "failing": bool(fb is not None and fb.failing),
                     "last_error": getattr(fb, "last_error", None),
                     "errors": s.scheduler.feedback_errors},
    }


# -- running ---------------------------------------------------------------------------------------
def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 = a free one), so callers know the port before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def make_server(cfg: DviConfig, sock: socket.socket, state: ServerState | None = None):
    """A uvicorn.Server for the app (call `.run(sockets=[sock])` in a thread or the main thread)."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(cfg, state), host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, lifespan="on")
    return uvicorn.Server(config)


def run_server(cfg: DviConfig) -> int:
    """`dvi serve`: bootstrap the pair if needed, then serve until SIGINT/SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.serve.num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ensure_pair(cfg)
    sock = bind_socket(cfg.serve.host, cfg.serve.port)
    host, port = sock.getsockname()[:2]
    print(f"dvi serving on http://{host}:{port}  (health: /health, metrics: /metrics)", flush=True)
    server = make_server(cfg, sock)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        # A forced exit (second Ctrl-C) skips the lifespan shutdown: still stop the trainer.
        state = getattr(server.config.app.state, "dvi", None)
        if state is not None:
            state.stop()
    return 0
