"""How a verify over draft trees attends, and how a row's cache keeps only the accepted path afterwards.

A row's tree is node 0 (its last emitted token) and draft nodes 1..N, node j+1's parent `parents[j]` < j + 1.
The verify writes node j's keys and values at column start + j and rotates it at position start + depth(j); node
j attends to the row's cache, its ancestors and itself. The nodes 0..s whose parents are their predecessors (the
spine: a proposer's chain) sit where a chain's would, so they attend exactly as a chain verify does (folded,
`dvi.decode.attention.folded_groups`). Every other node, one request at a time or in the exact mode, attends to a
gathered copy of its row's columns in which its ancestors sit at start..start + depth: the columns, count and
mask of the one-token step it stands for, so it rounds like that step too (SDPA rounds a query differently with
the positions of the masked columns beside it). A batch of several rows attends in one SDPA call with the
ancestor mask (the batched contract is near-tie anyway).

After acceptance `compact` moves the accepted path's entries to start + 1..start + n (a no-op along the spine), so
the cache has no holes and nothing of a rejected branch stays visible.
"""

from __future__ import annotations

import torch

from dvi.decode.attention import bucket_columns, folded_groups, one_call, per_query
from dvi.decode.attention_kernel import KernelPlan
from dvi.decode.tree import ancestors

__all__ = ["node_depths", "node_paths", "spine_length", "TreeAttention", "tree_attention", "compact_moves"]


def node_depths(parents: list[int]) -> list[int]:
    """Depth of nodes 0..N (the root 0)."""
    d = [0]
    for p in parents:
        d.append(d[p] + 1)
    return d


def node_paths(parents: list[int]) -> list[list[int]]:
    """Per node 0..N, the nodes from the root to it, both included."""
    paths = [[0]]
    for j, p in enumerate(parents):
        paths.append(paths[p] + [j + 1])
    return paths


def spine_length(parents: list[int]) -> int:
    """Draft nodes 1..s that form a chain from the root in column order (parents[j] == j)."""
    s = 0
    while s < len(parents) and parents[s] == s:
        s += 1
    return s


class TreeAttention:
    """`dvi.decode.attention.Attention`'s interface for a forward over trees: either one SDPA call with `mask`
    [B, 1, q, columns] (batched), or per row the spine's folded `groups` plus `gathers`: (row, flat query indices
    [m], columns [m, length] to gather, length, mask [m, 1, 1, length]). `depth` [B, q]: each node's depth, the
    offset of its position from its row's start (its column's offset is its index)."""

    __slots__ = ("columns", "mask", "groups", "gathers", "depth", "_trees", "_plan")
    real = None  # a tree forward scores every node
    runs = None  # and carries no runs beside its rows (`dvi.decode.segments`)

    def __init__(self, columns: int, mask: torch.Tensor | None = None, groups: list | None = None,
                 gathers: list | None = None):
        self.columns, self.mask, self.groups, self.gathers = columns, mask, groups, gathers
        self.depth: torch.Tensor | None = None
        self._trees: tuple[list[int], list[list[int]], int] | None = None  # starts, parents, q (`plan`)
        self._plan: KernelPlan | None = None

    @property
    def plan(self) -> KernelPlan | None:
        """Each node's columns for the attention kernel (`dvi.decode.attention_kernel`): its row's cache, then its
        ancestors' columns and its own in depth order, as the one-token step at its position sees them."""
        if self._plan is None and self._trees is not None:
            starts, parents, q = self._trees
            rows, prefix, extra, counts = [], [], [], []
            for i, (start, par) in enumerate(zip(starts, parents, strict=True)):
                for path in node_paths(par):
                    rows.append(i), prefix.append(start), counts.append(len(path))
                    extra.append([start + node for node in path] + [0] * (q - len(path)))
            self._plan = KernelPlan(torch.tensor(rows), torch.tensor(prefix), max(prefix) + q, torch.tensor(extra),
                                    torch.tensor(counts))
        return self._plan

    def attend(self, qrows: torch.Tensor, b: int, keys: torch.Tensor, values: torch.Tensor, scale: float,
               ) -> torch.Tensor:
        n, heads = qrows.shape[0], qrows.shape[1]
        q, d = n // b, keys.shape[3]
        if self.mask is not None:
            return one_call(qrows, b, keys, values, self.mask, scale)
        qf = qrows.view(n, heads, 1, d)
        out = qrows.new_empty(n, heads * d)
        for row, j0, j1, length, mask in self.groups:
            m = j1 - j0
            kf = keys[row : row + 1, :, :length].expand(m, -1, -1, -1)
            vf = values[row : row + 1, :, :length].expand(m, -1, -1, -1)
            o = per_query(qf[row * q + j0 : row * q + j1], kf, vf, mask, scale)
            out[row * q + j0 : row * q + j1] = o.view(m, heads * d)
        for row, idx, cols, length, mask in self.gathers:
            m = idx.shape[0]
            kf = keys[row].index_select(1, cols.view(-1)).view(-1, m, length, d).transpose(0, 1)
            vf = values[row].index_select(1, cols.view(-1)).view(-1, m, length, d).transpose(0, 1)
            o = per_query(qf.index_select(0, idx), kf, vf, mask, scale)
            out.index_copy_(0, idx, o.view(m, heads * d))
        return out


def tree_attention(starts: list[int], parents: list[list[int]], q: int, arange: torch.Tensor,
                   folded: bool) -> TreeAttention:
    """The attention of a forward of q nodes per row (node 0 and parents[b] padded to q - 1 entries) at cache
    columns starts[b]..starts[b] + q - 1; `arange` at least as long as the longest column count."""
    dev = arange.device
    if not folded:
        b = len(starts)
        columns = max(starts) + q
        anc = ancestors(torch.tensor(parents, dtype=torch.long).view(b, q - 1))  # [B, q, q]
        start = torch.tensor(starts, dtype=torch.long).view(b, 1, 1)
        rel = torch.arange(columns).view(1, 1, columns) - start  # [B, 1, C]: column - row start
        tree = anc.gather(2, rel.clamp(0, q - 1).expand(b, q, columns))
        mask = (rel < 0) | ((rel < q) & tree)
        attn = TreeAttention(columns, mask=mask.unsqueeze(1).to(dev))
        attn._trees = (list(starts), [list(p) for p in parents], q)
        return attn
    groups, gathers, columns = [], [], 0
    for i, par in enumerate(parents):
        s, start = spine_length(par), starts[i]
        depth, paths = node_depths(par), node_paths(par)
        columns = max(columns, bucket_columns(start + s), start + q)
        groups += [(i, j0, j1, length, mask) for _, j0, j1, length, mask in folded_groups([start], s + 1, arange)]
        by_length: dict[int, list[int]] = {}
        for j in range(s + 1, q):
            by_length.setdefault(bucket_columns(start + depth[j]), []).append(j)
        for length, nodes in by_length.items():
            columns = max(columns, length)
            cols = torch.zeros(len(nodes), length, dtype=torch.long)
            cols[:, :start] = torch.arange(start)
            for r, j in enumerate(nodes):
                cols[r, start : start + depth[j] + 1] = start + torch.tensor(paths[j])
            last = torch.tensor([start + depth[j] for j in nodes]).view(-1, 1)
            mask = (torch.arange(length).view(1, -1) <= last).view(len(nodes), 1, 1, length)
            idx = torch.tensor([i * q + j for j in nodes], dtype=torch.long)
            gathers.append((i, idx.to(dev), cols.to(dev), length, mask.to(dev)))
    attn = TreeAttention(columns, groups=groups, gathers=gathers)
    attn._trees = (list(starts), [list(p) for p in parents], q)
    return attn


def compact_moves(starts: list[int], paths: list[list[int]]) -> tuple[list[int], list[int], list[int]] | None:
    """(slots, from columns, to columns) that put each row's accepted path (node numbers a_1..a_n) at columns
    start + 1..start + n; None when every path is its spine (nothing moves)."""
    slots, src, dst = [], [], []
    for i, path in enumerate(paths):
        for depth, node in enumerate(path, 1):
            if node != depth:
                slots.append(i)
                src.append(starts[i] + node)
                dst.append(starts[i] + depth)
    return (slots, src, dst) if slots else None
