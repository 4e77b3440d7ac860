"""`hybrid`: per row and step, the suffix proposal when its score (expected accepted tokens) clears the bar, else
the learned drafter of `models.hybrid_kind` (a `dvi.drafters.model_proposer` / `eagle_proposer` it wraps).

The bar is `threshold` until the learned drafter has drafted, then the lower of it and what the drafter
measurably delivers: accepted drafts per row-step it drafted, averaged over about the last `1 / gain_rate` of
them. A suffix proposal costs no model pass, so one that promises as much as the drafter delivers wins; with a
fixed bar of 1, a drafter accepting 0.3 tokens a step took the rows of proposals scoring 0.3-1 and paid its
forwards for it. Rows of both kinds share a step: K is the longest row's drafts, shorter rows are padded and
their bonus token drawn at their own length; with sampling, suffix rows enter the rejection rule as one-hot
rows of q.

Where the target verifies draft trees, a row the drafter takes need not give up its suffix proposal: the
learned chain (with its siblings) and the below-bar proposal are verified in one tree, the proposal merged in
as a point-mass trie branch (`dvi.drafters.tree_draft`), and the target's walk keeps whichever it agrees with.
Rows whose proposal clears the bar still draft from the index alone (no drafter forward for them: why the bar
exists), with the runner-up proposal as a second branch as `suffix` drafts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dvi.decode.sources import SOURCE_MODEL
from dvi.drafters.model_proposer import with_siblings
from dvi.drafters.proposer import Draft, MakeProposer, Pricing, Proposer, Uniforms
from dvi.drafters.suffix_proposer import SuffixProposer, point_drafts, source_of
from dvi.drafters.tree_draft import RowTree, assemble

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.model_proposer import ModelProposer

__all__ = ["HybridProposer"]


@dataclass
class _Plan:
    """A hybrid step drafted as one tree (`HybridProposer._plan`)."""

    rows: int  # the batch
    k_model: int  # the learned chain (the spine) of each drafted row; 0: the drafter does not run
    sibs: list[int]  # siblings per depth beside it (`Pricing.siblings`)
    model_rows: list[int]  # the rows the drafter drafts
    branches: dict[int, tuple[list[int], str]]  # drafted row -> its below-bar suffix proposal and its source
    trees: dict[int, RowTree]  # chosen row -> its best and runner-up proposals as a trie


class HybridProposer(Proposer):
    name = "hybrid"
    uses_history = True
    _owned_parts = ("learned", "suffix")
    gain_rate = 0.05

    def __init__(self, learned: ModelProposer, suffix: SuffixProposer, threshold: float = 1.0):
        super().__init__(suffix.vocab_size, suffix.device)
        self.learned, self.suffix, self.threshold = learned, suffix, float(threshold)
        self.model_gain: float | None = None  # accepted drafts per model-drafted row-step (moving average)
        self.needs_features = learned.needs_features
        self.drafter = learned.drafter
        self.max_tokens = suffix.max_tokens

    @property
    def bar(self) -> float:
        """The score a suffix proposal needs this step."""
        return self.threshold if self.model_gain is None else min(self.threshold, self.model_gain)

    def use_rows_kernel(self, rows_kernel: bool | str) -> None:
        self.learned.use_rows_kernel(rows_kernel)

    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        self.learned.join(seqs, feats)
        self.suffix.join(seqs, feats)

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        self.learned.release(finished, keep)
        self.suffix.release(finished, keep)

    def set_adapter(self, group: str, factors) -> None:
        self.learned.set_adapter(group, factors)  # the suffix half is the same for every group

    def adapter_groups(self) -> list[str]:
        return self.learned.adapter_groups()

    def rebuild(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None = None,
                target_version: int | None = None, drafter_changed: bool = False) -> None:
        self.learned.rebuild(seqs, feats, target_version, drafter_changed)
        self.suffix.rebuild(seqs, feats, target_version, drafter_changed)

    def with_drafter(self, drafter, make: MakeProposer) -> Proposer:
        """The same hybrid around the same index, its learned part swapped."""
        self.set_learned(self.learned.with_drafter(drafter, make))
        return self

    def set_learned(self, learned: Proposer) -> None:
        """The learned part after a hot swap."""
        self.learned = learned
        self.drafter, self.needs_features = learned.drafter, learned.needs_features

    def stats(self) -> dict:
        return self.suffix.stats()

    def add_history(self, seq_id: str, tokens: list[int]) -> None:
        self.suffix.add_history(seq_id, tokens)

    def _split(self, caps: list[int], lookups: bool) -> tuple[dict, dict, list[int]]:
        """Each row's suffix proposals (best first), the rows whose best clears the bar (row -> it) and the rows the
        learned drafter takes."""
        sets = self.suffix.proposal_sets(caps, lookups)
        proposals = {i: found[0] for i, found in sets.items()}
        if self.learned.drafter is None:  # no learned part (swapped out): every proposal drafts
            return sets, proposals, []
        bar = self.bar
        chosen = {i: p for i, p in proposals.items() if p.score >= bar}
        return sets, chosen, [i for i in range(len(caps)) if i not in chosen]

    def choose(self, caps: list[int], lookups: bool = True) -> tuple[dict, list[int]]:
        """The rows whose suffix proposal clears the bar (row -> proposal) and the rows the learned drafter takes."""
        _, chosen, model_rows = self._split(caps, lookups)
        return chosen, model_rows

    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        """The learned drafter runs (all rows, one batch) only when some row uses it; suffix rows overwrite theirs.
        Where the target verifies trees, a step that would branch anywhere is one tree (`_plan`)."""
        b = len(seqs)
        sets, chosen, model_rows = self._split(caps, pricing.lookups)
        k_model = pricing.model_k(model_rows, self.learned.pending_tokens) if model_rows else 0
        k_suffix = pricing.point_k([list(p.probs) for p in chosen.values()],
                                   max(len(p.tokens) for p in chosen.values())) if chosen else 0
        k = max(0, min(max(k_model, k_suffix), max(caps)))
        k_model = min(k_model, k)
        if k == 0:
            return Draft.empty(b, uniforms, self.device, self.suffix.step_seconds)
        plan = self._plan(sets, chosen, model_rows, k, k_model, pricing, b)
        if plan is not None:
            return self._tree(plan, chosen, k, uniforms, params)
        d = point_drafts(chosen, b, k, uniforms(2 * k + 1), self.device)
        d.lookup_seconds = self.suffix.step_seconds
        if not model_rows or k_model <= 0:
            return d
        ids, q = self.learned.draft_model(k_model, d.u, params)  # [B, k_model], [B, k_model, V] or None
        for i, n in zip(model_rows, pricing.model_lens(k_model, model_rows), strict=True):
            d.ids[i, :k_model] = ids[i]
            d.lens[i], d.sources[i] = n, (SOURCE_MODEL if n else None)
        d.model_forwards, d.catchup = k_model, self.learned.last_catchup
        if q is not None:  # sampled: suffix rows' point masses as one-hot rows of q (lossless, one rule)
            full = q.new_zeros(q.shape[0], k, q.shape[2])  # [B, K, V]
            full[:, :k_model] = q
            for i in chosen:
                full[i] = 0
                full[i, torch.arange(d.lens[i]), d.ids[i, : d.lens[i]]] = 1.0
            d.q = full
        return d

    def _plan(self, sets: dict, chosen: dict, model_rows: list[int], k: int, k_model: int, pricing: Pricing,
              b: int) -> _Plan | None:
        """The step's tree where the target verifies trees (`siblings` asked once, all rows, k = 1) and some row
        would branch: the learned chain's siblings, each drafted row's below-bar suffix proposal as a branch
        (priced by `point_k`), and chosen rows' runner-up proposals (`SuffixProposer.branch_trees`). None: chains,
        exactly as without trees."""
        if not pricing.trees:
            return None
        runs = bool(model_rows) and k_model > 0
        sibs = pricing.siblings(k_model, model_rows) if runs else []
        below = {i: sets[i][0] for i in model_rows if i in sets} if runs else {}
        branches: dict[int, tuple[list[int], str]] = {}
        if below:
            kb = pricing.point_k([list(p.probs) for p in below.values()], max(len(p.tokens) for p in below.values()))
            branches = {i: (list(p.tokens[:kb]), source_of(p)) for i, p in below.items()} if kb > 0 else {}
        trees = self.suffix.branch_trees({i: sets[i] for i in chosen}, k, pricing)
        if not (any(sibs) or branches or trees):
            return None
        return _Plan(b, k_model if runs else 0, sibs, model_rows if runs else [], branches, trees)

    def _tree(self, plan: _Plan, chosen: dict, k: int, uniforms: Uniforms, params: BatchParams) -> Draft:
        """One tree draft: chosen rows their proposal (with its runner-up branch), drafted rows the learned chain as
        the spine with its siblings (`with_siblings`) and their suffix branch merged in as a trie, point masses
        after every learned node (so a sampled node is tried before any candidate placed by its token)."""
        b, km = plan.rows, plan.k_model
        base = point_drafts(chosen, b, k, None, self.device)
        rows = [plan.trees[i] if i in plan.trees else RowTree.of(base, i) for i in range(b)]
        learned = km + sum(plan.sibs)
        widest = max([len(r.ids) for r in rows] + [learned + len(t) for t, _ in plan.branches.values()] + [learned])
        u = uniforms(km + widest + 1)  # the spine's draft samples, a test per node, a resample
        if plan.model_rows:
            ids, q = self.learned.draft_model(km, u, params, max(plan.sibs, default=0))
            chain = Draft(ids, q, [km] * b, [SOURCE_MODEL] * b, None)
            drafted = with_siblings(chain, self.learned.alternatives, plan.sibs) if any(plan.sibs) else chain
            for i in plan.model_rows:
                rows[i] = RowTree.of(drafted, i)
                rows[i].merge(*plan.branches.get(i, ((), None)))
                base.sources[i] = SOURCE_MODEL
            base.q, base.model_forwards, base.catchup = q, km, self.learned.last_catchup
        drafted_rows = set(plan.model_rows)
        spine = [km if i in drafted_rows else 0 for i in range(b)]
        d = assemble(rows, base, spine, u, km)
        d.suffix_rows, d.lookup_seconds = bool(chosen or plan.branches), self.suffix.step_seconds
        return d

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        # After a tree step `draft` is the accepted path as a chain: a row the drafter ran for stays "model" though
        # its path may run through its suffix branch, so the label (and `model_gain`) means "drafted with the
        # learned drafter", the tokens that step kept whichever branch carried them: what a row gives up by being
        # drafted from the index alone, the bar's comparison. The drafter's cache keeps only its spine's part of
        # the path (`Draft.kept`, read by the learned proposer).
        for i, (src, ln) in enumerate(zip(draft.sources, draft.lens, strict=True)):
            if src == SOURCE_MODEL and ln > 0:
                g = float(min(n[i], ln))
                self.model_gain = g if self.model_gain is None else self.model_gain + self.gain_rate * (g - self.model_gain)
        self.learned.observe(draft, n, emitted, feats)
        self.suffix.observe(draft, n, emitted, feats)
