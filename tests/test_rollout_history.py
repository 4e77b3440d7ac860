"""History drafts for rollouts (`dvi.rollout_history`): live siblings in the index, per-row pricing, lossless."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from dvi.data import prompt_stream
from dvi.decode.request import Request, SamplingParams
from dvi.drafters.factory import make_proposer
from dvi.engine.speculative import EngineOptions, SpeculativeEngine
from dvi.models.loading import find_tokenizer_path, load_causal_lm, load_tokenizer
from dvi.rollout import RolloutEngine
from dvi.rollout_history import HistoryProposer, history_proposer, row_draft_lens


def test_row_draft_lens_drafts_only_positions_that_pay():
    # a plain step of 4 rows: 0.4 s; a verified draft position 0.05 s -> a position pays while p > 10 tok/s x 0.05
    assert row_draft_lens([[0.3, 0.2], [0.4]], 4, 0.4, 0.05, 4) == [0, 0]
    assert row_draft_lens([[0.9, 0.8, 0.3], [0.2], [0.95, 0.9, 0.85, 0.8, 0.7]], 4, 0.4, 0.05, 4) == [2, 0, 4]
    # a margin the best set cannot beat: plain
    assert row_draft_lens([[0.6]], 4, 0.4, 0.05, 4, margin=1.2) == [0]
    assert row_draft_lens([], 4, 0.4, 0.05, 4) == []


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    tok = load_tokenizer(find_tokenizer_path(tiny_pair_dir / "target"))
    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    prompts = list(itertools.islice(prompt_stream("code", tok, prompt_tokens=(6, 20), seed=3), 2))
    return tok, target, prompts


def _engine(target, proposer, adaptive: bool) -> SpeculativeEngine:
    return SpeculativeEngine(target, proposer, num_draft_tokens=3, max_draft_tokens=4, adaptive=adaptive)


def test_live_siblings_draft_from_each_other_before_any_finishes(pair):
    """One batch, no finished history: only the rows' live entries can give global proposals."""
    _, target, prompts = pair
    vocab = int(target.get_output_embeddings().weight.shape[0])
    hits = {}
    for live in (False, True):
        prop = history_proposer(vocab, live=live)
        eng = _engine(target, prop, adaptive=False)
        out = RolloutEngine(eng).generate_rollouts(prompts[:1], n=6, max_new_tokens=24, temperature=1.0, seed=5)
        assert all(len(r.completion_ids) == 24 for r in out)  # no stop: every row finishes at the last step
        hits[live] = prop.stats()["hits_global"]
        # finished rows' final entries replaced their live ones: one entry per row, prompt tail + output
        assert prop.cache.global_index.num_seqs == 6
    assert hits[False] == 0 and hits[True] > 0


def test_history_greedy_equals_plain_and_prices_per_row(pair):
    """Greedy rollouts with history drafts (adaptive, per-row pricing on a ragged CPU verify) are the target's own
    greedy tokens, also on a second batch that drafts from the first one's rollouts."""
    _, target, prompts = pair
    vocab = int(target.get_output_embeddings().weight.shape[0])
    plain = RolloutEngine(_engine(target, make_proposer("none", None, vocab, "cpu"), adaptive=False))
    prop = history_proposer(vocab)
    assert isinstance(prop, HistoryProposer)
    eng = _engine(target, prop, adaptive=True)
    ctl = eng.k_policy.controller
    assert ctl.ragged
    for b in (1, 2, 4):  # costs set, not timed: a verified draft position costs 1% of a plain step
        ctl.set_costs(b, {k: 0.01 * (1 + 0.01 * b * k) for k in range(eng.k_cap + 1)}, 0.001)
    spec = RolloutEngine(eng)
    drafted = 0
    for _ in range(2):
        want = plain.generate_rollouts(prompts, n=2, max_new_tokens=20, temperature=0.0)
        got = spec.generate_rollouts(prompts, n=2, max_new_tokens=20, temperature=0.0)
        assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
        assert spec.last_stats is not None
        drafted += spec.last_stats.num_drafted
    assert drafted > 0 and prop.priced_rows > 0


def test_an_aborted_row_leaves_no_live_entry(pair):
    _, target, prompts = pair
    vocab = int(target.get_output_embeddings().weight.shape[0])
    prop = history_proposer(vocab)
    eng = _engine(target, prop, adaptive=False)
    eng.add_request(Request("r0", list(prompts[0]), SamplingParams(8, 0.0, 0, 1.0, None, ())))
    eng.step()
    eng.step()
    assert "r0" in prop.cache.global_index
    eng.abort("r0")
    while eng.has_unfinished():
        eng.step()
    assert "r0" not in prop.cache.global_index


def test_rollout_engine_speculative_prices_by_default_and_takes_history(pair):
    """`RolloutEngine.speculative` builds an adaptive engine (the engine's own default is fixed K); a rollout made
    elsewhere joins the history index with its prompt's tail in front, and the next sample of that prompt drafts
    from it."""
    _, target, prompts = pair
    ro = RolloutEngine.speculative(target)
    assert ro.engine.adaptive and isinstance(ro.engine.proposer, HistoryProposer)
    prior = RolloutEngine(_engine(target, make_proposer("none", None, target.config.vocab_size, "cpu"), False))
    done = prior.generate_rollouts(prompts[:1], n=1, max_new_tokens=24, temperature=0.0)[0]
    ro.add_history(done.prompt_ids, done.completion_ids)
    assert ro.engine.proposer.stats()["seqs"] == 1
    again = ro.generate_rollouts(prompts[:1], n=1, max_new_tokens=24, temperature=0.0)[0]
    assert again.completion_ids == done.completion_ids
    assert again.num_accepted > 0  # drafted from the added rollout (batch of one: the suffix proposer's pricing)


def test_rollouts_run_the_engine_as_a_server_does(pair):
    """`rollout_options`, the one owner of how rollouts run the engine (`RolloutEngine.speculative`, `trainers.rl`):
    the server's defaults (kernels, packs, the prefix cache a GRPO group's prefill shares, draft trees with adaptive
    K, chains with a fixed K)."""
    from dvi.config import DviConfig
    from dvi.config_serve import DEFAULT_PREFIX_CACHE_TOKENS
    from dvi.rollout import rollout_options

    _, target, _ = pair
    served = DviConfig.model_validate({})
    opts = rollout_options(target)
    assert opts.tree_width == served.speculation.tree_width == 3
    assert opts.prefix_cache_tokens == served.serve.prefix_cache_tokens == DEFAULT_PREFIX_CACHE_TOKENS
    assert opts.cpu_rows_kernel == served.serve.cpu_rows_kernel == "auto"
    assert rollout_options(target, adaptive=False).tree_width == 0
    assert rollout_options(target, tree_width=1).tree_width == 1
    ro = RolloutEngine.speculative(target)
    assert ro.engine.k_policy.tree_width == (3 if ro.engine._target.trees else 0)


def test_rl_benchmark_interval_pairs_seed_and_step():
    """The paired bootstrap of plain / arm seconds per token: an arm like plain up to noise straddles 1, an arm twice
    as slow on every pair sits at 0.5 whatever the steps' own spread (a pair moves together), under 4 pairs none."""
    import random

    from benchmarks.rl import ratio_interval

    rng = random.Random(1)
    step = lambda s, t: SimpleNamespace(rollout_s=s, tokens=t)  # noqa: E731
    base = {sd: [(rng.uniform(0.5, 2.0), rng.randint(300, 700)) for _ in range(16)] for sd in range(3)}
    plain = {sd: [step(s, t) for s, t in v] for sd, v in base.items()}
    twin = {sd: [step(s * rng.uniform(0.97, 1.03), t) for s, t in v] for sd, v in base.items()}
    slow = {sd: [step(2 * s, t) for s, t in v] for sd, v in base.items()}
    lo, hi = ratio_interval(plain, twin)
    assert lo < 1.0 < hi and hi - lo < 0.05
    assert ratio_interval(plain, slow) == pytest.approx((0.5, 0.5))
    assert ratio_interval({0: plain[0][:3]}, {0: slow[0][:3]}) is None


def test_rl_benchmark_goals_match_the_issue():
    from benchmarks.rl import _goals

    def arm(s, tok, rewards):
        return {"rollout_s_total": s, "tokens_total": tok, "mean_reward_per_seed": rewards,
                "mean_reward": sum(rewards) / len(rewards)}

    pooled = {"plain": arm(10.0, 100, [0.3, 0.4, 0.5]), "frozen": arm(9.0, 100, [0.3, 0.4, 0.5]),
              "history": arm(7.0, 100, [0.4, 0.4, 0.5])}
    goals = {g["name"]: g for g in _goals(pooled, 16, [0, 1, 2])}
    assert goals["plain / frozen rollout seconds per token (never slower)"]["met"]
    best = goals["best arm (history): plain / history rollout seconds per token"]
    assert best["met"] and best["target"] == 1.3 and abs(best["value"] - 10 / 7) < 1e-9
    assert all(g["met"] for g in goals.values())
    few = _goals({a: arm(p["rollout_s_total"], 100, [0.4]) for a, p in pooled.items()}, 6, [0])
    assert [g["met"] for g in few if g["name"].startswith(("RL steps", "seeds", "rewards"))] == [False] * 3
    # `--aa`: plain twice; the gap between the two is the run's noise, judged against a 1% resolution
    aa = {g["name"]: g for g in _goals({**pooled, "plain-aa": arm(10.2, 100, [0.3, 0.4, 0.5])}, 16, [0, 1, 2])}
    noise = aa["A/A: |plain / plain-aa rollout seconds per token - 1| (this run's noise)"]
    assert not noise["met"] and abs(noise["value"] - (1 - 10 / 10.2)) < 1e-9
    assert "plain-aa" not in " ".join(n for n in aa if "never slower" in n)  # a twin is no speculative arm


def test_rl_loop_history_arm(tiny_pair_dir):
    """The `history` arm: no drafter, the history proposer, priced per step; later steps draft from earlier rollouts
    whose weight decays with the policy version."""
    from trainers.rl import RLConfig, RLRun

    cfg = RLConfig(arm="history", preset="tiny", reward="upper", pair_dir=str(tiny_pair_dir), steps=3,
                   prompts_per_step=2, n=4, max_new_tokens=16, prompt_tokens=(8, 16), kl_every=0)
    run = RLRun(cfg, log=None)
    logs = run.run()
    assert isinstance(run.engine.proposer, HistoryProposer) and run.engine.drafter is None and run.engine.adaptive
    assert run.engine.target_version == 3 and all(r.tokens > 0 for r in logs)
    assert run.engine.proposer.stats()["hits_global"] > 0
    assert run.engine.proposer.version == 3 and min(run.engine.proposer._versions.values()) < 3


@pytest.mark.parametrize("tree_width", [0, 3])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.0, 0.8)])
def test_history_sampling_matches_target_chi_square(temperature, top_p, tree_width):
    """Lossless with live siblings and per-row drafts (`tree_width` 0) or priced as the suffix kind is where the
    target verifies trees (3, `rollout_options`' default; the trees' own law: `tests/test_suffix_trees.py`,
    `tests/test_tree_accept.py`): many rows of one prompt decode together (each drafting from the others' text and
    from earlier calls' rollouts); their first two tokens follow the target's exact law (chi-square, the same check
    as `tests/test_sampling.py`)."""
    from tests.test_sampling import PROMPT, exact_two_token_law, tiny_lm, two_token_pvalue

    target = tiny_lm(0)
    from dvi.config import SuffixConfig

    prop = history_proposer(8, settings=SuffixConfig(max_draft_tokens=4, min_prob=0.05))
    for i, seq in enumerate([[1, 2, 3, 5, 6, 7], [1, 2, 3, 5, 6, 1], [2, 3, 4, 4, 0]]):
        prop.cache.add_finished(f"seed{i}", seq)
    eng = SpeculativeEngine(target, prop, num_draft_tokens=2, max_draft_tokens=4, adaptive=True,
                            options=EngineOptions(tree_width=tree_width))
    for b in (16, 32, 64):  # a draft position costs 1% of a plain step: every proposal with p > ~0.01 drafts
        eng.k_policy.controller.set_costs(b, {k: 0.01 * (1 + 0.01 * b * k) for k in range(eng.k_cap + 1)}, 0.001)
    res = []
    for call in range(60):
        res += eng.generate([PROMPT] * 50, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=1000 * call)
    drafted, accepted = sum(r.num_drafted for r in res), sum(r.num_accepted for r in res)
    assert drafted > 0 and 0 < accepted < drafted
    assert (prop.priced_rows > 0) == (tree_width == 0)  # per-row pricing only where the target verifies chains
    assert prop.stats()["hits_global"] > 0
    assert two_token_pvalue(res, exact_two_token_law(target, temperature, 0, top_p)) > 1e-3
