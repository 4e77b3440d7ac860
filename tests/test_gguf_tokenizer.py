"""Issue 36 item 10 (conversion side): the tokenizer built from a GGUF is what the file states, the same on
every supported transformers version, or the build refuses with what to install.

transformers 5.17 built SmolLM2's tokenizer with eos = bos = `<|im_start|>`, no pad and SentencePiece's decoder
sequence (an empty normalizer Sequence, byte fallback, untrimmed offsets beside); `convert_gguf` normalises
all of it from the GGUF's metadata, checks the result (vocabulary, special ids, template, round trips, the
model config's eos / bos, the validated digest of a known GGUF) and records the library versions and the
tokenizer's digest beside it, which `load_pair` compares on every load. The stand-in GGUF is test_pretrained's
(a tiny Llama written as llama.cpp writes SmolLM2's).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_pretrained import CHAT_SPECIALS, CHATML, ENDOFTEXT, _tiny_llama, _write_llama_gguf

from dvi.models import gguf_tokenizer
from dvi.models.embedded import embedded_paths, is_built
from dvi.models.gguf_tokenizer import KNOWN_DIGESTS, TokenizerConversionError
from dvi.models.loading import load_pair, load_tokenizer
from dvi.models.pretrained import convert_gguf, sha256_file
from dvi.models.tokenizer_check import CONVERSION_RECORD, library_versions, tokenizer_digest

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gguf_path(tiny_pair_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair_dir / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, *CHAT_SPECIALS]})
    tok.chat_template = CHATML
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|im_end|>"  # SmolLM2's specials: eos = pad = <|im_end|>
    model = _tiny_llama(len(tok), tied=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    return _write_llama_gguf(tmp_path_factory.mktemp("gguf-tok") / "tiny.F32.gguf", model, tok)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    convert_gguf(gguf_path, root / "target", root / "tokenizer")
    return root


def _as_transformers_5_17(monkeypatch) -> None:
    """Make the GGUF tokenizer come out as transformers 5.17 builds SmolLM2's."""
    from tokenizers import decoders, normalizers
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def skewed(*args, **kwargs):
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.eos_token, tok.pad_token = tok.bos_token, None
            backend = tok.backend_tokenizer
            backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                 decoders.Replace("▁", " "), decoders.ByteLevel()])
            backend.normalizer = normalizers.Sequence([])
            backend.model.byte_fallback = True
            backend.pre_tokenizer.trim_offsets = False
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", skewed)


def test_the_conversion_records_versions_and_digest(converted) -> None:
    record = json.loads((converted / "tokenizer" / CONVERSION_RECORD).read_text())
    tok = load_tokenizer(converted / "tokenizer")
    assert record["tokenizer_digest"] == tokenizer_digest(tok)
    assert record["libraries"] == library_versions() and {"transformers", "tokenizers", "gguf"} <= set(record["libraries"])
    assert record["special_ids"] == {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    assert load_pair(converted / "target", None, converted / "tokenizer", device="cpu").warnings == []


def test_another_versions_tokenizer_is_normalised_to_the_same(gguf_path, converted, tmp_path, monkeypatch) -> None:
    _as_transformers_5_17(monkeypatch)
    convert_gguf(gguf_path, tmp_path / "target", tmp_path / "tokenizer")
    record = json.loads((tmp_path / "tokenizer" / CONVERSION_RECORD).read_text())
    fixed = " | ".join(record["normalised"])
    for what in ("eos_token", "pad_token", "decoder Sequence -> ByteLevel", "normalizer", "byte_fallback",
                 "trim_offsets"):
        assert what in fixed, (what, fixed)
    want = json.loads((converted / "tokenizer" / CONVERSION_RECORD).read_text())["tokenizer_digest"]
    assert record["tokenizer_digest"] == want == tokenizer_digest(load_tokenizer(tmp_path / "tokenizer"))


def test_what_cannot_be_normalised_is_refused(gguf_path, tmp_path, monkeypatch) -> None:
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained

    def extra_token(*args, **kwargs):
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.add_tokens(["<|not-in-the-gguf|>"])
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", extra_token)
    with pytest.raises(TokenizerConversionError, match="tokens, the GGUF has") as err:
        convert_gguf(gguf_path, tmp_path / "target", tmp_path / "tokenizer")
    assert "pip install 'transformers==" in str(err.value) and library_versions()["transformers"] in str(err.value)


def test_a_known_gguf_must_give_its_validated_tokenizer(gguf_path, converted, tmp_path, monkeypatch) -> None:
    digest = json.loads((converted / "tokenizer" / CONVERSION_RECORD).read_text())["tokenizer_digest"]
    monkeypatch.setitem(KNOWN_DIGESTS, sha256_file(gguf_path), {**digest, "probes": "0" * 16, "all": "0" * 16})
    with pytest.raises(TokenizerConversionError, match="validated for this GGUF in: probes"):
        convert_gguf(gguf_path, tmp_path / "target", tmp_path / "tokenizer")
    monkeypatch.setitem(KNOWN_DIGESTS, sha256_file(gguf_path), digest)
    convert_gguf(gguf_path, tmp_path / "target", tmp_path / "tokenizer")


def test_a_tokenizer_that_loads_otherwise_than_built_is_said(converted, tmp_path, caplog) -> None:
    import shutil

    tok_dir = tmp_path / "tokenizer"
    shutil.copytree(converted / "tokenizer", tok_dir)
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "<|im_start|>"  # as a 5.17 conversion saved it
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    pair = load_pair(converted / "target", None, tok_dir, device="cpu")
    assert len(pair.warnings) == 2, pair.warnings
    mismatch, drift = pair.warnings
    assert "tokenizer eos is '<|im_start|>'" in mismatch and "dvi stops on all of them" in mismatch
    assert "loads differently from how it was built (special_ids differ" in drift and "dvi bootstrap" in drift
    assert set(pair.stop_ids) == {pair.tokenizer.convert_tokens_to_ids(t) for t in CHAT_SPECIALS}


def test_every_gguf_metadata_special_is_read(gguf_path) -> None:
    spec = gguf_tokenizer.read_gguf_tokenizer(gguf_path)
    assert spec.model == "gpt2" and spec.chat_template == CHATML and spec.tokens[spec.special_ids["eos"]] == "<|im_end|>"


@pytest.mark.skipif(not is_built("smollm2"), reason="the smollm2 pair is not built here")
def test_the_embedded_smollm2_tokenizer_is_the_validated_one() -> None:
    tok = load_tokenizer(embedded_paths("smollm2").tokenizer)
    [validated] = KNOWN_DIGESTS.values()
    assert tokenizer_digest(tok) == validated
