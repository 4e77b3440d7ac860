"""Admin endpoints, behind their own token (`serve.admin_token`; admin is off when unset).

- ``POST /admin/target`` ``{"path": ..., "version": N}``: new target weights (a ``.safetensors``
  file or a ``save_pretrained`` dir) applied between engine steps; `version` defaults to the
  current one + 1. The path, and every file loading it opens (a directory's shard index and the
  shards it names, symlinks followed), must resolve inside one of `serve.allowed_dirs`.
- ``POST /admin/drafter/pin`` ``{"version": N}``: serve exactly version N (0 = the startup drafter)
  until ``{"version": null}`` unpins; no automatic promotion or rollback overrides it (a failed
  rollback watch under a pin only alerts), and it is durable in the registry (SERVING): a restarted
  server serves it again.
- ``POST /admin/drafter/rollback`` ``{"reason": ...}``: back to the last version that passed its
  rollback watch (from such a version: the one before it); 409 while pinned.
- Both are messages to the drafter wing's door (`serving.drafter.client`: `Pin`, `Rollback`); the endpoint awaits
  the future the drafter thread resolves once its snapshot shows the result, as a target update awaits the engine's.
- ``POST /admin/trainer/pause`` / ``/admin/trainer/resume``: sets / clears the run dir's pause
  flag (`dvi.rundir`), which the online trainer honours (see `serving.supervisor`).
- ``GET /admin/status``: the health document plus the version events (the drafter snapshot's); its ``drafter.waiting`` is the version whose
  promotion check waits for held-out evidence (``{"version", "heldout_positions", "of"}``: ``of`` is
  ``trainer.shadow_min_positions``), null when none waits.

Errors: 401 without a bearer token, 403 for a wrong one, when admin is disabled, or for a path
outside the allowed dirs; 400 for bad bodies; 409 when the action does not apply.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from dvi.models.loading import load_state_dict
from dvi.registry.store import AdapterRejected

from .auth import require_admin
from .bodies import parse_body
from .drafter.client import DrafterClient, Pin, Rollback
from .engine_client import UpdateTarget
from .health import health_info
from .protocol import ApiError, BodyT, Text
from .wiring import ServerState

log = logging.getLogger("dvi.serving.admin")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_PATH_CHARS = 4096
MAX_REASON_CHARS = 500


class TargetUpdate(_Body):
    path: Text = Field(min_length=1, max_length=MAX_PATH_CHARS)
    version: StrictInt | None = Field(None, ge=0, le=2**62)

    @field_validator("path")
    @classmethod
    def _no_nul(cls, v: str) -> str:
        if "\x00" in v:
            raise ValueError("path contains a NUL byte")
        return v


class PinRequest(_Body):
    version: StrictInt | None = Field(..., ge=0, le=2**62)


class RollbackRequest(_Body):
    # kept in memory, logged and written to the event logs: bounded
    reason: Text = Field("admin rollback", max_length=MAX_REASON_CHARS)


def _state(request: Request) -> ServerState:
    return request.app.state.dvi


async def _body(request: Request, model: type[BodyT]) -> BodyT:
    s = _state(request)
    return await parse_body(request, model, s.cfg.serve.max_body_bytes, s.limits, allow_empty=True)


def confine_path(path: str, allowed_dirs: list[Path]) -> Path:
    """`path` with symlinks resolved, if it lies inside an allowed dir; ApiError(403/400) otherwise."""
    if not allowed_dirs:
        raise ApiError(403, "no serve.allowed_dirs configured; admin paths are refused", param="path",
                       type_="permission_error")
    try:
        resolved = Path(path).expanduser().resolve(strict=True)
    except (FileNotFoundError, RuntimeError, OSError):
        # Do not reveal whether a path outside the allowed dirs exists.
        resolved = Path(path).expanduser().resolve(strict=False)
        if not any(resolved.is_relative_to(Path(d).expanduser().resolve()) for d in allowed_dirs):
            raise ApiError(403, f"path {path!r} is outside the allowed dirs", param="path",
                           type_="permission_error") from None
        raise ApiError(400, f"path {path!r} does not exist", param="path") from None
    for d in allowed_dirs:
        if resolved.is_relative_to(Path(d).expanduser().resolve()):
            return resolved
    raise ApiError(403, f"path {path!r} is outside the allowed dirs", param="path", type_="permission_error")


# -- the routes (admin_router checks the admin token before each) -------------------------------------
async def update_target(request: Request) -> dict:
    """POST /admin/target: load new target weights between engine steps, then announce the version."""
    s = _state(request)
    body: TargetUpdate = await _body(request, TargetUpdate)
    allowed = list(s.cfg.serve.allowed_dirs)
    path = confine_path(body.path, allowed)
    version = body.version if body.version is not None else s.target_version + 1
    try:
        # read off the engine thread; every file it opens (index, shards, symlinks followed) is confined
        sd = await asyncio.to_thread(load_state_dict, path, lambda p: confine_path(str(p), allowed))
        await asyncio.wrap_future(s.scheduler.command(UpdateTarget(sd, version, complete=True)))
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - unreadable / NaN / partial weights are the caller's error
        log.warning("target update from %s refused: %s: %s", path, type(exc).__name__, exc)
        raise ApiError(400, f"cannot load target weights from {body.path!r}: {type(exc).__name__}: {exc}",
                       param="path", code="target_refused") from None
    s.target_version = version
    s.supervisor.rundir.write_target_version(version)  # the trainer learns of it before any feedback
    s.metrics.observe_target_update(version)
    log.warning("target weights updated from %s (target version %d)", path, version)
    return {"target_version": version, "path": str(path)}


async def _drafter_request(request: Request, model: type) -> tuple[Any, DrafterClient]:
    """(the parsed body, the drafter door) of a /admin/drafter request; 409 when no drafter is loaded."""
    s = _state(request)
    body = await _body(request, model)
    if s.drafter is None:
        raise ApiError(409, "no drafter is loaded (speculation off)")
    return body, s.drafter


async def pin(request: Request) -> dict:
    """POST /admin/drafter/pin: serve exactly one version (null unpins)."""
    body, drafter = await _drafter_request(request, PinRequest)
    try:
        version = await asyncio.wrap_future(drafter.command(Pin(body.version)))
    except AdapterRejected as exc:
        raise ApiError(400, f"drafter version {body.version} refused: {exc.reason}", param="version") from None
    except ValueError as exc:
        raise ApiError(400, str(exc), param="version") from None
    except RuntimeError as exc:  # the drafter thread is not running (the server stops)
        raise ApiError(409, str(exc)) from None
    return {"drafter_version": version, "pinned": drafter.snapshot.shared.pinned}


async def rollback(request: Request) -> dict:
    """POST /admin/drafter/rollback: back to the previous drafter."""
    body, drafter = await _drafter_request(request, RollbackRequest)
    try:
        version = await asyncio.wrap_future(drafter.command(Rollback(body.reason)))
    except (ValueError, AdapterRejected, RuntimeError) as exc:
        raise ApiError(409, str(exc)) from None
    return {"drafter_version": version}


def _trainer_action(request: Request, action: str) -> dict:
    s = _state(request)
    try:
        getattr(s.supervisor, action)()
    except RuntimeError as exc:
        raise ApiError(409, str(exc)) from None
    return s.supervisor.info()


async def pause(request: Request) -> dict:
    """POST /admin/trainer/pause: set the run dir's pause flag."""
    return _trainer_action(request, "pause")


async def resume(request: Request) -> dict:
    """POST /admin/trainer/resume: clear the run dir's pause flag."""
    return _trainer_action(request, "resume")


async def status(request: Request) -> dict:
    """GET /admin/status: the health document plus the version events."""
    s = _state(request)
    info = health_info(s)
    if s.drafter is not None:
        info["swap_events"] = [e.as_dict() for e in s.drafter.snapshot.shared.events]
    return info


ROUTES = (("POST", "/target", update_target), ("POST", "/drafter/pin", pin),
          ("POST", "/drafter/rollback", rollback), ("POST", "/trainer/pause", pause),
          ("POST", "/trainer/resume", resume), ("GET", "/status", status))


def admin_router() -> APIRouter:
    """The /admin routes (`ROUTES`); the router checks the admin token before any of them runs."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
    for method, path, endpoint in ROUTES:
        router.add_api_route(path, endpoint, methods=[method])
    return router
