"""The one interface between the engine and a drafter kind: a `Proposer` owns its rows' draft state and, each
step, proposes a `Draft` it has priced itself.

Six verbs, in the spirit of HF's `CandidateGenerator` and vLLM's `v1/spec_decode` proposers:

- `join(seqs, feats)` rows join the batch (after the target's prefill; `feats` when `needs_features`);
- `propose(seqs, caps, pricing, uniforms, params)` -> `Draft`: who drafts what, and how many tokens, priced by the
  engine's `pricing` (`dvi.decode.pricing.StepPricing`: adaptive K for learned drafts, point-mass pricing for
  suffix proposals); a `Draft` of width 0 is a plain step;
- `observe(draft, n, emitted, feats)` what the target kept;
- `release(finished, keep)` rows leave (finished ones may be learned from), the rest stay in order;
- `rebuild(seqs, feats, target_version, drafter_changed)` after new target weights or a new drafter;
- `stats()` counters for /metrics;
- `add_history(seq_id, tokens)` an output finished elsewhere (another replica) for history drafting (suffix kinds);
- `with_drafter(drafter, make)` the proposer after a hot swap: the same object where the kind is unchanged (`rebuild`
  then makes its rows' draft state current), `suffix` + a drafter becomes `hybrid` around the same index.

One class per kind, one file each: `Proposer` itself is speculation off; `dvi.drafters.model_proposer`
(`separate`, `early_exit`), `dvi.drafters.eagle_proposer` (`eagle`), `dvi.drafters.suffix_proposer` (`suffix`),
`dvi.drafters.hybrid_proposer` (`hybrid`); `dvi.drafters.factory.make_proposer` builds them by the config's kind names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.learned import Drafter

__all__ = ["Draft", "Pricing", "Proposer", "Uniforms"]

Uniforms = Callable[[int], "torch.Tensor | None"]
"""n -> the batch's uniforms [B, n] from each row's own generator (None: an all-greedy batch)."""


class Pricing(Protocol):
    """What the engine offers a proposer to price its draft with (`dvi.decode.pricing.StepPricing`)."""

    lookups: bool  # history lookups (suffix) are worth their host work at this batch size
    trees: bool  # the target verifies draft trees and `speculation.tree_width` allows them

    def model_k(self, rows: list[int], pending: Callable[[], int]) -> int:
        """Learned drafts for batch rows `rows` (fixed, or adaptive from costs and the rows' α); `pending` prices
        the drafter's catch-up on tokens it has not seen."""

    def model_lens(self, k: int, rows: list[int]) -> list[int]:
        """Per row of `rows`, its learned drafts of the k `model_k` chose (0 for rows whose drafts do not pay)."""

    def point_k(self, probs: Sequence[Sequence[float]], longest: int) -> int:
        """Verify width for point-mass proposals with these path probabilities (draft j kept with probs[j])."""

    def siblings(self, k: int, rows: list[int]) -> list[int]:
        """Siblings per depth 1..k beside a chain of k learned drafts ([]: a chain; `dvi.decode.tree_pricing`)."""


@dataclass
class Draft:
    """One step's drafts. Row i's real drafts are ids[i, :lens[i]]; later columns are padding the target verifies
    (batch-wide K) but the acceptance rule never keeps. Width 0: a plain step."""

    ids: torch.Tensor  # [B, K] long
    q: torch.Tensor | None  # [B, K, V] drafter probabilities (sampled model drafts); None: greedy or point masses
    lens: list[int]  # [B] real drafts per row, each <= K
    sources: list[str | None]  # [B] `dvi.decode.sources.SOURCES` entry of row i's drafts (None: it drafted nothing)
    u: torch.Tensor | None  # [B, 2K + 1]: K draft samples, K accept tests, 1 resample (None: all greedy); a tree's
    # [B, S + N + 1]: its spine's S draft samples, one test per node, 1 resample
    model_forwards: int = 0  # learned-drafter forwards this step
    catchup: bool = False  # the first of them fed more than the usual 1-2 pending tokens a row
    suffix_rows: bool = False  # some row drafted from the suffix index
    lookup_seconds: float | None = None  # host seconds of history lookups this step (None: a kind without them)
    # A draft tree (`dvi.decode.tree_attention`): per row the parent of node j + 1 (column j; 0 is the row's last
    # token), its first `spine` nodes a chain; None: every row a chain. lens[i] counts row i's real nodes.
    parents: list[list[int]] | None = None
    spine: list[int] | None = None  # [B] the chain a learned drafter ran (its cache holds spine - 1 of them)
    qmap: torch.Tensor | None = None  # [B, N] long: q's column a node was sampled from; -1: a point mass
    ranks: list[list[int]] | None = None  # [B][N] a node's rank among its siblings (0: the first tried)
    node_sources: list[list[str | None]] | None = None  # [B][N] who proposed each node (None: the row's `sources`)
    spine_kept: list[int] | None = None  # after a tree step: per row, the spine nodes its accepted path kept

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])

    @property
    def tree(self) -> bool:
        return self.parents is not None

    def kept(self, n: list[int]) -> list[int]:
        """Per row, how many of its chain's drafts the target kept (after a tree step: the spine's)."""
        return n if self.spine_kept is None else self.spine_kept

    @property
    def ragged(self) -> bool:
        return any(n != self.width for n in self.lens)

    @classmethod
    def empty(cls, b: int, uniforms: Uniforms, device: torch.device, lookup_seconds: float | None = None) -> Draft:
        """A plain step's draft: nothing proposed (its one uniform per row samples the next token)."""
        return cls(torch.zeros(b, 0, dtype=torch.long, device=device), None, [0] * b, [None] * b, uniforms(1),
                   lookup_seconds=lookup_seconds)


class MakeProposer(Protocol):
    """What builds the proposer of a drafter's kind (`dvi.drafters.factory.proposer_for_drafter`); with `suffix`,
    a hybrid around that same index. Passed in, so the kinds never import the factory that imports them."""

    def __call__(self, drafter: Any, vocab_size: int, device: torch.device, suffix: Any = None) -> Proposer: ...


class Proposer:
    """Speculation off (`name` none): every step is a plain step. The other kinds override what they need."""

    name = "none"  # `dvi.drafters.factory.PROPOSER_NAMES`: "none", the learned drafter's kind, suffix, hybrid
    needs_features = False  # the verify pass must return the target's features (eagle)
    drafter: Drafter | None = None  # the learned drafter, if any (what swaps and the trainer replace)
    max_tokens = 0  # longest draft it proposes (the verify widths the engine prepares for)
    uses_history = False  # drafts from finished outputs: `add_history` feeds it (suffix kinds)
    _owned_parts: tuple[str, ...] = ()  # what it owns, claimed with it (`dvi.decode.owner`)

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device

    def use_rows_kernel(self, rows_kernel: bool | str) -> None:
        """The learned drafter's forwards on dvi's rows kernel as the engine's target's (`serve.cpu_rows_kernel`;
        kinds without a lean drafter ignore it)."""

    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        """Rows `seqs` join at the end of the batch; `feats[i]` [len(prompt) - 1, H] when `needs_features`."""

    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        """This step's drafts; `caps[i]` the most drafts row i can use (its token budget)."""
        return Draft.empty(len(seqs), uniforms, self.device)

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        """The step's outcome: n [B] drafts accepted, emitted [B][n_i + 1] tokens (a finishing row's may be cut
        short), feats [B, K + 1, H] the verify pass's target features (when `needs_features`)."""

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        """Rows leave: each (i, seq, learn) of `finished` closes (learn: it finished and its output may be learned
        from; else aborted), then only rows `keep` stay, in that order."""

    def rebuild(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None = None,
                target_version: int | None = None, drafter_changed: bool = False) -> None:
        """After new target weights (`target_version`; `feats` the rows' recomputed features when
        `needs_features`) or a new drafter (`drafter_changed`): every row's draft state made current."""

    def stats(self) -> dict:
        """Counters for /metrics and /health (suffix: index size, hits, lookup seconds)."""
        return {}

    def add_history(self, seq_id: str, tokens: list[int]) -> None:
        """An output finished elsewhere (another replica's feedback) joins what it drafts from; a no-op here."""

    def set_adapter(self, group: str, factors: Any) -> None:
        """Draft `group`'s rows through the LoRA `factors` (`dvi.drafters.adapters.LoraFactors`; None: the base
        drafter again). Kinds without a learned drafter that takes adapters refuse."""
        raise ValueError(f"speculation kind {self.name!r} has no drafter that takes per-group adapters")

    def adapter_groups(self) -> list[str]:
        """The groups whose rows draft through their own adapter."""
        return []

    def with_drafter(self, drafter: Any, make: MakeProposer) -> Proposer:
        """This proposer after a hot swap to `drafter` (a learned drafter, an HF causal LM, or None): the same
        object where its kind keeps serving the new drafter (the engine's swap then rebuilds the rows' draft
        state), else what `make` (`dvi.drafters.factory.proposer_for_drafter`) builds for the drafter's kind."""
        return make(drafter, self.vocab_size, self.device)
