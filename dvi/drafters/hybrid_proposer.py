"""`hybrid`: per row and step, the suffix proposal when its score (expected accepted tokens) clears the bar, else
the learned drafter of `models.hybrid_kind` (a `dvi.drafters.model_proposer` / `eagle_proposer` it wraps).

The bar is `threshold` until the learned drafter has drafted, then the lower of it and what the drafter
measurably delivers: accepted drafts per row-step it drafted, averaged over about the last `1 / gain_rate` of
them. A suffix proposal costs no model pass, so one that promises as much as the drafter delivers wins; with a
fixed bar of 1, a drafter accepting 0.3 tokens a step took the rows of proposals scoring 0.3-1 and paid its
forwards for it. Rows of both kinds share a step: K is the longest row's drafts, shorter rows are padded and
their bonus token drawn at their own length; with sampling, suffix rows enter the rejection rule as one-hot
rows of q.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dvi.drafters.proposer import Draft, MakeProposer, Pricing, Proposer, Uniforms
from dvi.drafters.suffix_proposer import SuffixProposer, point_drafts

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.model_proposer import ModelProposer

__all__ = ["HybridProposer"]


class HybridProposer(Proposer):
    kind = "hybrid"
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

    def choose(self, caps: list[int], lookups: bool = True) -> tuple[dict, list[int]]:
        """The rows whose suffix proposal clears the bar (row -> proposal) and the rows the learned drafter takes."""
        proposals = self.suffix.proposals(caps, lookups)
        if self.learned.drafter is None:  # no learned part (swapped out): every proposal drafts
            return proposals, []
        bar = self.bar
        chosen = {i: p for i, p in proposals.items() if p.score >= bar}
        return chosen, [i for i in range(len(caps)) if i not in chosen]

    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        """The learned drafter runs (all rows, one batch) only when some row uses it; suffix rows overwrite theirs."""
        b = len(seqs)
        chosen, model_rows = self.choose(caps, pricing.lookups)
        k_model = pricing.model_k(model_rows, self.learned.pending_tokens) if model_rows else 0
        k_suffix = pricing.point_k([list(p.probs) for p in chosen.values()],
                                   max(len(p.tokens) for p in chosen.values())) if chosen else 0
        k = max(0, min(max(k_model, k_suffix), max(caps)))
        k_model = min(k_model, k)
        if k == 0:
            return Draft.empty(b, uniforms, self.device, self.suffix.step_seconds)
        d = point_drafts(chosen, b, k, uniforms(2 * k + 1), self.device)
        d.lookup_seconds = self.suffix.step_seconds
        if not model_rows or k_model <= 0:
            return d
        ids, q = self.learned.draft_model(k_model, d.u, params)  # [B, k_model], [B, k_model, V] or None
        for i in model_rows:
            d.ids[i, :k_model] = ids[i]
            d.lens[i], d.sources[i] = k_model, "model"
        d.model_forwards, d.catchup = k_model, self.learned.last_catchup
        if q is not None:  # sampled: suffix rows' point masses as one-hot rows of q (lossless, one rule)
            full = q.new_zeros(q.shape[0], k, q.shape[2])  # [B, K, V]
            full[:, :k_model] = q
            for i in chosen:
                full[i] = 0
                full[i, torch.arange(d.lens[i]), d.ids[i, : d.lens[i]]] = 1.0
            d.q = full
        return d

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        for i, (src, ln) in enumerate(zip(draft.sources, draft.lens, strict=True)):
            if src == "model" and ln > 0:
                g = float(min(n[i], ln))
                self.model_gain = g if self.model_gain is None else self.model_gain + self.gain_rate * (g - self.model_gain)
        self.learned.observe(draft, n, emitted, feats)
        self.suffix.observe(draft, n, emitted, feats)
