"""`logprobs` in the OpenAI shapes, from the log-probs the engine already records.

The engine keeps the target's log-prob of every emitted token (`GenerationResult.token_logprobs`,
under the served temperature; T=1 when greedy). Only the chosen tokens are reported: top
alternatives would need the target's top-k at the served temperature, which is not recorded, so
the app refuses asking for them (400).

Tokens are the ones the response's text is made of: special tokens (skipped in the text) and
tokens that start after a stop-string cut are left out. Offsets are character offsets into the
returned completion text, found with one incremental decode (O(tokens)). A token that holds only part
of a UTF-8 character (byte-level BPE splits most CJK and emoji characters) has no text of its own: its
`token` is OpenAI's `bytes:\\xe6\\x97` form (its raw bytes, never "\ufffd"), and chat's `bytes` field
carries the same bytes, so a client can join them into the characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .detok import TextStream


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token as the client sees it."""

    token: str
    logprob: float
    raw: bytes
    offset: int


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte<->unicode table, inverted: a ByteLevel token string back to its raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _is_byte_level(tokenizer: Any) -> bool:
    """A ByteLevel decoder, alone or last in a Sequence (transformers 5.17 built SmolLM2's GGUF tokenizer with
    ByteFallback, Fuse, Replace, ByteLevel)."""
    decoder = getattr(getattr(tokenizer, "_tokenizer", None), "decoder", None)
    decoder_type = type(decoder).__name__
    return decoder_type == "ByteLevel" or (decoder_type == "Sequence" and b'"type":"ByteLevel"' in decoder.__getstate__())


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback pieces


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """The raw UTF-8 bytes a token stands for (a piece of a multi-byte character stays a piece)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if _is_byte_level(tokenizer):
        table = byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
    fallback = _BYTE_FALLBACK.fullmatch(piece or "")
    if fallback is not None:
        return bytes([int(fallback.group(1), 16)])
    return tokenizer.decode([token_id]).encode("utf-8")


def token_text(tokenizer: Any, token_id: int, raw: bytes) -> str:
    """What a token is called in a response: its text, or `bytes:\\xNN...` (OpenAI's form) when its bytes are
    not whole UTF-8 characters (its decode alone would be "\ufffd")."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tokenizer.decode([token_id])


def token_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[float],
                   cut_at: int | None = None) -> list[TokenLogprob]:
    """The chosen tokens of a finished completion (`cut_at`: the text's length after a stop-string cut)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    stream = TextStream(tokenizer)
    out: list[TokenLogprob] = []
    for tid, lp in zip(token_ids, logprobs, strict=False):
        offset = len(stream.text)
        stream.add([tid])
        if tid in special:
            continue
        if cut_at is not None and offset >= cut_at:
            break
        raw = token_bytes(tokenizer, tid)
        out.append(TokenLogprob(token=token_text(tokenizer, tid, raw), logprob=float(lp), raw=raw, offset=offset))
    return out


def completion_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of /v1/completions (chosen tokens only: `top_logprobs` is null)."""
    return {"tokens": [t.token for t in items], "token_logprobs": [t.logprob for t in items],
            "text_offset": [t.offset for t in items], "top_logprobs": None}


def chat_logprobs(items: list[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of /v1/chat/completions (chosen tokens only: `top_logprobs` is [])."""
    return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.raw), "top_logprobs": []}
                        for t in items], "refusal": None}
