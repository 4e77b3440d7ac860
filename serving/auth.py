"""Who may call what: the API key (`serve.api_key`), the admin token (`serve.admin_token`) and, for
/metrics, `serve.metrics_access`.

FastAPI dependencies, attached to the routes (`serving.app`) and the /admin router
(`serving.admin`), so no endpoint parses the Authorization header itself and none can forget
its check. `HTTPBearer(auto_error=False)` reads the header and returns None for a missing or
ill-formed one; the refusals stay ours: `ApiError`s, OpenAI-shaped bodies, counted by reason.
Both secrets are compared in constant time (`dvi.config.Secret.__eq__`). The dependencies are
`async` so they run on the event loop, not on a threadpool hop per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .protocol import ApiError

if TYPE_CHECKING:
    from dvi.config import Secret

_bearer = HTTPBearer(auto_error=False, description="`serve.api_key` (/v1) or `serve.admin_token` (/admin)")


async def bearer_token(creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> str | None:
    """The token of an `Authorization: Bearer <token>` header; None without one.

    The scheme is case-insensitive (RFC 9110 §11.1): `bearer KEY` and `BEARER KEY` carry the key too
    (`HTTPBearer` has already refused any other scheme).
    """
    if creds is None or creds.scheme.lower() != "bearer":
        return None
    return creds.credentials


def _configured(secret: Secret | None) -> bool:
    """An unset or empty secret means that check is off."""
    return secret is not None and bool(secret.get_secret_value())


async def require_api_key(request: Request, token: str | None = Depends(bearer_token)) -> None:
    """401 unless the request carries `serve.api_key` (no key configured: open)."""
    key = request.app.state.dvi.cfg.serve.api_key
    if _configured(key) and not (key == token):  # Secret.__eq__: constant time
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                       type_="authentication_error", code="invalid_api_key")


def is_admin(request: Request, token: str | None) -> bool:
    """True when `token` is the configured admin token (never when admin is disabled)."""
    admin_token = request.app.state.dvi.cfg.serve.admin_token
    return _configured(admin_token) and token is not None and admin_token == token  # constant time


async def require_admin(request: Request, token: str | None = Depends(bearer_token)) -> None:
    """403 when admin is disabled (no token configured) or the token is wrong; 401 without one."""
    admin_token = request.app.state.dvi.cfg.serve.admin_token
    if not _configured(admin_token):
        raise ApiError(403, "admin API is disabled (set serve.admin_token)", type_="permission_error")
    if token is None:
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin_token>'",
                       type_="authentication_error")
    if not (admin_token == token):  # Secret.__eq__: constant time
        raise ApiError(403, "wrong admin token", type_="permission_error")


async def require_metrics_access(request: Request, token: str | None = Depends(bearer_token)) -> None:
    """/metrics as `serve.metrics_access` says: "open"; "api_key" (the default): the API key or the admin
    token when an API key is set, as /v1 asks; "admin": the admin token. A Prometheus scraper sends either
    as `authorization: {credentials: ...}` (a bearer token)."""
    serve = request.app.state.dvi.cfg.serve
    if serve.metrics_access == "open" or is_admin(request, token):
        return
    if serve.metrics_access == "admin":
        if token is None:
            raise ApiError(401, "/metrics needs 'Authorization: Bearer <admin_token>' (serve.metrics_access: admin)",
                           type_="authentication_error")
        raise ApiError(403, "wrong admin token", type_="permission_error")
    key = serve.api_key
    if _configured(key) and not (key == token):  # Secret.__eq__: constant time
        raise ApiError(401, "/metrics needs the API key (Authorization: Bearer <key>) or the admin token; "
                       "serve.metrics_access: open serves it to anyone", type_="authentication_error",
                       code="invalid_api_key")
