"""The `eagle` drafter kind: a head on the target's own features, lossless in the engine, its features
logged exactly, trained from feedback alone, published and hot-swapped like the other kinds."""

from __future__ import annotations

import pytest
import torch
from test_engine import NEW, PROMPTS, assert_greedy_equal, reference, tiny
from test_sampling import N_SAMPLES, engine_pvalue, tiny_lm

from dvi.drafters.eagle import EagleDrafter, features_from_hidden
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine
from dvi.feedback import FeedbackRecord
from dvi.feedback.record import records_to_table
from dvi.feedback.shadow import hf_logits_fn

torch.set_num_threads(1)


def noisy_eagle(target, scale: float = 0.05, seed: int = 3, vocab_ids=None) -> EagleDrafter:
    """An eagle head on `target` with noise on its own weights, the feature half of fc included (so the
    features it is fed change its drafts: a wrong feature bookkeeping shows up in the tests below)."""
    d = EagleDrafter(target, vocab_ids=vocab_ids)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale * p.abs().mean().clamp_min(0.05))
    return d


def target_features(target, tokens: list[int]) -> torch.Tensor:
    """The target's final normed hidden states f_0..f_{L-2} of `tokens` (one plain HF forward)."""
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
    return out.hidden_states[-1][0]  # [L - 1, H]


def run(eng: SpeculativeEngine, prompts, n: int = NEW, temperature: float = 0.0, midflight=None) -> list:
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"q{i}", p, SamplingParams(n, temperature=temperature, seed=i)))
    done, steps = {}, 0
    while eng.has_unfinished():
        if midflight is not None:
            midflight(eng, steps)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.result
        steps += 1
    return [done[f"q{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral"])
def family(request):
    target = tiny(request.param, seed=0)
    return target, [reference(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("ragged", [False, True], ids=["batch1", "ragged5"])
def test_greedy_equals_target(family, k, ragged):
    target, refs = family
    eng = SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)), num_draft_tokens=k)
    prompts = PROMPTS if ragged else PROMPTS[:1]
    got = run(eng, prompts)
    for p, r, ref in zip(prompts, got, refs, strict=False):
        assert_greedy_equal(target, p, r.token_ids, ref)
        assert r.hidden is not None and r.hidden.shape == (len(p) + NEW - 1, target.config.hidden_size)
    assert sum(r.num_drafted for r in got) > 0


def test_untrained_head_on_one_layer_target_accepts_everything():
    """Untrained, the head is the target's layer 0 on the embeddings: on a 1-layer target it IS the target,
    so every draft must be accepted; any misplaced position or cache entry would show up as a rejection."""
    target = tiny("llama", seed=0, layers=1)
    eng = SpeculativeEngine(target, proposer_for(target, EagleDrafter(target)), num_draft_tokens=4)
    got = run(eng, PROMPTS)
    for p, r in zip(PROMPTS, got, strict=True):
        assert_greedy_equal(target, p, r.token_ids, reference(target, p, NEW))
    assert sum(r.num_accepted for r in got) == sum(r.num_drafted for r in got) > 0



def assert_drafts_are_the_teacher_forced_head(target, d) -> None:
    """Every draft the engine made equals the head run teacher-forced on the features its record logged."""
    got = run(SpeculativeEngine(target, proposer_for(target, d), num_draft_tokens=1), PROMPTS)
    fn = hf_logits_fn(d.model)
    checked = 0
    for p, r in zip(PROMPTS, got, strict=True):
        rec = FeedbackRecord.from_result(r)
        feats = features_from_hidden(torch.from_numpy(rec.features().copy()).float()).unsqueeze(0)
        with torch.no_grad():
            pred = fn(torch.tensor([p + r.token_ids[:-1]]), feats)[0, len(p) - 1:].argmax(-1).tolist()
        for j, dr in enumerate(r.drafted_ids):
            if dr >= 0:
                assert dr == pred[j], (j, dr, pred[j])
                checked += 1
    assert checked > 20

def test_drafts_equal_the_teacher_forced_head_on_logged_features():
    """K = 1: each draft is the head's argmax given the TRUE features of every input; the same head run
    teacher-forced over the record (its logged features) must predict exactly the drafted ids."""
    target = tiny("llama", seed=0)
    d = noisy_eagle(target, scale=0.3)
    assert_drafts_are_the_teacher_forced_head(target, d)


def test_logged_features_round_trip_to_the_training_batch():
    """engine -> FeedbackRecord -> parquet row -> compact record -> Batch: the features are the target's own."""
    from trainers.online.collate import build_batch

    target = tiny("llama", seed=0)
    got = run(SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)),
                                num_draft_tokens=3, feedback_top_k=4), PROMPTS[:3])
    recs = [FeedbackRecord.from_result(r) for r in got]
    rows = records_to_table(recs).to_pylist()
    exs = [FeedbackRecord.from_row(row).compact() for row in rows]
    batch = build_batch(exs, [1.0] * len(exs))
    for i, (p, r) in enumerate(zip(PROMPTS[:3], got, strict=True)):
        ref = target_features(target, p + r.token_ids)  # [L - 1, H]
        assert torch.allclose(r.hidden.float(), ref, atol=2e-3, rtol=2e-3)
        n = len(p) + len(r.token_ids) - 1
        assert torch.equal(batch.features[i, -n:].float(), features_from_hidden(r.hidden.float()))
        assert torch.equal(batch.feature_targets[i, -len(r.token_ids):].float(),
                           r.hidden[-len(r.token_ids):].float())
    assert len(recs[0].hidden) == 2 * (len(PROMPTS[0]) + NEW - 1) * target.config.hidden_size


def test_record_rejects_features_of_the_wrong_size():
    target = tiny("llama", seed=0)
    r = run(SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)), num_draft_tokens=2), PROMPTS[:1])[0]
    rec = FeedbackRecord.from_result(r)
    with pytest.raises(ValueError, match="hidden has"):
        FeedbackRecord.from_row({**rec.__dict__, "hidden": rec.hidden[:-2]})
    old = {k: v for k, v in rec.__dict__.items() if k not in ("hidden", "hidden_dim")}
    assert FeedbackRecord.from_row(old).features() is None  # shards from before the field: no features


def test_row_joining_and_hot_swaps_midflight():
    target = tiny("mistral", seed=0)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    late = {"added": False}

    def midflight(eng, step):
        if step == 2:  # eagle -> another eagle version
            eng.set_drafter(noisy_eagle(target, seed=9), version=2)
        if step == 3 and not late["added"]:  # a row joins mid-flight
            eng.add_request(Request("late", PROMPTS[4], SamplingParams(NEW)))
            late["added"] = True
        if step == 5:  # eagle -> a separate drafter -> eagle again: features recomputed for every row
            eng.set_drafter(tiny("mistral", seed=1, layers=1), version=3)
        if step == 7:
            eng.set_drafter(noisy_eagle(target, seed=11), version=4)

    eng = SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)), num_draft_tokens=3)
    finished = {}
    orig_step = eng.step

    def step():
        outs = orig_step()
        for o in outs:
            if o.finished:
                finished[o.request_id] = o.result
        return outs

    eng.step = step
    got = run(eng, PROMPTS[:4], midflight=midflight)
    for p, r, ref in zip(PROMPTS[:4], got, refs, strict=False):
        assert_greedy_equal(target, p, r.token_ids, ref)
        assert r.hidden.shape[0] == len(p) + NEW - 1
    assert_greedy_equal(target, PROMPTS[4], finished["late"].token_ids, refs[4])


def test_target_update_midflight_recomputes_features():
    target = tiny("llama", seed=0)
    new_target = tiny("llama", seed=7)
    eng = SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)), num_draft_tokens=3)
    cut = {}

    def midflight(eng, step):
        if step == 2:
            cut.update({s.req.request_id: len(s.res.token_ids) for s in eng._seqs})
            eng.update_target_weights(new_target.state_dict(), version=5)

    got = run(eng, PROMPTS[:2], midflight=midflight)
    for i, (p, r) in enumerate(zip(PROMPTS[:2], got, strict=True)):
        c = cut[f"q{i}"]
        ctx = p + r.token_ids[:c]
        assert_greedy_equal(new_target, ctx, r.token_ids[c:], reference(new_target, ctx, NEW - c))
        tail = target_features(new_target, p + r.token_ids)[len(ctx):]  # positions after the update
        assert torch.allclose(r.hidden[len(ctx):].float(), tail, atol=2e-3, rtol=2e-3)


def _small_vocab(family: str):
    """A one-layer target over 8 tokens (the chi-square needs every two-token outcome counted)."""
    if family == "llama":
        return tiny_lm(0)
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, initializer_range=0.15, max_position_embeddings=32)
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16)).eval()
    return MistralForCausalLM(MistralConfig(**common, sliding_window=4)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
def test_sampling_follows_the_target_distribution(family):
    """Chi-square of the first two sampled tokens against the target's exact law (eagle drafts)."""
    target = _small_vocab(family)
    pv, alpha = engine_pvalue(target, noisy_eagle(target, scale=0.3), N_SAMPLES, 1.0, seed=11)
    assert 0.1 < alpha < 0.95
    assert pv > 1e-3, pv


def test_reduced_vocab_and_save_load(tmp_path):
    target = tiny("llama", seed=0)
    ids = torch.arange(0, 300, 2)
    d = noisy_eagle(target, vocab_ids=ids)
    got = run(SpeculativeEngine(target, proposer_for(target, d), num_draft_tokens=3), PROMPTS[:2])
    assert {x for r in got for x in r.drafted_ids if x >= 0} <= set(ids.tolist())
    d.save(tmp_path / "eagle")
    back = EagleDrafter.load(target, tmp_path / "eagle", vocab_ids=ids)
    for k, v in d.trainable_state_dict().items():
        assert torch.equal(v, back.trainable_state_dict()[k])
    with pytest.raises(ValueError, match="hidden size"):
        EagleDrafter.load(tiny("llama", seed=0, hidden_size=32, num_attention_heads=2), tmp_path / "eagle")
    shared = {id(p) for p in target.parameters()}
    assert all(id(p) not in shared for p in d.trainable_parameters())
    assert d.model.embed_tokens.weight is target.model.embed_tokens.weight  # no copy of the embedding


def test_non_llama_family_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="eagle drafters support"):
        EagleDrafter(tiny("gpt2", seed=0))


# -- online training, publishing, hot swap -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tiny_pair_dir):
    from dvi.models.loading import load_pair

    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


def eagle_records(pair, drafter, n: int, new: int = 20) -> list[FeedbackRecord]:
    """Greedy feedback records of the real engine serving an eagle head (features logged)."""
    import itertools

    from dvi.data import prompt_stream

    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, drafter), num_draft_tokens=3, feedback_top_k=16)
    prompts = list(itertools.islice(prompt_stream("prose", pair.tokenizer, prompt_tokens=(12, 40), seed=0), n))
    return [FeedbackRecord.from_result(r) for r in run(eng, prompts, n=new)]


def test_trainer_learns_from_feedback_publishes_and_the_server_swaps_losslessly(tiny_pair, tiny_pair_dir,
                                                                               tmp_path):
    from test_online import online_config

    from dvi.registry.codec import load_drafter_version
    from dvi.registry.store import DrafterRegistry
    from trainers.online.collate import is_heldout
    from trainers.online.trainer import OnlineTrainer

    base = EagleDrafter(tiny_pair.target)
    recs = eagle_records(tiny_pair, base, 64)
    assert all(r.hidden for r in recs)
    cfg = online_config(tiny_pair_dir, tmp_path, "models.drafter_kind=eagle", "trainer.shadow_margin=1.0",
                        "trainer.eagle_learning_rate=0.003")  # far from the target: a bold lr
    reg = DrafterRegistry(cfg.registry.dir)
    torch.manual_seed(0)
    tr = OnlineTrainer(cfg, noisy_eagle(tiny_pair.target, scale=0.3), registry=reg)  # far from the target
    assert tr.trainable.kind == "eagle"
    held = [r for r in recs if is_heldout(r.request_id, 0.25)]
    before = tr.publisher.shadow(held)
    for _ in range(3):
        st = tr.train_on_records(recs)
    after = tr.publisher.shadow(held)
    assert st.losses["feature"] > 0 and after.alpha > before.alpha + 0.3, (before, after)  # measured 0.10 -> 0.88
    v = tr.maybe_publish(force=True).published
    assert reg.manifest(v).drafter_kind == "eagle"
    live, _ = load_drafter_version(reg, v, base)
    for k, t in tr.trainable.state().items():
        assert torch.allclose(live.trainable_state_dict()[k].float(), t.float())
    prompts = [list(r.prompt_ids) for r in recs[:3]]
    refs = [reference(tiny_pair.target, p, 12) for p in prompts]

    def swap(eng, step):
        if step == 2:
            eng.set_drafter(live, v)

    got = run(SpeculativeEngine(tiny_pair.target, proposer_for(tiny_pair.target, base),
                                num_draft_tokens=3), prompts, n=12, midflight=swap)
    assert [r.token_ids for r in got] == refs and all(r.drafter_version == v for r in got)


@pytest.mark.parametrize("chained", [False, True])
def test_eagle_micro_batches_step_like_one_pass(tiny_pair, tiny_pair_dir, tmp_path, chained):
    """`trainer.micro_batch_tokens` with an eagle head: its features, feature regression and (chained) second pass
    split by rows accumulate the one-pass step's gradient."""
    from test_online import assert_same_gradient, online_config, step_gradients

    from trainers.online.collate import build_batch, micro_batches
    from trainers.online.trainer import OnlineTrainer

    recs = eagle_records(tiny_pair, EagleDrafter(tiny_pair.target), 6)
    budget = build_batch(recs, [1.0] * 6).input_ids.numel() // 3
    assert len(micro_batches(recs, [1.0] * 6, max_tokens=budget)) >= 3

    def step(tokens: int, rows: int = 6) -> tuple[dict, list]:
        cfg = online_config(tiny_pair_dir, tmp_path / f"{tokens}-{rows}", "models.drafter_kind=eagle",
                            "trainer.heldout_fraction=0", f"trainer.eagle_chained={chained}",
                            f"trainer.micro_batch_tokens={tokens}")
        torch.manual_seed(0)
        return step_gradients(OnlineTrainer(cfg, noisy_eagle(tiny_pair.target, scale=0.3)), recs[:rows], 0)

    (one, g1), (many, gm) = step(0), step(budget)
    assert one["feature"] > 0
    for k in ("loss", "kl", "feature"):
        assert many[k] == pytest.approx(one[k], rel=1e-5, abs=1e-6), k
    assert_same_gradient(g1, gm)
    with pytest.raises(AssertionError):  # a step on other rows has another gradient: the check can fail
        assert_same_gradient(g1, step(0, 3)[1])


def test_trainer_from_config_builds_an_eagle_head(tiny_pair, tiny_pair_dir, tmp_path):
    from test_online import online_config

    from trainers.online.trainer import OnlineTrainer

    cfg = online_config(tiny_pair_dir, tmp_path, "models.drafter_kind=eagle")
    tr = OnlineTrainer.from_config(cfg)
    assert tr.trainable.kind == "eagle"
    n_train = sum(p.numel() for p in tr.trainable.parameters())
    assert 0 < n_train < sum(p.numel() for p in tr.trainable.drafter.target_ref.parameters())


def test_chained_pass_feeds_generated_positions_the_heads_own_features():
    """The trainer's second eagle pass: prompt inputs keep the target's features, input j of the generated
    region reads the head's prediction at input j - 1 (what draft j of a step reads)."""
    from trainers.losses import chained_features
    from trainers.online.collate import build_batch

    target = tiny("llama", seed=0)
    d = noisy_eagle(target)
    got = run(SpeculativeEngine(target, proposer_for(target, d), num_draft_tokens=2, feedback_top_k=4), PROMPTS[:3])
    batch = build_batch([FeedbackRecord.from_result(r).compact() for r in got], [1.0] * 3)
    with torch.no_grad():
        out = d.model(input_ids=batch.input_ids, features=batch.features, attention_mask=batch.attention_mask,
                      position_ids=batch.position_ids, logits_to_keep=batch.width)
    f2 = chained_features(batch, out)
    w, t = batch.features.shape[1], batch.width
    assert f2.shape == batch.features.shape
    assert torch.equal(f2[:, : w - t + 1], batch.features[:, : w - t + 1])
    assert torch.equal(f2[:, w - t + 1:], out.features[:, :-1].to(f2.dtype))


def test_hybrid_with_an_eagle_head_is_greedy_equal_and_logs_true_features():
    """`hybrid` over an eagle head: steps where suffix rows draft leave the head's cache without those drafts and
    its features true (the head re-reads the kept tokens with the target's features), and every kind of step
    logs the same features the target computes."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    target = tiny("llama", seed=0)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    prop = make_proposer("hybrid", noisy_eagle(target), int(target.config.vocab_size), "cpu",
                          settings=SuffixConfig(threshold=1.0, max_draft_tokens=8))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=3)
    for _ in range(2):  # the second pass drafts mostly from the first one's outputs
        got = run(eng, PROMPTS)
        for p, r, ref in zip(PROMPTS, got, refs, strict=True):
            assert_greedy_equal(target, p, r.token_ids, ref)
            feats = target_features(target, p + r.token_ids)
            assert torch.allclose(r.hidden.float(), feats, atol=2e-3, rtol=2e-3)
    sources = {s for r in got for s in r.by_source}
    assert "suffix_global" in sources
