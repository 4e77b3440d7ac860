from __future__ import annotations

import pytest
import torch

from dvi.models.loading import (
    IncompatibleModelsError,
    ModelPair,
    check_compatible,
    decode_step_latency,
    load_causal_lm,
    load_pair,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)


def test_resolve_device_and_dtype():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type in {"cpu", "cuda", "mps"}
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("float13")


def test_load_pair_embedded_layout(tiny_pair_dir):
    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", device="cpu")
    assert isinstance(pair, ModelPair)
    assert not pair.target.training and not pair.drafter.training
    assert pair.target.config.vocab_size == pair.drafter.config.vocab_size == len(pair.tokenizer)
    ids = pair.tokenizer("def f(x):\n    return x", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == pair.tokenizer.bos_token_id
    assert pair.target(input_ids=ids).logits.shape[-1] == len(pair.tokenizer)
    # target alone works too
    assert load_pair(tiny_pair_dir / "target").drafter is None


def _save_llama(path, vocab_size):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_vocab_mismatch_is_a_clear_error(tiny_pair_dir, tmp_path):
    bad = _save_llama(tmp_path / "bad", vocab_size=len(load_tokenizer(tiny_pair_dir / "tokenizer")) + 7)
    with pytest.raises(IncompatibleModelsError, match="vocab size mismatch"):
        load_pair(tiny_pair_dir / "target", bad, tiny_pair_dir / "tokenizer", device="cpu")
    assert issubclass(IncompatibleModelsError, ValueError)


def test_tokenizer_mismatch_is_a_clear_error(tiny_pair_dir, tmp_path):
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    d = tmp_path / "drafter"
    load_causal_lm(tiny_pair_dir / "drafter", device="cpu").save_pretrained(d)
    # same size vocabulary, but two ids swapped: a different tokenizer
    vocab = tok.get_vocab()
    other = dict(vocab)
    a, b = sorted(other, key=other.get)[10:12]
    other[a], other[b] = other[b], other[a]

    class FakeTok:
        def get_vocab(self):
            return other

        def __len__(self):
            return len(other)

    target = load_causal_lm(tiny_pair_dir / "target", device="cpu")
    drafter = load_causal_lm(d, device="cpu")
    check_compatible(target, drafter, tok, tok)  # same tokenizer: fine
    with pytest.raises(IncompatibleModelsError, match="tokenizer mismatch"):
        check_compatible(target, drafter, tok, FakeTok())


def test_tokenizer_larger_than_model_vocab(tiny_pair_dir, tmp_path):
    small = _save_llama(tmp_path / "small", vocab_size=100)
    with pytest.raises(IncompatibleModelsError, match="tokenizer has"):
        load_pair(small, tokenizer_path=tiny_pair_dir / "tokenizer")


def test_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_causal_lm(tmp_path / "nope")


def test_decode_step_latency_positive(tiny_pair_dir):
    m = load_causal_lm(tiny_pair_dir / "drafter", device="cpu")
    s = decode_step_latency(m, steps=4, warmup=1)
    assert 0 < s < 1.0


def test_load_pair_from_config(tiny_pair_dir):
    from types import SimpleNamespace

    from dvi.models.loading import load_pair_from_config

    cfg = SimpleNamespace(preset="tiny", target=tiny_pair_dir / "target", drafter=tiny_pair_dir / "drafter",
                          tokenizer=None, device="cpu", dtype="auto")
    pair = load_pair_from_config(cfg)
    assert pair.drafter is not None and len(pair.tokenizer) == pair.target.config.vocab_size


def test_load_state_dict_reads_sharded_and_single_checkpoints(tmp_path):
    """A target update from a directory reads it as save_pretrained wrote it: every shard of the index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dvi.models.loading import load_state_dict

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    model.save_pretrained(tmp_path / "single")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    (tmp_path / "sharded" / "stray.safetensors").write_bytes(b"not a shard")  # not in the index: never read
    want = model.state_dict()
    for d in ("sharded", "single"):
        got = load_state_dict(tmp_path / d)
        assert got.keys() == want.keys(), d
        assert all(torch.equal(got[k], want[k]) for k in want), d
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="state_dict_or_path.*save_pretrained"):
        load_state_dict(tmp_path / "empty")
