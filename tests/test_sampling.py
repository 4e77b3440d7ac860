"""Sampling is lossless: exact enumeration of the acceptance rule, and chi-square tests of the engine.

Each statistical test is also run against deliberately wrong rules, which must fail it (testing the test).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import tiny_llama

import dvi.engine.accept
from dvi.decode.sampling import (
    acceptance_prob,
    greedy_accept,
    point_mass_accept,
    rejection_accept,
    residual_distribution,
    sample_from,
    warp_probs,
)
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine

torch.set_num_threads(1)


# --------------------------------------------------------------------------- exact enumeration
def _always_accept(p, q, d):
    return torch.ones((), dtype=p.dtype)


def _resample_from_p(p, q):
    return p


class Tables:
    """Random target p(.|ctx) and draft q(.|ctx) over a tiny vocabulary, created on demand per context."""

    def __init__(self, v: int, seed: int):
        self.v, self.g = v, torch.Generator().manual_seed(seed)
        self.p: dict[tuple, torch.Tensor] = {}
        self.q: dict[tuple, torch.Tensor] = {}

    def _draw(self, store, ctx):
        if ctx not in store:
            x = torch.rand(self.v, generator=self.g, dtype=torch.float64) ** 2
            x[torch.randint(self.v, (1,), generator=self.g)] = 0.0  # some zero-probability tokens
            store[ctx] = x / x.sum()
        return store[ctx]

    def P(self, ctx):
        return self._draw(self.p, ctx)

    def Q(self, ctx):
        return self._draw(self.q, ctx)


def step_outcomes(t: Tables, ctx: tuple, k: int, acc=acceptance_prob, res=residual_distribution) -> dict:
    """Exact distribution over the token tuple one speculative step with k drafts emits from ctx."""
    out: dict[tuple, float] = {}

    def rec(c: tuple, emitted: tuple, prob: float, j: int):
        p = t.P(c)
        if j == k:  # all accepted: bonus from p
            for x in range(t.v):
                if p[x] > 0:
                    out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + prob * float(p[x])
            return
        q = t.Q(c)
        r = res(p, q)
        for d in range(t.v):
            if q[d] == 0:
                continue
            a = float(acc(p, q, torch.tensor(d)))
            if a > 0:
                rec(c + (d,), emitted + (d,), prob * float(q[d]) * a, j + 1)
            if a < 1:
                for x in range(t.v):
                    w = prob * float(q[d]) * (1 - a) * float(r[x])
                    if w > 0:
                        out[emitted + (x,)] = out.get(emitted + (x,), 0.0) + w

    rec(ctx, (), 1.0, 0)
    return out


def first_tokens_dist(t: Tables, ctx: tuple, k: int, length: int, **rule) -> dict:
    """Exact joint law of the first `length` emitted tokens (repeated steps until enough are emitted)."""
    out: dict[tuple, float] = {}
    for toks, pr in step_outcomes(t, ctx, k, **rule).items():
        if len(toks) >= length:
            out[toks[:length]] = out.get(toks[:length], 0.0) + pr
        else:
            for rest, pr2 in first_tokens_dist(t, ctx + toks, k, length - len(toks), **rule).items():
                out[toks + rest] = out.get(toks + rest, 0.0) + pr * pr2
    return out


def target_joint(t: Tables, ctx: tuple, length: int) -> dict:
    out = {}
    for toks in itertools.product(range(t.v), repeat=length):
        pr, c = 1.0, ctx
        for x in toks:
            pr *= float(t.P(c)[x])
            c = c + (x,)
        out[toks] = pr
    return out


def max_err(a: dict, b: dict) -> float:
    return max(abs(a.get(x, 0.0) - b.get(x, 0.0)) for x in set(a) | set(b))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_enumeration_exact(k, seed):
    t = Tables(v=4, seed=seed)
    length = min(k + 1, 3)
    exact = target_joint(t, (), length)
    assert max_err(first_tokens_dist(t, (), k, length), exact) < 1e-6
    # testing the test: both classic mistakes are visibly wrong
    assert max_err(first_tokens_dist(t, (), k, length, acc=_always_accept), exact) > 1e-2
    assert max_err(first_tokens_dist(t, (), k, length, res=_resample_from_p), exact) > 1e-3


def test_rejection_accept_matches_enumeration():
    """The vectorised `rejection_accept` reproduces the exact one-step outcome law (chi-square)."""
    v, k, n = 4, 2, 60000
    t = Tables(v, seed=5)
    g = torch.Generator().manual_seed(0)
    q1 = t.Q(()).float().expand(n, v)
    d1 = sample_from(q1, torch.rand(n, generator=g))
    q2 = torch.stack([t.Q((int(x),)).float() for x in range(v)])[d1]
    d2 = sample_from(q2, torch.rand(n, generator=g))
    p1 = t.P(()).float().expand(n, v)
    p2 = torch.stack([t.P((int(x),)).float() for x in range(v)])[d1]
    p3tab = torch.stack([torch.stack([t.P((a, b)).float() for b in range(v)]) for a in range(v)])
    p3 = p3tab[d1, d2]
    drafts = torch.stack([d1, d2], 1)
    nacc, nxt = rejection_accept(
        drafts, torch.stack([q1, q2], 1), torch.stack([p1, p2, p3], 1), torch.rand(n, k, generator=g), torch.rand(n, generator=g)
    )
    counts: dict[tuple, int] = {}
    for dd, m, x in zip(drafts.tolist(), nacc.tolist(), nxt.tolist(), strict=True):
        key = tuple(dd[:m]) + (x,)
        counts[key] = counts.get(key, 0) + 1
    exact = step_outcomes(t, (), k)
    assert set(counts) <= {key for key, pr in exact.items() if pr > 0}
    keys = [key for key, pr in exact.items() if pr * n >= 5]
    obs = [counts.get(key, 0) for key in keys]
    exp = [exact[key] * n for key in keys]
    scale = sum(obs) / sum(exp)
    assert chisquare(obs, [e * scale for e in exp]).pvalue > 1e-3


def test_greedy_accept_prefix():
    logits = torch.full((3, 4, 10), -5.0)
    for b, row in enumerate([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4]]):
        for j, x in enumerate(row):
            logits[b, j, x] = 5.0
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    n, nxt = greedy_accept(drafts, logits)
    assert n.tolist() == [3, 1, 0] and nxt.tolist() == [4, 9, 7]


def test_warp_matches_hf_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    for temp, k, p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.6)]:
        x = TemperatureLogitsWarper(temp)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        ref = torch.softmax(x, -1)
        got = warp_probs(
            logits,
            torch.full((6,), temp),
            torch.full((6,), k, dtype=torch.long) if k else None,
            torch.full((6,), p) if p < 1 else None,
        )
        assert torch.allclose(got, ref, atol=1e-6)
    greedy = warp_probs(logits, torch.zeros(6))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.all(greedy.max(-1).values == 1)


# --------------------------------------------------------------------------- the engine, chi-square
def tiny_lm(seed: int, v: int = 8, layers: int = 1, init: float = 0.15):
    return tiny_llama(seed, vocab_size=v, num_hidden_layers=layers, num_key_value_heads=1,
                      initializer_range=init, max_position_embeddings=32)


PROMPT = [1, 2, 3]


def exact_two_token_law(target, temperature, top_k, top_p) -> dict:
    v = target.config.vocab_size

    def warped(ctx):
        with torch.no_grad():
            lg = target(torch.tensor([ctx])).logits[:, -1]
        return warp_probs(
            lg,
            torch.tensor([temperature]),
            torch.tensor([top_k]) if top_k else None,
            torch.tensor([top_p]) if top_p < 1 else None,
        )[0].double()

    p1 = warped(PROMPT)
    return {(a, b): float(p1[a]) * float(warped(PROMPT + [a])[b]) for a in range(v) for b in range(v) if p1[a] > 0}


def engine_pvalue(target, drafter, n, temperature, top_k=0, top_p=1.0, seed=0, reference=None,
                  batch: int | None = None, filler: list[int] | None = None) -> tuple[float, float]:
    """Chi-square p-value of the engine's first two tokens against the exact law of `reference` (default: target,
    on CPU), and the step's acceptance rate. `batch`: rows per generate call (default all n at once);
    `filler`: a second prompt interleaved with PROMPT (a ragged batch; only PROMPT's rows are counted)."""
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=2)
    batch = batch or n
    res = []
    for start in range(0, n, batch):
        rows = [PROMPT] * min(batch, n - start)
        if filler is not None:
            rows = [r for p in rows for r in (p, filler)]
        out = eng.generate(rows, max_new_tokens=3, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed + start)
        res += out[:: 2 if filler is not None else 1]
    exact = exact_two_token_law(reference if reference is not None else target, temperature, top_k, top_p)
    alpha = sum(r.num_accepted for r in res) / max(1, sum(r.num_drafted for r in res))
    return two_token_pvalue(res, exact), alpha


def two_token_pvalue(results, exact: dict) -> float:
    """Chi-square p-value of the results' first two tokens against `exact` ((t1, t2) -> probability): pairs expected
    fewer than 5 times pooled into one cell, dropped where the law leaves it empty."""
    n = len(results)
    counts: dict[tuple, int] = {}
    for r in results:
        key = tuple(r.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    big = [key for key, pr in exact.items() if pr * n >= 5]
    obs = [counts.get(key, 0) for key in big] + [n - sum(counts.get(key, 0) for key in big)]
    exp = [exact[key] * n for key in big] + [n - sum(exact[key] * n for key in big)]
    if exp[-1] < 1e-6:
        obs, exp = obs[:-1], exp[:-1]
    exp = [e * sum(obs) / sum(exp) for e in exp]  # float rounding only
    return float(chisquare(obs, exp).pvalue)


N_SAMPLES = 3000


@pytest.fixture(scope="module")
def pair():
    return tiny_lm(0), tiny_lm(1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.0, 0, 0.8)])
def test_engine_sampling_matches_target(pair, temperature, top_k, top_p):
    target, drafter = pair
    pv, alpha = engine_pvalue(target, drafter, N_SAMPLES, temperature, top_k, top_p, seed=11)
    assert 0.1 < alpha < 0.95  # the rule really had to accept and reject
    assert pv > 1e-3, pv


def _wrong_always_accept(draft_ids, draft_probs, target_probs, u_accept, u_sample):
    n = torch.full((draft_ids.shape[0],), draft_ids.shape[1], dtype=torch.long)
    return n, sample_from(target_probs[:, -1], u_sample)


def _wrong_resample_from_p(draft_ids, draft_probs, target_probs, u_accept, u_sample):
    b, k = draft_ids.shape
    pd = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    qd = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    n = (u_accept * qd < pd).long().cumprod(1).sum(1)
    return n, sample_from(target_probs[torch.arange(b), n], u_sample)


@pytest.mark.parametrize("wrong", [_wrong_always_accept, _wrong_resample_from_p])
def test_chi_square_catches_wrong_rules(pair, monkeypatch, wrong):
    target, drafter = pair
    monkeypatch.setattr(dvi.engine.accept, "rejection_accept", wrong)
    pv, _ = engine_pvalue(target, drafter, N_SAMPLES, 1.0, seed=11)
    assert pv < 1e-4, pv


def test_seeded_runs_reproducible_and_batch_independent(pair):
    target, drafter = pair
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3)
    prompts = [PROMPT, [4, 5], [6, 7, 1, 2, 3]]
    a = eng.generate(prompts, 8, temperature=1.0, seed=42)
    b = eng.generate(prompts, 8, temperature=1.0, seed=42)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    c = eng.generate(prompts, 8, temperature=1.0, seed=43)
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    # row i of a batch is seeded with seed + i: alone it samples the same tokens
    alone = eng.generate([prompts[2]], 8, temperature=1.0, seed=44)[0]
    assert alone.token_ids == a[2].token_ids


def test_token_logprobs_are_target_logprobs(pair):
    target, drafter = pair
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=2)
    r = eng.generate([PROMPT], 6, temperature=0.7, seed=3)[0]
    with torch.no_grad():
        lg = target(torch.tensor([PROMPT + r.token_ids])).logits[0, len(PROMPT) - 1 : -1]
    ref = torch.log_softmax(lg / 0.7, -1).gather(-1, torch.tensor(r.token_ids).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor(r.token_logprobs), ref, atol=1e-4)


# --------------------------------------------------------------------------- reduced draft vocabulary
def test_warp_and_residual_with_minus_inf_draft_logits():
    """A reduced-vocab drafter's logits are -inf outside its subset: exact zeros there, no NaN, any warping."""
    g = torch.Generator().manual_seed(1)
    v, ids = 50, torch.tensor([3, 7, 8, 20, 41])
    sub = torch.randn(6, ids.numel(), generator=g) * 2
    logits = torch.full((6, v), float("-inf")).index_copy(1, ids, sub)
    outside = torch.ones(v, dtype=torch.bool)
    outside[ids] = False
    for temp, k, p in [(1.0, 0, 1.0), (0.7, 3, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.3), (0.0, 0, 1.0)]:
        args = (torch.full((6,), temp), torch.full((6,), k) if k else None, torch.full((6,), p) if p < 1 else None)
        q = warp_probs(logits, *args)
        assert bool(torch.isfinite(q).all()) and bool((q[:, outside] == 0).all())
        assert torch.allclose(q.sum(-1), torch.ones(6))
        # same law as warping the subset logits alone (top-k larger than the subset keeps all of it)
        kk = min(k, ids.numel())
        sub_args = (args[0], torch.full((6,), kk) if kk else None, args[2])
        assert torch.allclose(q[:, ids], warp_probs(sub, *sub_args), atol=1e-6)
        target = torch.softmax(torch.randn(6, v, generator=g), -1)
        r = residual_distribution(target, q)
        assert bool(torch.isfinite(r).all()) and torch.allclose(r.sum(-1), torch.ones(6))
        # outside the subset the residual is p itself, rescaled: (p - 0)+ / Z
        z = (target - q).clamp_min(0).sum(-1, keepdim=True)
        assert torch.allclose(r[:, outside], target[:, outside] / z, atol=1e-6)
        d = sample_from(q, torch.rand(6, generator=g))
        assert not bool(outside[d].any())
        a = acceptance_prob(target, q, d)
        assert bool(torch.isfinite(a).all()) and bool(((a >= 0) & (a <= 1)).all())


def _subset(target, kind: str) -> torch.Tensor:
    """'likely': the target's 4 most likely first tokens; 'unlikely': its 3 least likely (most mass outside)."""
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([PROMPT])).logits[0, -1], -1)
    order = p1.argsort(descending=(kind == "likely"))
    ids = order[: 4 if kind == "likely" else 3]
    if kind == "unlikely":
        assert float(p1[ids].sum()) < 0.5, "the target must put most of its mass outside the subset"
    return torch.sort(ids).values


@pytest.mark.parametrize("kind", ["likely", "unlikely"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.0, 0, 0.8)])
def test_engine_sampling_matches_target_with_reduced_vocab_drafter(pair, kind, temperature, top_k, top_p):
    from dvi.drafters.learned import SeparateDrafter

    target, _ = pair
    ids = _subset(target, kind)
    drafter = SeparateDrafter(tiny_lm(1), vocab_ids=ids)  # q = 0 outside `ids`
    pv, alpha = engine_pvalue(target, drafter, N_SAMPLES, temperature, top_k, top_p, seed=11)
    assert 0.02 < alpha < 0.95, alpha
    assert pv > 1e-3, pv


def _wrong_residual_inside_subset(p, q):
    """A reduced-vocab bug: resample the correction only among the drafter's own ids."""
    r = (p - q).clamp_min(0) * (q > 0)
    z = r.sum(-1, keepdim=True)
    return torch.where(z > 0, r / z.clamp_min(1e-30), p)


def test_chi_square_catches_a_residual_restricted_to_the_subset(pair, monkeypatch):
    import dvi.decode.sampling
    from dvi.drafters.learned import SeparateDrafter

    target, _ = pair
    drafter = SeparateDrafter(tiny_lm(1), vocab_ids=_subset(target, "unlikely"))
    monkeypatch.setattr(dvi.decode.sampling, "residual_distribution", _wrong_residual_inside_subset)
    pv, _ = engine_pvalue(target, drafter, N_SAMPLES, 1.0, seed=11)
    assert pv < 1e-4, pv


# --------------------------------------------------------------------------- suffix drafts: point masses
def test_point_mass_accept_equals_rejection_with_one_hot_q():
    """`point_mass_accept` is `rejection_accept` with q one-hot at the drafts (same uniforms, same outcome),
    ragged lengths included, without building the [B, K, V] one-hot."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 4000, 3, 6
    p = torch.softmax(torch.randn(b, k + 1, v, generator=g) * 2, -1)
    ids = torch.randint(0, v, (b, k), generator=g)
    lens = torch.randint(0, k + 1, (b,), generator=g)
    ua, us = torch.rand(b, k, generator=g), torch.rand(b, generator=g)
    one_hot = torch.zeros(b, k, v).scatter_(-1, ids.unsqueeze(-1), 1.0)
    for ln in (None, lens):
        n1, x1 = point_mass_accept(ids, p, ua, us, ln)
        n2, x2 = rejection_accept(ids, one_hot, p, ua, us, ln)
        assert torch.equal(n1, n2) and torch.equal(x1, x2)
    n1, _ = point_mass_accept(ids, p, ua, us, lens)
    assert bool((n1 <= lens).all()) and 0 < float((n1 > 0).float().mean()) < 1


def test_a_ragged_verifys_unset_positions_are_never_read():
    """A ragged verify leaves each row's positions past its drafts unset (`LeanModel._real_logits`): greedy and
    sampled acceptance (point masses and sampled drafts, top-k / top-p rows) give the same outcome whether those
    positions hold NaN or the real logits, with the same uniforms."""
    from types import SimpleNamespace

    from dvi.drafters.proposer import Draft
    from dvi.engine.accept import accept_chain

    g = torch.Generator().manual_seed(3)
    b, k, v = 6, 4, 11
    logits = torch.randn(b, k + 1, v, generator=g) * 2
    lens = [4, 0, 2, 1, 0, 3]
    poisoned = logits.clone()
    for i, n in enumerate(lens):
        poisoned[i, n + 1 :] = float("nan")
    ids = torch.randint(0, v, (b, k), generator=g)
    q = torch.softmax(torch.randn(b, k, v, generator=g), -1)
    u = torch.rand(b, 2 * k + 1, generator=g)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.0, 0.7, 1.0])
    params = [SimpleNamespace(all_greedy=True, temp=torch.zeros(b), top_k=None, top_p=None),
              SimpleNamespace(all_greedy=False, temp=temps, top_k=torch.tensor([0, 3, 0, 5, 0, 0]),
                              top_p=torch.tensor([1.0, 1.0, 0.9, 1.0, 0.8, 1.0]))]
    for pr, draft_q in itertools.product(params, (None, q)):
        draft = Draft(ids, draft_q, lens, ["x"] * b, u)
        n1, x1 = accept_chain(draft, logits, pr)
        n2, x2 = accept_chain(draft, poisoned, pr)
        assert torch.equal(n1, n2) and torch.equal(x1, x2)
        assert all(int(n) <= ln for n, ln in zip(n1, lens, strict=True))


def _suffix(kind: str, drafter=None):
    """A suffix / hybrid proposer whose global index already continues PROMPT (so step 1 drafts from it)."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer
    from dvi.drafters.suffix import SuffixCache

    cache = SuffixCache()
    for i, seq in enumerate([[1, 2, 3, 5, 6, 7], [1, 2, 3, 5, 6, 1], [2, 3, 4, 4, 0], [4, 5, 0, 0, 0]]):
        cache.add_finished(f"seed{i}", seq)
    return make_proposer(kind, drafter, 8, "cpu", cache, SuffixConfig(threshold=1.5, max_draft_tokens=4, min_prob=0.05))


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
@pytest.mark.parametrize("layout,temperature,top_k,top_p", [("batch1", 1.0, 0, 1.0), ("ragged", 1.0, 0, 1.0),
                                                            ("ragged", 0.8, 4, 1.0)])
def test_suffix_and_hybrid_sampling_match_target(pair, kind, layout, temperature, top_k, top_p):
    """Suffix drafts are point masses: accepted with probability p(x), a rejection samples p without x. Batch 1
    (every row alone), and ragged batches with a second prompt (hybrid: rows of both sources in one step); the
    warped law (temperature, top-k) on the ragged layout, which holds batch 1's rows too."""
    target, drafter = pair
    n = 1200 if layout == "batch1" else N_SAMPLES
    kw = {"batch": 1} if layout == "batch1" else {"filler": [4, 5]}
    prop = _suffix(kind, drafter)
    pv, alpha = engine_pvalue(target, prop, n, temperature, top_k, top_p, seed=11, **kw)
    assert 0.01 < alpha < 0.95, alpha  # (top-k 4 rejects every suffix draft outside it: alpha ~0.03)
    assert pv > 1e-3, pv
    assert prop.stats()["hits"] > 0


def _wrong_point_mass_resample_from_p(draft_ids, target_probs, u_accept, u_sample, lens=None):
    b, k = draft_ids.shape
    pd = target_probs[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
    n = (u_accept[:, :k] < pd).long().cumprod(1).sum(1)
    if lens is not None:
        n = torch.minimum(n, lens)
    return n, sample_from(target_probs[torch.arange(b), n], u_sample)


def test_chi_square_catches_a_point_mass_rule_that_keeps_the_rejected_token(pair, monkeypatch):
    monkeypatch.setattr(dvi.engine.accept, "point_mass_accept", _wrong_point_mass_resample_from_p)
    pv, _ = engine_pvalue(pair[0], _suffix("suffix"), N_SAMPLES, 1.0, seed=11, filler=[4, 5])
    assert pv < 1e-4, pv


@pytest.mark.parametrize("v", [49_152, 50_000])
def test_two_level_sampling_is_the_inverse_cdf(v):
    """A large vocabulary is sampled in two levels (the block, then the token in it): the same inverse CDF as one
    cumulative sum over the vocabulary, token for token up to float rounding at a boundary, padding included where
    the vocabulary is not a whole number of blocks; zero-probability tokens (a top-k, a residual) never drawn."""
    from dvi.decode.sampling import SAMPLE_BLOCK

    assert v >= 4 * SAMPLE_BLOCK
    g = torch.Generator().manual_seed(3)
    n = 512
    probs = torch.softmax(torch.randn(n, v, generator=g) * 3, -1)
    probs[:, 1::3] = 0.0  # holes, as top-k / top-p and residuals leave them
    probs[:, -5:] = 0.0
    u = torch.rand(n, generator=g)
    got = sample_from(probs, u)
    cdf = probs.double().cumsum(-1)
    x = u.double() * cdf[:, -1]
    want = torch.searchsorted(cdf, x.unsqueeze(-1), right=True).squeeze(-1)
    # where they part, the draw sits within float32 rounding of a CDF boundary (two rows of 512 on an AVX2 Zen3, at
    # 4e-9 and 1e-8 of it): each drawn token's CDF interval holds u x total up to that rounding
    below = torch.where(got > 0, cdf.gather(1, (got - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(x))
    above = cdf.gather(1, got.unsqueeze(1)).squeeze(1)
    assert bool(((x >= below - 1e-6) & (x <= above + 1e-6)).all())
    assert int((got != want).sum()) <= 4
    assert bool((probs.gather(1, got.unsqueeze(1)) > 0).all())
    edge = sample_from(probs[:4], torch.tensor([0.0, 1.0 - 1e-7, 0.5, 0.999999]))  # the ends of the range
    assert bool((probs[:4].gather(1, edge.unsqueeze(1)) > 0).all())
