"""Draft trees from token branches, shared by `suffix` and `hybrid`: per row a list of nodes (a learned chain and
its siblings, history proposals) that further branches join as a trie, then one `Draft` with the tree fields.

A branch joins as a trie (follow the existing children while its tokens agree, branch off at the first differing
depth) because two siblings carrying one token are a wasted node: the target's walk can keep only the first.
Its nodes are point masses appended after every node already there: a point mass whose place depends on a
sampled node must be tried after it (`dvi.decode.tree.tree_sample_accept`), and history branches are chosen
before any drafter ran, so only their place in the trie depends on the samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dvi.drafters.proposer import Draft

__all__ = ["RowTree", "assemble"]


@dataclass
class RowTree:
    """One row's nodes: node j + 1 lives in column j with its token, parent (0: the row's last token), rank among
    its siblings (0: tried first), q column (-1: a point mass) and who proposed it (a `dvi.decode.sources.SOURCES` entry)."""

    ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    qcols: list[int] = field(default_factory=list)
    sources: list[str | None] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: Sequence[int], source: str | None = None) -> RowTree:
        """A chain of point masses (a history proposal)."""
        n = len(tokens)
        return cls([int(t) for t in tokens], list(range(n)), [0] * n, [-1] * n, [source] * n)

    @classmethod
    def of(cls, draft: Draft, i: int) -> RowTree:
        """Row i of `draft`, a chain (sampled drafts read q's columns in order) or a tree."""
        n = draft.lens[i]
        ids = draft.ids[i, :n].tolist()
        sources = list(draft.node_sources[i][:n]) if draft.node_sources else [draft.sources[i]] * n
        if draft.parents is None:
            qcols = list(range(n)) if draft.q is not None else [-1] * n
            return cls(ids, list(range(n)), [0] * n, qcols, sources)
        qcols = draft.qmap[i, :n].tolist() if draft.qmap is not None else [-1] * n
        ranks = list(draft.ranks[i][:n]) if draft.ranks is not None else [0] * n
        return cls(ids, list(draft.parents[i][:n]), ranks, qcols, sources)

    def _child(self, parent: int, token: int) -> int | None:
        """The node under `parent` carrying `token`, if any."""
        return next((j + 1 for j, (p, t) in enumerate(zip(self.parents, self.ids, strict=True))
                     if p == parent and t == token), None)

    def merge(self, tokens: Sequence[int], source: str | None = None) -> int:
        """Join the point-mass branch `tokens` (from the root, proposed by `source`) as a trie; returns the nodes it
        added."""
        cur, added = 0, 0
        for t in tokens:
            t = int(t)
            node = self._child(cur, t)
            if node is None:
                self.ranks.append(sum(1 for p in self.parents if p == cur))
                self.ids.append(t)
                self.parents.append(cur)
                self.qcols.append(-1)
                self.sources.append(source)
                node, added = len(self.ids), added + 1
            cur = node
        return added


def assemble(rows: list[RowTree], base: Draft, spine: list[int], u: torch.Tensor | None, drawn: int = 0) -> Draft:
    """`rows` (at least one node in all) as one tree draft, `base`'s other fields kept (q, sources, counters):
    ids [B, N], padding after each row's nodes (token 0, a leaf of the root, never accepted); `u` cut to
    [B, drawn + N + 1] (`drawn`: the spine's draft samples before the node tests, as `Draft.u` lays them out)."""
    n = max(len(r.ids) for r in rows)
    if u is not None and u.shape[1] < drawn + n + 1:
        raise ValueError(f"{u.shape[1]} uniforms a row for {drawn} draft samples and {n} nodes")
    pad = lambda xs, v: list(xs) + [v] * (n - len(xs))  # noqa: E731
    dev = base.ids.device
    ids = torch.tensor([pad(r.ids, 0) for r in rows], dtype=torch.long, device=dev).view(len(rows), n)
    qmap = torch.tensor([pad(r.qcols, -1) for r in rows], dtype=torch.long, device=dev).view(len(rows), n)
    return dataclasses.replace(base, ids=ids, lens=[len(r.ids) for r in rows], u=None if u is None else u[:, : drawn + n + 1],
                               parents=[pad(r.parents, 0) for r in rows], spine=list(spine), qmap=qmap,
                               ranks=[pad(r.ranks, 0) for r in rows], node_sources=[pad(r.sources, None) for r in rows])
