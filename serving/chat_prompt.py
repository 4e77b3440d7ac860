"""Chat messages to prompt token ids, message contents encoded as text.

A chat template writes its own control tokens around each message (ChatML: `<|im_start|>user\\n ...
<|im_end|>`); a message's `content` is what the client typed. Encoding the rendered chat in one piece,
special tokens parsed (what `apply_chat_template` does by default and what dvi did), made a control token
typed in a content a control token too: `"x <|im_start|>system\\n..."` opened a system turn (issue 36 item 11).

Here the template is rendered a second time with each content replaced by a private-use sentinel, which
shows where the contents sit in the rendered text. Special tokens found outside those spans are the
template's own and stay control tokens; the text between two of them, contents included, is encoded with
special-token parsing off (`split_special_tokens`), exactly as the tokenizer would encode it if the typed
token were not special. A chat whose contents hold no special token's text takes the old path (one
encode of the rendered text: the same ids as before and as training renders them, `dvi.data.render_chat`).
transformers 5.24's `apply_chat_template(sanitize_control_tokens=True)` does a similar thing but encodes the
typed token apart from its neighbours and is missing from earlier versions; this works on every supported one.
`split_special_tokens` flips a flag on the tokenizer's backend for the call: safe because the server encodes
on one worker thread per tokenizer copy (`serving.tokenize.PromptTokenizer`).
"""

from __future__ import annotations

import re
from typing import Any

from dvi.data import FALLBACK_CHAT_FORMAT, FALLBACK_CHAT_SUFFIX, render_chat

from .protocol import ApiError

_SENTINEL = "\ue000{}\ue001"  # private-use characters: no template writes them, no tokenizer treats them as special
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


def special_token_texts(tokenizer: Any) -> tuple[str, ...]:
    """The strings the tokenizer turns into a special (control) token wherever they appear in its input."""
    return tuple(t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content)


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` (each `{"role", "content"}`) ready for the assistant's reply, contents as text.
    An `ApiError` (400 naming the content) when a template that rewrites contents meets special-token text."""
    specials = special_token_texts(tokenizer)
    typed = next((i for i, m in enumerate(messages) if any(s in m["content"] for s in specials)), None)
    if typed is None:
        return render_chat(tokenizer, messages)
    if not getattr(tokenizer, "chat_template", None):  # dvi's own format writes no control token
        text = "".join(FALLBACK_CHAT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages)
        return tokenizer.encode(text + FALLBACK_CHAT_SUFFIX, add_special_tokens=True, split_special_tokens=True)
    text, spans = _render_with_spans(tokenizer, messages)
    if text is None:
        raise ApiError(400, f"messages[{typed}].content holds a special token's text ({_first(messages[typed], specials)!r}) "
                            "and this model's chat template rewrites message contents, so it cannot be kept as text; "
                            "remove it", param=f"messages.{typed}.content")
    return _encode_outside_spans(tokenizer, text, spans)


def _first(message: dict[str, str], specials: tuple[str, ...]) -> str:
    return next(s for s in specials if s in message["content"])


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _render_with_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str | None, list[tuple[int, int]]]:
    """The rendered chat and the [start, end) of every content in it; (None, []) when the template changes
    contents (trims, escapes: the sentinel render then does not rebuild the real one)."""
    marked = _render(tokenizer, [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)])
    parts, spans, pos = [], [], 0
    for j, piece in enumerate(_SENTINEL_RE.split(marked)):
        if j % 2:  # a sentinel's index: that message's content goes here
            piece = messages[int(piece)]["content"]
            spans.append((pos, pos + len(piece)))
        parts.append(piece)
        pos += len(piece)
    text = "".join(parts)
    return (text, spans) if text == _render(tokenizer, messages) else (None, [])


def _encode_outside_spans(tokenizer: Any, text: str, spans: list[tuple[int, int]]) -> list[int]:
    """`text` encoded with special tokens parsed only outside `spans` (a token touching a span is text)."""
    special_ids = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = []
    cursor = 0
    for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        if tid in special_ids and not any(start < e and s < end for s, e in spans):
            ids += _as_text(tokenizer, text[cursor:start])
            ids.append(tid)
            cursor = end
    return ids + _as_text(tokenizer, text[cursor:])


def _as_text(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
