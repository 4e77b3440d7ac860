"""Drafter kinds: the early-exit drafter shares the target's weights, leaves the target untouched, saves/loads."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from dvi.drafters.learned import EarlyExitDrafter, SeparateDrafter, as_drafter

torch.set_num_threads(1)


def _llama(seed=0, layers=3, tie=False):
    return tiny_llama(seed, vocab_size=120, num_hidden_layers=layers, num_attention_heads=4,
                      max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=tie)


def _gpt2(seed=0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=120, n_embd=32, n_layer=3, n_head=4, n_positions=64)).eval()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("make", [_llama, _gpt2, lambda: _llama(tie=True)])
def test_early_exit_shares_target_weights(make):
    target = make()
    keys_before = set(target.state_dict())
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        ref = target(ids).logits
    t_params = {id(p) for p in target.parameters()}
    t_ptrs = {_storage(p) for p in target.parameters()}
    ee = EarlyExitDrafter(target, num_layers=1, lora_rank=4)
    own = {id(p) for p in ee.trainable_parameters()}
    for name, p in ee.model.named_parameters():
        if id(p) in own:
            continue
        # every non-trainable tensor of the drafter IS a target Parameter (same object, same storage)
        assert id(p) in t_params, name
        assert _storage(p) in t_ptrs, name
    emb_t = target.get_input_embeddings().weight
    assert ee.model.get_input_embeddings().weight.data_ptr() == emb_t.data_ptr()
    assert ee.model.get_output_embeddings().weight.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    # no second copy: the drafter's own parameters are only LoRA + exit head (tiny)
    n_own = sum(p.numel() for p in ee.trainable_parameters())
    assert n_own < 0.2 * sum(p.numel() for p in target.parameters())
    # target untouched: same modules, same state_dict keys, same outputs even with non-zero LoRA
    with torch.no_grad():
        for p in ee.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
        out = target(ids).logits
    assert set(target.state_dict()) == keys_before
    assert torch.equal(out, ref)
    # the drafter itself is a different function (LoRA/exit head active)
    with torch.no_grad():
        d = ee(ids, None, torch.arange(4)[None], None, 0)
    assert d.shape == ref.shape and not torch.allclose(d, ref)


def test_early_exit_sees_in_place_target_updates():
    target = _llama()
    ee = EarlyExitDrafter(target, num_layers=2, lora_rank=0)
    ids = torch.tensor([[3, 4, 5]])
    pos = torch.arange(3)[None]
    with torch.no_grad():
        before = ee(ids, None, pos, None, 0)
        target.load_state_dict(_llama(seed=9).state_dict())  # in place: Parameter objects kept
        after = ee(ids, None, pos, None, 0)
    assert not torch.allclose(before, after)


def test_early_exit_save_load_roundtrip(tmp_path):
    target = _llama()
    ee = EarlyExitDrafter(target, num_layers=1, lora_rank=4, exit_rank=8)
    with torch.no_grad():
        for p in ee.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    ee.save(tmp_path / "v1")
    assert (tmp_path / "v1" / "adapter_model.safetensors").exists()
    loaded = EarlyExitDrafter.load(target, tmp_path / "v1")
    ids, pos = torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None]
    with torch.no_grad():
        assert torch.allclose(ee(ids, None, pos, None, 0), loaded(ids, None, pos, None, 0))
    fresh = EarlyExitDrafter(target, num_layers=1, lora_rank=4, exit_rank=8)
    with torch.no_grad():
        assert not torch.allclose(ee(ids, None, pos, None, 0), fresh(ids, None, pos, None, 0))
    assert loaded.config_dict()["num_layers"] == 1


def test_early_exit_bad_args():
    target = _llama()
    with pytest.raises(ValueError, match="num_layers"):
        EarlyExitDrafter(target, num_layers=0)
    with pytest.raises(ValueError, match="num_layers"):
        EarlyExitDrafter(target, num_layers=4)
    with pytest.raises(ValueError, match="lora_rank"):
        EarlyExitDrafter(target, num_layers=1, lora_rank=-1)


def test_separate_drafter_wraps_hf_and_peft():
    from peft import LoraConfig, get_peft_model

    m = _llama(seed=2, layers=1)
    d = as_drafter(m)
    assert isinstance(d, SeparateDrafter) and d.vocab_size == 120
    pm = get_peft_model(_llama(seed=2, layers=1), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.add_(0.5)
    dp = as_drafter(pm)
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    with torch.no_grad():
        assert not torch.allclose(d(ids, None, pos, None, 0), dp(ids, None, pos, None, 0))  # LoRA is applied
    with pytest.raises(TypeError):
        as_drafter("not a model")
