"""/v1/completions and /v1/chat/completions: from the request body to the OpenAI response.

Its own module because this is the request path (parse and validate the body, tokenise off the
event loop, check it against the config's limits and the model's context, submit to the
scheduler, then one JSON body or an SSE stream), apart from how the server is built and run
(`serving.app`). Every refusal here is an `ApiError`, which `add_error_handlers` turns into an
OpenAI-style 4xx that names the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dvi.decode.results import acceptance_rate
from dvi.engine.speculative import SamplingParams
from dvi.feedback.heldout import adapter_group, client_key

from .bodies import parse_body, validation_error
from .chat_prompt import chat_prompt_ids
from .control import draw_arm
from .finished import Finished
from .handle import Delta, Event, Handle
from .logprobs import chat_logprobs, completion_logprobs, token_logprobs
from .protocol import (
    SEED_MAX,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    new_id,
    now,
    shutting_down,
)
from .scheduler import QueueFull
from .tokenize import utf8_len
from .wiring import ServerState

log = logging.getLogger("dvi.serving")

DISCONNECT_POLL_S = 0.25

ApiRequest = CompletionRequest | ChatCompletionRequest


# -- request handling -----------------------------------------------------------------------------
async def _tokenize(state: ServerState, fn: Any, texts: list[str], param: str, *args: Any) -> list[int]:
    """`fn(tokenizer, *args)` off the event loop, on the worker for the size of `texts` (the prompt's text);
    a prompt that cannot fit the context is refused first, without an encode (`serving.tokenize`)."""
    least = state.prompts.min_tokens(*texts)
    if least > state.context_len:
        raise ApiError(400, f"prompt has at least {least} tokens; the model's context is {state.context_len} "
                            "tokens", param=param, code="context_length_exceeded")
    return await state.prompts.run(fn, sum(utf8_len(t) for t in texts), *args)


def _encode(tokenizer: Any, text: str) -> list[int]:
    """A /v1/completions prompt: the client's whole model input, so special-token text in it is parsed as the
    special token (as vLLM does, and OpenAI's completions with `<|endoftext|>`); a token-id prompt can hold any id
    anyway. Chat contents are text (`serving.chat_prompt`)."""
    return tokenizer.encode(text, add_special_tokens=True)


def _chat_prompt(tokenizer: Any, messages: list) -> list[int]:
    """Validated chat messages through the chat template, their contents encoded as text (`serving.chat_prompt`)."""
    return chat_prompt_ids(tokenizer, [{"role": m.role, "content": m.text()} for m in messages])


def _prepare(state: ServerState, req: ApiRequest, prompt_ids: list[int]) -> SamplingParams:
    """Config-dependent checks (model, limits, context) and the engine's sampling params."""
    cfg = state.cfg
    if req.stream and req.wants_logprobs():
        raise ApiError(400, "logprobs are not supported with stream=true", param="logprobs")
    if isinstance(req, CompletionRequest) and req.echo and req.wants_logprobs():
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
    asked, limit_param = req.token_limit()
    if asked is not None and asked > limit:
        raise ApiError(400, f"{limit_param} {asked} exceeds this server's limit of {limit}", param=limit_param)
    room = state.context_len - len(prompt_ids)
    if room <= 0:
        raise ApiError(400, f"prompt has {len(prompt_ids)} tokens; the model's context is "
                            f"{state.context_len} tokens", param="prompt", code="context_length_exceeded")
    max_tokens = asked if asked is not None else min(cfg.sampling.max_new_tokens, room, limit)
    if max_tokens > room:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + {limit_param} ({max_tokens}) exceeds the "
                            f"model's context of {state.context_len} tokens", param=limit_param,
                       code="context_length_exceeded")
    temperature = req.temperature if req.temperature is not None else cfg.sampling.temperature
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature,
        top_k=req.top_k if req.top_k is not None else cfg.sampling.top_k,
        top_p=req.top_p if req.top_p is not None else cfg.sampling.top_p,
        seed=req.seed, stop_token_ids=_stop_ids(state, req),
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty if req.repetition_penalty is not None else 1.0,
        logit_bias=req.bias(),
    )


def _stop_ids(state: ServerState, req: ApiRequest) -> tuple[int, ...]:
    """The ids that end an answer: the model's end-of-sequence ids unless `ignore_eos`, and the request's
    `stop_token_ids` (an id of them is kept in the answer's tokens, and in its text unless it is special, as vLLM)."""
    eos = () if req.ignore_eos else tuple(state.scheduler.eos_ids)
    return eos + tuple(t for t in req.stop_token_ids or () if t not in eos)


def _usage(fins: list[Finished], n: int) -> dict[str, int]:
    """Each prompt's tokens once (its first choice's count), every choice's completion tokens."""
    prompt = sum(f.prompt_len for f in fins[::n])
    done = sum(len(f.token_ids) for f in fins)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _dvi(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The response's `dvi` block from its choices' (`Finished.stats`): the one choice's, or for several their
    totals (each choice carries its own)."""
    if len(stats) == 1:
        return stats[0]
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    return {"choices": len(stats), "request_ids": [s["request_id"] for s in stats], "drafted": drafted,
            "accepted": accepted, "alpha": acceptance_rate(accepted, drafted), "steps": sum(s["steps"] for s in stats)}


async def _next_event(state: ServerState, handles: list[Handle], request: Request) -> tuple[int, Event]:
    """The request's next (choice, event); cancels every choice (frees their slots) if the client disconnects."""
    while True:
        try:
            return await asyncio.wait_for(handles[0].queue.get(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                _cancel(state, handles)
                raise asyncio.CancelledError from None


def _cancel(state: ServerState, handles: list[Handle]) -> None:
    for h in handles:
        if not h.done:
            state.scheduler.cancel(h)


def _choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """A prompt's choice j samples with seed + j (wrapped into the seed's range), so a seeded request's choices
    differ. (Under adaptive speculation a seed fixes the draws, not which of them a step consumes: what was drafted
    moves with the batch, so a seeded realization may too; its distribution cannot.)"""
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed if seed <= SEED_MAX else seed - 2**64)


def _submit(state: ServerState, req: ApiRequest, prompts: list[list[int]], params: list[SamplingParams],
            request_key: str | None) -> list[Handle]:
    """Queue every prompt's n choices, whole or not at all; `request_key` (the client's X-Request-Id) keeps a
    retried request in its control arm, all its choices in one."""
    domain, client = req.domain(), client_key(req.user)
    group = adapter_group(state.cfg.trainer.adapter_key, domain, client)
    arm = draw_arm(state.control_share, group, request_key or new_id("key"))
    choices = [(ids, _choice_params(p, j)) for ids, p in zip(prompts, params, strict=True) for j in range(req.n)]
    try:
        return state.scheduler.submit_choices(choices, domain=domain, stop=req.stop_list(), stream=req.stream,
                                              client=client, group=group, arm=arm)
    except QueueFull as exc:  # counted by the ApiError handler (reason queue_full)
        raise ApiError(429, str(exc), type_="rate_limit_error", code="queue_full") from None


def _echo_text(state: ServerState, req: ApiRequest, raw: str | list[int], ids: list[int]) -> str:
    """A prompt, returned before its completions when a completions request sets `echo`."""
    if not (isinstance(req, CompletionRequest) and req.echo):
        return ""
    return raw if isinstance(raw, str) else state.tokenizer.decode(ids, skip_special_tokens=True)


async def _complete(state: ServerState, request: Request, req: ApiRequest, prompts: list[list[int]],
                    chat: bool, raw: list[str | list[int]] | None = None) -> Response:
    params = [_prepare(state, req, ids) for ids in prompts]
    handles = _submit(state, req, prompts, params, request.headers.get("x-request-id"))
    rid = new_id("chatcmpl" if chat else "cmpl")
    created = now()
    echoes = [_echo_text(state, req, r, ids) for r, ids in zip(raw or prompts, prompts, strict=True)]
    if req.stream:
        return StreamingResponse(_stream(state, request, handles, rid, created, chat, echoes, req.n),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        fins = await _finish_all(state, handles, request)
    finally:
        _cancel(state, handles)
    stats = [f.stats() for f in fins]
    choices = []
    for c, fin in enumerate(fins):
        lps = _logprobs(state, fin, chat) if req.wants_logprobs() else None
        if chat:
            choice = {"index": c, "message": {"role": "assistant", "content": fin.text}, "logprobs": lps,
                      "finish_reason": fin.finish_reason}
        else:
            choice = {"index": c, "text": echoes[c // req.n] + fin.text, "logprobs": lps,
                      "finish_reason": fin.finish_reason}
        choices.append(choice | ({"dvi": stats[c]} if len(fins) > 1 else {}))
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": state.model_name, "choices": choices, "usage": _usage(fins, req.n),
                         "dvi": _dvi(stats)})


async def _finish_all(state: ServerState, handles: list[Handle], request: Request) -> list[Finished]:
    """Every choice's `Finished`, in choice order; the first `ApiError` of any is raised."""
    fins: dict[int, Finished] = {}
    while len(fins) < len(handles):
        c, ev = await _next_event(state, handles, request)
        if isinstance(ev, ApiError):
            raise ev
        if isinstance(ev, Finished):
            fins[c] = ev
    return [fins[c] for c in range(len(handles))]


def _logprobs(state: ServerState, fin: Finished, chat: bool) -> dict[str, Any]:
    """The chosen tokens' target log-probs in the endpoint's OpenAI shape."""
    lps = fin.result.token_logprobs if fin.result is not None else []
    cut = len(fin.text) if fin.finish_reason == "stop" else None
    items = token_logprobs(state.tokenizer, fin.token_ids, lps, cut_at=cut)
    return chat_logprobs(items) if chat else completion_logprobs(items)


async def _stream(state: ServerState, request: Request, handles: list[Handle], rid: str, created: int,
                  chat: bool, echoes: list[str], n: int) -> AsyncIterator[bytes]:
    """One SSE stream for every choice, each chunk naming its choice; a choice's last chunk carries its `dvi` block,
    the last choice to finish the request's usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(c: int, delta: str | None, finish: str | None = None, extra: dict | None = None,
              first: bool = False) -> bytes:
        if chat:
            d: dict[str, Any] = {"role": "assistant"} if first else {}
            if delta:
                d["content"] = delta
            choice = {"index": c, "delta": d, "finish_reason": finish}
        else:
            choice = {"index": c, "text": delta or "", "logprobs": None, "finish_reason": finish}
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice]}
        if extra:
            body.update(extra)
        return f"data: {json.dumps(body)}\n\n".encode()

    try:
        for c in range(len(handles)):
            if chat:
                yield chunk(c, None, first=True)
            elif echoes[c // n]:
                yield chunk(c, echoes[c // n])
        fins: dict[int, Finished] = {}
        while len(fins) < len(handles):
            c, ev = await _next_event(state, handles, request)
            if isinstance(ev, Delta):
                yield chunk(c, ev.text)
            elif isinstance(ev, Finished):
                fins[c] = ev
                extra: dict[str, Any] = {"dvi": ev.stats()}
                if len(fins) == len(handles):
                    extra["usage"] = _usage([fins[i] for i in range(len(handles))], n)
                yield chunk(c, None, ev.finish_reason, extra)
            else:
                state.metrics.observe_refusal(ev.status, ev.code)
                yield f"data: {json.dumps(ev.body())}\n\n".encode()
                break
        yield b"data: [DONE]\n\n"
    finally:
        _cancel(state, handles)


# -- routes ----------------------------------------------------------------------------------------
def _refuse_if_draining(s: ServerState) -> None:
    """A stopping server takes no new work: 503 with `Retry-After` (before the body is even read)."""
    if s.draining:
        raise shutting_down(s.cfg.serve.drain_timeout_s)


async def completions_endpoint(request: Request) -> Response:
    """POST /v1/completions: a string prompt is tokenised here, a token-id prompt is used as is."""
    s: ServerState = request.app.state.dvi
    _refuse_if_draining(s)
    req = await parse_body(request, CompletionRequest, s.cfg.serve.max_body_bytes, s.limits)
    raw = req.prompts()
    ids = [await _tokenize(s, _encode, [p], "prompt", p) if isinstance(p, str) else list(p) for p in raw]
    return await _complete(s, request, req, ids, chat=False, raw=raw)


async def chat_completions_endpoint(request: Request) -> Response:
    """POST /v1/chat/completions: the messages through the chat template, then as a completion."""
    s: ServerState = request.app.state.dvi
    _refuse_if_draining(s)
    req = await parse_body(request, ChatCompletionRequest, s.cfg.serve.max_body_bytes, s.limits)
    ids = await _tokenize(s, _chat_prompt, [m.text() for m in req.messages], "messages", req.messages)
    return await _complete(s, request, req, [ids], chat=True)


def _refused(request: Request, status: int, code: str | None) -> None:
    s = getattr(request.app.state, "dvi", None)
    if s is not None:
        s.metrics.observe_refusal(status, code)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    _refused(request, exc.status, exc.code)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _req_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    err = validation_error(exc)
    _refused(request, err.status, err.code)
    return JSONResponse(err.body(), status_code=err.status)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    _refused(request, exc.status_code, None)
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies: 4xx refusals are counted by reason; anything else is a 500."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _req_validation)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
