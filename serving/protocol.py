"""OpenAI-compatible request/response models and the error shape.

Requests are validated here so that every bad field becomes a 4xx naming the field (OpenAI's
`{"error": {"message", "type", "param", "code"}}`), never a 500. Limits that depend on the
config (max_tokens ceiling, context length, served model name) are checked in the app.
Unknown extra fields are ignored, as OpenAI clients send many (presence_penalty, ...); `logprobs`
is served for the chosen tokens and asking for top alternatives is a 400 (serving/logprobs.py).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

BodyT = TypeVar("BodyT", bound=BaseModel)
"""A request body model (`_parse` returns the validated instance of the model it is given)."""


class ApiError(Exception):
    """An error the client caused (or a server state it must know about), as an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def shutting_down(retry_after_s: float) -> ApiError:
    """The 503 of a draining server: for a new request, and for one the drain cut (`Retry-After` in seconds)."""
    return ApiError(503, "server is shutting down", type_="server_error", code="shutting_down",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class RequestLimits:
    """Config-dependent bounds, handed to validation as pydantic context (`limits_context`)."""

    max_prompt_chars: int = 1_000_000
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    vocab_size: int | None = None
    domains: tuple[str, ...] | None = None  # None: any domain; else others are reported as OTHER_DOMAIN


OTHER_DOMAIN = "other"
DEFAULT_LIMITS = RequestLimits()


def limits_context(limits: RequestLimits) -> dict[str, Any]:
    return {"limits": limits}


def _limits(info: ValidationInfo) -> RequestLimits:
    ctx = info.context or {}
    return ctx.get("limits", DEFAULT_LIMITS)


def _unicode(v: str) -> str:
    """Strings must be encodable (a lone surrogate from a JSON escape is not text; it crashed the tokenizer)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid Unicode text)") from None
    return v


Text = Annotated[str, AfterValidator(_unicode)]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: StrictInt | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt | None = Field(None, ge=0)
    stop: Text | list[Text] | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1)
    metadata: dict[str, Any] | None = None
    user: Text | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k_in_vocab(cls, v: int | None, info: ValidationInfo) -> int | None:
        vocab = _limits(info).vocab_size
        if v is not None and vocab is not None and v > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab})")
        return v

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        lim = _limits(info)
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > lim.max_stop_strings:
            raise ValueError(f"at most {lim.max_stop_strings} stop strings")
        if any(len(s) > lim.max_stop_chars for s in items):
            raise ValueError(f"stop strings must be at most {lim.max_stop_chars} characters")
        return v

    @field_validator("metadata")
    @classmethod
    def _domain(cls, v: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        """Clients choose the domain, so it is a metrics label only if the config lists it."""
        if v is not None and "domain" in v:
            d = v["domain"]
            if not isinstance(d, str) or not d or len(d) > 64:
                raise ValueError("metadata.domain must be a non-empty string of at most 64 characters")
            _unicode(d)
            allowed = _limits(info).domains
            if allowed is not None and d not in allowed:
                v = {**v, "domain": OTHER_DOMAIN}
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def domain(self) -> str:
        return str((self.metadata or {}).get("domain") or "default")


def _check_prompt_chars(n: int, info: ValidationInfo) -> None:
    limit = _limits(info).max_prompt_chars
    if n > limit:
        raise ValueError(f"prompt has {n} characters; this server's limit is {limit}")


def _chosen_tokens_only(field: str):
    """Validator: log-probs of the chosen tokens only (`field` 0 or absent). Top alternatives would need the
    served distribution's top-k per token, which the engine does not keep (its feedback top-k is at T=1)."""

    def check(v: int | None) -> int | None:
        if v:
            raise ValueError(f"only {field}=0 (the chosen tokens' log-probs) is supported; top alternatives are not")
        return v

    return field_validator(field)(check)


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text, or a list of token ids, or a one-element list)."""

    prompt: Text | list[StrictInt] | list[Text]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)

    _chosen_only = _chosen_tokens_only("logprobs")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list, info: ValidationInfo) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported (n=1)")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, str):
            _check_prompt_chars(len(v), info)
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    _chosen_only = _chosen_tokens_only("top_logprobs")

    def wants_logprobs(self) -> bool:
        return self.logprobs

    @field_validator("messages")
    @classmethod
    def _messages_chars(cls, v: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        _check_prompt_chars(sum(len(m.content) for m in v), info)
        return v


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
