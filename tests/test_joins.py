"""Runs of a row's tokens beside the batch's (`dvi.decode.segments.Segments`). Rows admitted lazily join inside the batch's
next forward (their prompts as prefixes): every row's logits, cache entries and greedy tokens are what eager admission
(each prompt its own prefill, then the step) gives, as rows join a running batch, join an empty one together, draft
ragged, and leave before the forward that would have carried them. A ragged verify where few rows drafted scores
their drafts as tails: what the padded ragged forward scores."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget

KW = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _pair(dtype=torch.float32):
    lean = LeanModel(tiny_llama(0, **KW).to(dtype))
    return LeanTarget(lean=lean), LeanTarget(lean=lean)


def _contexts(g, lengths):
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _same_caches(a: LeanTarget, b: LeanTarget) -> None:
    assert a.cache.lengths == b.cache.lengths
    for i, n in enumerate(a.cache.lengths):
        torch.testing.assert_close(a.cache.kv[:, i, :n], b.cache.kv[:, i, :n], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_rows_joining_a_running_batch_score_as_eager_admission_does():
    g = torch.Generator().manual_seed(0)
    eager, lazy = _pair()
    first, joiners = _contexts(g, (9, 20)), _contexts(g, (14, 0, 33))
    for run in (eager, lazy):
        run.admit(first, False)
        run.forward(torch.ones(2, 1, dtype=torch.long), False)
        run.keep(1, [1, 1])
    eager.admit(joiners, False)
    assert lazy.admit(joiners, False, lazy=True) is None
    assert lazy.cache.lengths[2:] == [0, 0, 0]  # nothing prefilled yet
    for step, (q, kept) in enumerate([(3, [2, 3, 1, 1, 3]), (1, [1] * 5), (4, [4, 1, 2, 3, 1])]):
        ids = torch.randint(0, 128, (5, q), generator=g)
        a, b = eager.forward(ids, False), lazy.forward(ids, False)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
        for run in (eager, lazy):
            run.keep(q, kept)
        _same_caches(eager, lazy)


@torch.inference_mode()
def test_rows_joining_an_empty_batch_together_and_a_ragged_verify():
    g = torch.Generator().manual_seed(1)
    eager, lazy = _pair()
    contexts = _contexts(g, (5, 17, 11))
    eager.admit(contexts, False)
    lazy.admit(contexts, False, lazy=True)
    ids = torch.randint(0, 128, (3, 1), generator=g)
    torch.testing.assert_close(lazy.forward(ids, False), eager.forward(ids, False), rtol=1e-5, atol=1e-5)
    for run in (eager, lazy):
        run.keep(1, [1, 1, 1])
    more = _contexts(g, (6,))
    eager.admit(more, False)
    lazy.admit(more, False, lazy=True)
    ids, lens = torch.randint(0, 128, (4, 4), generator=g), [3, 0, 1, 2]  # ragged drafts, the joiner's too
    a, b = eager.forward(ids, False, lens=lens), lazy.forward(ids, False, lens=lens)
    for i, n in enumerate(lens):  # positions past a row's drafts are unscored (unset) in a ragged verify
        torch.testing.assert_close(b[i, : n + 1], a[i, : n + 1], rtol=1e-5, atol=1e-5)
    for run in (eager, lazy):
        run.keep(4, [n + 1 for n in lens])
    _same_caches(eager, lazy)


@torch.inference_mode()
def test_a_lone_request_and_forwards_that_cannot_carry_joins_prefill_as_before():
    g = torch.Generator().manual_seed(2)
    eager, lazy = _pair()
    (ctx,) = _contexts(g, (12,))
    lazy.admit([ctx], False, lazy=True)
    assert lazy.cache.lengths == [12]  # a lone request keeps its bitwise verify: prefilled at once
    eager.admit([ctx], False)
    more = _contexts(g, (7, 8))
    eager.admit(more, False)
    lazy.admit(more, False, lazy=True)
    assert lazy.cache.lengths == [12, 0, 0]
    lazy.select_rows([0, 2])  # a row leaves before the forward: the pending prefills run first
    eager.select_rows([0, 2])
    _same_caches(eager, lazy)
    tree = [[0, 0], [0, 1]]  # a draft tree's verify does not carry joins either
    lazy.admit(more[:1], False, lazy=True)
    eager.admit(more[:1], False)
    ids = torch.randint(0, 128, (3, 3), generator=g)
    torch.testing.assert_close(lazy.forward(ids, False, tree=[tree[0], tree[1], tree[0]]),
                               eager.forward(ids, False, tree=[tree[0], tree[1], tree[0]]), rtol=1e-5, atol=1e-5)
    assert lazy.admit(more, True, lazy=True) is not None  # features wanted: prefilled at once, features back


@pytest.mark.parametrize("drafting", [True, False])
def test_engine_text_is_that_of_requests_run_alone(drafting):
    """Requests joining a running batch at different steps, their prefills riding on its steps, get the greedy
    text they get alone, drafting or not."""
    from dvi.decode.request import Request, SamplingParams
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine

    target, drafter = tiny_llama(0, **KW), tiny_llama(1, **KW)
    g = torch.Generator().manual_seed(3)
    prompts = _contexts(g, (5, 9, 3, 12, 7, 4, 8, 6))
    alone = [SpeculativeEngine(target, proposer_for(target, drafter if drafting else None),
                               num_draft_tokens=2).generate([p], max_new_tokens=8)[0].token_ids for p in prompts]
    eng = SpeculativeEngine(target, proposer_for(target, drafter if drafting else None),
                            num_draft_tokens=2)
    joined, carry = [], eng._target._prefixes
    eng._target._prefixes = lambda: joined.append(1) or carry()  # counts the forwards that carried prefills
    texts: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or eng.has_unfinished():
        if pending and steps % 2 == 0:  # a request joins every other step, into a running batch
            i, p = pending.pop(0)
            eng.add_request(Request(f"r{i}", p, SamplingParams(8, 0.0, 0, 1.0, None, ())))
        for out in eng.step():
            texts.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
    assert [texts[f"r{i}"] for i in range(len(prompts))] == alone
    assert len(joined) >= len(prompts) - 2  # every request that found a batch running joined inside its step


@torch.inference_mode()
def test_prompts_longer_than_the_cache_join_and_catch_up():
    """A joining prompt past the cache's capacity grows it before the forward that writes it (the target's rows and
    a drafter catching up alike); what the rows held stays."""
    from dvi.drafters.draft_cache import LeanDraftCache

    g = torch.Generator().manual_seed(4)
    eager, lazy = _pair()
    first, (long,) = _contexts(g, (9, 20)), _contexts(g, (300,))
    for run in (eager, lazy):
        run.admit(first, False)
    eager.admit([long], False)
    lazy.admit([long], False, lazy=True)
    assert lazy.cache.capacity < 300
    ids = torch.randint(0, 128, (3, 2), generator=g)
    torch.testing.assert_close(lazy.forward(ids, False), eager.forward(ids, False), rtol=1e-5, atol=1e-5)
    for run in (eager, lazy):
        run.keep(2, [1, 2, 1])
    _same_caches(eager, lazy)

    model = tiny_llama(1, **KW).eval()
    dkv = LeanDraftCache(model)
    dkv.add_rows(2)
    dkv.forward_rows([first[0], first[1]])
    dkv.add_rows(1)
    out = dkv.forward_rows([[5], [6, 7], long])  # a catch-up: the joiner's prompt past the capacity
    assert dkv.cache.lengths == [10, 22, 300]
    for i, seq in enumerate([first[0] + [5], first[1] + [6, 7], long]):
        ref = model(torch.tensor([seq])).logits[0, -1]
        torch.testing.assert_close(out[i], ref, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_a_ragged_verify_of_few_drafting_rows_scores_their_drafts_as_tails():
    g = torch.Generator().manual_seed(5)
    tails, padded = _pair()  # the reference scores every position (no lens)
    contexts, joiner = _contexts(g, (9, 30, 4, 17, 12)), _contexts(g, (21,))
    for run in (tails, padded):
        run.admit(contexts, False)
    forward, calls = tails._tails, []
    tails._tails = lambda *a: calls.append(1) or forward(*a)  # counts the forwards that scored tails
    for step, lens in enumerate([[3, 0, 0, 0, 0], [0, 2, 0, 1, 0], [4, 0, 0, 0, 0, 1]]):
        if step == 2:  # a joiner's prompt as a prefix, its drafts as a tail, in the same forward
            tails.admit(joiner, False, lazy=True)
            padded.admit(joiner, False)
        b = len(lens)
        ids = torch.randint(0, 128, (b, 5), generator=g)
        a, p = tails.forward(ids, False, lens=lens), padded.forward(ids, False)
        assert len(calls) == step + 1  # at most half the rows drafted: tails
        for i, n in enumerate(lens):
            torch.testing.assert_close(a[i, : n + 1], p[i, : n + 1], rtol=1e-5, atol=1e-5)
        for run in (tails, padded):
            run.keep(5, [n + 1 for n in lens])
        _same_caches(tails, padded)


def _every_other_row(n: int) -> list[int]:
    return list(range(0, n, 2))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
@pytest.mark.parametrize("kind", ["learned", "history"])
def test_sampling_through_tails_follows_the_target_chi_square(monkeypatch, kind, temperature, top_p):
    """Lossless where few rows draft: 50 rows of one prompt sample (T = 1, and T = 0.7 with top-p), every other row
    drafting (the pricing forced to choose those rows; the verify is the code under test: their drafts scored as tails
    beside the others' one-token steps); the rows' first two tokens follow the target's exact law (chi-square), for a learned drafter
    (its own law q) and point-mass history drafts."""
    from test_sampling import PROMPT, exact_two_token_law, tiny_lm, two_token_pvalue

    import dvi.decode.adaptive
    import dvi.rollout_history
    from dvi.config import SuffixConfig
    from dvi.decode.adaptive import GoodputGuard
    from dvi.decode.step_costs import MeasuredCosts
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.rollout_history import history_proposer

    target = tiny_lm(0)
    if kind == "learned":
        prop = proposer_for(target, tiny_lm(1))
        monkeypatch.setattr(dvi.decode.adaptive, "choose_rows",
                            lambda alphas, *a, **kw: (2, _every_other_row(len(alphas))))
    else:
        prop = history_proposer(8, settings=SuffixConfig(max_draft_tokens=4, min_prob=0.05))
        for i, seq in enumerate([[1, 2, 3, 5, 6, 7], [1, 2, 3, 5, 6, 1], [2, 3, 4, 4, 0]]):
            prop.cache.add_finished(f"seed{i}", seq)
        real = dvi.rollout_history.row_draft_lens
        monkeypatch.setattr(dvi.rollout_history, "row_draft_lens", lambda probs, *a, **kw: [
            n if j % 2 == 0 else 0 for j, n in enumerate(real(probs, *a, **kw))])
    # the tiny models' timings do not judge drafting, nor price it: lookups and drafting always
    monkeypatch.setattr(GoodputGuard, "allow", lambda self, batch: True)
    monkeypatch.setattr(GoodputGuard, "judged", lambda self, batch: "unknown")
    monkeypatch.setattr(MeasuredCosts, "observe", lambda self, *a: False)
    eng = SpeculativeEngine(target, prop, num_draft_tokens=2, max_draft_tokens=4, adaptive=True)
    eng.drain_aware = False  # the server's pricing: throughput, rows chosen one by one
    assert isinstance(eng._target, LeanTarget) and eng._target.ragged
    for b in (16, 32, 64):  # a row's draft position costs 0.2% of a plain step: drafting pays
        eng.k_policy.controller.set_costs(b, {k: 0.01 * (1 + 0.002 * k) for k in range(eng.k_cap + 1)}, 0.0001)
    forward, calls = LeanTarget._tails, []
    monkeypatch.setattr(LeanTarget, "_tails", lambda self, *a: calls.append(1) or forward(self, *a))
    res = []
    for call in range(60):
        res += eng.generate([PROMPT] * 50, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=1000 * call)
    drafted, accepted = sum(r.num_drafted for r in res), sum(r.num_accepted for r in res)
    assert len(calls) >= 60 and 0 < accepted < drafted  # the tails verify ran, and the rule accepted and rejected
    assert two_token_pvalue(res, exact_two_token_law(target, temperature, 0, top_p)) > 1e-3


KERNELS = [pytest.param(dtype, id=name) for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))]


@pytest.mark.parametrize("dtype", KERNELS)
@pytest.mark.parametrize("kind", ["off", "separate", "suffix"])
def test_on_the_kernels_a_batch_s_greedy_text_is_each_request_s_alone_bitwise(monkeypatch, dtype, kind):
    """Where dvi's rows and attention kernels serve every forward (`EVERY_ROW`: they won every probed row count),
    each position is computed alone whatever the forward carries (other rows, joining prompts, tails, drafts), so
    a batch's greedy text is each request's alone token for token, speculating or not: bf16's near-ties (common in
    bf16 logits) cannot part them (torch's GEMMs and SDPA round a row by what is beside it: 22 of 32 answers of the
    real pair at 8 in flight parted from their lone text, AMD EPYC, bf16)."""
    from dvi.decode import attention_kernel, rows_kernel

    if rows_kernel.load(dtype) is None or attention_kernel.load() is None:
        pytest.skip(f"kernels unavailable here: {rows_kernel.unavailable_reason(dtype)}, "
                    f"{attention_kernel.unavailable_reason()}")
    monkeypatch.setattr(rows_kernel, "kernel_rows_measured", lambda lean: rows_kernel.EVERY_ROW)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `dvi serve` runs (serve.num_threads: 1)
    try:
        _batch_equals_alone(dtype, kind)
    finally:
        torch.set_num_threads(threads)


def _batch_equals_alone(dtype: torch.dtype, kind: str) -> None:
    from dvi.config import SuffixConfig
    from dvi.decode import rows_kernel
    from dvi.decode.request import Request, SamplingParams
    from dvi.drafters.factory import make_proposer, proposer_for
    from dvi.engine.options import EngineOptions
    from dvi.engine.speculative import SpeculativeEngine

    target, drafter = tiny_llama(0, **KW), tiny_llama(1, **KW)
    with torch.no_grad():  # head rows alike but for a little: logits close together, near-ties on every few tokens
        head = target.lm_head.weight
        head.copy_(head[:1] + 0.05 * head)
    target, drafter = target.to(dtype), drafter.to(dtype)
    opts = EngineOptions(cpu_rows_kernel="auto")

    def engine(speculate: bool) -> SpeculativeEngine:
        if not speculate or kind == "off":
            return SpeculativeEngine(target, None, options=opts)
        if kind == "suffix":
            return SpeculativeEngine(target, make_proposer("suffix", None, 128, "cpu", settings=SuffixConfig(
                max_draft_tokens=4)), num_draft_tokens=4, max_draft_tokens=4, options=opts)
        return SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3, options=opts)

    g = torch.Generator().manual_seed(5)
    prompts = [(c * 3)[: 20 + 7 * i] for i, c in enumerate(_contexts(g, (9, 11, 7, 13, 8, 10, 12, 6, 9, 14)))]
    off = engine(False)
    assert off._target.lean.kernel_rows == rows_kernel.EVERY_ROW and off._target.lean.attn_kernel is not None
    assert off.greedy_contract == {"one_request": "bitwise", "batched": "bitwise"}
    torch.set_num_threads(2)  # torch's elementwise ops then chunk tensors across a row: not promised
    assert off.greedy_contract["batched"] == "near-tie"
    torch.set_num_threads(1)
    alone = [off.generate([p], max_new_tokens=24)[0].token_ids for p in prompts]
    eng = engine(True)
    texts: dict[str, list[int]] = {}
    pending, steps, drafted = list(enumerate(prompts)), 0, 0
    while pending or eng.has_unfinished():
        while pending and len(texts) - sum(1 for t in texts.values() if len(t) >= 24) < 4 + steps % 3:
            i, p = pending.pop(0)  # up to 4-6 in flight, joining a running batch
            texts[f"r{i}"] = []
            eng.add_request(Request(f"r{i}", p, SamplingParams(24, 0.0, 0, 1.0, None, ())))
        for out in eng.step():
            texts[out.request_id].extend(out.new_token_ids)
            drafted += out.result.num_drafted if out.finished else 0
        steps += 1
    assert [texts[f"r{i}"] for i in range(len(prompts))] == alone
    assert (drafted > 0) == (kind != "off")
