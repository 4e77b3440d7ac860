"""The device build (`trainers.builds.device_build`) end to end on the CPU with a tiny budget.

A tiny llama.cpp-style GGUF on disk (as on a lent machine that cannot reach PyPI) -> target + tokenizer -> the
target's greedy chat replies and code continuations -> distillation with the target labelling each batch, until the
token budget -> learning curve -> agreement -> manifest. Exported as a shipped drafter, it installs through
`dvi bootstrap` bit for bit; a pair installed from an older shipped drafter is reinstalled when the shipped one
changes (an upgraded checkout), and one the user retrained is left alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import types

import pytest
import torch
from test_pretrained_build import MEMBER, PACKAGE, VERSION, _NoPip, _tiny_preset, tiny_chat_gguf

import dvi.models.pretrained
from dvi.models.embedded import PRESETS, EmbeddedPaths, is_built, read_manifest
from dvi.models.loading import CPU_BF16_ENV, load_causal_lm
from dvi.models.pretrained import WheelModel
from trainers.builds import device_build, pretrained_build, shipped_drafter
from trainers.builds.bootstrap import bootstrap

BUDGET = device_build.Budget(tokens=2048, seconds=120.0, chat_replies=2, code_continuations=2, open_chats=4,
                             reply_tokens=8, continuation_tokens=8, batch_windows=2, gen_batch=2)


@pytest.fixture(scope="module")
def setup(tiny_pair_dir, tmp_path_factory):
    """(preset, gguf path, tmp dir) with `$DVI_CACHE`, the wheels cache and `PRESETS["smollm2"]` pointing here."""
    tmp = tmp_path_factory.mktemp("device-build")
    _model, _tok, gguf, blob = tiny_chat_gguf(tiny_pair_dir, tmp)
    preset = dataclasses.replace(_tiny_preset(hashlib.sha256(blob).hexdigest()), train_vocab=128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_BF16_ENV, "0")
        mp.setenv("DVI_CACHE", str(tmp / "cache" / "models"))
        mp.setitem(PRESETS, "smollm2", preset)
        mp.setattr(dvi.models.pretrained, "subprocess", types.SimpleNamespace(run=_NoPip().run))
        wheels = pretrained_build.wheels_dir()
        wheels.mkdir(parents=True)
        (wheels / WheelModel(PACKAGE, VERSION, preset.sha256, MEMBER).wheel_name).write_bytes(blob)
        yield preset, gguf, tmp


@pytest.fixture(scope="module")
def built(setup):
    preset, gguf, tmp = setup
    root = tmp / "built" / "smollm2"
    return root, device_build.build(preset, root, "cpu", BUDGET, progress=False, sources=device_build.Sources(gguf))


def test_device_build_spends_its_budget_and_writes_a_pair(setup, built):
    preset, gguf, _ = setup
    root, m = built
    train = m["drafter"]["train"]
    assert train["stopped_by"] == "tokens" and BUDGET.tokens <= train["tokens"] < BUDGET.tokens + 2 * 64
    assert train["final_loss"] < train["first_loss"]
    assert {"chat", "code_greedy", "code", "prose"} <= set(m["training_text_tokens"])
    assert m["training_text_tokens"]["chat"] > 0 and m["training_text_tokens"]["code_greedy"] > 0
    points = m["learning_curve"]["points"]
    assert points and points[-1]["tokens"] == train["tokens"]
    assert [p["tokens"] for p in points] == sorted({p["tokens"] for p in points})
    assert (root / "learning_curve.png").stat().st_size > 1000
    assert set(m["agreement"]) == {"code", "prose", "chat"}
    assert all(0.0 <= a <= 1.0 for per in m["agreement"].values() for a in per.values())
    assert m["built_on"]["device"] == "cpu" and m["device_budget"]["tokens"] == BUDGET.tokens
    assert m["source"]["conversion"]["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert is_built(root) and read_manifest(root)["fingerprint"] == preset.fingerprint()
    drafter = load_causal_lm(EmbeddedPaths.at(root).drafter, "cpu", "float32")
    head = drafter.lm_head.weight
    assert int(head.ne(0).any(-1).sum()) <= preset.train_vocab  # rows it never trained on are zero


def test_exported_drafter_installs_and_a_changed_one_is_reinstalled(setup, built):
    preset, gguf, tmp = setup
    root, _ = built
    ship_root = tmp / "ship"
    shipped_drafter.export(root, preset, "test", root=ship_root, commit="test")
    first, why = shipped_drafter.find(preset, ship_root)
    assert first is not None, why
    assert first.manifest["built_on"]["device"] == "cpu" and first.manifest["tokens_trained"] >= BUDGET.tokens
    out = bootstrap(preset, seed=0, progress=False, shipped_root=ship_root)
    installed = load_causal_lm(EmbeddedPaths.at(out).drafter, "cpu", "bfloat16")
    assert shipped_drafter.state_digest(installed.state_dict()) == first.manifest["drafter_digest"]
    assert bootstrap(preset, seed=0, progress=False, shipped_root=ship_root) == out  # unchanged: a cache hit
    # an upgraded checkout ships another drafter (here: the same one, its layer nudged): the installed pair takes it
    other = tmp / "other" / "smollm2"
    shutil.copytree(root, other)
    nudged = load_causal_lm(EmbeddedPaths.at(other).drafter, "cpu", "bfloat16")
    with torch.no_grad():
        nudged.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    nudged.save_pretrained(str(EmbeddedPaths.at(other).drafter))
    shipped_drafter.export(other, preset, "test", root=ship_root, commit="test")
    second, _ = shipped_drafter.find(preset, ship_root)
    assert second.manifest["drafter_digest"] != first.manifest["drafter_digest"]
    assert bootstrap(preset, seed=0, progress=False, shipped_root=ship_root) == out
    installed = load_causal_lm(EmbeddedPaths.at(out).drafter, "cpu", "bfloat16")
    assert shipped_drafter.state_digest(installed.state_dict()) == second.manifest["drafter_digest"]
    assert read_manifest(out)["drafter"]["shipped"]["files"] == second.manifest["files"]


def test_a_refinement_goes_on_from_a_shipped_drafter(setup, built):
    """`--init`: training starts from the shipped drafter's weights and draft vocabulary, and the export counts the
    tokens both builds spent and names what it refined."""
    preset, gguf, tmp = setup
    root, _ = built
    ship_root = tmp / "ship-init"
    init = shipped_drafter.export(root, preset, "test", root=ship_root, commit="first")
    init_manifest = shipped_drafter.find(preset, ship_root)[0].manifest
    refined_root = tmp / "refined" / "smollm2"
    # an LR too small to move a bf16 weight: what comes out is exactly what went in, so training started from it
    budget = dataclasses.replace(BUDGET, open_chats=0, lr=1e-12, mix=(("chat", 0.5), ("code", 0.5)))
    m = device_build.build(preset, refined_root, "cpu", budget, progress=False,
                           sources=device_build.Sources(gguf, init=init))
    assert m["drafter"]["init"]["drafter_digest"] == init_manifest["drafter_digest"]
    assert m["drafter"]["distilled_on"] == {"chat": 0.5, "code": 0.5}
    assert m["drafter"]["train"]["tokens"] >= budget.tokens
    stored = shipped_drafter._stored_order(init)
    assert torch.equal(shipped_drafter._stored_order(EmbeddedPaths.at(refined_root).drafter), stored)
    out = shipped_drafter.export(refined_root, preset, "test", root=tmp / "ship-refined", commit="second")
    refined = shipped_drafter.find(preset, out.parent)[0].manifest
    assert refined["drafter_digest"] == init_manifest["drafter_digest"]
    assert refined["tokens_trained"] == m["drafter"]["train_tokens"] + init_manifest["tokens_trained"]
    assert refined["refined_from"]["commit"] == "first"


def test_a_bad_mix_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        device_build.main(["--out", "/nonexistent", "--device", "cpu", "--mix", "chat=0.5,poems=0.5"])
    assert "--mix: unknown text 'poems'" in capsys.readouterr().err


def test_budget_for_a_gpu_fills_it():
    gpu, cpu = device_build.Budget.for_device("cuda"), device_build.Budget.for_device("cpu")
    assert gpu.tokens >= 20 * 2**20 and gpu.batch_windows > cpu.batch_windows and gpu.gen_batch > cpu.gen_batch
    assert torch.isfinite(torch.tensor(gpu.gen_seconds))
