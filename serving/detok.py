"""Incremental detokenization: each engine step decodes only that step's new tokens.

Re-decoding a whole stream every step costs O(n) per step, O(n^2) per stream. `TextStream`
keeps a tokenizers `DecodeStream` per request (it re-decodes only a small window of recent
tokens to get the spacing and multi-byte characters right), so a step costs O(new tokens).

`text` is the text of every complete character so far (a UTF-8 character split across tokens
waits for its last byte). `final_text()` is the one full decode at the end, so a finished
request's text is exactly `tokenizer.decode(ids, skip_special_tokens=True)` as before.

Tokenizers DecodeStream cannot reproduce exactly (a slow tokenizer, or transformers'
`clean_up_tokenization_spaces`, which rewrites text across token boundaries) fall back to the
full decode every step: correct, just quadratic.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


def _rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind an HF tokenizer when DecodeStream reproduces its decode."""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if not getattr(tokenizer, "is_fast", False):
        return None
    return getattr(tokenizer, "_tokenizer", None)


class TextStream:
    """One request's generated text, grown a step at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""
        self._rust = _rust_tokenizer(tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True) if self._rust is not None else None

    def add(self, ids: list[int]) -> None:
        """Append one step's new tokens and the text they complete."""
        self.token_ids.extend(ids)
        if not ids:
            return
        if self._stream is None:
            self.text = self._decode_all()
        else:
            self.text += self._stream.step(self._rust, list(ids)) or ""

    def final_text(self) -> str:
        """The whole stream decoded at once (what a non-streamed request always returned)."""
        return self._decode_all()

    def _decode_all(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
