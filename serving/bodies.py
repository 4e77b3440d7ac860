"""Reading a request body (the byte limit before anything is buffered, JSON, the pydantic model) and turning
pydantic's errors into 400s that name the client's field; what the completions and the admin routes share."""

from __future__ import annotations

import json
import re

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from .protocol import ApiError, BodyT, RequestLimits, limits_context, unsupported_field

# pydantic puts the union member that failed into `loc` ("str", "list[int]",
# "function-after[_unicode(), str]"); the client's parameter is the field path without them.
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


def validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
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


async def parse_body(request: Request, model: type[BodyT], max_bytes: int, limits: RequestLimits,
                     allow_empty: bool = False) -> BodyT:
    """Validate a JSON body of at most `max_bytes` against a pydantic model; errors are 400s that name the field.

    The config's limits (prompt characters, stop strings, top_k <= vocabulary, the domain
    allowlist) reach the model's validators as pydantic context.
    """
    body = await read_body(request, max_bytes)
    try:
        data = {} if allow_empty and not body.strip() else json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    refused = unsupported_field(data)
    if refused is not None:
        raise refused
    try:
        return model.model_validate(data, context=limits_context(limits))
    except ValidationError as exc:
        raise validation_error(exc) from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply") from None
