"""`suffix` (SuffixDecoding, arXiv 2411.04975): drafts from history, over a `dvi.drafters.suffix.SuffixCache`.

Per row, the continuation that followed the longest match of its context's suffix, in the row's own prompt +
output or in recently finished outputs; no model pass, so a long draft is almost free. A proposal is a point
mass: the engine accepts draft x with probability p(x) and after a rejection samples from p with x removed
(`dvi.decode.sampling.point_mass_accept`), lossless at any temperature.

Every finished row's output joins the cache's global index at once (`release`), with the last `prompt_tail`
tokens of its prompt in front, so a later request with the same prompt (an RL prompt's next samples, its
siblings still running, a repeated agent call) drafts its first tokens from it too. When the target's weights
change (`rebuild` with a new target version, RL), outputs of older versions decay: weight
`version_decay ** age`. The time spent on lookups and appends is counted (`stats()["seconds"]`, on /metrics).

Where the target verifies draft trees, both indices' proposals are drafted when they differ: the better one as
the first branch, the runner-up merged in as a trie (`dvi.drafters.tree_draft`), so a step whose best guess
misses can still keep the other index's continuation; a chain could only carry one of them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from dvi.decode.sources import SUFFIX_SOURCE
from dvi.drafters.proposer import Draft, MakeProposer, Pricing, Proposer, Uniforms
from dvi.drafters.tree_draft import RowTree, assemble

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.suffix import SuffixCache, SuffixProposal

__all__ = ["SuffixProposer", "PROMPT_TAIL", "finished_entry", "source_of", "point_drafts", "suffix_tree_draft"]


PROMPT_TAIL = 16  # prompt tokens kept in front of a finished output in the global index


def finished_entry(prompt_ids, output_ids: list[int], prompt_tail: int = PROMPT_TAIL) -> list[int]:
    """What a finished row adds to the global index: its prompt's last `prompt_tail` tokens, then its output (a
    later request with the same prompt drafts its first tokens from it)."""
    tail = [int(t) for t in prompt_ids[len(prompt_ids) - prompt_tail:]] if prompt_tail > 0 else []
    return tail + [int(t) for t in output_ids]


def source_of(proposal) -> str:
    """The `dvi.decode.sources.SOURCES` entry of a suffix proposal ("request" -> "suffix_request")."""
    return SUFFIX_SOURCE[proposal.source]


class SuffixProposer(Proposer):
    """Suffix-tree drafts from a `SuffixCache` (per-request index + global index of finished outputs)."""

    name = "suffix"
    uses_history = True
    _owned_parts = ("cache",)

    def __init__(self, cache: SuffixCache, vocab_size: int, device: torch.device, max_tokens: int = 16,
                 min_prob: float = 0.1, prompt_tail: int = PROMPT_TAIL, version_decay: float = 0.5):
        super().__init__(vocab_size, device)
        self.cache, self.max_tokens, self.min_prob = cache, int(max_tokens), float(min_prob)
        self.prompt_tail, self.version_decay = int(prompt_tail), float(version_decay)
        self.version = 0  # the target's weights version (outputs of older ones decay)
        self._versions: OrderedDict[str, int] = OrderedDict()  # finished seq id -> its target version (bounded)
        self.rids: list[str] = []
        # per row, tokens emitted since its last append: a step without lookups only collects them, and the next
        # lookup step indexes them first (`_index_unindexed`), so every lookup reads what it would have read
        self._unindexed: list[list[int]] = []
        self._looked = False  # this step looked its rows up (its emitted tokens then grade the proposals at once)
        self._offered: dict[int, SuffixProposal] = {}  # row -> its best proposal this step (graded in `observe` if drafted)
        self.seconds = 0.0  # host time in lookups and appends (the tree's own work)
        self.step_seconds = 0.0  # that time in the current step

    def _timed(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.step_seconds += dt

    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        t0 = time.perf_counter()
        for s in seqs:
            self.cache.start(s.req.request_id, [int(t) for t in s.req.prompt_ids])
            self.rids.append(s.req.request_id)
            self._unindexed.append([])
        self._timed(t0)

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        """A finished row's prompt tail + output joins the global index now; an aborted one is forgotten."""
        t0 = time.perf_counter()
        for i, seq, learn in finished:
            rid = self.rids[i]
            self.cache.forget(rid)
            out = [int(t) for t in seq.res.token_ids]
            if learn and out:
                self.cache.add_finished(rid, finished_entry(seq.req.prompt_ids, out, self.prompt_tail))
                self._versions[rid] = self.version
                self._versions.move_to_end(rid)
                while len(self._versions) > 100_000:
                    self._versions.popitem(last=False)
        self.rids = [self.rids[i] for i in keep]
        self._unindexed = [self._unindexed[i] for i in keep]  # a finished row's output comes whole from its result
        self._timed(t0)

    def rebuild(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None = None,
                target_version: int | None = None, drafter_changed: bool = False) -> None:
        """The tree holds tokens, not weights: new target weights only make older outputs count
        `version_decay ** age` in proposals."""
        if target_version is None:
            return
        self.version = int(target_version)
        for sid, v in list(self._versions.items()):
            try:
                self.cache.set_weight(sid, max(self.version_decay ** max(self.version - v, 0), 1e-6))
            except ValueError:  # evicted from the bounded index meanwhile
                del self._versions[sid]

    def proposal_sets(self, caps: list[int], lookups: bool = True) -> dict[int, list]:
        """Row -> its `SuffixProposal`s with tokens (the request's own, the global one), best first, for rows
        with one (`lookups` False: none)."""
        t0 = time.perf_counter()
        self.step_seconds = 0.0
        out = {}
        self._looked = lookups
        if lookups:
            self._index_unindexed()
            for i, rid in enumerate(self.rids):
                cap = min(self.max_tokens, caps[i])
                if cap <= 0:
                    continue
                found = [p for p in self.cache.propose_all(rid, cap, min_prob=self.min_prob) if p.tokens]
                if found:
                    out[i] = found
        self._offered = {i: found[0] for i, found in out.items()}
        self._timed(t0)
        return out

    def proposals(self, caps: list[int], lookups: bool = True) -> dict:
        """Row -> its best `SuffixProposal` (tokens, probs, score), for rows with one (`lookups` False: none)."""
        return {i: found[0] for i, found in self.proposal_sets(caps, lookups).items()}

    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        """The best proposal per row, as a chain; where the target verifies trees, a row whose runner-up differs
        gets it as a second branch (`branch_trees`)."""
        sets = self.proposal_sets(caps, pricing.lookups)
        chosen = {i: found[0] for i, found in sets.items()}
        b = len(seqs)
        k = 0
        if chosen:
            k = pricing.point_k([list(p.probs) for p in chosen.values()], max(len(p.tokens) for p in chosen.values()))
            k = max(0, min(k, max(caps)))
        if k == 0:
            return Draft.empty(b, uniforms, self.device, self.step_seconds)
        trees = {}
        if pricing.trees and any(len(found) > 1 for found in sets.values()):
            trees = self.branch_trees(sets, k, pricing)
        if trees:
            d = suffix_tree_draft(chosen, trees, b, k, uniforms, self.device)
        else:
            d = point_drafts(chosen, b, k, uniforms(2 * k + 1), self.device)
        d.lookup_seconds = self.step_seconds
        return d

    def branch_trees(self, sets: dict[int, list], k: int, pricing: Pricing) -> dict[int, RowTree]:
        """Rows whose runner-up proposal adds nodes beside the best one's first k tokens -> their tree (the best
        as the first branch, the runner-up merged in as a trie, cut to the width `point_k` prices for the
        runner-ups). For a step whose target verifies trees (the caller asked `Pricing.siblings`)."""
        seconds = {i: found[1] for i, found in sets.items() if len(found) > 1}
        if not seconds:
            return {}
        k2 = pricing.point_k([list(p.probs) for p in seconds.values()], max(len(p.tokens) for p in seconds.values()))
        out = {}
        for i, p in seconds.items():
            tree = RowTree.chain(sets[i][0].tokens[:k], source_of(sets[i][0]))
            if k2 > 0 and tree.merge(p.tokens[:k2], source_of(p)):
                out[i] = tree
        return out

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        """The step's emitted tokens: indexed now where the step looked its rows up (they grade its proposals,
        `SuffixCache.append`), else collected for the next lookup step: under load most steps look nothing up
        (`KPolicy.lookups_due`), and an append a row a step was most of their host work."""
        t0 = time.perf_counter()
        self._grade_drafted(draft, emitted)
        if self._looked:
            for rid, e in zip(self.rids, emitted, strict=True):
                self._index(rid, e)
        else:
            for pending, e in zip(self._unindexed, emitted, strict=True):
                pending.extend(e)
        self._looked = False
        self._timed(t0)
        draft.lookup_seconds = self.step_seconds  # lookups and appends: the tree's host work this step

    def _grade_drafted(self, draft: Draft, emitted: list[list[int]]) -> None:
        """The rows that drafted their best proposal grade it (`Calibrator.observe_drafted`)."""
        cal, offered, self._offered = self.cache.calibrator, self._offered, {}
        if cal is None or not offered or not draft.width:
            return
        for i, p in offered.items():
            if draft.lens[i] > 0 and draft.sources[i] == source_of(p):
                cal.observe_drafted(p, emitted[i], draft.lens[i])

    def _index_unindexed(self) -> None:
        for rid, pending in zip(self.rids, self._unindexed, strict=True):
            if pending:
                self._index(rid, pending)
                pending.clear()

    def _index(self, rid: str, tokens: list[int]) -> None:
        """Tokens a running row emitted into its own index."""
        self.cache.append(rid, tokens)

    def add_history(self, seq_id: str, tokens: list[int]) -> None:
        self.cache.add_finished(seq_id, tokens)

    def with_drafter(self, drafter, make: MakeProposer) -> Proposer:
        """None: this proposer; a learned drafter: a hybrid around this same index, the drafter behind it."""
        from dvi.drafters.learned import as_drafter

        d = as_drafter(drafter)
        return self if d is None else make(d, self.vocab_size, self.device, suffix=self)

    def stats(self) -> dict:
        s = dict(self.cache.stats())
        s["seconds"] = self.seconds
        return s


def point_drafts(chosen: dict, b: int, k: int, u: torch.Tensor | None, device: torch.device) -> Draft:
    """Rows of `chosen` (row -> proposal) draft their proposal (up to k tokens), the others nothing: ids [b, k]
    (padding 0)."""
    rows = [[0] * k for _ in range(b)]
    lens, sources = [0] * b, [None] * b
    for i, p in chosen.items():
        toks = [int(t) for t in p.tokens[:k]]
        rows[i][: len(toks)] = toks
        lens[i], sources[i] = len(toks), source_of(p)
    return Draft(torch.tensor(rows, dtype=torch.long, device=device).view(b, k), None, lens, sources, u,
                 suffix_rows=bool(chosen))


def suffix_tree_draft(chosen: dict, trees: dict[int, RowTree], b: int, k: int, uniforms: Uniforms,
                      device: torch.device) -> Draft:
    """Rows of `trees` draft their tree, the other rows of `chosen` their proposal's first k tokens as a chain, the
    rest nothing: point masses all (no spine: no learned drafter ran). A row's source is its best proposal's,
    also where the target's path took the runner-up's branch."""
    base = point_drafts(chosen, b, k, None, device)
    rows = [trees[i] if i in trees else RowTree.of(base, i) for i in range(b)]
    return assemble(rows, base, [0] * b, uniforms(max(len(r.ids) for r in rows) + 1))
