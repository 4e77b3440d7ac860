"""A request to the engine: its sampling parameters and the checks a request must pass before it joins a
batch (bad ones raise `InvalidParam` naming the field, the server's 400)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["InvalidParam", "SamplingParams", "Request", "SEED_RANGE", "MAX_DRAFT_TOKENS_LIMIT", "PENALTY_RANGE",
           "REPETITION_RANGE", "LOGIT_BIAS_RANGE", "is_int", "validate_prompt", "validate_params",
           "validate_penalties", "validate_engine_limits"]

MAX_DRAFT_TOKENS_LIMIT = 32
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency penalties (OpenAI's range)
REPETITION_RANGE = (0.0, 10.0)  # repetition_penalty in (0, 10]; 1 = off
LOGIT_BIAS_RANGE = (-100.0, 100.0)

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


class InvalidParam(ValueError):
    """A request parameter the engine cannot serve; `param` names it (the server's 400 says which)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    # transforms of the target's logits (`dvi.decode.sampling.penalize`), lossless: drafts are judged against them
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None

    def transforms_logits(self) -> bool:
        """Whether any penalty or bias is set (rows without one skip the transform)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str = "default"
    # the traffic group whose drafter adapter drafts for this request (`dvi.drafters.adapters`; "" for none)
    group: str = ""
    # the client request this is one choice of ("" for a request of one): a cohort's rows join the batch in one step,
    # since its answer waits for its last row (`dvi.engine.options.prefill_share`)
    cohort: str = ""


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_prompt(prompt, name: str, vocab_size: int, num_embeddings: int) -> None:
    if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    if not all(is_int(t) for t in prompt):
        raise ValueError(f"{name} must contain only ints")
    lo, hi = min(prompt), max(prompt)
    if lo < 0 or hi >= vocab_size or hi >= num_embeddings:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} has token id {bad} outside the vocabulary [0, {vocab_size})")


def validate_params(p: SamplingParams, prompt_len: int, vocab_size: int, max_context: int | None,
                    prompt_name: str = "prompt_ids") -> None:
    if not is_int(p.max_new_tokens) or p.max_new_tokens <= 0:
        raise InvalidParam("max_tokens", f"max_new_tokens must be a positive int, got {p.max_new_tokens!r}")
    if not isinstance(p.temperature, (int, float)) or not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidParam("temperature", f"temperature must be a finite number >= 0, got {p.temperature!r}")
    if not is_int(p.top_k) or not 0 <= p.top_k <= vocab_size:
        raise InvalidParam("top_k", f"top_k must be an int in [0, {vocab_size}] (the vocabulary), "
                                    f"got {p.top_k!r}")
    if not isinstance(p.top_p, (int, float)) or not 0 < p.top_p <= 1:
        raise InvalidParam("top_p", f"top_p must be in (0, 1], got {p.top_p!r}")
    if p.seed is not None and (not is_int(p.seed) or not SEED_RANGE[0] <= p.seed <= SEED_RANGE[1]):
        raise InvalidParam("seed", f"seed must be an int in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or None, "
                                   f"got {p.seed!r}")
    if any(not is_int(t) for t in (p.stop_token_ids or ())):
        raise ValueError("stop_token_ids must be ints")
    validate_penalties(p, vocab_size)
    if max_context is not None and prompt_len + p.max_new_tokens > max_context:
        raise InvalidParam("max_tokens",
            f"max_new_tokens={p.max_new_tokens} + {prompt_name} length {prompt_len} exceeds the target's "
            f"max_position_embeddings={max_context}"
        )


def _finite_in(x, lo: float, hi: float, lo_open: bool = False) -> bool:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return ok and (lo < x if lo_open else lo <= x) and x <= hi


def validate_penalties(p: SamplingParams, vocab_size: int) -> None:
    """The logit transforms: penalties in range, logit_bias keys token ids of the vocabulary, values in range."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not _finite_in(getattr(p, name), *PENALTY_RANGE):
            raise InvalidParam(name, f"{name} must be a number in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], "
                                     f"got {getattr(p, name)!r}")
    if not _finite_in(p.repetition_penalty, *REPETITION_RANGE, lo_open=True):
        raise InvalidParam("repetition_penalty", f"repetition_penalty must be in (0, {REPETITION_RANGE[1]:g}], "
                                                 f"got {p.repetition_penalty!r}")
    for t, b in (p.logit_bias or {}).items():
        if not is_int(t) or not 0 <= t < vocab_size:
            raise InvalidParam("logit_bias", f"logit_bias key {t!r} is not a token id in [0, {vocab_size})")
        if not _finite_in(b, *LOGIT_BIAS_RANGE):
            raise InvalidParam("logit_bias", f"logit_bias[{t}] must be in [{LOGIT_BIAS_RANGE[0]:g}, "
                                             f"{LOGIT_BIAS_RANGE[1]:g}], got {b!r}")


def validate_engine_limits(num_draft_tokens: int, max_draft_tokens: int, feedback_top_k: int) -> None:
    """The engine's own settings: K within [0, max_draft_tokens], max_draft_tokens within the hard limit."""
    if not is_int(max_draft_tokens) or not 0 <= max_draft_tokens <= MAX_DRAFT_TOKENS_LIMIT:
        raise ValueError(f"max_draft_tokens must be an int in [0, {MAX_DRAFT_TOKENS_LIMIT}], got {max_draft_tokens!r}")
    if not is_int(num_draft_tokens) or not 0 <= num_draft_tokens <= max_draft_tokens:
        raise ValueError(
            f"num_draft_tokens must be an int in [0, max_draft_tokens={max_draft_tokens}], got {num_draft_tokens!r}"
        )
    if not is_int(feedback_top_k) or feedback_top_k < 0:
        raise ValueError(f"feedback_top_k must be an int >= 0, got {feedback_top_k!r}")
