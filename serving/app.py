"""The OpenAI-compatible HTTP server: server state, the FastAPI app, and `run_server`.

One process holds the models, one engine thread (`serving.scheduler`), the registry watcher
(`serving.swap`), the trainer supervisor (`serving.supervisor`) and the feedback writer. Every
request error is a 4xx with an OpenAI-style error body that names the field; a 500 only means a
bug or an engine failure, and it fails one request, never the server.

This module builds that state and wires the routes; the parts live by job: `serving.loading`
(which pair to serve), `serving.completions` (the request path and error handlers),
`serving.health` (/health and refusal counting). Their names are re-exported here, so
`from serving.app import ...` keeps working for every caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from dvi.config import DviConfig
from dvi.decode.adaptive import batch_bucket
from dvi.decode.engine import SpeculativeEngine
from dvi.feedback import FeedbackWriter, Retention
from dvi.registry.store import DrafterRegistry
from dvi.rundir import RunDir

from .auth import bearer_token, is_admin, require_api_key
from .completions import (  # noqa: F401  (re-exported: serving.app is the callers' import path)
    _UNION_TAG,
    DISCONNECT_POLL_S,
    _chat_prompt,
    _complete,
    _echo_text,
    _echoes,
    _encode,
    _logprobs,
    _next_event,
    _parse,
    _prepare,
    _stream,
    _submit,
    _tokenize,
    _usage,
    _validation_error,
    add_error_handlers,
    chat_completions_endpoint,
    completions_endpoint,
    read_body,
)
from .connection import HeaderLimit, deadline_protocol
from .health import (  # noqa: F401  (re-exported)
    REJECTION_REASONS,
    _draft_vocab_size,
    count_refusal,
    degraded_reasons,
    health_info,
    public_health,
    rejection_reason,
)
from .loading import ensure_pair, load_serving_pair, pair_paths, serving_proposer  # noqa: F401  (re-exported)
from .protocol import RequestLimits
from .scheduler import Finished, Scheduler
from .supervisor import TrainerSupervisor
from .swap import DrafterSwapper, SwapEvent, SwapPolicy
from .telemetry import ServerMetrics
from .tokenize import PromptTokenizer

log = logging.getLogger("dvi.serving")


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
    # tokenising off the event loop: an early context check, and large prompts on their own worker
    prompts: PromptTokenizer
    started_at: float = field(default_factory=time.time)
    target_version: int = 0
    stopped: bool = False
    draining: bool = False  # a stop was asked for (`serving.drain`): new requests get a 503
    suffix_tailer: Any = None  # serving.suffix_tail.SuffixTailer (suffix / hybrid with a shared feedback dir)

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
        if self.suffix_tailer is not None:
            self.suffix_tailer.start()

    def stop(self) -> None:
        """Stop in dependency order: trainer, watcher, engine loop, then flush the feedback."""
        if self.stopped:
            return
        self.stopped = True
        if self.suffix_tailer is not None:
            self.suffix_tailer.stop()
        self.supervisor.stop()
        if self.swapper is not None:
            self.swapper.stop()
        self.scheduler.stop()
        self.prompts.close()
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
        pair.target, serving_proposer(cfg, pair), num_draft_tokens=spec.num_draft_tokens, adaptive=spec.adaptive,
        max_draft_tokens=spec.max_draft_tokens, feedback_top_k=cfg.feedback.top_k,
        greedy_below_temperature=cfg.sampling.greedy_below_temperature,
    )
    if spec.adaptive and engine.proposer.kind != "none":
        # Measure draft/verify costs for every batch bucket now, so no request pays for a
        # calibration the first time the running batch reaches a new size.
        buckets = sorted({batch_bucket(n) for n in range(1, cfg.serve.max_batch_size + 1)})
        t0 = time.perf_counter()
        engine.calibrate(buckets)
        log.info("adaptive K calibrated for batch sizes %s in %.1fs", buckets, time.perf_counter() - t0)
    rundir = RunDir.of(cfg)
    rundir.make_root()
    fb = cfg.feedback
    feedback = FeedbackWriter(fb.dir, shard_records=fb.shard_records, flush_seconds=fb.flush_seconds,
                              retention=Retention(fb.retention_bytes, fb.retention_shards, fb.retention_seconds),
                              background=True, max_pending_bytes=fb.max_buffer_bytes, access=cfg.files.access)
    metrics = ServerMetrics(cfg, domains=cfg.serve.domains, max_versions=cfg.serve.metrics_versions)
    scheduler = Scheduler(engine, tokenizer, cfg.serve.max_batch_size, cfg.serve.queue_limit,
                          feedback=feedback, num_threads=cfg.serve.num_threads)
    supervisor = TrainerSupervisor(cfg)
    swapper = None
    if pair.drafter is not None:
        swapper = DrafterSwapper(
            DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last), scheduler, pair.drafter,
            SwapPolicy.of(cfg), on_event=lambda ev: _on_swap_event(metrics, ev), event_log=rundir.log(rundir.swap_events_path),
        )
    state = ServerState(
        cfg=cfg, tokenizer=tokenizer, engine=engine, scheduler=scheduler, swapper=swapper,
        supervisor=supervisor, feedback=feedback, metrics=metrics, model_name=cfg.serve.model_name,
        context_len=int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30),
        vocab_size=int(pair.target.get_output_embeddings().weight.shape[0]),
        prompts=PromptTokenizer(tokenizer, cfg.serve.tokenize_large_bytes),
    )
    scheduler.observers.append(lambda fin: _on_finished(state, fin))
    cache = getattr(getattr(engine.proposer, "suffix", engine.proposer), "cache", None)
    if cache is not None and cfg.suffix.tail_seconds > 0:
        from .suffix_tail import SuffixTailer

        state.suffix_tailer = SuffixTailer(fb.dir, cache, scheduler.call_between_steps, cfg.suffix.tail_seconds,
                                           cfg.suffix.tail_records)
    return state


def _on_finished(state: ServerState, fin: Finished) -> None:
    """Engine thread: per-request metrics and the swapper's live-α window and shadow records."""
    state.metrics.observe_request(fin)
    if state.swapper is not None and fin.result is not None:
        r = fin.result
        drafted, accepted = r.model_counts()  # the learned drafter's own drafts (hybrid: not the suffix ones)
        state.swapper.observe(drafted, accepted, r.drafter_version)
        if fin.record is not None and fin.record.token_ids:
            state.swapper.observe_record(fin.record)


def _on_swap_event(metrics: ServerMetrics, ev: SwapEvent) -> None:
    metrics.observe_swap(ev.kind, ev.version, ev.reason, category=ev.category)



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

    docs = cfg.serve.api_docs
    app = FastAPI(title="dvi", version="0.1.0", lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    add_error_handlers(app)
    app.add_middleware(HeaderLimit, max_bytes=cfg.serve.max_header_bytes)
    api_key = [Depends(require_api_key)]
    app.post("/v1/completions", dependencies=api_key)(completions_endpoint)
    app.post("/v1/chat/completions", dependencies=api_key)(chat_completions_endpoint)

    @app.get("/v1/models", dependencies=api_key)
    async def models(request: Request) -> dict:
        s: ServerState = request.app.state.dvi
        return {"object": "list", "data": [{
            "id": s.model_name, "object": "model", "created": int(s.started_at), "owned_by": "dvi",
            "max_model_len": s.context_len}]}

    @app.get("/health")
    async def health(request: Request, token: str | None = Depends(bearer_token)) -> JSONResponse:
        s: ServerState = request.app.state.dvi
        body = health_info(s) if is_admin(request, token) else public_health(s)
        return JSONResponse(body, status_code=503 if s.draining else 200)  # draining: route elsewhere

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        s: ServerState = request.app.state.dvi
        s.metrics.update_gauges(s)
        s.metrics.observe_http_timeouts(getattr(request.app.state, "http_timeouts", {}))
        body, content_type = s.metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    app.include_router(admin_router())
    return app


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
    """A uvicorn.Server for the app (call `.run(sockets=[sock])` in a thread or the main thread) that drains
    requests on SIGTERM/SIGINT or `should_exit` (`serving.drain`) before uvicorn's own shutdown."""
    import uvicorn

    from .drain import DrainingServer

    host, port = sock.getsockname()[:2]
    sv = cfg.serve
    app, protocol = create_app(cfg, state), deadline_protocol(sv.header_timeout_s, sv.body_timeout_s)
    app.state.http_timeouts = protocol.timeouts
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, lifespan="on", http=protocol,
                            timeout_keep_alive=sv.keep_alive_s, h11_max_incomplete_event_size=sv.max_header_bytes)
    return DrainingServer(config, sv.drain_timeout_s)


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
