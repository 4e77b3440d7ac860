"""Suffix and hybrid drafts as trees (`dvi.drafters.tree_draft`): both indices' proposals as two branches of one
verify (`suffix`), the learned chain beside a below-bar suffix proposal (`hybrid`); greedy output equal to
speculation off with a second branch really accepted, and the sampled law of the first tokens (chi-square).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine import assert_greedy_equal, reference, tiny
from test_sampling import tiny_lm, two_token_pvalue

import dvi.engine.accept
import dvi.engine.speculative
from dvi.config import SuffixConfig
from dvi.decode.sampling import warp_probs
from dvi.drafters.factory import make_proposer
from dvi.drafters.proposer import Draft
from dvi.drafters.suffix import SuffixCache
from dvi.drafters.suffix_proposer import SuffixProposer
from dvi.drafters.tree_draft import RowTree
from dvi.engine.speculative import EngineOptions, SpeculativeEngine

torch.set_num_threads(1)

WIDTH = 3  # siblings per learned depth (fixed K: every depth gets all of them)
K = 3  # learned drafts a step


# --------------------------------------------------------------------------- the trie and the proposals
def test_merge_follows_agreeing_nodes_and_never_duplicates_a_sibling():
    row = RowTree.of(Draft(torch.tensor([[5, 6, 7]]), None, [3], ["model"], None), 0)  # a chain 5 6 7
    for t, parent in ((8, 0), (9, 1)):  # two sibling leaves, as `with_siblings` adds them
        row.ids.append(t)
        row.parents.append(parent)
        row.ranks.append(1)
        row.qcols.append(-1)
    assert row.merge([5, 6, 7]) == 0  # the chain itself: nothing new
    assert row.merge([5, 6, 1, 2]) == 2  # branches off under node 2 (token 6), after its child 7
    assert row.parents[5:] == [2, 6] and row.ranks[5:] == [1, 0] and row.ids[5:] == [1, 2]
    assert row.merge([8, 3]) == 1  # a matching sibling leaf gets a child
    assert row.parents[-1] == 4 and row.ranks[-1] == 0
    assert row.merge([4]) == 1 and row.parents[-1] == 0 and row.ranks[-1] == 2  # the root's third child
    for v in range(len(row.ids) + 1):
        kids = [t for t, p in zip(row.ids, row.parents, strict=True) if p == v]
        assert len(kids) == len(set(kids))
    assert all(p <= j for j, p in enumerate(row.parents))


def test_propose_all_ranks_both_and_propose_is_unchanged():
    cache = SuffixCache()
    cache.add_finished("g", [1, 2, 3, 10, 11, 12, 13])
    cache.start("r", [1, 2, 3, 10, 11, 20, 21, 22, 23, 1, 2, 3])
    both = cache.propose_all("r", 8)
    assert [p.source for p in both] == ["request", "global"]  # 8 own tokens score above the global 4
    assert both[0].tokens == [10, 11, 20, 21, 22, 23, 1, 2] and both[1].tokens == [10, 11, 12, 13]
    assert cache.propose("r", 8) == both[0]
    assert cache.lookups == 2 and cache.hits == {"request": 2, "global": 0}
    cache.start("s", [7, 1, 2, 3])  # nothing of its own: the empty one comes second
    assert [bool(p.tokens) for p in cache.propose_all("s", 8)] == [True, False]


class _Pricing:
    """Fixed widths; `siblings` [] (a chain target) unless `width`."""

    lookups = True

    def __init__(self, width: int):
        self.width = width
        self.trees = bool(width)  # the target verifies trees

    def point_k(self, probs, longest: int) -> int:
        return longest

    def siblings(self, k: int, rows: list[int]) -> list[int]:
        return [self.width] * k if self.width and k else []


def _suffix_proposer() -> SuffixProposer:
    cache = SuffixCache()
    cache.add_finished("g", [1, 2, 3, 10, 11, 12, 13])
    sp = SuffixProposer(cache, 64, torch.device("cpu"), max_tokens=8)
    req = SimpleNamespace(request_id="r", prompt_ids=[1, 2, 3, 10, 11, 20, 21, 22, 23, 1, 2, 3])
    sp.join([SimpleNamespace(req=req)], None)
    return sp


def test_suffix_tree_shape_and_chain_without_trees():
    """Best proposal first as a chain, the runner-up branching off where it differs (after the shared 10 11);
    a target without trees gets exactly the chain (2K + 1 uniforms)."""
    drawn = []
    uniforms = lambda n: drawn.append(n) or torch.rand(1, n)  # noqa: E731
    d = _suffix_proposer().propose([None], [20], _Pricing(WIDTH), uniforms, None)
    assert d.tree and d.spine == [0] and d.sources == ["suffix_request"] and d.lens == [10]
    assert d.ids[0].tolist() == [10, 11, 20, 21, 22, 23, 1, 2, 12, 13]
    assert d.parents == [[0, 1, 2, 3, 4, 5, 6, 7, 2, 9]] and d.ranks == [[0] * 8 + [1, 0]]
    assert d.qmap.tolist() == [[-1] * 10] and d.u.shape == (1, 11) and drawn == [11]
    chain = _suffix_proposer().propose([None], [20], _Pricing(0), uniforms, None)
    assert not chain.tree and chain.ids[0].tolist() == [10, 11, 20, 21, 22, 23, 1, 2] and chain.u.shape == (1, 17)


# --------------------------------------------------------------------------- the engine, greedy
@pytest.fixture(scope="module")
def world():
    """A target; prompts whose own history and the global index (finished outputs that continue them the
    target's way) both propose: rows 0-1 repeat 11 tokens of their own, so their own proposal (wrong) ranks
    first, row 2 repeats 3, so the global one (right) does."""
    target = tiny("llama", 0)
    prompts = []
    for j, filler in enumerate((11, 11, 3)):
        marker = [7 + 3 * j, 8 + 3 * j, 9 + 3 * j]
        prompts.append(marker + list(range(50 + 20 * j, 50 + 20 * j + filler)) + marker)
    refs = [reference(target, p, 24) for p in prompts]
    return target, prompts, refs


def _engine(world, kind: str, width: int = WIDTH) -> SpeculativeEngine:
    target, prompts, refs = world
    cache = SuffixCache()
    for j, (p, r) in enumerate(zip(prompts, refs, strict=True)):
        cache.add_finished(f"done{j}", p[:3] + r[:20])
    drafter = tiny("llama", 5) if kind == "hybrid" else None  # unrelated: its chain mostly misses
    prop = make_proposer(kind, drafter, 300, "cpu", cache, SuffixConfig(max_draft_tokens=8, threshold=100.0))
    return SpeculativeEngine(target, prop, num_draft_tokens=K, options=EngineOptions(tree_width=width))


def _spy(monkeypatch) -> list:
    """Every tree step's (draft, accepted paths)."""
    seen, accept = [], dvi.engine.speculative.accept_tree

    def spy(draft, logits, feats, params):
        t = accept(draft, logits, feats, params)
        seen.append((draft, t.paths))
        return t

    monkeypatch.setattr(dvi.engine.speculative, "accept_tree", spy)
    return seen


def _second_branch_hits(seen) -> int:
    """Rows whose path left the first branch: a suffix row through a node tried after a sibling, a drafted row
    through a node of its suffix branch (after the spine and its WIDTH siblings a depth)."""
    hits = 0
    for d, paths in seen:
        for i, path in enumerate(paths):
            s = d.spine[i]
            hits += any(a > s * (1 + WIDTH) for a in path) if s else any(d.ranks[i][a - 1] for a in path)
    return hits


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
@pytest.mark.parametrize("layout", ["batch", "single"])
def test_greedy_trees_equal_speculation_off(world, kind, layout, monkeypatch):
    target, prompts, refs = world
    seen = _spy(monkeypatch)
    if layout == "batch":
        res = _engine(world, kind).generate(prompts, 24)
    else:  # one at a time, each on a fresh engine (hybrid: its bar at the threshold again)
        res = [_engine(world, kind).generate([p], 24)[0] for p in prompts]
    for p, r, ref in zip(prompts, res, refs, strict=True):
        assert_greedy_equal(target, p, r.token_ids, ref)
    assert seen and all(d.parents is not None for d, _ in seen)
    assert _second_branch_hits(seen) >= 1
    if kind == "hybrid":  # a drafted row's suffix branch kept tokens, counted as the index's, not the drafter's
        assert any(d.sources[i] == "model" and any(a > d.spine[i] * (1 + WIDTH) for a in path)
                   for d, paths in seen for i, path in enumerate(paths))
        suffix_kept = sum(r.by_source.get(s, [0, 0, 0])[2] for r in res for s in ("suffix_request", "suffix_global"))
        assert suffix_kept > 0 and all(code in (0, 1, 2, 3) for r in res for code in r.draft_source)
        assert any(code in (2, 3) and ok for r in res for code, ok in zip(r.draft_source, r.accepted, strict=True))


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_no_trees_without_tree_width(world, kind, monkeypatch):
    target, prompts, refs = world
    seen = _spy(monkeypatch)
    res = _engine(world, kind, width=0).generate(prompts, 24)
    for p, r, ref in zip(prompts, res, refs, strict=True):
        assert_greedy_equal(target, p, r.token_ids, ref)
    assert seen == []


@pytest.mark.parametrize("kind", ["suffix", "hybrid"])
def test_sampled_trees_complete(world, kind, monkeypatch):
    _, prompts, _ = world
    seen = _spy(monkeypatch)
    eng = _engine(world, kind)
    # sampled, but nearly the target's argmax: the global index's continuations are then accepted by law, not by
    # luck (at T = 1 this tiny random target spreads over its vocabulary and the calibration rightly stops drafting)
    a = eng.generate(prompts, 24, temperature=0.05, seed=3)
    assert [len(r.token_ids) for r in a] == [24] * 3 and seen
    assert all(0 <= t < 300 for r in a for t in r.token_ids) and sum(r.num_accepted for r in a) > 0


# --------------------------------------------------------------------------- the engine, sampled law
PROMPT = [1, 2, 3, 4, 1, 2, 3]  # its own history continues 4 1 2 3, the global index 5 6 ...
N = 3000


def _two_token_law(target, prompt: list[int]) -> dict:
    def warped(ctx):
        with torch.no_grad():
            return warp_probs(target(torch.tensor([ctx])).logits[:, -1], torch.tensor([1.0]))[0].double()

    p1 = warped(prompt)
    v = p1.shape[0]
    return {(a, b): float(p1[a]) * float(warped(prompt + [a])[b]) for a in range(v) for b in range(v) if p1[a] > 0}


def _pvalue(kind: str, seen: list) -> float:
    """Chi-square p-value of the first two tokens of N rows at T = 1 against the target's exact law: `hybrid` at
    a bar of 100 (step 1 drafts every row with the drafter and its suffix branch, later steps also rows of the
    index alone once the bar falls to what the drafter delivers), `suffix` with both indices' branches."""
    target, drafter = tiny_lm(0), tiny_lm(1)
    cache = SuffixCache()
    for i, seq in enumerate([[1, 2, 3, 5, 6, 7], [1, 2, 3, 5, 6, 1], [2, 3, 4, 4, 0], [4, 5, 0, 0, 0]]):
        cache.add_finished(f"seed{i}", seq)
    prop = make_proposer(kind, drafter if kind == "hybrid" else None, 8, "cpu", cache,
                         SuffixConfig(threshold=100.0, max_draft_tokens=4, min_prob=0.05))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=2, options=EngineOptions(tree_width=WIDTH))
    res = eng.generate([PROMPT] * N, max_new_tokens=3, temperature=1.0, seed=11)
    assert seen and _second_branch_hits(seen) > 0
    return two_token_pvalue(res, _two_token_law(target, PROMPT))


@pytest.mark.parametrize("kind", ["hybrid", "suffix"])
def test_tree_sampling_matches_target(kind, monkeypatch):
    seen = _spy(monkeypatch)
    assert _pvalue(kind, seen) > 1e-3
    if kind == "hybrid":  # all three row kinds met: drafted with a branch, index alone with two branches
        assert any(d.spine[i] for d, _ in seen for i in range(len(d.spine)))
        assert any(not d.spine[i] and d.lens[i] for d, _ in seen for i in range(len(d.spine)))


def test_chi_square_catches_point_masses_taken_whenever_possible(monkeypatch):
    """Testing the test: a tree rule that accepts every point mass the target allows at all must fail it."""
    rule = dvi.engine.accept.tree_sample_accept

    def broken(ids, parents, valid, qmap, q, p, u_test, u_sample):
        return rule(ids, parents, valid, qmap, q, p, torch.where(qmap < 0, 0.0, u_test), u_sample)

    monkeypatch.setattr(dvi.engine.accept, "tree_sample_accept", broken)
    assert _pvalue("hybrid", _spy(monkeypatch)) < 1e-4
