"""Tokenising prompts off the event loop without one client's large prompts delaying everyone.

Two things keep a small request from waiting behind seconds of someone else's tokenising:
- a prompt that cannot fit the context is refused before any encode, from a sound lower bound on
  its token count (`min_tokens`): with a byte-level BPE (GPT-2 family: SmolLM2, Llama 3, Qwen, the
  test pair) every token decodes to at most `max_token_bytes` bytes of the (normalised) text, so a
  text of B bytes has at least ceil(B / max_token_bytes) tokens. The bound can only under-count,
  so it never refuses a prompt that fits; for other tokenizers it is 0 (no early refusal).
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

__all__ = ["PromptTokenizer", "utf8_len"]


def utf8_len(text: str) -> int:
    """Bytes of `text` in UTF-8 (validated text: no lone surrogates)."""
    return len(text.encode("utf-8"))


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
    kinds = {pre.get("type")} | {p.get("type") for p in pre.get("pretokenizers", []) or []}
    model = (spec.get("model") or {}).get("type")
    return "ByteLevel" in kinds and model == "BPE", backend.normalizer


class PromptTokenizer:
    """The server's tokenising: the early context check and the two workers."""

    def __init__(self, tokenizer: Any, large_bytes: int = 16384) -> None:
        self.tokenizer = tokenizer
        self.large_bytes = large_bytes
        self.bound_is_sound, self._normalizer = _byte_level(tokenizer)
        # added tokens (special ones) match raw text: their UTF-8 length counts too; a byte-level vocab
        # entry's UTF-8 length is >= the bytes it stands for, so the maximum can only be over-estimated
        self.max_token_bytes = max((utf8_len(t) for t in tokenizer.get_vocab()), default=1) or 1
        self._small = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dvi-tokenize")
        self._large = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dvi-tokenize-large")
        self._large_tokenizer = copy.deepcopy(tokenizer)

    def min_tokens(self, *texts: str) -> int:
        """A lower bound on the tokens of any text that contains `texts` (0 when no sound bound is known)."""
        if not self.bound_is_sound:
            return 0
        norm = self._normalizer.normalize_str if self._normalizer is not None else str
        return math.ceil(sum(utf8_len(norm(t)) for t in texts) / self.max_token_bytes)

    async def run(self, fn: Callable[..., list[int]], size_bytes: int, *args: Any) -> list[int]:
        """`fn(tokenizer, *args)` on the worker for its size: large prompts never delay small ones."""
        large = size_bytes > self.large_bytes
        pool, tok = (self._large, self._large_tokenizer) if large else (self._small, self.tokenizer)
        return await asyncio.get_running_loop().run_in_executor(pool, fn, tok, *args)

    def close(self) -> None:
        for pool in (self._small, self._large):
            pool.shutdown(wait=False, cancel_futures=True)
