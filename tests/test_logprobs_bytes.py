"""Issue 36 item 14: a logprobs token that holds part of a UTF-8 character is named by its bytes.

Byte-level BPE splits most CJK and emoji characters across tokens; such a token decoded alone is "\ufffd",
which told the client nothing (23 of 24 tokens of a Japanese completion). The server names it as OpenAI
does, `bytes:\\xe6`, and chat's `bytes` field carries the same raw bytes.
"""

from __future__ import annotations

import pytest
from test_serving_helpers import ServerThread, tiny_config

from dvi.models.loading import load_tokenizer
from serving.logprobs import token_bytes, token_logprobs

JAPANESE = "日本語のテキストです。"


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory):
    with ServerThread(tiny_config(tiny_pair_dir, tmp_path_factory.mktemp("lp-bytes"))) as s:
        yield s


def _lead_byte_id(tok) -> int:
    """The byte-level token of byte 0xE6 alone (the lead byte of 日): never a whole character."""
    tid = tok.convert_tokens_to_ids("æ")  # GPT-2's byte alphabet writes byte 0xE6 as U+00E6
    assert token_bytes(tok, tid) == b"\xe6"
    return tid


def test_partial_character_tokens_are_named_by_their_bytes_over_http(server) -> None:
    tok = server.state.tokenizer
    bias = {str(_lead_byte_id(tok)): 100}
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 4, "logprobs": 0, "logit_bias": bias})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == ["bytes:\\xe6"] * 4, lp["tokens"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                                 "logprobs": True, "logit_bias": bias})
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert [(c["token"], c["bytes"]) for c in content] == [("bytes:\\xe6", [0xE6])] * 3


def test_japanese_tokens_keep_their_bytes(tiny_pair_dir) -> None:
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    ids = tok.encode(JAPANESE, add_special_tokens=False)
    items = token_logprobs(tok, ids, [-0.5] * len(ids))
    assert b"".join(t.raw for t in items) == JAPANESE.encode()
    assert not any("\ufffd" in t.token for t in items)
    for t in items:
        try:
            assert t.token == t.raw.decode("utf-8")
        except UnicodeDecodeError:
            assert t.token == "bytes:" + "".join(f"\\x{b:02x}" for b in t.raw)
    assert sum(t.token.startswith("bytes:") for t in items) >= len(JAPANESE) // 2  # most are pieces


def test_a_byte_level_decoder_inside_a_sequence_still_gives_bytes(tiny_pair_dir) -> None:
    """A pair converted by transformers 5.17 before dvi normalised it has that decoder sequence."""
    from tokenizers import decoders

    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                       decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    ids = tok.encode(JAPANESE, add_special_tokens=False)
    assert b"".join(t.raw for t in token_logprobs(tok, ids, [-0.5] * len(ids))) == JAPANESE.encode()
