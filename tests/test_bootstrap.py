from __future__ import annotations

import json
import time

import pytest
import torch

from dvi import data
from dvi.models.embedded import PRESETS, EmbeddedPaths, cache_root, embedded_dir, embedded_paths, is_built
from dvi.models.loading import load_causal_lm, load_tokenizer
from trainers.builds.bootstrap import bootstrap, summary_table
from trainers.builds.offline import evaluate_lms
from trainers.builds.stdlib_build import build_pair, save_pair


@pytest.fixture(scope="module")
def tiny_built():
    """A second, in-memory tiny build with the fixture's seed (for reload and determinism checks)."""
    return build_pair("tiny", seed=0, progress=False)


def test_layout_and_manifest(tiny_pair_dir):
    paths = EmbeddedPaths.at(tiny_pair_dir)
    assert is_built(tiny_pair_dir) and is_built(tiny_pair_dir, "tiny")
    for d in (paths.target, paths.drafter):
        assert (d / "config.json").exists() and (d / "model.safetensors").exists()
    assert (paths.tokenizer / "tokenizer.json").exists()
    m = json.loads(paths.manifest.read_text())
    assert m["preset"] == "tiny" and m["seed"] == 0
    for dom in ("code", "prose"):
        for split in ("train", "heldout"):
            assert m["corpus"][dom][split]["files"] > 0
        for who in ("target", "drafter"):
            assert m["heldout"][who][dom]["bits_per_char"] > 0
        assert 0 <= m["agreement"][dom] <= 1
        assert 0 < m["continuations"][dom]["target"] <= 1
    assert m["latency"]["target_ms"] > 0 and m["latency"]["drafter_ms"] > 0
    assert m["target"]["train_tokens"] > 0 and m["drafter"]["train_tokens"] > 0
    assert m["versions"]["torch"] == torch.__version__
    # no temp dirs left beside the result
    assert not [p for p in tiny_pair_dir.parent.iterdir() if p.name.startswith(".tiny.")]
    s = summary_table(m)
    assert "bits/char" in s and "latency ratio" in s and "params" in s


def test_drafter_is_code_student_better_than_untrained(tiny_pair_dir):
    m = json.loads((tiny_pair_dir / "manifest.json").read_text())
    trained = m["heldout"]["drafter"]["code"]["loss"]
    untrained = m["heldout"]["untrained_drafter"]["code"]["loss"]
    assert trained < untrained - 0.5, (trained, untrained)
    # independent check on held-out code
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    drafter = load_causal_lm(tiny_pair_dir / "drafter", device="cpu")
    torch.manual_seed(123)
    fresh = type(drafter)(drafter.config).eval()
    docs = data.sample_docs("code", "heldout", 5_000)
    ids = [tok(d, add_special_tokens=False)["input_ids"] for d in docs]
    r = evaluate_lms({"drafter": drafter, "fresh": fresh}, ids, sum(map(len, docs)), tok.bos_token_id, 128)
    assert r["drafter"]["loss"] < r["fresh"]["loss"] - 0.5


def test_rerun_reuses_cache(tiny_pair_dir):
    manifest = (tiny_pair_dir / "manifest.json").read_text()
    mtime = (tiny_pair_dir / "manifest.json").stat().st_mtime_ns
    t0 = time.perf_counter()
    out = bootstrap("tiny", out=tiny_pair_dir, seed=0, progress=False)
    assert time.perf_counter() - t0 < 2.0
    assert out == tiny_pair_dir
    assert (tiny_pair_dir / "manifest.json").read_text() == manifest
    assert (tiny_pair_dir / "manifest.json").stat().st_mtime_ns == mtime


def test_saved_pair_reloads_with_identical_logits(tiny_built, tmp_path):
    out = save_pair(tiny_built, tmp_path / "pair")
    ids = torch.tensor([[tiny_built.tokenizer.bos_token_id] + tiny_built.tokenizer("import os\nx = 1\n")["input_ids"]])
    for name in ("target", "drafter"):
        mem = getattr(tiny_built, name)
        disk = load_causal_lm(out / name, device="cpu", dtype="float32")
        with torch.inference_mode():
            assert torch.equal(mem(input_ids=ids).logits, disk(input_ids=ids).logits), name
    tok = load_tokenizer(out / "tokenizer")
    text = "def f(a, b):\n    return a + b  # sum\n"
    assert tok(text)["input_ids"] == tiny_built.tokenizer(text)["input_ids"]
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_same_seed_same_pair(tiny_built, tiny_pair_dir):
    """The fixture's build (bootstrap, maybe another process) and this in-memory one agree exactly."""
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    assert tok.get_vocab() == tiny_built.tokenizer.get_vocab()
    for name in ("target", "drafter"):
        disk = load_causal_lm(tiny_pair_dir / name, device="cpu").state_dict()
        mem = getattr(tiny_built, name).state_dict()
        assert disk.keys() == mem.keys()
        for k in disk:
            assert torch.equal(disk[k], mem[k]), f"{name}.{k} differs between two builds with seed 0"


def test_cache_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("DVI_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert embedded_dir("smollm2") == tmp_path / "c" / "smollm2"
    assert embedded_paths("tiny").target == tmp_path / "c" / "tiny" / "target"
    assert not is_built(embedded_dir("tiny"))
    monkeypatch.delenv("DVI_CACHE")
    assert embedded_dir("tiny").parts[-4:] == (".cache", "dvi", "models", "tiny")
    with pytest.raises(ValueError, match="unknown preset"):
        embedded_dir("huge")
    assert set(PRESETS) >= {"tiny", "smollm2"}


@pytest.mark.parametrize("stride", [None, 64, 1])
def test_sliding_eval_windows_score_every_token_once_with_context(stride):
    from trainers.builds.offline import _eval_windows

    seq_len = 8
    docs = [list(range(3, 3 + n)) for n in (0, 1, 7, 8, 9, 40)]
    wins = _eval_windows(docs, 0, seq_len, None if stride is None else min(stride, seq_len))
    scored = []
    for w, skip in wins:
        t = w.tolist()
        assert len(t) <= seq_len + 1 and 0 <= skip < len(t) - 1
        # each scored target sees at least seq_len - stride tokens (or the whole doc prefix)
        s = seq_len if stride is None else min(stride, seq_len)
        assert skip in (0, seq_len - s)
        scored += [(t[i], t[i + 1]) for i in range(skip, len(t) - 1)]
    expected = [(r[i], r[i + 1]) for r in ([0] + d for d in docs) for i in range(len(r) - 1)]
    assert sorted(scored) == sorted(expected) and len(scored) == len(expected)
    with pytest.raises(ValueError, match="stride"):
        _eval_windows(docs, 0, seq_len, 0)


def test_mixed_precision_training_lowers_loss():
    """bf16 autocast (the small preset's setting) trains: the loss falls and the weights stay fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.builds.offline import pretrain_lm

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=2, intermediate_size=64))
    seq = torch.arange(64).repeat(20)  # a deterministic pattern a 1-layer model learns in a few steps

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            offs = torch.randint(0, seq.numel() - 34, (4,), generator=g).tolist()
            yield torch.stack([seq[o: o + 33] for o in offs])

    stats = pretrain_lm(m, batches(), steps=40, lr=1e-2, warmup=2, progress=False, mixed_precision=True)
    assert stats["final_loss"] < 0.5 * stats["first_loss"]
    assert all(p.dtype == torch.float32 for p in m.parameters())


def test_drafter_warm_start_is_the_targets_first_layer_exit():
    """drafter_init='target': before any distillation the drafter computes exactly the target cut
    after its first layer (embeddings, layer 0, final norm, LM head), so it starts in the target's
    token and output space."""
    import copy

    from dvi.models.embedded import ModelDims, Preset
    from trainers.builds.stdlib_build import init_drafter_from_target, make_llama, train_tokenizer

    tok = train_tokenizer(["def f(x):\n    return x + 1\n" * 20], 300)
    t_dims = ModelDims(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64)
    target = make_llama(t_dims, len(tok), 128, tok, seed=0)
    cut = copy.deepcopy(target)
    cut.model.layers = cut.model.layers[:1]
    cut.config.num_hidden_layers = 1
    x = torch.randint(0, len(tok), (2, 12))
    for inter in (64, 160):  # same FFN as the target's, and a wider one (extra units start silent)
        drafter = make_llama(ModelDims(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=inter), len(tok), 128, tok, seed=1)
        init_drafter_from_target(drafter, target)
        with torch.no_grad():
            torch.testing.assert_close(drafter(input_ids=x).logits, cut(input_ids=x).logits)
            assert not torch.allclose(drafter(input_ids=x).logits, target(input_ids=x).logits)
        up = drafter.model.layers[0].mlp.up_proj.weight
        assert up.shape[0] == inter and bool(up.abs().sum() > 0)
    fields = dict(name="x", vocab_size=300, seq_len=16, max_position_embeddings=128, target=t_dims,
                  tokenizer_chars=1, train_chars=1, eval_chars=1, prose_fraction=0.0, target_steps=1, target_batch=1,
                  target_lr=1e-3, target_warmup=0, drafter_steps=1, drafter_batch=1, drafter_lr=1e-3, drafter_warmup=0)
    for bad in (ModelDims(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                ModelDims(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)):
        with pytest.raises(ValueError, match="drafter_init='target' needs"):
            Preset(drafter=bad, drafter_init="target", **fields)
    with pytest.raises(ValueError, match="drafter_init must be"):
        Preset(drafter=t_dims, drafter_init="copy", **fields)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        Preset(drafter=t_dims, optimizer="sgd", **fields)


def test_muon_trains_hidden_matrices_and_adamw_the_rest():
    """optimizer='muon': decoder-layer matrices go to Muon, embeddings / LM head / norms to AdamW, each
    group keeps its own peak LR for the schedule, and training with it lowers the loss."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.builds.offline import make_optimizer, pretrain_lm

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=2, intermediate_size=64))
    opt = make_optimizer(m, lr=1e-3, optimizer="muon", muon_lr=5e-3)
    muon, adamw = (next(o for o in opt.opts if isinstance(o, cls)) for cls in (torch.optim.Muon, torch.optim.AdamW))
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {id(p): n for n, p in m.named_parameters()}
    assert {names[i] for i in muon_ids} == {n for n, p in m.named_parameters() if ".layers." in n and p.dim() == 2}
    assert all(".layers." not in names[id(p)] or p.dim() == 1 for g in adamw.param_groups for p in g["params"])
    assert {g["initial_lr"] for g in muon.param_groups} == {5e-3}
    assert {g["initial_lr"] for g in adamw.param_groups} == {1e-3}
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(m, lr=1e-3, optimizer="sgd")

    seq = torch.arange(64).repeat(20)

    def batches():
        g = torch.Generator().manual_seed(0)
        while True:
            offs = torch.randint(0, seq.numel() - 34, (4,), generator=g).tolist()
            yield torch.stack([seq[o: o + 33] for o in offs])

    stats = pretrain_lm(m, batches(), steps=40, lr=1e-2, warmup=2, progress=False, optimizer="muon", muon_lr=2e-2)
    assert stats["final_loss"] < 0.5 * stats["first_loss"]
