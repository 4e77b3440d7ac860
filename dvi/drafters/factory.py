"""The one place a proposer is made: `make_proposer`, keyed by the config's `models.drafter_kind` names.

`proposer_for_drafter` is the same factory for a learned drafter object (its own `kind` decides: `separate`,
`early_exit`, `eagle`), and `proposer_for` the same for a target's vocabulary and device: the engine takes only a
proposer. What a hot swap makes of a serving proposer is its own `Proposer.with_drafter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dvi.drafters.proposer import Proposer

if TYPE_CHECKING:
    from dvi.config import SuffixConfig
    from dvi.drafters.learned import Drafter
    from dvi.drafters.suffix import SuffixCache
    from dvi.drafters.suffix_proposer import SuffixProposer

__all__ = ["PROPOSER_NAMES", "make_proposer", "proposer_for", "proposer_for_drafter"]

PROPOSER_NAMES = ("none", "separate", "early_exit", "eagle", "suffix", "hybrid")
"""What `make_proposer` builds, by `Proposer.name`: speculation off, then `models.drafter_kind`'s values."""


def proposer_for_drafter(drafter: Any, vocab_size: int, device: torch.device | str,
                         suffix: SuffixProposer | None = None) -> Proposer:
    """The proposer of a learned drafter by its kind (None: speculation off); with `suffix`, a hybrid around that
    same index (its default threshold) with the drafter behind it."""
    from dvi.drafters.learned import as_drafter

    device = torch.device(device)
    d = as_drafter(drafter)
    if suffix is not None and d is not None:
        from dvi.drafters.hybrid_proposer import HybridProposer

        return HybridProposer(proposer_for_drafter(d, vocab_size, device), suffix)
    if d is None:
        return Proposer(vocab_size, device)
    if getattr(d, "needs_features", False):
        from dvi.drafters.eagle_proposer import EagleProposer

        return EagleProposer(d, vocab_size, device)
    from dvi.drafters.model_proposer import ModelProposer

    return ModelProposer(d, vocab_size, device)


def proposer_for(target: torch.nn.Module, drafter: Any = None) -> Proposer:
    """The proposer of `drafter` (a learned drafter or an HF causal LM; None: speculation off) drafting for
    `target`: its output vocabulary, on its device. A `Proposer` is its own (a caller may hold either)."""
    if isinstance(drafter, Proposer):
        return drafter
    vocab = int(target.get_output_embeddings().weight.shape[0])
    return proposer_for_drafter(drafter, vocab, next(target.parameters()).device)


def make_proposer(name: str, drafter: Drafter | None, vocab_size: int, device: torch.device | str,
                  cache: SuffixCache | None = None, settings: SuffixConfig | None = None) -> Proposer:
    """The proposer named `name` (`PROPOSER_NAMES`): `none` (speculation off), a learned kind (`drafter` as is), `suffix` (the
    history index alone) or `hybrid` (the index, else `drafter`). `cache` defaults to a fresh `SuffixCache`
    bounded by `settings` (the config's `suffix:` section; default: its defaults); pass one to share it."""
    if name not in PROPOSER_NAMES:
        raise ValueError(f"drafter kind must be one of {PROPOSER_NAMES}, got {name!r}")
    device = torch.device(device)
    if name == "none":
        return Proposer(vocab_size, device)
    if name not in ("suffix", "hybrid"):
        if drafter is None:
            raise ValueError(f"drafter kind {name} needs a drafter")
        return proposer_for_drafter(drafter, vocab_size, device)
    from dvi.config import SuffixConfig
    from dvi.drafters.suffix_proposer import SuffixProposer

    sx = settings or SuffixConfig()
    if cache is None:
        from dvi.drafters.suffix import SuffixCache

        cache = SuffixCache(max_tokens=sx.max_tokens, max_seqs=sx.max_seqs, max_depth=sx.max_depth)
    sp = SuffixProposer(cache, vocab_size, device, max_tokens=sx.max_draft_tokens, min_prob=sx.min_prob,
                        version_decay=sx.version_decay)
    if name == "suffix":
        return sp
    if drafter is None:
        raise ValueError("drafter_kind hybrid needs a learned drafter")
    from dvi.drafters.hybrid_proposer import HybridProposer

    return HybridProposer(proposer_for_drafter(drafter, vocab_size, device), sp, sx.threshold)
