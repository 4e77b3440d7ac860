"""The online trainer's published drafters: publishing, loading back, lossless swaps mid-request, refusals of
corrupt adapters, each drafter kind and draft vocabulary from the config, reduced-vocabulary drafters.
Training itself (batches, stale targets, replay, exactly-once, budget): tests/test_online.py.

Feedback comes from the real engine on the tiny pair (module fixture, a few seconds).
"""

from __future__ import annotations

import copy

import pytest
import torch
from registry_doors import load_adapter_into
from test_online import engine_records, online_config

from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine, Versions
from dvi.feedback import FeedbackRecord
from dvi.registry.store import AdapterRejected, DrafterRegistry
from trainers.online.loop import TrainerLoop
from trainers.online.trainer import OnlineTrainer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    from dvi.models.loading import load_pair

    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


@pytest.fixture(scope="module")
def prose(pair) -> list[FeedbackRecord]:
    return engine_records(pair, "prose", 64, max_new_tokens=20)


def _greedy_reference(target, prompts, n):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        g = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
        out.append(g[0, len(p):].tolist())
    return out


# -- publishing, swaps, refusals -----------------------------------------------------------------------
def _swap_midway_and_compare(pair, drafter_v1, version, prompts, ref, k=3):
    """Start greedy requests on the base drafter, swap in `drafter_v1` after 2 steps, finish; tokens must equal ref."""
    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=k)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"s{i}", p, SamplingParams(len(ref[0]))))
    results = {}
    steps = 0
    while eng.has_unfinished():
        if steps == 2:
            eng.set_drafter(drafter_v1, version)
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o.result
        steps += 1
    assert [results[f"s{i}"].token_ids for i in range(len(prompts))] == ref
    return results


@pytest.mark.parametrize("mode", ["lora", "full", "early_exit"])
def test_published_drafter_loads_back_and_swap_stays_lossless(pair, prose, tiny_pair_dir, tmp_path, mode) -> None:
    extra = ["trainer.publish_margin=-1.0"]
    if mode == "full":
        extra.append("trainer.mode=full")
    cfg = online_config(tiny_pair_dir, tmp_path, *extra)
    reg = DrafterRegistry(cfg.registry.dir)
    if mode == "early_exit":
        from dvi.drafters.learned import EarlyExitDrafter

        drafter = EarlyExitDrafter(copy.deepcopy(pair.target), 1, lora_rank=4, target_modules=["q_proj", "v_proj"])
    else:
        drafter = copy.deepcopy(pair.drafter)
    tr = OnlineTrainer(cfg, drafter, registry=reg)
    tr.train_on_records(prose[:48])
    d = tr.maybe_publish(force=True)
    v = d.published
    assert v == 1 and reg.latest() == 1
    man = reg.manifest(v)
    for key in ("version", "parent_version", "target_version", "steps", "records_seen", "heldout_alpha", "created_at"):
        assert key in man.as_dict()
    assert man.steps == tr.step and man.records_seen == tr.records_seen and man.heldout_alpha is not None
    vdir = reg.version_dir(v)
    if mode == "lora":
        from peft import PeftModel

        pm = PeftModel.from_pretrained(copy.deepcopy(pair.drafter), str(vdir))
        # the registry's own path into a live adapter agrees with peft's loader
        live = copy.deepcopy(pm)
        load_adapter_into(reg, live, v)
        new = pm.merge_and_unload()
    elif mode == "full":
        from transformers import AutoModelForCausalLM

        new = AutoModelForCausalLM.from_pretrained(str(vdir)).eval()
    else:
        from dvi.drafters.learned import EarlyExitDrafter

        new = EarlyExitDrafter.load(pair.target, vdir)
    # the loaded drafter is the trained one (not the base): same teacher-forced logits as the trainer's
    ids = torch.tensor([list(prose[0].prompt_ids)])
    with torch.no_grad():
        want = tr.model(input_ids=ids).logits
        got = (new.model if mode == "early_exit" else new)(input_ids=ids).logits
        base = pair.drafter(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, base, atol=1e-3) or mode == "early_exit"
    prompts = [list(r.prompt_ids) for r in prose[:4]]
    ref = _greedy_reference(pair.target, prompts, 20)
    res = _swap_midway_and_compare(pair, new, v, prompts, ref)
    assert {r.drafter_version for r in res.values()} == {v}


def test_corrupt_adapter_refused_live_drafter_keeps_serving(pair, prose, tiny_pair_dir, tmp_path) -> None:
    from peft import PeftModel

    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.publish_margin=-1.0")
    reg = DrafterRegistry(cfg.registry.dir)
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=reg)
    tr.train_on_records(prose[:32])
    v1 = tr.maybe_publish(force=True).published
    live = PeftModel.from_pretrained(copy.deepcopy(pair.drafter), str(reg.version_dir(v1)))
    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, live),
                            num_draft_tokens=3, versions=Versions(drafter=v1))
    prompts = [list(r.prompt_ids) for r in prose[:3]]
    ref = _greedy_reference(pair.target, prompts, 16)

    tr.train_on_records(prose[32:64])
    v2 = tr.maybe_publish(force=True).published
    weights = reg.version_dir(v2) / "adapter_model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2])  # torn / corrupted file
    with pytest.raises(AdapterRejected, match="does not load"):
        reg.open_version(v2)
    with pytest.raises(AdapterRejected):
        load_adapter_into(reg, live, v2)
    # NaNs and wrong shapes are refused too
    from safetensors.torch import load_file, save_file

    weights.write_bytes(blob)
    sd = load_file(str(weights))
    k0 = next(iter(sd))
    save_file({**sd, k0: torch.full_like(sd[k0], float("nan"))}, str(weights))
    with pytest.raises(AdapterRejected, match="non-finite"):
        load_adapter_into(reg, live, v2)
    save_file({**sd, k0: torch.zeros(3, 3)}, str(weights))
    with pytest.raises(AdapterRejected, match="shape"):
        load_adapter_into(reg, live, v2)
    # the live drafter keeps serving, unchanged and lossless
    out = eng.generate(prompts, 16)
    assert [r.token_ids for r in out] == ref and {r.drafter_version for r in out} == {v1}
    # the trainer survives a corrupt LATEST: it compares with what is served (nothing recorded: the base)
    tr.train_on_records(prose[:16])
    d = tr.maybe_publish(force=True)
    assert d.published == v2 + 1 and d.parent_version == 0
    # and a fresh trainer process start (no checkpoint) with a corrupt LATEST starts from the base
    (reg.dir / "LATEST").write_text(f"v{v2:06d}\n")
    tr2 = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=reg)
    loop = TrainerLoop(tr2, cfg)
    loop.restore()
    assert tr2.publisher.published is None


# -- loading each drafter kind from the config -------------------------------------------------------
@pytest.mark.parametrize("overrides,kind,file_format", [((), "separate", "lora"),
                                                        (("trainer.mode=full",), "separate", "full"),
                                                        (("models.drafter_kind=early_exit",), "early_exit", "lora")])
def test_from_config_loads_each_drafter_kind(prose, tiny_pair_dir, tmp_path, overrides, kind, file_format) -> None:
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.lora_targets=[q_proj,v_proj]",
                        "trainer.publish_margin=-1.0", *overrides)
    tr = OnlineTrainer.from_config(cfg)
    assert (tr.trainable.kind, tr.trainable.format) == (kind, file_format) and tr.registry is not None
    n_train = sum(p.numel() for p in tr.trainable.parameters())
    n_all = sum(p.numel() for p in tr.model.parameters())
    assert (n_train == n_all) == (file_format == "full")
    st = tr.train_on_records(prose[:8])
    assert st.steps >= 1 and tr.maybe_publish(force=True).published == 1


# -- reduced draft vocabulary ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["lora", "full", "early_exit"])
def test_reduced_vocab_drafter_trains_publishes_and_swaps_losslessly(pair, prose, tiny_pair_dir, tmp_path,
                                                                      mode) -> None:
    """The trainer trains a reduced drafter on its subset logits; the server's loader rebuilds it with the
    same subset (and refuses it for a server drafting over another subset size)."""
    import math

    from dvi.drafters.learned import EarlyExitDrafter
    from dvi.drafters.vocab import apply_draft_vocab, find_subset_head, frequent_token_ids
    from dvi.registry.codec import load_drafter_version

    ids = frequent_token_ids([r.token_ids for r in prose], n=16, always=[pair.tokenizer.eos_token_id])
    assert {t for r in prose for t in r.token_ids} - set(ids.tolist())  # some target tokens lie outside
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.publish_margin=-1.0",
                        *(["trainer.mode=full"] if mode == "full" else []))
    reg = DrafterRegistry(cfg.registry.dir)
    target = copy.deepcopy(pair.target)

    def make(vocab: torch.Tensor):
        if mode == "early_exit":
            return EarlyExitDrafter(target, 1, lora_rank=4, target_modules=["q_proj", "v_proj"], vocab_ids=vocab)
        return apply_draft_vocab(copy.deepcopy(pair.drafter), vocab)

    tr = OnlineTrainer(cfg, make(ids), registry=reg)
    st = tr.train_on_records(prose[:48])
    assert st.steps >= 1 and math.isfinite(st.losses["loss"]) and math.isfinite(st.losses["kl"])
    v = tr.maybe_publish(force=True).published
    assert reg.manifest(v).draft_vocab_size == 16
    new, _ = load_drafter_version(reg, v, make(ids))
    module = new.model if mode == "early_exit" else new
    assert torch.equal(find_subset_head(module).token_ids, torch.sort(ids).values)
    x = torch.tensor([list(prose[0].prompt_ids)])
    with torch.no_grad():
        want, got = tr.model(input_ids=x).logits, module(input_ids=x).logits  # [1, L, V], -inf outside
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and int(torch.isfinite(got[0, 0]).sum()) == 16
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)], atol=1e-4, rtol=1e-4)
    prompts = [list(r.prompt_ids) for r in prose[:4]]
    _swap_midway_and_compare(pair, new, v, prompts, _greedy_reference(pair.target, prompts, 20))
    with pytest.raises(AdapterRejected, match="draft vocabulary of 16 ids"):
        load_drafter_version(reg, v, make(ids[:8]))


@pytest.mark.parametrize("kind", ["separate", "early_exit"])
def test_from_config_loads_the_configured_draft_vocabulary(prose, tiny_pair_dir, tmp_path, kind) -> None:
    from dvi.drafters.vocab import save_draft_vocab

    save_draft_vocab(tmp_path / "vocab", torch.arange(511, -1, -1), vocab_size=512)
    extra = ["models.drafter_kind=early_exit"] if kind == "early_exit" else []
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.lora_targets=[q_proj,v_proj]",
                        f"models.draft_vocab={tmp_path / 'vocab'}", "models.draft_vocab_size=32",
                        "trainer.publish_margin=-1.0", *extra)
    tr = OnlineTrainer.from_config(cfg)
    assert tr.draft_vocab_size == 32
    st = tr.train_on_records(prose[:8])
    assert st.steps >= 1 and tr.maybe_publish(force=True).published == 1
    assert tr.registry.manifest(1).draft_vocab_size == 32


