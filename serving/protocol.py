"""OpenAI-compatible request/response models and the error shape.

Requests are validated here so that every bad field becomes a 4xx naming the field (OpenAI's
`{"error": {"message", "type", "param", "code"}}`), never a 500. Limits that depend on the
config (max_tokens ceiling, context length, served model name) are checked in the app.
Every field that changes the answer is honoured or refused with a 400 naming it: the penalties and
`logit_bias` are served (a lossless transform of the target), `max_completion_tokens` is chat's
token limit, `n` choices of each prompt (a completions request may send several prompts, OpenAI's
batch form) up to `serve.max_choices` in all, and vLLM's `ignore_eos` and `stop_token_ids` are served;
`best_of` other than n, `suffix`, `response_format` other than text, tool calling, non-text content
parts and vLLM's sampling extras dvi does not implement (`UNSUPPORTED`) are refused. Fields that do
not change the tokens (`user`, `store`, `service_tier`, `stream_options`, `parallel_tool_calls`, ...)
and unknown ones are ignored. `logprobs` is served for the chosen
tokens and asking for top alternatives is a 400 (serving/logprobs.py).
"""

from __future__ import annotations

import json
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

from dvi.decode.request import LOGIT_BIAS_RANGE, PENALTY_RANGE, REPETITION_RANGE

BodyT = TypeVar("BodyT", bound=BaseModel)
"""A request body model (`serving.bodies.parse_body` returns the validated instance of the model it is given)."""


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

    def __reduce__(self):  # pickled whole (an engine process's answer, `serving.engine_core`), not as Exception(message)
        return ApiError, (self.status, self.message, self.param, self.type, self.code, self.headers)


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
    max_choices: int = 64  # n x a completions request's prompts
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
    presence_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=REPETITION_RANGE[0], le=REPETITION_RANGE[1],
                                             allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool = False  # vLLM's: the model's end-of-sequence ids do not end the answer
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: ids that end the answer too (kept in it)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        lim = _limits(info)
        if v and len(v) > lim.max_stop_strings:
            raise ValueError(f"at most {lim.max_stop_strings} stop token ids")
        bad = [t for t in v or () if t < 0 or (lim.vocab_size is not None and t >= lim.vocab_size)]
        if bad:
            raise ValueError(f"{bad[0]} is not a token id in [0, {lim.vocab_size})")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None, info: ValidationInfo) -> dict[str, float] | None:
        vocab = _limits(info).vocab_size
        for key, b in (v or {}).items():
            if not key.strip().isdigit() or (vocab is not None and int(key) >= vocab):
                raise ValueError(f"key {key!r} is not a token id in [0, {vocab})")
            if not (math.isfinite(b) and LOGIT_BIAS_RANGE[0] <= b <= LOGIT_BIAS_RANGE[1]):
                raise ValueError(f"bias of {key} must be in [{LOGIT_BIAS_RANGE[0]:g}, {LOGIT_BIAS_RANGE[1]:g}]")
        return v

    def token_limit(self) -> tuple[int | None, str]:
        """(the requested completion-token limit, the field it came from)."""
        return self.max_tokens, "max_tokens"

    def bias(self) -> dict[int, float] | None:
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("top_k")
    @classmethod
    def _top_k_in_vocab(cls, v: int | None, info: ValidationInfo) -> int | None:
        vocab = _limits(info).vocab_size
        if v is not None and vocab is not None and v > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size ({vocab})")
        return v

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int, info: ValidationInfo) -> int:
        limit = _limits(info).max_choices
        if v > limit:
            raise ValueError(f"n={v} exceeds this server's limit of {limit} choices a request")
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
    """POST /v1/completions: a prompt (text or a list of token ids) or several (a list of either)."""

    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("only best_of equal to n is supported (every sample drawn is returned)")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v

    _chosen_only = _chosen_tokens_only("logprobs")

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list, info: ValidationInfo) -> str | list:
        if isinstance(v, list) and v and isinstance(v[0], str | list) and len(v) == 1:
            v = v[0]  # a batch of one is that prompt
        if not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list):
            if not all(v):
                raise ValueError("prompt must not hold an empty prompt")
            limit = _limits(info).max_choices
            if len(v) * info.data.get("n", 1) > limit:
                raise ValueError(f"{len(v)} prompts x n={info.data.get('n', 1)} exceeds this server's limit of "
                                 f"{limit} choices a request")
            _check_prompt_chars(sum(len(p) for p in v if isinstance(p, str)), info)
        elif isinstance(v, str):
            _check_prompt_chars(len(v), info)
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, each text or token ids."""
        p = self.prompt
        return list(p) if isinstance(p, list) and isinstance(p[0], str | list) else [p]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: Text
    arguments: Text = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message: `content` a string, a list of text parts (joined with newlines, as vLLM does), or null on an
    assistant message with `tool_calls` (rendered into its text as one JSON object per call)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    tool_calls: list[ToolCall] | None = None  # before content: its check reads them
    content: Text | list[dict[str, Any]] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _parts(cls, v: str | list | None, info: ValidationInfo) -> str | None:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (null only on an assistant message with tool_calls)")
        if not isinstance(v, list):
            return v
        texts = []
        for part in v:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(_unicode(part["text"]))
        return "\n".join(texts)

    def text(self) -> str:
        calls = [json.dumps({"name": c.function.name, "arguments": c.function.arguments}, ensure_ascii=False)
                 for c in self.tool_calls or []]
        return "\n".join(([self.content] if self.content else []) + calls)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # OpenAI's current name of the limit (max_tokens is deprecated on chat); when both are set it wins
    max_completion_tokens: StrictInt | None = Field(None, gt=0)
    response_format: dict[str, Any] | None = None
    # tool_choice before tools: the tools check reads it
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    modalities: list[Literal["text", "audio"]] | None = None

    _chosen_only = _chosen_tokens_only("top_logprobs")

    def wants_logprobs(self) -> bool:
        return self.logprobs

    def token_limit(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @field_validator("messages")
    @classmethod
    def _messages_chars(cls, v: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        _check_prompt_chars(sum(len(m.text()) for m in v), info)
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(f"only type 'text' is supported (structured output is not), got {v.get('type')!r}")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_forced_tools(cls, v: str | dict | None) -> str | dict | None:
        if v not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported: the model never calls a tool")
        return v

    @field_validator("tools")
    @classmethod
    def _tools_unused(cls, v: list | None, info: ValidationInfo) -> list | None:
        if v and info.data.get("tool_choice") != "none":
            raise ValueError("tool calling is not supported; send tool_choice 'none' (the tools are then unused)")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, v: list[str] | None) -> list[str] | None:
        if v and set(v) != {"text"}:
            raise ValueError("only the text modality is supported")
        return v


UNSUPPORTED = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "min_p": "min_p sampling is not supported",
    "min_tokens": "min_tokens is not supported",
    "use_beam_search": "beam search is not supported",
    "guided_json": "guided decoding is not supported",
    "guided_regex": "guided decoding is not supported",
    "guided_choice": "guided decoding is not supported",
    "guided_grammar": "guided decoding is not supported",
    "structured_outputs": "structured output is not supported",
    "prompt_logprobs": "prompt log-probs are not computed",
}
"""Request fields (OpenAI's and vLLM's) that change the answer and dvi does not implement: refused when set."""


def unsupported_field(data: dict[str, Any]) -> ApiError | None:
    """The 400 for the first `UNSUPPORTED` field the body sets (None, false and empty count as unset)."""
    for name, why in UNSUPPORTED.items():
        if data.get(name) not in (None, False, [], {}):
            return ApiError(400, f"{why} (parameter '{name}')", param=name)
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
