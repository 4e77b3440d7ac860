"""History drafts for RL rollouts: a prompt's earlier rollouts and its GRPO siblings, drafted where they pay.

`HistoryProposer` is the `suffix` proposer (`dvi.drafters.suffix_proposer`) with live siblings for rollouts:

* **live siblings**: a row's text joins the cache's global index as it is generated (its prompt's last
  `prompt_tail` tokens, then its output so far, under its own request id, which the row's own lookups exclude), so
  the other samples of the same prompt in the same batch (the GRPO group) draft from it while they all run, not
  only once it has finished. Finished rows replace their live entry with the final one (`release`, as before), so a
  prompt's earlier rollouts (previous RL steps or epochs; older policy versions decay) stay in the index too.

Its drafts are priced as the suffix proposer's: per row and position where the target verifies only real drafts
(`dvi.decode.pricing.StepPricing.point_lens`), so where no draft pays (a full batch, poor matches) the step is plain.

Sampling stays lossless: a draft is a point mass built from tokens other rows emitted before this step, so it is
independent of this row's acceptance coins, and the engine's rejection rule (`sampling.point_mass_accept`) keeps
every emitted token distributed as the target's; the rows stay independent samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dvi.drafters.suffix_index import token_list
from dvi.drafters.suffix_proposer import SuffixProposer

if TYPE_CHECKING:
    from dvi.decode.seq import Seq
    from dvi.drafters.suffix import SuffixCache

__all__ = ["HistoryProposer", "history_proposer"]


class HistoryProposer(SuffixProposer):
    """Suffix drafts from a prompt's earlier rollouts and its live siblings, priced per row (module docstring)."""

    live = True  # siblings' text joins the index as it is generated (`history_proposer(live=)`)

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


def history_proposer(vocab_size: int, device: torch.device | str = "cpu", cache: SuffixCache | None = None,
                     settings=None, live: bool = True) -> HistoryProposer:
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
    prop.live = bool(live)
    return prop
