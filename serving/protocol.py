"""OpenAI-compatible request/response models and the error shape.

Requests are validated here so that every bad field becomes a 4xx naming the field (OpenAI's
`{"error": {"message", "type", "param", "code"}}`), never a 500. Limits that depend on the
config (max_tokens ceiling, context length, served model name) are checked in the app.
Unknown extra fields are ignored, as OpenAI clients send many (presence_penalty, logprobs, ...).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

# The fallback chat format, used when the tokenizer has no chat template: one line per message,
# "<role>: <content>", then "assistant:" so the model continues as the assistant.
FALLBACK_CHAT_FORMAT = "{role}: {content}\n"
FALLBACK_CHAT_SUFFIX = "assistant:"


class ApiError(Exception):
    """An error the client caused (or a server state it must know about), as an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False
    n: StrictInt = Field(1, ge=1)
    metadata: dict[str, Any] | None = None
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @field_validator("metadata")
    @classmethod
    def _domain(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and "domain" in v:
            d = v["domain"]
            if not isinstance(d, str) or not d or len(d) > 64:
                raise ValueError("metadata.domain must be a non-empty string of at most 64 characters")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def domain(self) -> str:
        return str((self.metadata or {}).get("domain") or "default")


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text, or a list of token ids, or a one-element list)."""

    prompt: str | list[StrictInt] | list[str]
    echo: StrictBool = False

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list) -> str | list:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported (n=1)")
                v = v[0]
        if isinstance(v, str) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DviStats(BaseModel):
    """Per-response speculation stats (like vLLM's per-request spec-decode metrics)."""

    drafted: int
    accepted: int
    alpha: float | None
    mean_accepted_length: float
    steps: int
    drafter_version: int
    target_version: int
    domain: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
