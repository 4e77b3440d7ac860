"""Proposers: one object per drafter kind that owns its rows' draft state and proposes K tokens a step.

In the spirit of HF's `CandidateGenerator` and vLLM's `v1/spec_decode` proposers, the engine
(`dvi.decode.engine`) keeps its phases (choose K, draft, verify, accept, roll back, emit) and talks to one
`Proposer` through a small interface, so it has no branch per kind:

- `admit(seqs, feats)` rows join the batch (after the target's prefill; `feats` when `needs_features`);
- `plan(seqs, k_cap)` who drafts what this step (the learned drafter's rows, the suffix proposals);
- `propose(plan, k_model, k, u, params)` -> `Draft` (ids [B, K], q [B, K, V] or None, per-row lengths);
- `observe(draft, n, emitted, feats)` what the target kept: roll back / feed the accepted tokens;
- `close_row(i, seq, keep)` a row leaves (finished or aborted), `select_rows(keep)` the batch shrinks;
- `rebuild(seqs)` after a drafter swap or a target update of a drafter sharing its weights,
  `set_features(feats)` after the target's cache (and so its features) was recomputed.

Kinds: `NoProposer` (speculation off), `ModelProposer` (`separate` / `early_exit`: a drafter KV cache and
the pending tokens it lacks), `EagleProposer` (+ the target's features per row), and in
`dvi.drafters.suffix_proposer` `SuffixProposer` (`suffix`) and `HybridProposer` (`hybrid`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dvi.decode.emit import SOURCES
from dvi.decode.sampling import sample_from, warp_probs
from dvi.drafters.draft_cache import DraftCache, RaggedDraftCache, draft_cache
from dvi.drafters.learned import Drafter, as_drafter
from dvi.drafters.vocab import fit_vocab

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq

__all__ = ["SOURCES", "Draft", "Plan", "Proposer", "NoProposer", "ModelProposer", "EagleProposer", "model_proposer"]

@dataclass
class Plan:
    """Who drafts this step: rows of the learned drafter, and rows with a suffix proposal (row -> proposal)."""

    model_rows: list[int] = field(default_factory=list)
    suffix: dict[int, Any] = field(default_factory=dict)  # row -> dvi.drafters.suffix.SuffixProposal (tokens, probs, ...)


@dataclass
class Draft:
    """One step's drafts. Row i's real drafts are ids[i, :lens[i]]; later columns are padding the target
    verifies (batch-wide K) but the acceptance rule never keeps."""

    ids: torch.Tensor  # [B, K] long
    q: torch.Tensor | None  # [B, K, V] drafter probabilities (sampled model drafts); None: greedy or point masses
    lens: list[int]  # [B] real drafts per row, each <= K
    sources: list[str | None]  # [B] SOURCES entry of row i's drafts (None: it drafted nothing)
    point: list[bool]  # [B] row i's drafts are point masses (suffix): q[i] is not a distribution

    @property
    def ragged(self) -> bool:
        k = self.ids.shape[1]
        return any(n != k for n in self.lens)

    @property
    def any_point(self) -> bool:
        return any(self.point)


class Proposer:
    """The interface (and the no-op defaults) of a drafter kind's per-row state; see the module doc."""

    kind = "none"
    needs_features = False  # the verify pass must return the target's features (eagle)
    drafter: Drafter | None = None  # the learned drafter, if any (what swaps and the trainer replace)
    max_tokens = 0  # longest draft it proposes beyond the learned drafter's K (suffix proposals)
    last_catchup = False  # the last model draft fed more than the usual 1-2 pending tokens a row
    step_seconds: float | None = None  # host seconds of index work in the current step (suffix kinds)

    def admit(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        """Rows `seqs` join at the end of the batch; `feats[i]` [len(prompt) - 1, H] when `needs_features`."""

    def select_rows(self, keep: list[int], idx: torch.Tensor) -> None:
        """Only rows `keep` (idx: the same as a long tensor [B']) stay, in that order."""

    def plan(self, seqs: list[Seq], k_cap: list[int], suffix: bool = True) -> Plan:
        """Which rows draft from where this step; `k_cap[i]` the most drafts row i can use; `suffix`: False when
        suffix drafts measured slower than plain steps at this batch size (no lookups this step)."""
        return Plan()

    def propose(self, plan: Plan, k_model: int, k: int, u: torch.Tensor | None, params: BatchParams) -> Draft:
        """Drafts [B, k]: model rows k_model of them (<= k), suffix rows their proposal; u [B, 2k + 1] or None.
        Without a drafter (`NoProposer`) the engine's `_choose_k` returns 0 and never asks."""
        raise ValueError(f"drafter kind {self.kind!r} has no drafter: K must be 0, the engine asked for {k}")

    def observe(self, draft: Draft | None, n: list[int], emitted: list[list[int]],
                feats: torch.Tensor | None) -> None:
        """The step's outcome: n [B] drafts accepted, emitted [B][n_i + 1] tokens (a finishing row's may be cut
        short), feats [B, K + 1, H] the verify pass's target features (when `needs_features`)."""

    def close_row(self, i: int, seq: Seq, keep: bool) -> None:
        """Row i leaves the batch (`keep`: it finished and its output may be learned from; else aborted)."""

    def forget_waiting(self, seq: Seq) -> None:
        """A request aborted before it joined the batch."""

    def rebuild(self, seqs: list[Seq]) -> None:
        """Rebuild every row's draft state (drafter swapped, or the weights it shares with the target changed)."""

    def set_features(self, feats: list[torch.Tensor | None]) -> None:
        """The target's recomputed features of every row, [len(tokens) - 1, H] each."""

    def pending_tokens(self) -> int:
        """Tokens the drafter cache still lacks, over all rows (prices a catch-up)."""
        return 0

    def maybe_compact(self) -> None:
        """Compact the drafter cache when holes dominate it."""

    def with_drafter(self, drafter: Drafter | None) -> Proposer:
        """The proposer after a hot swap to `drafter` (this one reused where the kind is unchanged)."""
        return model_proposer(drafter, self.vocab_size, self.device)

    def stats(self) -> dict:
        """Counters for /metrics (suffix: index size, hits, seconds spent on lookups)."""
        return {}

    def target_updated(self, version: int) -> None:
        """The target's weights changed to `version` (suffix: older outputs decay)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device


class NoProposer(Proposer):
    """No drafter: every step is a plain decoding step."""


class ModelProposer(Proposer):
    """A learned drafter with its own KV cache (`separate`, `early_exit`). Per row, `pending` holds the tokens its
    cache lacks: 1 after a step, 2 after a fully accepted one (d_K was never fed), more after steps it did not
    draft, the whole prompt until its first draft (the cache is filled lazily)."""

    kind = "model"

    def __init__(self, drafter: Drafter, vocab_size: int, device: torch.device):
        super().__init__(vocab_size, device)
        self.drafter = drafter
        self.dkv: DraftCache = self._new_cache()
        self.pending: list[list[int]] = []
        self._k = 0  # drafts the drafter ran this step (it was fed k - 1 of them)

    def _new_cache(self) -> DraftCache:
        return draft_cache(self.drafter)

    # ---------------------------------------------------------------- membership
    def admit(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        self.dkv.add_rows(len(seqs))
        self.pending.extend([int(t) for t in s.req.prompt_ids] for s in seqs)

    def select_rows(self, keep: list[int], idx: torch.Tensor) -> None:
        self.dkv.select_rows(keep)
        self.pending = [self.pending[i] for i in keep]

    def rebuild(self, seqs: list[Seq]) -> None:
        self.dkv.rebuild([s.tokens()[:-1] for s in seqs])
        self.pending = [[s.tokens()[-1]] for s in seqs]

    def pending_tokens(self) -> int:
        return sum(len(p) for p in self.pending)

    def maybe_compact(self) -> None:
        self.dkv.tidy()

    def with_drafter(self, drafter: Drafter | None) -> Proposer:
        d = as_drafter(drafter)
        if d is not None and bool(getattr(d, "needs_features", False)) == self.needs_features:
            self.drafter = d  # same kind: the engine rebuilds the rows' cache (`rebuild`) at the next step
            self.dkv = self._new_cache()
            return self
        return model_proposer(d, self.vocab_size, self.device)

    # ---------------------------------------------------------------- one step
    def plan(self, seqs: list[Seq], k_cap: list[int], suffix: bool = True) -> Plan:
        return Plan(model_rows=list(range(len(seqs))))

    def _forward(self, ids: torch.Tensor | None, first: bool) -> torch.Tensor:
        """One drafter forward: the first over every row's pending tokens, later ones over ids [B, 1] (the
        previous drafts) -> logits [B, V_draft] after each row's last input."""
        return self.dkv.forward_rows(self.pending) if first else self.dkv.forward(ids)

    def draft_model(self, k: int, u: torch.Tensor | None, params: BatchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafter forwards, the first over every row's pending tokens, the others over the previous draft.
        u [B, >= k] draft uniforms (None: greedy). Returns ids [B, k] and, when sampling, q [B, k, V]."""
        self.last_catchup = max(len(p) for p in self.pending) > 2
        self._k = k
        drafts, qs = [], []
        ids = None
        for j in range(k):
            logits = fit_vocab(self._forward(ids, j == 0), self.vocab_size)  # [B, V]
            logits = params.transform(logits, drafts)  # penalized as the target's p (better α)
            if params.all_greedy:
                d = logits.argmax(-1)  # [B]
            else:
                q = warp_probs(logits, params.temp, params.top_k, params.top_p)  # [B, V]
                d = sample_from(q, u[:, j])
                qs.append(q)
            drafts.append(d)
            ids = d.unsqueeze(1)  # [B, 1]
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def propose(self, plan: Plan, k_model: int, k: int, u: torch.Tensor | None, params: BatchParams) -> Draft:
        ids, q = self.draft_model(k, u, params)
        b = ids.shape[0]
        return Draft(ids, q, [k] * b, ["model"] * b, [False] * b)

    def observe(self, draft: Draft | None, n: list[int], emitted: list[list[int]],
                feats: torch.Tensor | None) -> None:
        k, self._k = self._k, 0
        if k == 0:  # the drafter did not run: the emitted tokens join what its cache lacks
            for p, e in zip(self.pending, emitted, strict=True):
                p.extend(e)
            return
        # It ran: its cache holds every pending token and d_1..d_{k-1}. A row keeps the drafts the target
        # accepted when they were the drafter's own (`_keeps`); whatever it emitted past them is pending.
        keep = self._keeps(draft, n, k)
        if k > 1:
            self.dkv.keep(k - 1, keep)
        self.pending = [list(e[c:]) for e, c in zip(emitted, keep, strict=True)]

    def _keeps(self, draft: Draft | None, n: list[int], k: int) -> list[int]:
        """Per row, how many of the k - 1 drafts fed to the drafter its cache keeps."""
        return [min(ni, k - 1) if draft is not None and draft.sources[i] == "model" else 0 for i, ni in enumerate(n)]


class EagleProposer(ModelProposer):
    """An eagle head (`dvi.drafters.eagle`): reads, per input token, the target's feature of the position before. Rows keep
    their features (the verify pass returns them) and log them in the finished record (`hidden`). Drafted
    entries always leave the head's cache after verification; accepted tokens are re-fed with true features."""

    kind = "eagle"
    needs_features = True

    def __init__(self, drafter: Drafter, vocab_size: int, device: torch.device):
        super().__init__(drafter, vocab_size, device)
        self.feats: list[list[torch.Tensor]] = []  # per row, chunks [n, H] of its features f_0..f_{L-2}

    def admit(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        super().admit(seqs, feats)
        self.feats.extend([f] if f is not None and f.shape[0] else [] for f in (feats or [None] * len(seqs)))

    def select_rows(self, keep: list[int], idx: torch.Tensor) -> None:
        super().select_rows(keep, idx)
        self.feats = [self.feats[i] for i in keep]

    def set_features(self, feats: list[torch.Tensor | None]) -> None:
        self.feats = [[f] if f is not None and f.shape[0] else [] for f in feats]

    def _new_cache(self) -> DraftCache:
        return RaggedDraftCache(self.drafter)

    def rebuild(self, seqs: list[Seq]) -> None:
        """Filled lazily, as at admission: every token pending, fed with its true feature."""
        self.dkv = self._new_cache()
        self.dkv.add_rows(len(seqs))
        self.pending = [s.tokens() for s in seqs]
        if len(self.feats) != len(seqs):
            self.feats = [[] for _ in seqs]

    def close_row(self, i: int, seq: Seq, keep: bool) -> None:
        """The row's features f_0..f_{L-2}, fp16 on the host, for its feedback record."""
        if self.feats[i]:
            seq.res.hidden = torch.cat(self.feats[i]).to("cpu", torch.float16)

    def _row_features(self, i: int, hidden: int) -> torch.Tensor:
        """Features F [m, H] of row i's m pending tokens (its last m): F_j = f_{j-1}, F_0 = 0."""
        m, rows, have, chunks = len(self.pending[i]), [], 0, self.feats[i]
        for chunk in reversed(chunks):
            rows.append(chunk[max(0, chunk.shape[0] - (m - have)):])
            have += rows[-1].shape[0]
            if have >= m:
                break
        if have < m:  # the pending tokens include x_0, which no feature precedes
            ref = chunks[0] if chunks else None
            rows.append(torch.zeros(m - have, hidden) if ref is None else ref.new_zeros(m - have, hidden))
        return torch.cat(rows[::-1]) if len(rows) > 1 else rows[0]

    def draft_model(self, k: int, u: torch.Tensor | None, params: BatchParams) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = max(len(p) for p in self.pending)
        h = int(self.drafter.config.hidden_size)
        self._feats = torch.zeros(len(self.pending), m, h, dtype=self.drafter.dtype, device=self.device)  # [B, M, H]
        for i in range(len(self.pending)):
            r = self._row_features(i, h)
            self._feats[i, m - r.shape[0]:] = r
        return super().draft_model(k, u, params)

    def _forward(self, ids: torch.Tensor | None, first: bool) -> torch.Tensor:
        """Later drafts read the head's own predicted feature of the previous position."""
        fn = self.drafter.with_features(self._feats)
        logits, self._feats = self.dkv.forward_rows(self.pending, fn) if first else self.dkv.forward(ids, fn)
        return logits  # [B, V_draft]; _feats [B, 1, H]

    def _keeps(self, draft: Draft | None, n: list[int], k: int) -> list[int]:
        return [0] * len(n)

    def observe(self, draft: Draft | None, n: list[int], emitted: list[list[int]],
                feats: torch.Tensor | None) -> None:
        super().observe(draft, n, emitted, feats)
        for i, e in enumerate(emitted):
            self.feats[i].append(feats[i, : len(e)].clone())  # [n_i + 1, H]


def model_proposer(drafter: Any, vocab_size: int, device: torch.device) -> Proposer:
    """The proposer of a learned drafter (None: `NoProposer`; an eagle head: `EagleProposer`)."""
    d = as_drafter(drafter)
    if d is None:
        return NoProposer(vocab_size, device)
    if getattr(d, "needs_features", False):
        return EagleProposer(d, vocab_size, device)
    return ModelProposer(d, vocab_size, device)
