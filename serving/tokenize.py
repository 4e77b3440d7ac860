"""Tokenising prompts off the event loop without one client's large prompts delaying everyone.

Two things keep a small request from waiting behind seconds of someone else's tokenising:
- a prompt that cannot fit the context is refused before any encode, from a sound lower bound on
  its token count (`min_tokens`): with a byte-level BPE (GPT-2 family: SmolLM2, Llama 3, Qwen, the
  test pair) the tokens' bytes are exactly the (normalised) text's bytes, and no token holds more
  than `max_bytes` of them, `max_ascii` ASCII ones or `max_nonascii` others (SmolLM2: 81, 81, 24),
  so a text with A ASCII and N other bytes has at least max(ceil((A + N) / max_bytes),
  ceil(A / max_ascii), ceil(N / max_nonascii)) tokens. The bound can only under-count, so it never
  refuses a prompt that fits; for other tokenizers it is 0 (no early refusal).
- prompts over `serve.tokenize_large_bytes` are tokenised on their own worker with their own copy
  of the tokenizer (HF fast tokenizers must not be shared between threads), so small prompts keep
  their worker to themselves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
from collections.abc import Callable
from typing import Any

from .logprobs import byte_level_decoder

__all__ = ["PromptTokenizer", "utf8_len"]


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8 (validated text: no lone surrogates)."""
    return len(text.encode("utf-8"))


def _token_byte_maxima(tokenizer: Any) -> tuple[int, int, int] | None:
    """(most bytes, most ASCII bytes, most other bytes) any token stands for; None if a vocabulary entry is not
    in the byte-level alphabet. Added (special) tokens match the raw text: their own UTF-8 bytes count."""
    alphabet = byte_level_decoder()
    model_vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    entries = [[alphabet.get(c, -1) for c in tok] for tok in model_vocab]
    entries += [list(tok.encode("utf-8")) for tok in tokenizer.get_added_vocab()]
    if any(-1 in e for e in entries):
        return None
    ascii_ = [sum(b < 128 for b in e) for e in entries]
    return (max(map(len, entries), default=1), max(ascii_, default=1),
            max((len(e) - a for e, a in zip(entries, ascii_, strict=True)), default=1))


def _byte_level(tokenizer: Any) -> tuple[bool, Any]:
    """(whether the tokenizer is a byte-level BPE whose tokens decode to the normalised input's bytes,
    its normalizer or None)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False, None
    try:
        spec = json.loads(backend.to_str())
    except (ValueError, AttributeError):
        return False, None
    pre = spec.get("pre_tokenizer") or {}
    types = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", []) or []}
    model = (spec.get("model") or {}).get("type")
    return "ByteLevel" in types and model == "BPE", backend.normalizer


class PromptTokenizer:
    """The server's tokenising: the early context check and the two workers."""

    def __init__(self, tokenizer: Any, large_bytes: int = 16384) -> None:
        self.tokenizer = tokenizer
        self.large_bytes = large_bytes
        sound, self._normalizer = _byte_level(tokenizer)
        maxima = _token_byte_maxima(tokenizer) if sound else None
        self.bound_is_sound = maxima is not None
        self.max_bytes, self.max_ascii, self.max_nonascii = (max(1, m) for m in (maxima or (1, 1, 1)))
        self._small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dvi-tokenize")
        self._large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dvi-tokenize-large")
        self._large_tokenizer = copy.deepcopy(tokenizer)

    def min_tokens(self, *texts: str) -> int:
        """A lower bound on the tokens of any text that contains `texts` (0 when no sound bound is known)."""
        if not self.bound_is_sound:
            return 0
        norm = self._normalizer.normalize_str if self._normalizer is not None else str
        texts = [norm(t) for t in texts]
        total = sum(utf8_len(t) for t in texts)
        ascii_ = sum(len(t.encode("ascii", "ignore")) for t in texts)
        return max(math.ceil(total / self.max_bytes), math.ceil(ascii_ / self.max_ascii),
                   math.ceil((total - ascii_) / self.max_nonascii))

    async def run(self, fn: Callable[..., list[int]], size_bytes: int, *args: Any) -> list[int]:
        """`fn(tokenizer, *args)` on the worker for its size: large prompts never delay small ones."""
        large = size_bytes > self.large_bytes
        pool, tok = (self._large, self._large_tokenizer) if large else (self._small, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, tok, *args)

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
