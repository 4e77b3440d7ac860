"""A verified draft's acceptance: what each row keeps, and for a draft tree the accepted path as a chain.

A chain keeps the longest accepted prefix (`dvi.decode.sampling`); a tree walks from the root through the children
the target accepts (`dvi.decode.tree`), and the rest of the step (the transfer, the emitted tokens, the proposer's
`observe`, the feedback record) then reads the accepted path as if it had been a chain: its tokens, and at the
miss the first candidate tried there (what a chain would have drafted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dvi.decode.sampling import (
    greedy_accept,
    greedy_tokens,
    point_mass_accept,
    real_positions,
    rejection_accept,
    sample_from,
    warp_probs,
)
from dvi.decode.seq import BatchParams
from dvi.decode.sources import SOURCE_MODEL
from dvi.decode.tree import ancestors, tree_greedy_walk, tree_sample_accept
from dvi.drafters.proposer import Draft

__all__ = ["accept_chain", "accept_tree", "chain_evidence", "TreeOutcome"]


def accept_chain(draft: Draft, logits: torch.Tensor, params: BatchParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the drafts kept (n [B]) and the target's token after them (nxt [B]), judged against the
    penalized `logits`: greedy exact match, or rejection sampling with the draft's uniforms (K accept tests,
    then one resample); history drafts are point masses (`point_mass_accept`); short rows get the bonus there."""
    k, u, dev = draft.width, draft.u, logits.device
    lens = torch.tensor(draft.lens, device=dev) if k and draft.ragged else None  # [B]
    if params.all_greedy:
        if k > 0:
            return greedy_accept(draft.ids, logits, lens)
        nxt = greedy_tokens(logits[:, 0])  # [B]
        return torch.zeros_like(nxt), nxt
    p = warp_probs(logits, params.temp, params.top_k, params.top_p) if lens is None else \
        _warp_real(logits, draft.lens, params)  # [B, K + 1, V]
    if k > 0:
        tests, resample = u[:, k : 2 * k], u[:, 2 * k]
        if draft.q is None:
            return point_mass_accept(draft.ids, p, tests, resample, lens)
        if lens is None:
            return rejection_accept(draft.ids, draft.q, p, tests, resample)
        return rejection_accept(draft.ids, draft.q, p, tests, resample, lens)
    nxt = sample_from(p[:, 0], u[:, 0])  # [B]
    return torch.zeros_like(nxt), nxt


def _warp_real(logits: torch.Tensor, lens: list[int], params: BatchParams) -> torch.Tensor:
    """A ragged verify's target probabilities: each row's positions up to its drafts warped (the others are unset
    logits, left as zeros no rule keeps), so its cost follows the real positions, not rows x width."""
    b, k1, v = logits.shape
    idx = real_positions(lens, k1, logits.device)
    rows = idx // k1

    def per_position(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(0, rows)

    real = warp_probs(logits.reshape(b * k1, v).index_select(0, idx), per_position(params.temp),
                      per_position(params.top_k), per_position(params.top_p))  # [M, V]
    return real.new_zeros(b * k1, v).index_copy_(0, idx, real).view(b, k1, v)


@dataclass
class TreeOutcome:
    """A tree step's acceptance, and the accepted path as the chain the rest of the step reads."""

    n: torch.Tensor  # [B] nodes accepted
    nxt: torch.Tensor  # [B] the target's token after them
    paths: list[list[int]]  # per row the accepted node numbers, root excluded
    view: Draft  # the path as a chain draft: its tokens, then the first candidate tried at the miss
    logits: torch.Tensor  # [B, W + 1, V] the target's logits at the root and along the view
    feats: torch.Tensor | None  # [B, W + 1, H] likewise, when the verify returned features


def accept_tree(draft: Draft, logits: torch.Tensor, feats: torch.Tensor | None, params: BatchParams) -> TreeOutcome:
    """Walk every row's tree (greedy: the child equal to the target's argmax; sampling: each child in column order a
    rejection test against the current residual, `dvi.decode.tree.tree_sample_accept`); `logits` [B, N + 1, V]
    raw (the view keeps them for log-probs and the target's top-k), penalized here for the judgement."""
    b, nodes = draft.ids.shape
    dev = draft.ids.device
    ids = draft.ids.tolist()
    parents = None  # as a tensor only where penalties or the sampled rule read it (the greedy walk reads the lists)
    if params.pen is not None or not params.all_greedy:
        parents = torch.tensor(draft.parents, dtype=torch.long, device=dev).view(b, nodes)
    judged = logits if params.pen is None else params.transform(logits, draft.ids, ancestors(parents))
    if params.all_greedy:
        paths, nxt_l = tree_greedy_walk(ids, draft.parents, draft.lens, greedy_tokens(judged).tolist())
        n = torch.tensor([len(x) for x in paths], dtype=torch.long, device=dev)
        nxt = torch.tensor(nxt_l, dtype=torch.long, device=dev)
    else:
        valid = torch.arange(nodes, device=dev).view(1, nodes) < torch.tensor(draft.lens, device=dev).view(b, 1)
        p = warp_probs(judged, params.temp, params.top_k, params.top_p)
        qmap = draft.qmap if draft.qmap is not None else torch.full_like(draft.ids, -1)
        off = draft.u.shape[1] - nodes - 1
        path, n, nxt = tree_sample_accept(draft.ids, parents, valid, qmap, draft.q, p, draft.u[:, off : off + nodes],
                                          draft.u[:, off + nodes])
        paths = [row[:k] for row, k in zip(path.tolist(), n.tolist(), strict=True)]
    view, cols = _chain_view(draft, paths, ids)
    idx = torch.tensor(cols, dtype=torch.long, device=dev)  # [B, W + 1] node of each view column
    gather = lambda x: x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # noqa: E731
    return TreeOutcome(n, nxt, paths, view, gather(logits), gather(feats) if feats is not None else None)


def _chain_view(draft: Draft, paths: list[list[int]], ids: list[list[int]]) -> tuple[Draft, list[list[int]]]:
    """The chain each row's path reads as: ids (path tokens, then the first candidate tried at the miss), lens,
    the spine nodes the path kept, each kept node's sibling rank, who proposed each column (`node_sources`: the
    feedback record's `draft_source` per token); and per view column the tree node it shows. `ids`: draft.ids as lists."""
    rows, lens, cols, spine_kept, ranks, sources = [], [], [], [], [], []
    for i, path in enumerate(paths):
        par, ln = draft.parents[i], draft.lens[i]
        last = path[-1] if path else 0
        first = next((j + 1 for j in range(ln) if par[j] == last), None)  # the first child tried after the path
        toks = [ids[i][a - 1] for a in path] + ([ids[i][first - 1]] if first else [])
        rows.append(toks)
        lens.append(len(toks))
        cols.append([0] + path)
        s = next((j for j, a in enumerate(path) if a != j + 1), len(path))
        spine_kept.append(min(s, draft.spine[i] if draft.spine else s))
        ranks.append([draft.ranks[i][a - 1] for a in path] if draft.ranks else [0] * len(path))
        if draft.node_sources:
            src = draft.node_sources[i]
            sources.append([src[a - 1] for a in path] + ([src[first - 1]] if first else []))
    w = max(lens)
    for i in range(len(rows)):
        rows[i] += [0] * (w - len(rows[i]))
        cols[i] += [cols[i][-1]] * (w + 1 - len(cols[i]))
    ids_t = torch.tensor(rows, dtype=torch.long, device=draft.ids.device).view(len(rows), w)
    view = dataclasses.replace(draft, ids=ids_t, q=None, lens=lens, parents=None, qmap=None, ranks=ranks,
                               spine_kept=spine_kept, node_sources=sources or None)
    return view, cols


def chain_evidence(view: Draft, i: int, k: int, n: int, source: str | None) -> tuple[int, int]:
    """Row i's evidence for its learned chain's acceptance estimate, (drafts tried, kept), after a step whose (chain
    view of the) draft gave it k drafts and kept n. Adaptive K and the tree's siblings are priced from the drafter's
    top-1 chain, so after a tree step only the spine counts: a path kept through a sibling is the sibling's hit
    (`SiblingStats`), and counted as the chain's it inflated the estimate K is chosen from, deepening every spine
    beyond what pays (docs/design.md, "Trees priced from the chain's own acceptance"). (0, 0): no learned chain."""
    spine = view.spine[i] if view.spine is not None and view.spine_kept is not None else None
    if spine is not None and spine > 0:
        return spine, view.spine_kept[i]
    return (k, n) if source == SOURCE_MODEL and spine is None else (0, 0)
