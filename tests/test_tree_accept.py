"""Tree-shaped drafts (`dvi.decode.tree`): structure helpers against brute force, the acceptance rules
against per-row reference walks and the chain rules, and losslessness of tree sampling by chi-square
tests on the joint law of the first two emitted tokens (with a broken rule that the test must catch).
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import dvi.decode.tree as tree_mod
from dvi.decode.sampling import (
    draft_mask,
    greedy_accept,
    greedy_tokens,
    point_mass_accept,
    rejection_accept,
    sample_from,
    warp_probs,
)
from dvi.decode.tree import (
    ancestors,
    depths,
    gather_path,
    path_tokens,
    tree_greedy_accept,
    tree_greedy_walk,
    tree_sample_accept,
)

torch.set_num_threads(1)


# --------------------------------------------------------------------------- random trees and references
def _random_tree(gen: torch.Generator, b: int, n: int, keep: float = 0.85) -> tuple[torch.Tensor, torch.Tensor]:
    """Random parents (node j+1's parent in 0..j) and a valid mask whose padding nodes have no valid children."""
    parents = (torch.rand(b, n, generator=gen) * torch.arange(1, n + 1)).long()
    coin = torch.rand(b, n, generator=gen) < keep
    full = torch.ones(b, n + 1, dtype=torch.bool)
    rows = torch.arange(b)
    for j in range(n):
        full[:, j + 1] = coin[:, j] & full[rows, parents[:, j]]
    return parents, full[:, 1:]


def _ref_greedy(ids, parents, valid, logits) -> list[tuple[list[int], int]]:
    """Per row: walk from the root to the first valid child carrying the argmax, until none does."""
    out = []
    for b in range(ids.shape[0]):
        cur, path = 0, []
        while True:
            t = int(logits[b, cur].argmax())
            nxt = [j for j in range(ids.shape[1])
                   if int(parents[b, j]) == cur and bool(valid[b, j]) and int(ids[b, j]) == t]
            if not nxt:
                break
            cur = nxt[0] + 1
            path.append(cur)
        out.append((path, t))
    return out


def _ref_try(r, x, u, qc):
    """One candidate against residual r: (accepted, residual after a rejection)."""
    if qc is not None:
        if float(u) * float(qc[x]) < float(r[x]):
            return True, r
        res = (r - qc).clamp_min(0)
        return False, res / res.sum() if float(res.sum()) > 0 else r
    if float(u) < float(r[x]) or float(r[x]) >= 1:
        return True, r
    res = r.clone()
    res[x] = 0
    return False, res / res.sum() if float(res.sum()) > 0 else r


def _ref_sample(ids, parents, valid, qmap, q, p, u_test, u_sample) -> list[tuple[list[int], int]]:
    """Per row, the multi-candidate rejection rule written as a plain walk."""
    out = []
    for b in range(ids.shape[0]):
        cur, path, r = 0, [], p[b, 0]
        moved = True
        while moved:
            moved = False
            for j in range(ids.shape[1]):
                if int(parents[b, j]) != cur or not bool(valid[b, j]):
                    continue
                k = int(qmap[b, j])
                ok, r = _ref_try(r, int(ids[b, j]), u_test[b, j], q[b, k] if k >= 0 else None)
                if ok:
                    cur, r, moved = j + 1, p[b, j + 1], True
                    path.append(cur)
                    break
        out.append((path, int(sample_from(r.unsqueeze(0), u_sample[b:b + 1])[0])))
    return out


def _check_against(path, n, nxt, ref) -> None:
    """Vectorised (path, n, nxt) equal a per-row reference."""
    for b, (rp, rt) in enumerate(ref):
        assert int(n[b]) == len(rp), b
        assert path[b].tolist() == rp + [0] * (path.shape[1] - len(rp)), b
        assert int(nxt[b]) == rt, b


# --------------------------------------------------------------------------- structure helpers
def test_ancestors_and_depths_brute_force():
    gen = torch.Generator().manual_seed(0)
    b, n = 64, 12
    parents, _ = _random_tree(gen, b, n)
    anc, dep = ancestors(parents), depths(parents)
    assert anc.shape == (b, n + 1, n + 1) and dep.shape == (b, n)
    for row in range(b):
        for i in range(n + 1):
            want, a = {i, 0}, i
            while a:
                a = int(parents[row, a - 1])
                want.add(a)
            assert set(anc[row, i].nonzero().flatten().tolist()) == want
            if i:
                assert int(dep[row, i - 1]) == len(want) - 1
    chain = torch.arange(5).expand(3, 5)
    assert depths(chain).tolist() == [[1, 2, 3, 4, 5]] * 3
    assert ancestors(torch.zeros(2, 0, dtype=torch.long)).tolist() == [[[True]], [[True]]]


def test_gather_path_and_path_tokens():
    ids = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    path = torch.tensor([[1, 3, 4, 0], [0, 0, 0, 0], [2, 0, 0, 0]])
    n = torch.tensor([3, 0, 1])
    x = torch.arange(3 * 5 * 2).view(3, 5, 2)
    g = gather_path(x, path, n)
    assert g.shape == (3, 4, 2)
    assert g[0].tolist() == x[0, [0, 1, 3, 4]].tolist()
    assert g[1].tolist() == x[1, [0, 0, 0, 0]].tolist()
    assert g[2].tolist() == x[2, [0, 2, 2, 2]].tolist()
    assert path_tokens(ids, path, n).tolist() == [[10, 12, 13], [0, 0, 0], [31, 31, 31]]
    zero = torch.zeros(3, dtype=torch.long)
    assert gather_path(x, path, zero).tolist() == x[:, :1].tolist()
    assert path_tokens(ids, path, zero).shape == (3, 0)
    assert gather_path(torch.arange(15).view(3, 5), path, n)[0].tolist() == [0, 1, 3, 4]


# --------------------------------------------------------------------------- greedy
def test_tree_greedy_matches_reference_walk():
    gen = torch.Generator().manual_seed(1)
    b, n, v = 400, 10, 4
    parents, valid = _random_tree(gen, b, n)
    logits = torch.randn(b, n + 1, v, generator=gen)
    tgt = logits.argmax(-1).gather(1, parents)
    ids = torch.where(torch.rand(b, n, generator=gen) < 0.6, tgt, torch.randint(0, v, (b, n), generator=gen))
    path, acc, nxt = tree_greedy_accept(ids, parents, valid, logits)
    assert int(acc.max()) >= 4  # deep paths are exercised
    _check_against(path, acc, nxt, _ref_greedy(ids, parents, valid, logits))
    path2, acc2, nxt2 = tree_greedy_accept(ids, parents, None, logits)
    _check_against(path2, acc2, nxt2, _ref_greedy(ids, parents, torch.ones_like(valid), logits))


def test_tree_greedy_walk_equals_the_batched_rule():
    """The engine's host walk (`tree_greedy_walk`, real nodes a prefix of `lens` as drafts have them) accepts the
    same paths and next tokens as the batched mask reduction, ties included (few token values)."""
    gen = torch.Generator().manual_seed(11)
    b, n, v = 400, 10, 3
    parents, _ = _random_tree(gen, b, n)
    lens = torch.randint(0, n + 1, (b,), generator=gen)
    valid = torch.arange(n).view(1, n) < lens.view(b, 1)
    logits = torch.randint(0, 3, (b, n + 1, v), generator=gen).float()  # equal maxima: the first one wins
    tgt = greedy_tokens(logits)
    ids = torch.where(torch.rand(b, n, generator=gen) < 0.6, tgt.gather(1, parents),
                      torch.randint(0, v, (b, n), generator=gen))
    path, acc, nxt = tree_greedy_accept(ids, parents, valid, logits)
    paths, nxts = tree_greedy_walk(ids.tolist(), parents.tolist(), lens.tolist(), tgt.tolist())
    assert int(acc.max()) >= 4  # deep paths are exercised
    assert paths == [row[:k] for row, k in zip(path.tolist(), acc.tolist(), strict=True)]
    assert nxts == nxt.tolist()


def test_tree_greedy_chain_equals_greedy_accept():
    gen = torch.Generator().manual_seed(2)
    b, k, v = 300, 6, 5
    logits = torch.randn(b, k + 1, v, generator=gen)
    ids = torch.where(torch.rand(b, k, generator=gen) < 0.8, logits[:, :k].argmax(-1),
                      torch.randint(0, v, (b, k), generator=gen))
    lens = torch.randint(0, k + 1, (b,), generator=gen)
    chain = torch.arange(k).expand(b, k)
    n_ref, nxt_ref = greedy_accept(ids, logits, lens)
    path, n, nxt = tree_greedy_accept(ids, chain, draft_mask(lens, b, k, ids.device), logits)
    assert torch.equal(n, n_ref) and torch.equal(nxt, nxt_ref)
    cols = torch.arange(1, k + 1).expand(b, k)
    assert torch.equal(path, torch.where(cols <= n.unsqueeze(1), cols, 0))


def test_empty_tree():
    p = torch.softmax(torch.randn(3, 1, 4), -1)
    ids = torch.zeros(3, 0, dtype=torch.long)
    u = torch.tensor([0.1, 0.5, 0.9])
    path, n, nxt = tree_sample_accept(ids, ids, None, ids, None, p, torch.zeros(3, 0), u)
    assert path.shape == (3, 0) and n.tolist() == [0, 0, 0]
    assert torch.equal(nxt, sample_from(p[:, 0], u))
    path, n, nxt = tree_greedy_accept(ids, ids, None, p)
    assert path.shape == (3, 0) and n.tolist() == [0, 0, 0] and torch.equal(nxt, p[:, 0].argmax(-1))


# --------------------------------------------------------------------------- sampling: exact checks
def _warped(gen: torch.Generator, b: int, s: int, v: int) -> torch.Tensor:
    """Target probabilities [B, S, V] with a mix of greedy, sharp and top-p-truncated rows."""
    logits = torch.randn(b, s, v, generator=gen) * 2
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.randint(0, 4, (b,), generator=gen)]
    top_p = torch.tensor([1.0, 0.9, 0.6])[torch.randint(0, 3, (b,), generator=gen)]
    return warp_probs(logits, temp, top_p=top_p)


def test_tree_sample_matches_reference_walk():
    gen = torch.Generator().manual_seed(3)
    b, n, v = 300, 9, 5
    parents, valid = _random_tree(gen, b, n)
    p = _warped(gen, b, n + 1, v)
    q = torch.softmax(torch.randn(b, n, v, generator=gen), -1)
    sampled = torch.rand(b, n, generator=gen) < 0.5
    qmap = torch.where(sampled, torch.arange(n).expand(b, n), -1)
    drawn = sample_from(q.reshape(-1, v), torch.rand(b * n, generator=gen)).view(b, n)
    likely = p.argmax(-1).gather(1, parents)  # point masses often the target's favourite: deep accepts
    ids = torch.where(sampled, drawn, torch.where(torch.rand(b, n, generator=gen) < 0.5, likely,
                                                 torch.randint(0, v, (b, n), generator=gen)))
    u_test, u_sample = torch.rand(b, n, generator=gen), torch.rand(b, generator=gen)
    path, acc, nxt = tree_sample_accept(ids, parents, valid, qmap, q, p, u_test, u_sample)
    assert int(acc.max()) >= 3
    _check_against(path, acc, nxt, _ref_sample(ids, parents, valid, qmap, q, p, u_test, u_sample))


def test_tree_sample_greedy_rows_equal_tree_greedy():
    gen = torch.Generator().manual_seed(4)
    b, n, v = 300, 10, 4
    parents, valid = _random_tree(gen, b, n)
    logits = torch.randn(b, n + 1, v, generator=gen)
    p = warp_probs(logits, torch.zeros(b))
    tgt = logits.argmax(-1).gather(1, parents)
    ids = torch.where(torch.rand(b, n, generator=gen) < 0.6, tgt, torch.randint(0, v, (b, n), generator=gen))
    q = torch.softmax(torch.randn(b, n, v, generator=gen), -1)
    qmap = torch.where(torch.rand(b, n, generator=gen) < 0.5, torch.arange(n).expand(b, n), -1)
    u_test, u_sample = torch.rand(b, n, generator=gen), torch.rand(b, generator=gen)
    got = tree_sample_accept(ids, parents, valid, qmap, q, p, u_test, u_sample)
    want = tree_greedy_accept(ids, parents, valid, logits)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("point", [False, True])
def test_tree_sample_chain_equals_chain_rules(point: bool):
    gen = torch.Generator().manual_seed(5 + point)
    b, k, v = 2000, 5, 6
    p = _warped(gen, b, k + 1, v)
    q = torch.softmax(torch.log(p[:, :k] + 0.05) + 0.5 * torch.randn(b, k, v, generator=gen), -1)
    ids = sample_from(q.reshape(-1, v), torch.rand(b * k, generator=gen)).view(b, k)
    if point:  # deterministic candidates: often the target's top token
        ids = torch.where(torch.rand(b, k, generator=gen) < 0.6, p[:, :k].argmax(-1), ids)
    lens = torch.randint(0, k + 1, (b,), generator=gen)
    u_acc, u_sample = torch.rand(b, k, generator=gen), torch.rand(b, generator=gen)
    chain = torch.arange(k).expand(b, k)
    valid = draft_mask(lens, b, k, ids.device)
    if point:
        n_ref, nxt_ref = point_mass_accept(ids, p, u_acc, u_sample, lens)
        path, n, nxt = tree_sample_accept(ids, chain, valid, torch.full_like(ids, -1), None, p, u_acc, u_sample)
    else:
        n_ref, nxt_ref = rejection_accept(ids, q, p, u_acc, u_sample, lens)
        path, n, nxt = tree_sample_accept(ids, chain, valid, chain.clone(), q, p, u_acc, u_sample)
    assert 0 < int((n == lens).sum()) < b and int((n > 0).sum()) > b // 4
    assert torch.equal(n, n_ref)
    assert int((nxt != nxt_ref).sum()) == 0
    cols = torch.arange(1, k + 1).expand(b, k)
    assert torch.equal(path, torch.where(cols <= n.unsqueeze(1), cols, 0))


# --------------------------------------------------------------------------- losslessness (chi-square)
V = 6


def _world(seed: int, temperature: float) -> dict:
    """A toy target and drafter: one random distribution per prefix of up to 3 tokens, keyed by the
    bijective base-(V+1) code of the prefix (empty prefix = 0)."""
    gen = torch.Generator().manual_seed(seed)
    m = (V + 1) ** 3
    logits = torch.randn(m, V, generator=gen)
    q = torch.softmax(0.5 * logits + torch.randn(m, V, generator=gen), -1)
    pt = warp_probs(logits, torch.full((m,), temperature), top_p=torch.full((m,), 0.9))
    guess = (logits + torch.randn(m, V, generator=gen)).argsort(-1, descending=True)  # suffix-like guesses
    return {"pt": pt, "q": q, "fixed": guess[:, 2], "suffix": guess[:, :2]}


def _extend(code: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    return code * (V + 1) + tok + 1


def _add(tree: dict, parent: int, tok: torch.Tensor, qdist: torch.Tensor | None = None,
         valid: torch.Tensor | None = None) -> int:
    """Append a node (token [B], sampled from qdist [B, V] or a point mass) under `parent`; its number."""
    tree["ids"].append(tok)
    tree["parents"].append(parent)
    tree["valid"].append(torch.ones_like(tok, dtype=torch.bool) if valid is None else valid)
    tree["qmap"].append(-1 if qdist is None else len(tree["q"]))
    if qdist is not None:
        tree["q"].append(qdist)
    tree["codes"].append(_extend(tree["codes"][parent], tok))
    return len(tree["ids"])


def _draw(w: dict, code: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A drafter sample at prefix `code`: (token, its distribution)."""
    qd = w["q"][code]
    return sample_from(qd, torch.rand(code.shape[0], generator=gen)), qd


def _shape_chain(w, tree, gen):
    """(a) a chain of two sampled drafts."""
    s1, q1 = _draw(w, tree["codes"][0], gen)
    a = _add(tree, 0, s1, q1)
    s2, q2 = _draw(w, tree["codes"][a], gen)
    _add(tree, a, s2, q2)


def _shape_spine(w, tree, gen):
    """(b) a sampled spine of depth 2 plus, at each depth, the drafter's top-2 other tokens as point masses
    (tried after the sampled sibling they depend on)."""
    parent = 0
    for _ in range(2):
        s, qd = _draw(w, tree["codes"][parent], gen)
        top = qd.scatter(1, s.unsqueeze(1), -1.0).topk(2, -1).indices
        node = _add(tree, parent, s, qd)
        _add(tree, parent, top[:, 0])
        _add(tree, parent, top[:, 1])
        parent = node


def _shape_points(w, tree, gen):
    """(c) two point-mass branches of depth 2 (suffix-index continuations)."""
    for branch in range(2):
        a = _add(tree, 0, w["suffix"][tree["codes"][0], branch])
        _add(tree, a, w["suffix"][tree["codes"][a], 0])


def _shape_mixed(w, tree, gen):
    """(d) a sampled child and a fixed point mass (padding when it repeats the sample), each with children;
    the sampled child's point-mass child may repeat its sampled sibling (the rule does not need distinct
    siblings)."""
    s1, q1 = _draw(w, tree["codes"][0], gen)
    f1 = w["fixed"][tree["codes"][0]]
    a = _add(tree, 0, s1, q1)
    keep = f1 != s1
    f = _add(tree, 0, f1, valid=keep)
    s2, q2 = _draw(w, tree["codes"][a], gen)
    _add(tree, a, s2, q2)
    _add(tree, a, w["fixed"][tree["codes"][a]])
    g, qg = _draw(w, tree["codes"][f], gen)
    _add(tree, f, g, qg, valid=keep)


SHAPES = {"chain": _shape_chain, "spine": _shape_spine, "points": _shape_points, "mixed": _shape_mixed}


def _step(w: dict, shape, code: torch.Tensor, gen: torch.Generator, broken: bool = False):
    """One verify of a fresh tree at prefix `code` [B] -> (first emitted token, second or -1)."""
    b = code.shape[0]
    tree = {"ids": [], "parents": [], "valid": [], "qmap": [], "q": [], "codes": [code]}
    shape(w, tree, gen)
    ids, valid = torch.stack(tree["ids"], 1), torch.stack(tree["valid"], 1)
    n_cols = ids.shape[1]
    parents = torch.tensor(tree["parents"]).expand(b, n_cols)
    qmap = torch.tensor(tree["qmap"]).expand(b, n_cols)
    q = torch.stack(tree["q"], 1) if tree["q"] else None
    p = w["pt"][torch.stack(tree["codes"], 1)]
    u_test, u_sample = torch.rand(b, n_cols, generator=gen), torch.rand(b, generator=gen)
    if broken:  # point masses accepted whenever the target allows them at all
        u_test = torch.where(qmap < 0, torch.zeros_like(u_test), u_test)
    path, n, nxt = tree_sample_accept(ids, parents, valid, qmap, q, p, u_test, u_sample)
    toks = torch.cat([path_tokens(ids, path, n), torch.zeros(b, 2, dtype=torch.long)], 1)
    first = torch.where(n > 0, toks[:, 0], nxt)
    second = torch.where(n > 1, toks[:, 1], torch.where(n == 1, nxt, -1))
    return first, second, n


def _two_tokens(w: dict, shape, trials: int, seed: int, broken: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(observed counts, exact probabilities) of the first two emitted tokens over V*V cells."""
    gen = torch.Generator().manual_seed(seed)
    root = torch.zeros(trials, dtype=torch.long)
    y1, y2, n = _step(w, shape, root, gen, broken)
    again, _, _ = _step(w, shape, _extend(root, y1), gen, broken)  # a fresh tree after y1
    y2 = torch.where(n > 0, y2, again)
    obs = torch.bincount(y1 * V + y2, minlength=V * V).double()
    p1 = w["pt"][0].double()
    p2 = w["pt"][_extend(torch.zeros(V, dtype=torch.long), torch.arange(V))].double()
    exact = (p1.unsqueeze(1) * p2).flatten()
    return obs, exact / exact.sum()


def _chi2_pvalue(obs: torch.Tensor, exact: torch.Tensor) -> float:
    """Chi-square p-value; cells of probability 0 must be empty, cells expecting < 5 are pooled."""
    assert float(obs[exact == 0].sum()) == 0, "a token of target probability 0 was emitted"
    exp = exact * obs.sum()
    big = exp >= 5
    o = torch.cat([obs[big], obs[~big & (exact > 0)].sum().view(1)])
    e = torch.cat([exp[big], exp[~big & (exact > 0)].sum().view(1)])
    if float(e[-1]) < 5:  # fold a tiny pooled cell into the smallest kept one
        o, e = torch.cat([o[:-2], (o[-2:]).sum().view(1)]), torch.cat([e[:-2], e[-2:].sum().view(1)])
    return float(chisquare(o.numpy(), e.numpy()).pvalue)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tree_sampling_is_lossless(shape: str, temperature: float):
    w = _world(10 + int(temperature * 10), temperature)
    obs, exact = _two_tokens(w, SHAPES[shape], 30000, seed=list(SHAPES).index(shape) * 10 + int(temperature * 10))
    assert _chi2_pvalue(obs, exact) > 1e-3


def _spine_points_first(w, tree, gen):
    """(b) with the point masses tried before the sampled sibling they were chosen around: not allowed."""
    parent = 0
    for _ in range(2):
        s, qd = _draw(w, tree["codes"][parent], gen)
        top = qd.scatter(1, s.unsqueeze(1), -1.0).topk(2, -1).indices
        _add(tree, parent, top[:, 0])
        _add(tree, parent, top[:, 1])
        parent = _add(tree, parent, s, qd)


@pytest.mark.parametrize("bug", ["coins", "no_residual", "order"])
def test_lossless_check_catches_a_broken_rule(bug: str, monkeypatch):
    """Testing the test: point masses taken whenever possible, no residual after a rejected sample, or a
    point mass tried before the sample it depends on must all fail the chi-square test."""
    w = _world(17, 1.0)
    shape = {"coins": _shape_points, "no_residual": _shape_spine, "order": _spine_points_first}[bug]
    obs, exact = _two_tokens(w, _shape_points if bug == "coins" else _shape_spine, 30000, seed=99)
    assert _chi2_pvalue(obs, exact) > 1e-3  # the correct rule on the same world passes
    if bug == "no_residual":
        monkeypatch.setattr(tree_mod, "residual_distribution", lambda p, q: p)
    obs, exact = _two_tokens(w, shape, 30000, seed=99, broken=bug == "coins")
    assert _chi2_pvalue(obs, exact) < 1e-6
