"""Reduced draft vocabulary: counting, the file format, loading from a drafter dir, the cached head slice.

Losslessness with a reduced drafter is in tests/test_engine.py (greedy) and tests/test_sampling.py
(chi-square); its loss in tests/test_losses.py; training + publishing in tests/test_online_publish.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from dvi.drafters.vocab import (
    DRAFT_VOCAB_FILE,
    SubsetHead,
    apply_draft_vocab,
    find_subset_head,
    frequent_token_ids,
    load_draft_vocab,
    save_draft_vocab,
    subset_mode,
)
from dvi.models.loading import load_causal_lm, load_pair

torch.set_num_threads(1)


def test_frequent_token_ids_priority_order():
    seqs = [[5, 5, 5, 2, 2, 9], torch.tensor([9, 9, 9, 9, 1])]
    # counts: 9 x5, 5 x3, 2 x2, 1 x1; `always` first whatever its count; ties go to the smaller id
    assert frequent_token_ids(seqs, 10, always=[7, 0]).tolist() == [7, 0, 9, 5, 2, 1]
    assert frequent_token_ids(seqs, 3, always=[7]).tolist() == [7, 9, 5]
    # with the vocabulary size never-seen ids fill up, smallest first
    assert frequent_token_ids(seqs, 7, vocab_size=12).tolist() == [9, 5, 2, 1, 0, 3, 4]
    assert frequent_token_ids([[3, 4], [4, 3]], 2).tolist() == [3, 4]
    with pytest.raises(ValueError, match="must lie in"):
        frequent_token_ids(seqs, 3, vocab_size=8)


def test_build_draft_vocab_from_text(tiny_pair_dir, tmp_path):
    from dvi.drafters.vocab import build_draft_vocab
    from dvi.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    texts = ["def f(x):\n    return x + 1\n", "for i in range(10):\n    print(i)\n"] * 3
    order = build_draft_vocab(tok, texts, tmp_path, vocab_size=len(tok))
    assert sorted(order.tolist()) == list(range(len(tok)))  # the whole vocabulary, any prefix usable
    specials = set(tok.all_special_ids)
    assert set(order[: len(specials)].tolist()) == specials  # EOS / BOS / pad always kept
    seen = {t for s in texts for t in tok.encode(s, add_special_tokens=False)}
    assert set(order[len(specials): len(specials) + len(seen - specials)].tolist()) == seen - specials
    assert load_draft_vocab(tmp_path, 20, len(tok)).tolist() == sorted(order[:20].tolist())


def test_file_round_trip_and_size_semantics(tmp_path):
    ids = torch.tensor([9, 2, 40, 7, 31, 0])  # priority order, as stored
    path = save_draft_vocab(tmp_path, ids, vocab_size=50)
    assert path == tmp_path / DRAFT_VOCAB_FILE
    assert load_draft_vocab(tmp_path, None, 50).tolist() == [0, 2, 7, 9, 31, 40]  # all, sorted
    assert load_draft_vocab(path, 3, 50).tolist() == [2, 9, 40]  # the 3 first of the priority order
    assert load_draft_vocab(tmp_path, 0, 50) is None  # 0 = full vocabulary
    with pytest.raises(ValueError, match="models.draft_vocab_size=7 exceeds the 6 ids"):
        load_draft_vocab(tmp_path, 7, 50)
    with pytest.raises(ValueError, match="50-token vocabulary"):
        load_draft_vocab(tmp_path, None, 64)
    empty = tmp_path / "none"
    empty.mkdir()
    assert load_draft_vocab(empty, None) is None
    with pytest.raises(ValueError, match="models.draft_vocab_size=4 but there is no"):
        load_draft_vocab(empty, 4)
    with pytest.raises(ValueError, match="duplicate"):
        save_draft_vocab(tmp_path / "dup", [1, 2, 1], vocab_size=50)


def test_reduced_model_saves_as_the_plain_full_vocab_model(tiny_pair_dir, tmp_path):
    model = load_causal_lm(tiny_pair_dir / "drafter", "cpu")
    x = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(input_ids=x).logits
    apply_draft_vocab(model, torch.arange(0, 512, 7))
    model.save_pretrained(tmp_path / "saved")
    again = load_causal_lm(tmp_path / "saved", "cpu")
    assert find_subset_head(again) is None
    with torch.no_grad():
        assert torch.equal(again(input_ids=x).logits, want)


def test_subset_head_shares_weights_and_refreshes_its_slice(tiny_pair_dir):
    model = load_causal_lm(tiny_pair_dir / "drafter", "cpu")
    keys = set(model.state_dict())
    ids = torch.tensor([3, 1, 100, 511, 42])
    apply_draft_vocab(model, ids)
    head = model.get_output_embeddings()
    assert isinstance(head, SubsetHead) and head.token_ids.tolist() == [1, 3, 42, 100, 511]
    assert set(model.state_dict()) == keys  # still a plain full-vocab HF model on disk
    x = torch.tensor([[5, 6, 7, 8]])

    def served_and_expected() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            h = model.model(input_ids=x).last_hidden_state  # [1, 4, H]
            return model(input_ids=x).logits, h @ head.weight[head.token_ids].T  # [1, 4, V], [1, 4, N]

    a, want = served_and_expected()
    assert torch.allclose(a[..., head.token_ids], want, atol=1e-5)
    outside = torch.ones(a.shape[-1], dtype=torch.bool)
    outside[head.token_ids] = False
    assert bool(torch.isneginf(a[..., outside]).all())
    with torch.no_grad():  # an in-place update of the full head (optimiser step, target update) ...
        head.weight.mul_(2.0)
    b, want = served_and_expected()
    assert torch.allclose(b[..., head.token_ids], want, atol=1e-5)  # ... is seen
    assert not torch.allclose(b, a)
    with subset_mode(model) as sh:
        assert sh is head
        sub = model(input_ids=x).logits  # [1, 4, N] for the trainer's loss
    assert sub.shape[-1] == 5 and not head.subset_only
    sub.sum().backward()  # gradients reach the full weight's subset rows (and, tied, the input tokens' rows)
    g = head.weight.grad
    untouched = outside.clone()
    untouched[x[0]] = False
    assert bool((g[head.token_ids].abs().sum(-1) > 0).all()) and bool((g[untouched] == 0).all())
    apply_draft_vocab(model, None)
    assert not isinstance(model.get_output_embeddings(), SubsetHead)
    assert model.get_output_embeddings().weight is head.weight


def test_load_pair_reads_the_drafter_dirs_vocabulary(tiny_pair_dir, tmp_path):
    d = tmp_path / "drafter"
    shutil.copytree(tiny_pair_dir / "drafter", d)
    order = torch.randperm(512, generator=torch.Generator().manual_seed(0))[:64]
    save_draft_vocab(d, order, vocab_size=512)
    pair = load_pair(tiny_pair_dir / "target", d, tiny_pair_dir / "tokenizer", device="cpu")
    assert find_subset_head(pair.drafter).num_ids == 64
    small = load_pair(tiny_pair_dir / "target", d, tiny_pair_dir / "tokenizer", device="cpu", draft_vocab_size=16)
    assert find_subset_head(small.drafter).token_ids.tolist() == sorted(order[:16].tolist())
    full = load_pair(tiny_pair_dir / "target", d, tiny_pair_dir / "tokenizer", device="cpu", draft_vocab_size=0)
    assert find_subset_head(full.drafter) is None
    # the same dir is still a normal HF model: the full-vocabulary assistant of HF assisted generation
    assistant = load_causal_lm(d, "cpu")
    assert find_subset_head(assistant) is None
    ids = pair.tokenizer("def f(x):", return_tensors="pt")["input_ids"]
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    plain = pair.target.generate(input_ids=ids, **kw)
    assert torch.equal(pair.target.generate(input_ids=ids, assistant_model=assistant, **kw), plain)


def test_serving_pair_and_config_keys(tiny_pair_dir, tmp_path):
    from dvi.config import ConfigError, load_config
    from dvi.drafters.learned import EarlyExitDrafter
    from serving.loading import load_serving_pair

    save_draft_vocab(tmp_path, torch.arange(100, 0, -1), vocab_size=512)
    base = [f"models.target={tiny_pair_dir / 'target'}", f"models.drafter={tiny_pair_dir / 'drafter'}",
            f"models.tokenizer={tiny_pair_dir / 'tokenizer'}", "models.device=cpu", f"models.draft_vocab={tmp_path}"]
    pair = load_serving_pair(load_config(None, [*base, "models.draft_vocab_size=10"]))
    assert find_subset_head(pair.drafter).token_ids.tolist() == list(range(91, 101))
    ee = load_serving_pair(load_config(None, [*base, "models.drafter_kind=early_exit", "trainer.lora_rank=2"]))
    assert isinstance(ee.drafter, EarlyExitDrafter) and ee.drafter.draft_vocab.numel() == 100
    assert ee.drafter.target_ref is ee.target
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        load_config(None, ["models.draft_vocab_size=-1"])
    with pytest.raises(ConfigError, match="draft_vocab"):
        load_config(None, [f"models.draft_vocab={tmp_path / 'missing'}"])
