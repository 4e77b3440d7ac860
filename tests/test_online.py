"""The online trainer in-process: batches, stale targets, replay, publishing, swaps, refusals, exactly-once.

Feedback comes from the real engine on the tiny pair (module fixture, a few seconds).
"""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch

from dvi.config import DviConfig, load_config
from dvi.decode.engine import Request, SamplingParams, SpeculativeEngine, Versions
from dvi.feedback import FeedbackRecord, FeedbackWriter
from dvi.registry.store import AdapterRejected, DrafterRegistry
from dvi.rundir import CONSUMED_LOG, TARGET_VERSION_FILE, TRAINER_DIR
from trainers.online.collate import build_batch, is_heldout
from trainers.online.loop import TrainerLoop
from trainers.online.trainer import OnlineTrainer

torch.set_num_threads(1)


def online_config(pair_dir: Path, run_dir: Path, *overrides: str) -> DviConfig:
    base = [
        f"models.target={pair_dir / 'target'}",
        f"models.drafter={pair_dir / 'drafter'}",
        f"models.tokenizer={pair_dir / 'tokenizer'}",
        "models.device=cpu",
        f"run_dir={run_dir}",
        f"feedback.dir={run_dir / 'feedback'}",
        f"registry.dir={run_dir / 'registry'}",
        "wandb.mode=disabled",
        "trainer.batch_size=8",
        "trainer.learning_rate=0.003",
        "trainer.heldout_fraction=0.25",
        "trainer.shadow_min_positions=16",
        "trainer.min_new_records=4",
        "trainer.poll_seconds=0.1",
        "trainer.reward_ramp_start=20",
        "trainer.reward_ramp_steps=20",
        "trainer.reward_weight=0.1",
    ]
    return load_config(None, base + list(overrides))


def engine_records(pair, domain: str, n: int, max_new_tokens: int = 24, prefix: str = "r", seed: int = 0,
                   target_version: int = 0) -> list[FeedbackRecord]:
    """`n` greedy feedback records from the real engine (unique request ids)."""
    from dvi.data import prompt_stream

    eng = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=3, feedback_top_k=16,
                            versions=Versions(target=target_version))
    prompts = list(itertools.islice(prompt_stream(domain, pair.tokenizer, prompt_tokens=(12, 40), seed=seed), n))
    out = []
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"{prefix}-{domain}-{i}", p, SamplingParams(max_new_tokens), domain=domain))
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                out.append(FeedbackRecord.from_result(o.result))
    return out


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


# -- batches ------------------------------------------------------------------------------------------
def test_build_batch_matches_plain_teacher_forcing(pair, prose) -> None:
    """Left padding + position ids + logits_to_keep give the same logits as one row at a time."""
    exs = [r.compact() for r in prose[:4]]
    exs[1].token_ids = exs[1].token_ids[:7]  # ragged generated lengths
    exs[1].drafted_ids, exs[1].accepted = exs[1].drafted_ids[:7], exs[1].accepted[:7]
    exs[1].topk_ids, exs[1].topk_logprobs = exs[1].topk_ids[:7], exs[1].topk_logprobs[:7]
    b = build_batch(exs, [1.0, 1.0, 0.5, 1.0], pad_id=0, max_seq_len=512)
    model = pair.drafter
    with torch.no_grad():
        got = model(input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids,
                    logits_to_keep=b.width).logits
        for i, e in enumerate(exs):
            seq = torch.tensor([list(e.prompt_ids) + list(e.token_ids[:-1])])
            ref = model(input_ids=seq).logits[0, len(e.prompt_ids) - 1:]
            n = len(e.token_ids)
            torch.testing.assert_close(got[i, b.width - n:], ref, atol=1e-4, rtol=1e-4)
            assert (b.weights[i, : b.width - n] == 0).all()
            assert torch.equal(b.drafted_ids[i, b.width - n:], torch.from_numpy(e.drafted_ids))
    assert b.weights[2].max() == 0.5


def test_truncation_keeps_the_newest_tokens(prose) -> None:
    e = prose[0].compact()
    b = build_batch([e], [1.0], max_seq_len=10)
    assert b.input_ids.shape[1] == 10 and b.width == min(10, len(e.token_ids))
    assert b.input_ids[0].tolist() == (list(e.prompt_ids) + list(e.token_ids[:-1]))[-10:]


def test_records_without_topk_train_on_the_targets_token(prose) -> None:
    r = copy.deepcopy(prose[0])
    r.topk_ids, r.topk_logprobs = [], []
    e = r.compact()
    assert e.topk_ids[:, 0].tolist() == list(r.token_ids) and (e.topk_logprobs == 0).all()


# -- the in-process trainer ---------------------------------------------------------------------------
def test_heldout_split_is_deterministic_and_never_trained(pair, prose, tmp_path) -> None:
    ids = [f"req-{i}" for i in range(2000)]
    frac = sum(is_heldout(i, 0.25) for i in ids) / len(ids)
    assert 0.2 < frac < 0.3 and [is_heldout(i, 0.25) for i in ids] == [is_heldout(i, 0.25) for i in ids]
    assert not any(is_heldout(i, 0.0) for i in ids)


def test_stale_targets_dropped_or_downweighted_and_version_file(pair, prose, tiny_pair_dir, tmp_path) -> None:
    recs = copy.deepcopy(prose[:16])
    for i, r in enumerate(recs):
        r.target_version = 1 if i % 2 else 0
    seen = []

    def capture(tr):
        orig = tr._train_step

        def f(examples, current):
            seen.append([(e.target_version, tr._weight(e, current)) for e in examples])
            return orig(examples, current)

        tr._train_step = f

    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.stale_target_policy=drop", "trainer.heldout_fraction=0")
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    capture(tr)
    st = tr.train_on_records(recs)
    assert st.dropped_stale == 8 and st.new == 8 and all(v == 1 for b in seen for v, _ in b)
    assert sorted(st.dropped_ids) == sorted(r.request_id for r in recs if r.target_version == 0)

    seen.clear()
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.stale_target_policy=downweight", "trainer.stale_weight=0.25",
                        "trainer.heldout_fraction=0")
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    capture(tr)
    st = tr.train_on_records(recs)
    assert st.new == 16 and {(v, w) for b in seen for v, w in b} == {(0, 0.25), (1, 1.0)}

    # the server / RL loop announces target v2 before any v2 feedback exists: now all of it is stale
    (tmp_path / TARGET_VERSION_FILE).write_text("2\n")
    seen.clear()
    st = tr.train_on_records(recs)
    assert st.target_version == 2 and {w for b in seen for _, w in b} == {0.25}


def test_recent_first_and_replay_share(pair, prose, tiny_pair_dir, tmp_path) -> None:
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.heldout_fraction=0", "trainer.replay_ratio=0.25",
                        "trainer.batch_size=4")
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    batches = []
    orig = tr._train_step
    tr._train_step = lambda ex, cur: (batches.append([e.request_id for e in ex]), orig(ex, cur))[1]
    first = copy.deepcopy(prose[:8])
    for i, r in enumerate(first):
        r.finished_at = 100.0 + i
    st = tr.train_on_records(first)
    assert st.replayed == 0 and batches[0] == [r.request_id for r in first[::-1][:4]]  # newest first, no replay yet
    batches.clear()
    st = tr.train_on_records(prose[8:14])
    assert st.new == 6 and st.replayed == 2 * 1  # 3 new + 1 replayed per batch of 4
    assert all(set(b[3:]) <= {r.request_id for r in first} for b in batches)
    assert tr.records_seen == 14 and tr.replayed == 2
    # idle replay: steps on recent trained records, counted as replay, never as new records
    st = tr.train_on_replay(steps=2, recent=6)
    assert st.steps == 2 and tr.records_seen == 14 and tr.replayed == 2 + 2 * 4


@pytest.mark.parametrize("mode", ["lora", "full", "lora_reduced_vocab"])
def test_training_on_feedback_raises_heldout_shadow_alpha(pair, prose, tiny_pair_dir, tmp_path, mode) -> None:
    # The tiny target is nearly flat (its argmax hinges on near-ties), so pure KL barely flips argmaxes
    # in a few dozen LoRA steps; the accept/reject reward does. Ramp it in early here.
    from dvi.drafters.vocab import apply_draft_vocab, frequent_token_ids

    cfg = online_config(tiny_pair_dir, tmp_path, f"trainer.mode={mode.split('_')[0]}", "trainer.reward_weight=0.5",
                        "trainer.reward_ramp_start=0", "trainer.reward_ramp_steps=10")
    torch.manual_seed(0)  # LoRA init: a few dozen steps on this flat target are seed-sensitive
    drafter = copy.deepcopy(pair.drafter)
    if mode.endswith("reduced_vocab"):  # trained on its subset logits, the loss over the subset
        apply_draft_vocab(drafter, frequent_token_ids([r.token_ids for r in prose], n=16))
    tr = OnlineTrainer(cfg, drafter)
    held = [r for r in prose if is_heldout(r.request_id, 0.25)]
    assert len(held) >= 10
    before = tr.shadow(held)
    for _ in range(4):  # in-process callers may re-feed records (the process never does)
        tr.train_on_records(prose)
    after = tr.shadow(held)
    assert tr.step >= 24
    assert after.alpha > before.alpha + 0.05, (before, after)


# -- publishing, swaps, refusals -----------------------------------------------------------------------
def _swap_midway_and_compare(pair, drafter_v1, version, prompts, ref, k=3):
    """Start greedy requests on the base drafter, swap in `drafter_v1` after 2 steps, finish; tokens must equal ref."""
    eng = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=k)
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
        reg.load_peft_adapter_into(live, v)
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
    eng = SpeculativeEngine(pair.target, live, num_draft_tokens=3, versions=Versions(drafter=v1))
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
        reg.load_peft_adapter_into(live, v2)
    # NaNs and wrong shapes are refused too
    from safetensors.torch import load_file, save_file

    weights.write_bytes(blob)
    sd = load_file(str(weights))
    k0 = next(iter(sd))
    save_file({**sd, k0: torch.full_like(sd[k0], float("nan"))}, str(weights))
    with pytest.raises(AdapterRejected, match="non-finite"):
        reg.load_peft_adapter_into(live, v2)
    save_file({**sd, k0: torch.zeros(3, 3)}, str(weights))
    with pytest.raises(AdapterRejected, match="shape"):
        reg.load_peft_adapter_into(live, v2)
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
    assert tr2.last_published is None


# -- exactly-once across crashes (in-process; the SIGKILL test is in test_online_process.py) -------------
def _write_shards(root: Path, records, per_shard: int) -> None:
    w = FeedbackWriter(root, shard_records=per_shard)
    for r in records:
        w.write(r)
    w.close()


def _consumed(run_dir: Path) -> list[dict]:
    p = run_dir / TRAINER_DIR / CONSUMED_LOG
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _drain(loop: TrainerLoop, max_rounds: int = 100) -> None:
    for _ in range(max_rounds):
        if loop.run_round() is None:
            return
    raise AssertionError("rounds did not drain the log")


@pytest.mark.parametrize("crash_at", ["train", "checkpoint", "log", "commit", "unflushed"])
def test_crash_windows_never_train_twice_or_skip(pair, prose, tiny_pair_dir, tmp_path, crash_at) -> None:
    # checkpoint_seconds=0: every round flushes (checkpoint -> log -> commit), so each window is hit;
    # "unflushed": rounds trained since the last flush die with the process and are trained again.
    every = 3600 if crash_at == "unflushed" else 0
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.batch_size=4", f"trainer.checkpoint_seconds={every}")
    recs = prose[:40]
    _write_shards(Path(cfg.feedback.dir), recs[:24], per_shard=4)

    def new_loop() -> TrainerLoop:
        tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=DrafterRegistry(cfg.registry.dir))
        loop = TrainerLoop(tr, cfg)
        loop.stop.requested = True  # take whatever is pending without waiting for min_new_records
        loop.restore()
        return loop

    loop = new_loop()
    loop.run_round()
    loop.run_round()
    target = {"train": (loop.trainer, "train_on_records"), "checkpoint": (loop.trainer, "save_checkpoint"),
              "log": (loop, "_append_consumed"), "commit": (loop, "_commit_trained"),
              "unflushed": (loop.trainer, "train_on_records")}[crash_at]

    def boom(*a, **k):
        raise RuntimeError("killed")

    setattr(*target, boom)
    with pytest.raises(RuntimeError, match="killed"):
        loop.run_round()
    steps_at_crash = loop.trainer.step
    del loop  # the process is gone; a new one starts from disk
    _write_shards(Path(cfg.feedback.dir), recs[24:], per_shard=4)  # traffic went on meanwhile
    loop = new_loop()
    if crash_at in ("log", "commit"):  # the crashed round was checkpointed: its updates survive
        assert loop.trainer.step == steps_at_crash
    if crash_at == "unflushed":  # nothing was ever flushed: a fresh start
        assert loop.trainer.step == 0 and not _consumed(tmp_path)
    _drain(loop)
    loop.flush()
    entries = _consumed(tmp_path)
    ids = [i for e in entries for key in ("trained", "heldout", "dropped") for i in e[key]]
    assert sorted(ids) == sorted(r.request_id for r in recs), "a record was trained twice or skipped"
    assert loop.trainer.records_seen == sum(len(e["trained"]) for e in entries)
    assert loop.reader.poll() == []
    assert [e["seq"] for e in entries] == list(range(1, len(entries) + 1))


@pytest.mark.parametrize("overrides,kind", [((), "lora"), (("trainer.mode=full",), "full"),
                                            (("models.drafter_kind=early_exit",), "early_exit")])
def test_from_config_loads_each_drafter_kind(prose, tiny_pair_dir, tmp_path, overrides, kind) -> None:
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.lora_targets=[q_proj,v_proj]",
                        "trainer.publish_margin=-1.0", *overrides)
    tr = OnlineTrainer.from_config(cfg)
    assert tr.trainable.kind == kind and tr.registry is not None
    n_train = sum(p.numel() for p in tr.trainable.parameters())
    n_all = sum(p.numel() for p in tr.model.parameters())
    assert (n_train == n_all) == (kind == "full")
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
    from serving.swap import load_drafter_version

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


def test_feedback_token_budget_caps_steps_new_and_replay(pair, prose, tiny_pair_dir, tmp_path) -> None:
    """At most one step per `feedback_tokens_per_step` tokens read: new records beyond it are deferred
    (kept for replay), replay steps stop at the budget, and status reports steps, tokens and the cap."""
    recs = prose[:24]
    tokens = sum(len(r.token_ids) for r in recs)
    per_step = tokens // 2  # two steps' worth for records that would take six (4 new each)
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.heldout_fraction=0", "trainer.replay_ratio=0",
                        "trainer.batch_size=4", f"trainer.feedback_tokens_per_step={per_step}")
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    st = tr.train_on_records(recs)
    assert tr.feedback_tokens == tokens and tr.records_read == 24 and tr.steps_allowed() == 2
    assert st.steps == 2 and tr.step == 2 and st.budget_deferred == 24 - 2 * 4
    assert tr.records_seen == 8 and tr.budget_deferred == 16 and len(tr.replay) == 24  # deferred kept for replay
    assert tr.train_on_replay(steps=3).steps == 0 and tr.step == 2  # budget spent: no replay either
    more = prose[24:40]
    tr.train_on_records(more)  # enough tokens for about one more step; replay may use what is left
    allowed = (tokens + sum(len(r.token_ids) for r in more)) // per_step
    assert tr.step <= allowed
    tr.train_on_replay(steps=10)
    assert tr.step == allowed and not tr.budget_left()
    status = tr.status()
    assert status["feedback_tokens"] == tr.feedback_tokens and status["steps_allowed"] == allowed
    assert status["feedback_tokens_per_step"] == per_step and status["budget_deferred"] == tr.budget_deferred
    # unlimited (0): every chunk steps, nothing deferred
    free = OnlineTrainer(online_config(tiny_pair_dir, tmp_path / "free", "trainer.heldout_fraction=0",
                                       "trainer.replay_ratio=0", "trainer.batch_size=4"), copy.deepcopy(pair.drafter))
    st = free.train_on_records(recs)
    assert st.steps == 6 and free.budget_deferred == 0 and free.steps_allowed() is None
    # the counters survive a checkpoint round trip (the loop's resume point)
    tr.save_checkpoint(tmp_path / "ckpt", {})
    back = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    back.load_checkpoint(tmp_path / "ckpt")
    saved = (tr.records_read, tr.feedback_tokens, tr.budget_deferred, tr.step)
    assert (back.records_read, back.feedback_tokens, back.budget_deferred, back.step) == saved


def test_trainer_ignores_a_mixed_precision_another_accelerator_fixed(pair, tiny_pair_dir, tmp_path) -> None:
    """accelerate keeps one process-wide state: a TRL trainer created first (GRPOConfig defaults to bf16) used
    to make the online trainer's forward run under bf16 autocast, silently (found by running test_rl before
    this module). The trainer's module must compute exactly what the drafter computes."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    try:
        # what GRPOTrainer(args=GRPOConfig(...)) does first: transformers resets the state, then fixes bf16
        AcceleratorState._reset_state(reset_partial_state=True)
        Accelerator(cpu=True, mixed_precision="bf16")
        tr = OnlineTrainer(online_config(tiny_pair_dir, tmp_path), copy.deepcopy(pair.drafter))
        ids = torch.tensor([[1, 5, 9, 13, 17, 21]])
        with torch.no_grad():
            torch.testing.assert_close(tr.module(input_ids=ids).logits, pair.drafter(input_ids=ids).logits,
                                       atol=0, rtol=0)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)  # leave no process-wide state to later tests


def test_warmup_ramps_the_learning_rate_and_the_anchor_holds_weights_near_the_start(pair, prose, tiny_pair_dir,
                                                                                  tmp_path) -> None:
    """Issue 24 §2's knobs: `trainer.warmup_steps` ramps the LR linearly; `trainer.anchor_weight` pulls the
    weights towards where the trainer started (a trust region), so the same steps move them less."""
    def moved(*extra: str) -> tuple[float, float]:
        cfg = online_config(tiny_pair_dir, tmp_path, "trainer.heldout_fraction=0", "trainer.mode=full", *extra)
        tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
        start = [p.detach().clone() for p in tr.trainable.parameters()]
        tr.train_on_records(prose[:12])
        lr = tr.optimizer.param_groups[0]["lr"]
        return lr, float(sum(((p - s) ** 2).sum() for p, s in zip(tr.trainable.parameters(), start, strict=True)))

    lr_free, free = moved()
    lr_warm, warm = moved("trainer.warmup_steps=10")
    assert lr_free == pytest.approx(0.003) and lr_warm == pytest.approx(0.003 * 2 / 10) and warm < free
    _, anchored = moved("trainer.anchor_weight=1000")
    assert anchored < free
