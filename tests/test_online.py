"""The online trainer in-process: batches, stale targets, replay, shadow α, exactly-once, the feedback-token
budget, precision, warmup and anchor. Publishing, swaps, refusals and each drafter kind and draft vocabulary
from the config: tests/test_online_publish.py.

Feedback comes from the real engine on the tiny pair (module fixture, a few seconds). `online_config`,
`engine_records`, `_write_shards` and `_consumed` are shared with other test modules.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import threading
import time
from pathlib import Path

import pytest
import torch

from dvi.config import DviConfig, load_config
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine, Versions
from dvi.feedback import FeedbackRecord, FeedbackWriter
from dvi.registry.store import DrafterRegistry
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

    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter),
                            num_draft_tokens=3, feedback_top_k=16,
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


def step_gradients(tr: OnlineTrainer, records: list[FeedbackRecord], current: int) -> tuple[dict, list]:
    """(what one `_train_step` returns, the gradient its optimizer stepped with)."""
    seen, step = [], tr.optimizer.step

    def record(*a, **kw):
        seen.extend(p.grad.detach().clone() for p in tr.trainable.parameters())
        return step(*a, **kw)

    tr.optimizer.step = record
    return tr._train_step(records, current), seen


def assert_same_gradient(a: list, b: list) -> None:
    """Equal up to float summation order (scaled to the gradient's size); the gradient must not vanish."""
    scale = max(float(g.abs().max()) for g in a)
    assert scale > 1e-6
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5 * scale)


def _one_step(pair, cfg: DviConfig, records: list[FeedbackRecord], current: int = 1) -> tuple[dict, list]:
    """One step of a fresh trainer (the pair's drafter, or the config's when `pair` is None) on `records`."""
    torch.manual_seed(0)
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter)) if pair is not None else OnlineTrainer.from_config(cfg)
    tr.step = 30  # the reward term ramped in
    return step_gradients(tr, records, current)


@pytest.mark.parametrize("variant", ["lora", "full", "draft_vocab"])
def test_micro_batches_step_like_one_pass(pair, prose, tiny_pair_dir, tmp_path, variant) -> None:
    """`trainer.micro_batch_tokens`: a step split into passes of like-length rows (here 1-3 rows each) accumulates the
    one-pass step's gradient, with the reward term, stale-weighted rows and the anchor on (and a reduced draft
    vocabulary); the logged losses are the one pass's too."""
    from dvi.drafters.vocab import save_draft_vocab
    from trainers.online.collate import micro_batches

    records = [dataclasses.replace(r, target_version=i % 2) for i, r in enumerate(prose[:8])]  # half stale
    assert len({len(r.prompt_ids) for r in records}) > 3
    base = ["trainer.heldout_fraction=0", f"trainer.mode={'full' if variant == 'full' else 'lora'}",
            "trainer.anchor_weight=10", "trainer.reward_ramp_start=0", "trainer.reward_ramp_steps=1",
            "trainer.reward_weight=0.5"]
    drafter = pair
    if variant == "draft_vocab":
        save_draft_vocab(tmp_path / "vocab", torch.arange(511, -1, -1), vocab_size=512)
        base += [f"models.draft_vocab={tmp_path / 'vocab'}", "models.draft_vocab_size=32"]
        drafter = None
    budget = build_batch(records, [1.0] * 8).input_ids.numel() // 3
    assert len(micro_batches(records, [1.0] * 8, max_tokens=budget)) >= 3

    def step(name: str, tokens: int, recs: list[FeedbackRecord] = records) -> tuple[dict, list]:
        return _one_step(drafter, online_config(tiny_pair_dir, tmp_path / name, *base,
                                                f"trainer.micro_batch_tokens={tokens}"), recs)

    (one, g1), (many, gm) = step("one", 0), step("many", budget)
    assert one["tokens"] == many["tokens"] and (one["reward"] != 0 or variant == "draft_vocab")
    for k in ("loss", "kl", "reward"):
        assert many[k] == pytest.approx(one[k], rel=1e-5, abs=1e-6), k
    assert_same_gradient(g1, gm)
    with pytest.raises(AssertionError):  # a step on other rows has another gradient: the check can fail
        assert_same_gradient(g1, step("other", 0, records[:4])[1])


def test_micro_batches_bound_the_padded_tokens_of_a_pass(prose) -> None:
    from trainers.online.collate import micro_batches
    widths = sorted(len(r.prompt_ids) + len(r.token_ids) - 1 for r in prose[:16])
    parts = micro_batches(prose[:16], [1.0] * 16, max_tokens=2 * widths[-1])
    assert sum(p.input_ids.shape[0] for p in parts) == 16 and len(parts) >= 5
    assert all(p.input_ids.numel() <= 2 * widths[-1] for p in parts)
    assert sum(p.tokens for p in parts) == build_batch(prose[:16], [1.0] * 16).tokens
    assert len(micro_batches(prose[:16], [1.0] * 16, max_tokens=widths[0] - 1)) == 16  # a row too wide passes alone
    assert len(micro_batches(prose[:16], [1.0] * 16, max_tokens=0)) == 1


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
    # trainer.idle_replay_epochs bounds idle replay by the records trained: 10 replays of 14 records is under 1 per
    # record, 14 is not; 0 never bounds it
    assert tr.may_replay_idle()
    tr.tc = tr.tc.model_copy(update={"idle_replay_epochs": 1.0})
    assert tr.may_replay_idle()
    tr.train_on_replay(steps=1, recent=6)
    assert tr.replayed == 14 and not tr.may_replay_idle()


def test_replay_gives_each_group_an_equal_share_however_few_its_records(pair, prose, tiny_pair_dir, tmp_path) -> None:
    from dvi.feedback.heldout import group_of

    tr = OnlineTrainer(online_config(tiny_pair_dir, tmp_path), copy.deepcopy(pair.drafter))
    records = copy.deepcopy(prose)
    for i, r in enumerate(records):
        r.domain, r.temperature = ("code" if i < 3 else "prose"), 0.0  # code's traffic stopped: 3 of 64 records
    tr.replay.extend(records)
    drawn = [group_of(r) for r in tr._sample_replay(2000)]
    assert set(drawn) == {"code/greedy", "prose/greedy"} and 0.45 < drawn.count("code/greedy") / len(drawn) < 0.55


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
    before = tr.publisher.shadow(held)
    for _ in range(4):  # in-process callers may re-feed records (the process never does)
        tr.train_on_records(prose)
    after = tr.publisher.shadow(held)
    assert tr.step >= 24
    assert after.alpha > before.alpha + 0.05, (before, after)


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


def test_trainer_gives_freed_heap_back_once_caught_up(pair, prose, tiny_pair_dir, tmp_path) -> None:
    """Issue 60: a trainer between its periodic trims held the freed heap of its last rounds (256-360 MiB per trim on
    the real pair), so its RSS followed the traffic of the moment. Once it has caught up with the log it trims at
    once (no round waits on it), and only once until it trains again."""
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.batch_size=4", "trainer.malloc_trim_seconds=3600",
                        "trainer.poll_seconds=0.05", "trainer.checkpoint_seconds=0")
    _write_shards(Path(cfg.feedback.dir), prose[:16], per_shard=4)
    loop = TrainerLoop(OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=DrafterRegistry(cfg.registry.dir)),
                       cfg)
    if not loop.heap.enabled:
        pytest.skip("no glibc malloc_trim here")
    seen: dict[str, int] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (loop.rounds and loop.heap.trims):
            time.sleep(0.02)
        time.sleep(0.5)  # idle polls go on: no trim without a round in between
        seen.update(rounds=loop.rounds, trims=loop.heap.trims)
        loop.stop.requested = True

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    loop.run()
    watcher.join()
    assert seen["rounds"] >= 1 and seen["trims"] == 1, seen


# -- the feedback-token budget, precision, warmup and anchor ---------------------------------------------
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
    # a checkpoint from before `format` named only its kind (a separate LoRA drafter's: "lora") and still resumes
    state_path = tmp_path / "ckpt" / "state.json"
    state = json.loads(state_path.read_text())
    assert (state["drafter_kind"], state["format"]) == ("separate", "lora")
    state_path.write_text(json.dumps({k: v for k, v in state.items() if k not in ("drafter_kind", "format")}
                                     | {"kind": "lora"}))
    OnlineTrainer(cfg, copy.deepcopy(pair.drafter)).load_checkpoint(tmp_path / "ckpt")
    state_path.write_text(json.dumps(state | {"format": "full"}))
    with pytest.raises(ValueError, match="separate/full drafter, this is separate/lora"):
        OnlineTrainer(cfg, copy.deepcopy(pair.drafter)).load_checkpoint(tmp_path / "ckpt")


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
