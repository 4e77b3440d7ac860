"""The OpenAI-compatible HTTP server: the FastAPI app (`create_app`: routes) and `run_server`.

The server's process holds the endpoints, the drafter thread (`serving.drafter.client`), the trainer supervisor
(`serving.supervisor`) and the feedback writer, all built by `serving.wiring.build_state`; the engine and its thread
(`serving.scheduler`) run in a process of their own (`serving.engine_core`, behind `serving.engine_process`), or with
`serve.engine_process: false` as a thread of this one. Every request error is a 4xx with an OpenAI-style error body that names the
field; a 500 only means a bug or an engine failure, and it fails one request, never the server.

This module holds the routes; the parts live by job: `serving.wiring` (builds the parts and what the endpoints share),
`serving.completions` (the request path and error handlers), `serving.health` (/health and refusal
counting), `serving.admin` (the admin API), `serving.drain` (a stop that answers every request).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from contextlib import asynccontextmanager

import torch
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from dvi.config import DviConfig
from dvi.memory import freeze_long_lived

from .admin import admin_router
from .auth import bearer_token, is_admin, require_api_key, require_metrics_access
from .completions import add_error_handlers, chat_completions_endpoint, completions_endpoint
from .connection import HeaderLimit, deadline_protocol
from .drain import DrainingServer, exit_process
from .health import health_info, public_health
from .loading import ensure_pair
from .wiring import ServerState, build_state

log = logging.getLogger("dvi.serving")


# -- app -------------------------------------------------------------------------------------------
def create_app(cfg: DviConfig, state: ServerState | None = None, freeze_gc: bool = False) -> FastAPI:
    """The FastAPI app; builds (and on shutdown stops) its ServerState unless one is given. `freeze_gc`: the process
    is the server's own (`run_server`): what start-up built is frozen out of the cyclic collector's walks
    (`dvi.memory.freeze_long_lived`) before the first request."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st = state if state is not None else await asyncio.to_thread(build_state, cfg)
        app.state.dvi = st
        if freeze_gc:
            t0 = time.perf_counter()
            frozen = freeze_long_lived()
            log.info("%d start-up objects frozen out of garbage collection in %.2fs", frozen, time.perf_counter() - t0)
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

    @app.get("/metrics", dependencies=[Depends(require_metrics_access)])
    async def metrics(request: Request) -> PlainTextResponse:
        s: ServerState = request.app.state.dvi
        snap = s.scheduler.snapshot  # the engine as its thread last published it (`serving.engine_client`)
        drafter = s.drafter.snapshot if s.drafter is not None else None  # the drafter thread's last publication
        s.metrics.update_gauges(snap, drafter, s.supervisor, s.feedback, s.target_version)
        s.metrics.update_suffix(snap, s.scheduler.suffix_step_seconds.drain(), s.suffix_tailer)
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


def make_server(cfg: DviConfig, sock: socket.socket, state: ServerState | None = None, freeze_gc: bool = False):
    """A uvicorn.Server for the app (call `.run(sockets=[sock])` in a thread or the main thread) that drains
    requests on SIGTERM/SIGINT or `should_exit` (`serving.drain`) before uvicorn's own shutdown."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    sv = cfg.serve
    app, protocol = create_app(cfg, state, freeze_gc), deadline_protocol(sv.header_timeout_s, sv.body_timeout_s)
    app.state.http_timeouts = protocol.timeouts
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5, lifespan="on", http=protocol,
                            timeout_keep_alive=sv.keep_alive_s, h11_max_incomplete_event_size=sv.max_header_bytes)
    return DrainingServer(config, sv.drain_timeout_s)


def run_server(cfg: DviConfig) -> int:
    """`dvi serve`: bootstrap the pair if needed, then serve until SIGINT/SIGTERM, drain, stop, and end the
    process (`serving.drain.exit_process`: status 0, without the interpreter's seconds-long teardown); returns
    only by an exception."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.serve.num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ensure_pair(cfg)
    sock = bind_socket(cfg.serve.host, cfg.serve.port)
    host, port = sock.getsockname()[:2]
    print(f"dvi serving on http://{host}:{port}  (health: /health, metrics: /metrics)", flush=True)
    server = make_server(cfg, sock, freeze_gc=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        # A forced exit (second Ctrl-C) skips the lifespan shutdown: still stop the trainer.
        state = getattr(server.config.app.state, "dvi", None)
        if state is not None:
            state.stop()
    exit_process(0)
