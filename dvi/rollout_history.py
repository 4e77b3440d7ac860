"""History drafts for RL rollouts: a prompt's earlier rollouts and its GRPO siblings, drafted where they pay.

`HistoryProposer` is the `suffix` proposer (`dvi.drafters.suffix_proposer`) with two changes for rollouts:

* **live siblings**: a row's text joins the cache's global index as it is generated (its prompt's last
  `prompt_tail` tokens, then its output so far, under its own request id, which the row's own lookups exclude), so
  the other samples of the same prompt in the same batch (the GRPO group) draft from it while they all run, not
  only once it has finished. Finished rows replace their live entry with the final one (`release`, as before), so a
  prompt's earlier rollouts (previous RL steps or epochs; older policy versions decay) stay in the index too.
* **per-row pricing**: where the target verifies only real drafts (`TargetRunner.ragged`: eager CPU forwards), a
  row's draft positions cost the calibrated seconds per verified position, not a batch-wide K for every row; each
  position is drafted when its path probability (the expected accepted token it adds) raises the step's tokens per
  second, as `dvi.decode.k_choice.choose_rows` prices learned drafts. Where no draft pays (a full batch, poor
  matches) the step is plain. Elsewhere (fixed K, trees, CUDA graphs) the suffix proposer's own pricing applies.

Sampling stays lossless: a draft is a point mass built from tokens other rows emitted before this step, so it is
independent of this row's acceptance coins, and the engine's rejection rule (`sampling.point_mass_accept`) keeps
every emitted token distributed as the target's; the rows stay independent samples.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dvi.drafters.suffix_index import token_list
from dvi.drafters.suffix_proposer import SuffixProposer, point_drafts

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.proposer import Draft, Pricing, Uniforms
    from dvi.drafters.suffix import SuffixCache

__all__ = ["HistoryProposer", "history_proposer", "row_draft_lens"]


def row_draft_lens(probs: list[list[float]], batch: int, plain_s: float, position_s: float, k_max: int,
                   margin: float = 1.0) -> list[int]:
    """Per proposal row, how many of its drafts to verify: the set of draft positions (each a prefix of its row,
    path probabilities non-increasing) maximising (batch + expected accepted drafts) / (plain_s + positions x
    position_s), which must beat plain decoding (batch / plain_s) by `margin`; all zero where none does.

    Positions are taken best first (a row's later ones never before its earlier ones: their probabilities do not
    rise), and the best prefix of that order is kept (the ratio rises while a position's probability exceeds the
    current tokens per second x `position_s`)."""
    order = sorted(((min(max(float(p), 0.0), 1.0), j, i) for i, row in enumerate(probs)
                    for j, p in enumerate(row[:k_max])), key=lambda x: (-x[0], x[1]))
    plain = batch / max(plain_s, 1e-12)
    best, best_m = plain * margin, 0
    tokens, seconds = float(batch), plain_s
    for m, (p, _, _) in enumerate(order, 1):
        tokens, seconds = tokens + p, seconds + position_s
        if tokens / seconds > best * 1.0001:
            best, best_m = tokens / seconds, m
    lens = [0] * len(probs)
    for _, j, i in order[:best_m]:
        lens[i] = max(lens[i], j + 1)
    return lens


class HistoryProposer(SuffixProposer):
    """Suffix drafts from a prompt's earlier rollouts and its live siblings, priced per row (module docstring)."""

    live = True  # siblings' text joins the index as it is generated (`history_proposer(live=)`)
    per_row = True  # each row's draft priced per position on a ragged verify (`history_proposer(per_row=)`)
    priced_rows = 0  # steps priced per row (for reports and tests)

    # -- live siblings -------------------------------------------------------------------------------------
    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        super().join(seqs, feats)
        if self.live:
            g = self.cache.global_index
            for s in seqs:
                p = s.req.prompt_ids
                g.remove(s.req.request_id)  # a restarted id starts over
                g.extend(s.req.request_id, token_list(p[len(p) - self.prompt_tail:] if self.prompt_tail > 0 else []))

    def _index(self, rid: str, tokens: list[int]) -> None:
        """A running row's tokens into its own index and, live, its entry in the global one (where its siblings'
        lookups read them; indexed before any lookup reads, as `SuffixProposer.observe` says)."""
        super()._index(rid, tokens)
        if self.live and tokens:
            self.cache.global_index.extend_checked(rid, token_list(tokens))

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        """As `SuffixProposer.release` (a finished row's final entry replaces its live one); an aborted row's, or an
        empty one's, live entry leaves the index."""
        drop = [self.rids[i] for i, seq, learn in finished if not (learn and seq.res.token_ids)]
        super().release(finished, keep)
        if self.live:
            for rid in drop:
                self.cache.global_index.remove(rid)

    # -- per-row pricing -----------------------------------------------------------------------------------
    def _costs(self, pricing: Pricing, k_max: int) -> tuple[float, float, float] | None:
        """(plain step seconds, seconds per verified draft position, margin) for this batch from the engine's
        calibrated costs; None where the step is not priced per row (fixed K, trees, a target that verifies every
        position of a [B, K + 1] batch)."""
        policy = getattr(pricing, "policy", None)
        if not self.per_row or policy is None or not policy.adaptive or pricing.trees:
            return None
        ctl = policy.controller
        if not getattr(ctl, "ragged", False):
            return None
        batch = len(getattr(pricing, "seqs", ()))
        policy._ensure_costs(batch)
        verify = [ctl.verify_at(batch, k) for k in range(min(k_max, 4) + 1)]
        if any(v is None for v in verify):
            return None
        # Seconds per position: the dearest of the priced widths (per position, over the batch's rows), so a ragged
        # verify is never priced cheaper than the calibration and the measured steps say.
        position = max((verify[k] - verify[0]) / (batch * k) for k in range(1, len(verify)))
        return verify[0], max(position, 1e-9), ctl.margin

    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        from dvi.drafters.proposer import Draft

        costs = self._costs(pricing, self.max_tokens) if len(seqs) > 1 else None
        if costs is None:
            return super().propose(seqs, caps, pricing, uniforms, params)
        sets = self.proposal_sets(caps, pricing.lookups)
        chosen = {i: found[0] for i, found in sets.items()}
        b = len(seqs)
        if not chosen:
            return Draft.empty(b, uniforms, self.device, self.step_seconds)
        rows = list(chosen)
        plain_s, position_s, margin = costs
        lens = row_draft_lens([list(chosen[i].probs) for i in rows], b, plain_s, position_s,
                              min(self.max_tokens, max(caps)), margin)
        lens = [min(n, caps[i]) for i, n in zip(rows, lens, strict=True)]
        cut = {i: dataclasses.replace(chosen[i], tokens=list(chosen[i].tokens[:n]), probs=list(chosen[i].probs[:n]))
               for i, n in zip(rows, lens, strict=True) if n > 0}
        if not cut:
            return Draft.empty(b, uniforms, self.device, self.step_seconds)
        k = max(len(p.tokens) for p in cut.values())
        self.priced_rows += 1
        d = point_drafts(cut, b, k, uniforms(2 * k + 1), self.device)
        d.lookup_seconds = self.step_seconds
        return d


def history_proposer(vocab_size: int, device: torch.device | str = "cpu", cache: SuffixCache | None = None,
                     settings=None, live: bool = True, per_row: bool = True) -> HistoryProposer:
    """A `HistoryProposer` over `cache` (default: a fresh `SuffixCache` bounded by `settings`, the config's `suffix:`
    section, default its defaults), its draft length, cut-off and version decay from `settings` as
    `dvi.drafters.factory.make_proposer` builds a `suffix` proposer. Pass it to `SpeculativeEngine(target, it)`, or
    as the index of a hybrid (`HybridProposer(learned, it)`)."""
    from dvi.config import SuffixConfig

    sx = settings or SuffixConfig()
    if cache is None:
        from dvi.drafters.suffix import SuffixCache

        cache = SuffixCache(max_tokens=sx.max_tokens, max_seqs=sx.max_seqs, max_depth=sx.max_depth)
    prop = HistoryProposer(cache, vocab_size, torch.device(device), max_tokens=sx.max_draft_tokens,
                           min_prob=sx.min_prob, version_decay=sx.version_decay)
    prop.live, prop.per_row = bool(live), bool(per_row)
    return prop
