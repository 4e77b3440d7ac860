"""Tree-shaped drafts: structure helpers and the lossless acceptance rules for them.

A batch of B rows, each with a draft tree of up to N nodes. Node 0 is the root (the row's last emitted
token); draft nodes are 1..N and live in draft columns 0..N-1:

- `ids` [B, N] long: token of node j+1 in column j;
- `parents` [B, N] long: parent node of node j+1, in 0..j (parents come before children; a chain is
  parents[:, j] == j);
- `valid` [B, N] bool or None (all valid): padding nodes are never accepted and have no valid children;
- `qmap` [B, N] long: for a node sampled from a drafter distribution, its index k into `q` [B, Kq, V]
  (the distribution its token was drawn from, given its parent's path); -1 for a point-mass candidate;
- the target's scores `logits` / warped probabilities `p` [B, N+1, V] at every node (index 0 = root,
  j+1 = node j+1): the distribution of the token after that node's path.

Children of a node are tried in column order. An accepted path is returned as `path` [B, N] (1-based node
numbers, 0 after the row's `n` entries), `n` [B] and `nxt` [B] (the token emitted after the path).
"""

from __future__ import annotations

import torch

from dvi.decode.sampling import greedy_tokens, residual_distribution, sample_from

__all__ = [
    "depths",
    "ancestors",
    "tree_greedy_accept",
    "tree_greedy_walk",
    "tree_sample_accept",
    "gather_path",
    "path_tokens",
]


def _valid(ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The valid mask with None meaning all nodes are real."""
    return torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.bool()


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """[B, N+1, N+1] bool: anc[b, i, a] iff node a is node i or one of its ancestors (the root for all i).

    Transitive closure by repeated squaring of (identity + parent edge): log2(N+1) batched matmuls instead
    of a walk per row; float32 counts of at most N+1 are exact.
    """
    b, n = parents.shape
    m = n + 1
    edge = torch.eye(m, device=parents.device).expand(b, m, m).clone()
    edge[:, 1:].scatter_(-1, parents.long().unsqueeze(-1), 1.0)
    reach = 1
    while reach < m:
        edge = (edge @ edge).clamp_(max=1.0)
        reach *= 2
    return edge > 0


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, N] long depth of node j+1 (children of the root have depth 1): its count of non-root ancestors,
    itself included."""
    return ancestors(parents)[:, 1:, 1:].sum(-1)


def _first_per_parent(parents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, N] bool: mask[b, j] and no earlier column with the same parent is in mask (the first of its
    siblings in column order)."""
    n = parents.shape[1]
    same = parents.unsqueeze(2) == parents.unsqueeze(1)  # [B, j, j']
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)  # j' < j
    return mask & ~(same & earlier & mask.unsqueeze(1)).any(-1)


def _path_from_nodes(on_path: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From a [B, N] mask of the accepted nodes (one root-to-node chain per row) to (path, n, last node).

    Parents precede children, so column order along a chain is depth order: sorting the columns with the
    off-path ones pushed back puts the path first."""
    b, n_cols = on_path.shape
    n = on_path.sum(1)
    cols = torch.arange(1, n_cols + 1, device=on_path.device).expand(b, n_cols)
    key = torch.where(on_path, cols, cols + n_cols)
    order = key.sort(1).values  # keys are distinct
    path = torch.where(order <= n_cols, order, torch.zeros_like(order))
    last = torch.where(on_path, cols, torch.zeros_like(cols)).max(1).values if n_cols else n
    return path, n, last


def tree_greedy_accept(
    ids: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification of a tree: from the root, follow the (first, in column order) valid child whose
    token is the target's argmax at the current node; stop where none matches.

    A node is on the path iff it and every non-root ancestor are such first matches, so the walk is one
    ancestor-mask reduction (no loop over rows or depth). For a chain it is `sampling.greedy_accept`.
    Returns (path [B, N], n [B], nxt [B] = argmax at the last accepted node).
    """
    b, n_cols = ids.shape
    tgt = greedy_tokens(logits)  # [B, N+1]
    match = _valid(ids, valid) & (ids == tgt.gather(1, parents.long()))
    good = _first_per_parent(parents.long(), match)
    good_full = torch.cat([torch.ones_like(good[:, :1]), good], 1)  # the root is always "good"
    anc = ancestors(parents)[:, 1:]  # [B, N, N+1]
    on_path = ~(anc & ~good_full.unsqueeze(1)).any(-1)
    path, n, last = _path_from_nodes(on_path)
    return path, n, tgt.gather(1, last.unsqueeze(1)).squeeze(1)


def tree_greedy_walk(ids: list[list[int]], parents: list[list[int]], lens: list[int], tgt: list[list[int]],
                     ) -> tuple[list[list[int]], list[int]]:
    """`tree_greedy_accept` walked on the host: per row its accepted path (1-based nodes) and the token after it, from
    the target's argmax at every node `tgt` [B][N + 1]. A step's trees are a few nodes a row, where the batched mask
    reduction's dozen small ops cost more than the walk; the one transfer is the argmax's, which the path's is anyway."""
    paths, nxts = [], []
    for row, par, ln, t in zip(ids, parents, lens, tgt, strict=True):
        node, path = 0, []
        while True:  # node's children sit in later columns (parents come first), tried in column order
            child = next((j + 1 for j in range(node, ln) if par[j] == node and row[j] == t[node]), 0)
            if not child:
                break
            path.append(child)
            node = child
        paths.append(path)
        nxts.append(t[node])
    return paths, nxts


def _children_table(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N+1, R] long: column of the r-th valid child (column order) of node v, -1 where there is none;
    R = the most valid children of any node (at least 1)."""
    b, n = parents.shape
    same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid.unsqueeze(1)
    earlier = torch.ones(n, n, dtype=torch.bool, device=parents.device).tril(-1)
    rank = (same & earlier).sum(-1)  # [B, N] rank among valid siblings
    r = max(1, int(rank[valid].max()) + 1) if bool(valid.any()) else 1
    table = torch.full((b, n + 2, r), -1, dtype=torch.long, device=parents.device)
    sink = torch.full_like(parents, n + 1)  # padding nodes write into a dropped extra row
    rows = torch.arange(b, device=parents.device).unsqueeze(1).expand(b, n)
    cols = torch.arange(n, device=parents.device).expand(b, n)
    table[rows, torch.where(valid, parents.long(), sink), rank.clamp(max=r - 1)] = cols
    return table[:, : n + 1]


def _point_residual(r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """r with token x removed and renormalised: (r - onehot(x))+ / (1 - r(x)); r unchanged if nothing is left
    (then r(x) was 1 and the candidate was accepted anyway)."""
    removed = r.scatter(1, x.unsqueeze(1), 0.0)
    z = removed.sum(-1, keepdim=True)
    return torch.where(z > 0, removed / z.clamp_min(1e-30), r)


def _try_child(
    state: dict, c: torch.Tensor, ids: torch.Tensor, qmap: torch.Tensor, q: torch.Tensor | None,
    p: torch.Tensor, u_test: torch.Tensor,
) -> None:
    """One rejection step for each row whose candidate is column c (-1: none) against its residual. The residuals
    over the vocabulary are rebuilt only for the rows that moved (a rejection's residual, an acceptance's p at the
    new node): at T = 1, 5 rows of 2 nodes each rebuilt every row's both ways each try, ~2 ms a step on AMD Zen 5."""
    rows = torch.arange(c.shape[0], device=c.device)
    active = (c >= 0) & ~state["done"] & ~state["moved"]
    cc = c.clamp(min=0)
    r = state["r"]
    x = ids[rows, cc]
    rx = r.gather(1, x.unsqueeze(1)).squeeze(1)
    u = u_test[rows, cc].to(r.dtype)
    k = qmap[rows, cc]
    sampled = k >= 0
    if q is not None:
        qx = q[rows, k.clamp(min=0), x].to(r.dtype)
        ok = torch.where(sampled, u * qx < rx, (u < rx) | (rx >= 1))
    else:
        ok = (u < rx) | (rx >= 1)
    acc = active & ok
    rej = active & ~ok
    node = cc + 1
    slot = state["n"].clamp(max=state["path"].shape[1] - 1)
    state["path"][rows, slot] = torch.where(acc, node, state["path"][rows, slot])
    state["n"] = state["n"] + acc.long()
    state["cur"] = torch.where(acc, node, state["cur"])
    state["moved"] = state["moved"] | acc
    if bool(rej.any()):
        i = rej.nonzero().squeeze(1)
        ri, xi = r.index_select(0, i), x.index_select(0, i)
        miss = _point_residual(ri, xi)
        if q is not None:
            si = sampled.index_select(0, i)
            if bool(si.any()):
                qc = q[i, k.index_select(0, i).clamp(min=0)].to(r.dtype)
                miss = torch.where(si.unsqueeze(1), residual_distribution(ri, qc), miss)
        r = r.index_copy(0, i, miss)
    if bool(acc.any()):
        i = acc.nonzero().squeeze(1)
        r = r.index_copy(0, i, p[i, node.index_select(0, i)].to(r.dtype))
    state["r"] = r


def tree_sample_accept(
    ids: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor | None,
    qmap: torch.Tensor | None,
    q: torch.Tensor | None,
    p: torch.Tensor,
    u_test: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless multi-candidate speculative sampling over a draft tree (recursive rejection sampling).

    Rule: at the current node v (first the root) the residual is r := p[v]. Each valid child c of v is tried
    in column order with its token x. If c was sampled (qmap >= 0, proposal qc = q[b, qmap]) it is accepted
    when u_test[c] * qc(x) < r(x) (prob min(1, r/qc)), else r := normalise((r - qc)+) (`residual_distribution`,
    r unchanged if that is all zero). A point mass is accepted when u_test[c] < r(x) (always if r(x) == 1),
    else r := r with x zeroed, renormalised. On acceptance move to c with r := p[c] and repeat; when every
    child of v is rejected (or it has none) the next token is `sample_from(r, u_sample)`.

    Why lossless: claim that from any state with residual r the emitted token is distributed as r. With no
    candidates left this is the final sample. Otherwise the candidate x ~ qc (qc may depend on everything
    drafted before it but not on the coins) is accepted as y with probability qc(y) min(1, r(y)/qc(y)) =
    min(qc, r)(y); it is rejected with probability sum (r - qc)+ = Z, and then, by induction, the output is
    (r - qc)+ / Z whatever x was; the sum is min(qc, r) + (r - qc)+ = r. A point mass is qc = onehot(x).
    At an accepted node the same holds one level down against p[c], so every emitted token follows the
    target given the path before it. Needs: a sampled node's token, given the tokens tried before it and
    its path, is drawn from its q (so a point mass that depends on a sampled sibling must come after it).

    Vectorised over rows with per-row state (current node, residual [B, V], done flags): a loop over depth
    levels and, within a level, over child rank. For a chain of sampled nodes this is
    `sampling.rejection_accept`, of point masses `sampling.point_mass_accept` (same uniforms).
    ids/parents/valid/qmap [B, N], q [B, Kq, V] or None (all point masses), p [B, N+1, V] warped target
    probabilities, u_test [B, N], u_sample [B]. Returns (path [B, N], n [B], nxt [B]).
    """
    b, n_cols = ids.shape
    dev = ids.device
    ok = _valid(ids, valid)
    qmap = torch.full_like(ids, -1) if qmap is None else qmap.long()
    rows = torch.arange(b, device=dev)
    state = {
        "path": torch.zeros(b, max(n_cols, 1), dtype=torch.long, device=dev),
        "n": torch.zeros(b, dtype=torch.long, device=dev),
        "cur": torch.zeros(b, dtype=torch.long, device=dev),
        "done": torch.zeros(b, dtype=torch.bool, device=dev),
        "r": p[:, 0].clone(),
    }
    if n_cols:
        table = _children_table(parents.long(), ok)
        levels = int(depths(parents)[ok].max()) if bool(ok.any()) else 0
        for _ in range(levels):
            state["moved"] = torch.zeros(b, dtype=torch.bool, device=dev)
            for k in range(table.shape[2]):
                _try_child(state, table[rows, state["cur"], k], ids, qmap, q, p, u_test)
            state["done"] = state["done"] | ~state["moved"]
    return state["path"][:, :n_cols], state["n"], sample_from(state["r"], u_sample)


def _path_index(path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B, D] node numbers along the path, D = max n, padded with the row's last accepted node (0: root)."""
    d = int(n.max()) if n.numel() else 0
    pos = torch.arange(d, device=path.device).unsqueeze(0)
    last = (n - 1).clamp(min=0).unsqueeze(1)
    idx = path[:, :d].gather(1, torch.minimum(pos, last).expand(path.shape[0], d)) if d else path[:, :0]
    return torch.where(n.unsqueeze(1) > 0, idx, torch.zeros_like(idx))


def gather_path(x: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Per-node values x [B, N+1, ...] (0 = root) along the accepted path as a chain [B, D+1, ...]:
    entry 0 the root's, entry i path node i's, entries past a row's n its last accepted node's (padding)."""
    idx = torch.cat([torch.zeros_like(path[:, :1]), _path_index(path, n)], 1)
    shape = idx.shape + x.shape[2:]
    idx = idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(shape)
    return x.gather(1, idx)


def path_tokens(ids: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Tokens along the accepted path [B, D] (D = max n), padded with the row's last path token (0 when the
    row accepted nothing)."""
    idx = _path_index(path, n)
    tok = ids.gather(1, (idx - 1).clamp(min=0))
    return torch.where(n.unsqueeze(1) > 0, tok, torch.zeros_like(tok))
