"""Greedy losslessness of the batched speculative engine across architectures, ragged batches and K."""

from __future__ import annotations

import copy

import pytest
import torch

from dvi.decode.sampling import tie_bound
from dvi.drafters.factory import proposer_for
from dvi.drafters.learned import EarlyExitDrafter, SeparateDrafter
from dvi.drafters.vocab import frequent_token_ids
from dvi.engine.speculative import EngineOptions, Request, SamplingParams, SpeculativeEngine

torch.set_num_threads(1)

VOCAB = 300
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [3, 4, 5, 6], [100, 200, 150, 7, 9, 11, 13, 15, 17], [42]]
NEW = 16
TIE_EPS = 1e-4


def tiny(family: str, seed: int, layers: int = 2, **over):
    """Tiny random model with peaked logits (initializer_range 0.2+) so greedy ties are rare."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.25,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    if family == "llama":
        cfg, cls = LlamaConfig(**{**common, **over}), LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = Qwen2Config(**{**common, **over}), Qwen2ForCausalLM
    elif family == "qwen3":
        cfg, cls = Qwen3Config(**{**common, "head_dim": 16, **over}), Qwen3ForCausalLM
    elif family == "mistral":
        cfg, cls = MistralConfig(**{**common, "sliding_window": 12, **over}), MistralForCausalLM
    elif family == "gpt2":
        cfg = GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=128, initializer_range=0.25, **over
        )
        cls = GPT2LMHeadModel
    elif family == "gpt_neox":
        cfg = GPTNeoXConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            max_position_embeddings=128, initializer_range=0.25, tie_word_embeddings=False, **over,
        )
        cls = GPTNeoXForCausalLM
    else:
        raise ValueError(family)
    m = cls(cfg).eval()
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def perturbed(model, scale: float = 0.03, seed: int = 123):
    """A copy of the target with small weight noise: agrees often but not always (exercises partial acceptance)."""
    torch.manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale * p.abs().mean().clamp_min(1e-3))
    return m


def reference(target, prompt: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([prompt], device=target.device), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt) :].tolist()


def assert_greedy_equal(target, prompt: list[int], got: list[int], ref: list[int], tie_eps: float = TIE_EPS) -> None:
    """Equal, or the first divergence sits on a float-noise tie of the target's top-2 logits (shown here)."""
    assert len(got) == len(ref)
    if got == ref:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, ref, strict=True)) if a != b)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + ref[:j]], device=target.device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    dtype = next(target.parameters()).dtype
    if dtype != torch.float32:  # a reduced-precision target: the contract is near-ties of its dtype (tie_bound)
        tie_eps = max(tie_eps, tie_bound(top2[0], dtype))
    assert gap < tie_eps, f"divergence at {j}: got {got[j]} ref {ref[j]}, top-2 gap {gap:.3g} is not {dtype} noise"


def reduced_ids(refs: list[list[int]], keep: float = 0.5) -> torch.Tensor:
    """A draft vocabulary of the most frequent `keep` share of the target's greedy tokens (+ id 0).

    Some of the target's own greedy tokens fall outside it, so the drafter must miss them and the
    engine must reject and correct there.
    """
    distinct = {t for r in refs for t in r}
    ids = frequent_token_ids(refs, n=max(1, int(len(distinct) * keep)), always=[0])
    assert distinct - set(ids.tolist()), "the subset must leave some target tokens out"
    return ids


def assert_drafts_in(results, ids: torch.Tensor) -> None:
    """A reduced drafter only ever proposes ids of its subset."""
    allowed = set(ids.tolist())
    drafted = [d for r in results for d in r.drafted_ids if d >= 0]
    assert drafted and set(drafted) <= allowed


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_models(request):
    fam = request.param
    target = tiny(fam, seed=0)
    other = tiny(fam, seed=1, layers=1)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    return fam, target, other, refs


@pytest.mark.parametrize("drafter_kind", ["other", "perturbed", "perturbed_reduced"])
def test_greedy_equals_hf_generate(family_models, drafter_kind):
    fam, target, other, refs = family_models
    drafter = other if drafter_kind == "other" else perturbed(target)
    ids = None
    if drafter_kind.endswith("_reduced"):  # reduced draft vocabulary: q = 0 outside `ids`
        ids = reduced_ids(refs)
        drafter = SeparateDrafter(drafter, vocab_ids=ids)
    alphas = []
    for k in (1, 3, 5):
        eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=k)
        # batch 1, one prompt at a time
        for p, ref in zip(PROMPTS, refs, strict=True):
            r = eng.generate([p], NEW)[0]
            assert_greedy_equal(target, p, r.token_ids, ref)
        # batch 5, ragged prompts
        res = eng.generate(PROMPTS, NEW)
        for p, ref, r in zip(PROMPTS, refs, res, strict=True):
            assert_greedy_equal(target, p, r.token_ids, ref)
            assert r.finish_reason == "length"
            assert len(r.drafted_ids) == len(r.accepted) == len(r.token_logprobs) == NEW
        alphas += [r.alpha for r in res]
        if ids is not None:
            assert_drafts_in(res, ids)
    mean_alpha = sum(alphas) / len(alphas)
    if drafter_kind == "perturbed":
        # acceptance exercised both ways: many accepts and some rejects
        assert 0.3 < mean_alpha < 1.0, mean_alpha
    elif drafter_kind == "perturbed_reduced":
        # tokens outside the subset are always rejected, the rest mostly accepted
        assert 0.1 < mean_alpha < 1.0, mean_alpha
    else:
        assert mean_alpha < 0.5, mean_alpha


def test_self_drafter_accepts_everything():
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, target), num_draft_tokens=4)
    res = eng.generate(PROMPTS, NEW)
    for p, r in zip(PROMPTS, res, strict=True):
        assert_greedy_equal(target, p, r.token_ids, reference(target, p, NEW))
        assert r.alpha == 1.0
        assert r.mean_accepted_length == pytest.approx(NEW / r.num_steps)


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
@pytest.mark.parametrize("fam", ["llama", "gpt2"])
def test_early_exit_drafter_lossless(fam, reduced):
    target = tiny(fam, seed=0, layers=3)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    ids = reduced_ids(refs) if reduced else None
    ee = EarlyExitDrafter(target, num_layers=1, lora_rank=4, vocab_ids=ids)
    with torch.no_grad():  # make the LoRA / exit head non-trivial
        for p in ee.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for k in (1, 3):
        eng = SpeculativeEngine(target, proposer_for(target, ee), num_draft_tokens=k)
        res = eng.generate(PROMPTS, NEW)
        for p, ref, r in zip(PROMPTS, refs, res, strict=True):
            assert_greedy_equal(target, p, r.token_ids, ref)
        if ids is not None:
            assert_drafts_in(res, ids)
    # and the target still equals its own reference after the engine ran (no LoRA leaked into it)
    assert refs == [reference(target, p, NEW) for p in PROMPTS]


def test_continuous_batching_add_and_abort():
    target = tiny("llama", seed=0)
    drafter = perturbed(target)
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3)
    refs = {i: reference(target, p, NEW) for i, p in enumerate(PROMPTS)}

    def req(i):
        return Request(f"r{i}", PROMPTS[i], SamplingParams(max_new_tokens=NEW))

    eng.add_request(req(0))
    eng.add_request(req(1))
    got: dict[str, list[int]] = {}
    results = {}

    def run_step():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                results[o.request_id] = o.result

    run_step()
    run_step()
    eng.add_request(req(3))  # joins mid-flight
    eng.add_request(req(2))
    run_step()
    aborted = eng.abort("r1")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert eng.num_active() == 3
    while eng.has_unfinished():
        run_step()
    for i in (0, 2, 3):
        assert_greedy_equal(target, PROMPTS[i], results[f"r{i}"].token_ids, refs[i])
        assert got[f"r{i}"] == results[f"r{i}"].token_ids
    assert results["r1"].finish_reason == "abort"
    partial = results["r1"].token_ids
    assert 0 < len(partial) < NEW and partial == refs[1][: len(partial)]
    assert eng.abort("nope") is None


def test_stop_tokens_and_feedback_fields():
    target = tiny("llama", seed=0)
    ref = reference(target, PROMPTS[0], NEW)
    stop = ref[5]
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)), num_draft_tokens=3, feedback_top_k=4)
    r = eng.generate([PROMPTS[0]], NEW, stop_token_ids=[stop])[0]
    cut = ref.index(stop) + 1
    assert r.token_ids == ref[:cut] and r.finish_reason == "stop"
    n = len(r.token_ids)
    assert len(r.topk_ids) == len(r.topk_logprobs) == n and all(len(t) == 4 for t in r.topk_ids)
    for j in range(n):
        assert r.topk_ids[j][0] == r.token_ids[j]  # greedy: the emitted token is the target's top-1
        assert r.token_logprobs[j] == pytest.approx(r.topk_logprobs[j][0], abs=1e-5)
        if r.accepted[j]:
            assert r.drafted_ids[j] == r.token_ids[j]
    assert sum(r.accepted) <= r.num_accepted
    assert sum(r.drafted_per_position) == r.num_drafted and sum(r.accepted_per_position) == r.num_accepted


@pytest.mark.parametrize("all_t1", [True, False])
def test_emitted_scores_only_what_a_row_emits_and_as_the_full_pass_does(all_t1):
    """On a CPU a verify's log-probs and top-k are taken over the emitted positions only (columns 0..n_i of row i):
    what a pass over every verified position gives there, and nothing past them (never read)."""
    from dvi.decode.emit import emitted

    g = torch.Generator().manual_seed(0)
    b, k, v, top = 4, 3, 50, 5
    logits = torch.randn(b, k + 1, v, generator=g).bfloat16()
    drafts = torch.randint(0, v, (b, k), generator=g)
    n, nxt = torch.tensor([0, 3, 1, 2]), torch.randint(0, v, (b,), generator=g)
    temp = torch.tensor([0.0, 0.7, 1.0, 0.0]) if not all_t1 else torch.ones(b)
    e = emitted(drafts, n, nxt, logits, temp, all_t1, top)
    assert e.n == n.tolist() and e.drafts == drafts.tolist()
    scaled = logits.float() / torch.where(temp > 0, temp, 1.0).view(b, 1, 1)
    lp, raw = torch.log_softmax(scaled, -1), torch.log_softmax(logits.float(), -1)
    for i in range(b):
        ni = int(n[i])
        toks = drafts[i, :ni].tolist() + [int(nxt[i])]
        assert e.tokens[i][: ni + 1] == toks
        assert len(e.logprobs[i]) == len(e.topk_ids[i]) == len(e.topk_logprobs[i]) == ni + 1
        for j, t in enumerate(toks):
            assert e.logprobs[i][j] == pytest.approx(float(lp[i, j, t]), abs=1e-5)
            tv, ti = raw[i, j].topk(top)
            assert e.topk_ids[i][j] == ti.tolist()
            assert e.topk_logprobs[i][j] == pytest.approx(tv.tolist(), abs=1e-5)
    plain = emitted(None, torch.zeros(b, dtype=torch.long), nxt, logits[:, :1], temp, all_t1, top)
    assert [len(x) for x in plain.logprobs] == [1] * b and plain.drafts is None
    assert plain.logprobs[1][0] == pytest.approx(float(lp[1, 0, int(nxt[1])]), abs=1e-5)


def test_speculation_off_and_no_drafter():
    target = tiny("qwen2", seed=0)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    for eng in (SpeculativeEngine(target, None), SpeculativeEngine(target, proposer_for(target, tiny("qwen2", 1, 1)),
                                  num_draft_tokens=0)):
        for p, ref, r in zip(PROMPTS, refs, eng.generate(PROMPTS, NEW), strict=True):
            assert_greedy_equal(target, p, r.token_ids, ref)
            assert r.num_drafted == 0 and all(d == -1 for d in r.drafted_ids)


def test_adaptive_engine_lossless():
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)),
                            num_draft_tokens=3, adaptive=True, max_draft_tokens=6)
    for _ in range(2):
        res = eng.generate(PROMPTS, NEW)
        for p, r in zip(PROMPTS, res, strict=True):
            assert_greedy_equal(target, p, r.token_ids, reference(target, p, NEW))
    assert eng.costs.verify and eng.controller.costs.verify  # online timings and calibrated costs


def test_rows_whose_drafts_do_not_pay_draft_nothing_and_the_text_stays_greedy(monkeypatch):
    """Adaptive K in throughput mode over a target that skips padding: where the pricing keeps only some rows
    drafting (`AdaptiveK.last_rows`), the others propose nothing, the verify scores only real drafts, and every
    answer is still the target's greedy text."""
    from dvi.decode.lean_target import LeanTarget

    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)), num_draft_tokens=3, adaptive=True,
                            max_draft_tokens=3, options=EngineOptions(drain_aware=False))
    ctl = eng.k_policy.controller
    assert ctl.ragged and not eng.k_policy.drain_aware

    def first_row_only(batch, alphas, remaining=None, pending_tokens=0):
        assert remaining is None  # throughput mode
        ctl.last_rows = [0] if len(alphas) > 1 else None
        return 2

    monkeypatch.setattr(ctl, "choose", first_row_only)
    skipped = []
    ragged_rows = LeanTarget.ragged_rows
    monkeypatch.setattr(LeanTarget, "ragged_rows", lambda self, lens, q: skipped.append(
        sum(q - 1 - n for n in lens)) or ragged_rows(self, lens, q))
    res = eng.generate(PROMPTS, NEW)
    for p, r in zip(PROMPTS, res, strict=True):
        assert_greedy_equal(target, p, r.token_ids, reference(target, p, NEW))
    assert skipped and max(skipped) == 2 * (len(PROMPTS) - 1)  # all rows but one: 2 unscored positions each
    assert sum(r.num_drafted for r in res) < sum(r.num_steps for r in res) * 2  # not every row drafted every step


def test_set_drafter_and_update_target_midflight():
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, tiny("llama", 1, 1)), num_draft_tokens=3)
    for i in (0, 3):
        eng.add_request(Request(f"r{i}", PROMPTS[i], SamplingParams(max_new_tokens=NEW)))
    results = {}

    def run_step():
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o.result

    run_step()
    eng.set_drafter(perturbed(target), version=2)  # hot swap: must not change the tokens
    run_step()
    new_target = tiny("llama", seed=7)
    cut = {s.req.request_id: len(s.res.token_ids) for s in eng._seqs}  # tokens so far, per request
    eng.update_target_weights(new_target.state_dict(), version=5)
    while eng.has_unfinished():
        run_step()
    for i in (0, 3):
        r = results[f"r{i}"]
        c = cut[f"r{i}"]
        assert r.target_version == 5 and r.drafter_version == 2
        old_ref = reference(tiny("llama", seed=0), PROMPTS[i], NEW)
        assert r.token_ids[:c] == old_ref[:c]
        ctx = PROMPTS[i] + r.token_ids[:c]
        assert_greedy_equal(new_target, ctx, r.token_ids[c:], reference(new_target, ctx, NEW - c))


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_update_target_weights_from_path_with_early_exit(tmp_path, reduced):
    target = tiny("llama", seed=0, layers=3)
    # reduced: the drafter's head is a cached row slice of the target's lm_head; it must follow the update
    ids = torch.arange(0, VOCAB, 2) if reduced else None
    ee = EarlyExitDrafter(target, num_layers=1, lora_rank=2, vocab_ids=ids)
    eng = SpeculativeEngine(target, proposer_for(target, ee), num_draft_tokens=3)
    eng.generate(PROMPTS[:2], 4)
    new = tiny("llama", seed=8, layers=3)
    new.save_pretrained(tmp_path / "t2")
    eng.update_target_weights(tmp_path / "t2", version=3)
    # the early-exit drafter reads the same (updated in place) Parameters
    assert ee.model.model.embed_tokens.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    assert torch.equal(target.model.embed_tokens.weight, new.model.embed_tokens.weight)
    for p, r in zip(PROMPTS, eng.generate(PROMPTS, NEW), strict=True):
        assert_greedy_equal(new, p, r.token_ids, reference(new, p, NEW))
        assert r.target_version == 3
    if reduced:
        x = torch.tensor([PROMPTS[0]])
        with torch.no_grad():
            got = ee.model(input_ids=x).logits[0, -1]
        head_rows = new.lm_head.weight[ids]
        h = ee.model.model(input_ids=x).last_hidden_state[0, -1]
        assert torch.allclose(got[ids], head_rows @ h, atol=1e-5)
        assert bool(torch.isinf(got[1::2]).all())


def test_mixed_greedy_and_sampled_rows():
    """A greedy row stays exact while it shares the batch with sampled rows (one-hot path of the same rule)."""
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)), num_draft_tokens=3)
    eng.add_request(Request("g", PROMPTS[0], SamplingParams(max_new_tokens=NEW)))
    eng.add_request(Request("s1", PROMPTS[3], SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=1)))
    eng.add_request(Request("s2", PROMPTS[1], SamplingParams(max_new_tokens=NEW, temperature=0.7, top_k=5, seed=2)))
    res = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                res[o.request_id] = o.result
    assert_greedy_equal(target, PROMPTS[0], res["g"].token_ids, reference(target, PROMPTS[0], NEW))
    assert all(len(r.token_ids) == NEW for r in res.values())


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_suffix_and_hybrid_greedy_equal_hf_generate(kind):
    """Suffix drafts (point masses) keep greedy output equal at batch 1 and ragged batches; a second pass over
    the same prompts drafts from the finished outputs (the global index) and accepts most of them."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    target = tiny("llama", seed=0)
    refs = [reference(target, p, NEW) for p in PROMPTS]
    prop = make_proposer(kind, perturbed(target), VOCAB, "cpu", settings=SuffixConfig(threshold=2.0, max_draft_tokens=12))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=3)
    first = [eng.generate([p], NEW)[0] for p in PROMPTS]  # batch 1: nothing finished yet for the first prompt
    for p, ref, r in zip(PROMPTS, refs, first, strict=True):
        assert_greedy_equal(target, p, r.token_ids, ref)
    res = eng.generate(PROMPTS, NEW)
    for p, ref, r in zip(PROMPTS, refs, res, strict=True):
        assert_greedy_equal(target, p, r.token_ids, ref)
        assert len(r.drafted_ids) == len(r.draft_source) == NEW
    if kind == "hybrid":  # the learned drafter drafted where the index had nothing (the first prompt's start)
        assert sum(r.by_source.get("model", [0, 0, 0])[1] for r in first) > 0
    by = {}
    for r in res:
        for src, c in r.by_source.items():
            by.setdefault(src, [0, 0, 0])
            by[src] = [a + b for a, b in zip(by[src], c, strict=True)]
    assert by["suffix_global"][2] / by["suffix_global"][1] > 0.9, by  # the same prompts again: history repeats
    assert max(r.num_drafted / r.num_steps for r in res) > 3  # suffix drafts longer than num_draft_tokens
    assert prop.stats()["hits"] > 0 and prop.stats()["seqs"] == 2 * len(PROMPTS)


def test_a_new_drafter_or_adapter_brings_a_refusing_guards_retry_near_and_a_target_update_does_not():
    """A refusing guard's back-off belongs to the drafter it measured (issue 59: a drafter that just learned must be
    able to show it soon); a target update alone (an RL policy step) leaves the schedule as it was."""
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, tiny("llama", 1, 1)), num_draft_tokens=3, adaptive=True)
    from test_engine_adaptive import refusals_until_retry

    guard = eng.k_policy.controller.goodput
    guard.budget = 1.0  # the schedule alone (a spell's cost waits longer: tests/test_engine_adaptive.py)

    def plain_verdict() -> None:
        for _ in range(guard.window):
            guard.observe(8, True, 4, 0.1)
            guard.observe(8, False, 8, 0.1)
        assert guard.judged(8) == "plain"

    plain_verdict()
    assert refusals_until_retry(guard) == guard.retry_first
    plain_verdict()  # measured slower again: the next retry waits twice as long ...
    eng.update_target_weights(tiny("llama", seed=7).state_dict(), version=1)
    assert refusals_until_retry(guard) == 2 * guard.retry_first  # ... a target update changes nothing ...
    for swap in (lambda: eng.set_drafter(perturbed(target), version=2), lambda: eng.set_adapter("sql", None, None)):
        plain_verdict()
        swap()  # ... a new drafter or adapter brings it back to retry_first
        assert refusals_until_retry(guard) == guard.retry_first


def test_prefill_share_fits_the_budget_and_always_admits_one():
    from dvi.engine.options import prefill_share

    def share(lens, budget, cohorts=None):
        return prefill_share(list(zip(lens, cohorts or [""] * len(lens), strict=True)), budget)

    assert share([100, 100, 100], 250) == 2
    assert share([100, 200, 300], 250) == 1
    assert share([600, 10], 250) == 1  # a prompt longer than the budget still joins, alone
    assert share([600, 10], 0) == 2 and share([], 512) == 0
    # a request's choices (one cohort) join together past the budget; the next request waits
    assert share([60, 60, 60, 60, 10], 64, ["a", "a", "a", "", ""]) == 3
    assert share([60, 60, 10], 64, ["a", "b", "b"]) == 1  # a cohort whose first does not fit waits whole
    assert share([60, 60, 10], 128, ["a", "b", "b"]) == 3


def test_joiners_are_admitted_within_the_prefill_budget_and_answer_the_same():
    """`max_prefill_tokens`: a wave of requests joins over several steps (each step's joiners' prompts within the
    budget), and every answer is the target's greedy text as with no limit."""
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)), num_draft_tokens=3,
                            options=EngineOptions(max_prefill_tokens=10))
    for i, p in enumerate(PROMPTS):  # prompts of 7, 2, 4, 9 and 1 tokens
        eng.add_request(Request(f"r{i}", p, SamplingParams(max_new_tokens=NEW)))
    seen: set[str] = set()
    waves, results = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                results[o.request_id] = o.result
        now = {s.req.request_id for s in eng._seqs} | set(results)
        waves.append(sorted(now - seen))
        seen |= now
    assert [w for w in waves if w] == [["r0", "r1"], ["r2"], ["r3", "r4"]]  # 7 + 2 <= 10; 4 (+ 9 > 10); 9 + 1
    for i, p in enumerate(PROMPTS):
        assert_greedy_equal(target, p, results[f"r{i}"].token_ids, reference(target, p, NEW))


def test_a_cohort_joins_in_one_step_past_the_prefill_budget():
    """The choices of one client request (a GRPO group's samples) join together, its answer waiting for its last
    row; the requests after it still join within the budget."""
    target = tiny("llama", seed=0)
    eng = SpeculativeEngine(target, proposer_for(target, perturbed(target)), num_draft_tokens=3,
                            options=EngineOptions(max_prefill_tokens=10))
    p = PROMPTS[0]  # 7 tokens: one alone fits the budget, three of them do not
    for j in range(3):
        eng.add_request(Request(f"g{j}", p, SamplingParams(max_new_tokens=NEW), cohort="g"))
    eng.add_request(Request("solo", PROMPTS[3], SamplingParams(max_new_tokens=NEW)))  # 9 tokens
    eng.step()
    assert sorted(s.req.request_id for s in eng._seqs) == ["g0", "g1", "g2"]
    eng.step()
    assert "solo" in {s.req.request_id for s in eng._seqs}
