"""`separate` and `early_exit`: a learned drafter with its own KV cache (`dvi.drafters.draft_cache`).

Per row, `pending` holds the tokens the drafter's cache lacks: 1 after a step, 2 after a fully accepted one
(d_K was never fed), more after steps it did not draft, the whole prompt until its first draft (the cache is
filled lazily).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from dvi.decode.rows_kernel import option_rows
from dvi.decode.sampling import greedy_tokens, sample_from, warp_probs
from dvi.decode.sources import SOURCE_MODEL
from dvi.drafters.adapters import AdapterBank, LoraFactors
from dvi.drafters.draft_cache import DraftCache, LeanDraftCache, draft_cache
from dvi.drafters.proposer import Draft, MakeProposer, Pricing, Proposer, Uniforms
from dvi.drafters.vocab import fit_vocab

if TYPE_CHECKING:
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.learned import Drafter

__all__ = ["ModelProposer"]


class ModelProposer(Proposer):
    """K drafter forwards a step, the first over each row's pending tokens, the others over the previous draft."""

    def __init__(self, drafter: Drafter, vocab_size: int, device: torch.device):
        super().__init__(vocab_size, device)
        self.drafter = drafter
        self.name = drafter.kind  # a learned proposer is named by its drafter's kind
        self.bank: AdapterBank | None = None  # per-group adapters (`set_adapter`), kept across hot swaps
        self.rows_kernel: bool | str = False  # `use_rows_kernel`, kept across hot swaps
        self.dkv: DraftCache = self._new_cache()
        self.pending: list[list[int]] = []
        self._k = 0  # drafts the drafter ran this step (it was fed k - 1 of them)
        self.alternatives: torch.Tensor | None = None  # [B, k, m] the last draft's next candidates per depth
        self.last_catchup = False

    def _new_cache(self) -> DraftCache:
        return draft_cache(self.drafter, self.bank, self.rows_kernel)

    def use_rows_kernel(self, rows_kernel: bool | str) -> None:
        if rows_kernel != self.rows_kernel:
            self.rows_kernel = rows_kernel
            if isinstance(self.dkv, LeanDraftCache):  # the rows' caches stay: only how the weights are multiplied
                self.dkv.lean.use_rows_kernel(option_rows(rows_kernel))

    def set_adapter(self, group: str, factors: LoraFactors | None) -> None:
        """Draft `group`'s rows through `factors` (None: the base drafter), from the next forward on."""
        if not isinstance(self.dkv, LeanDraftCache):
            raise ValueError("per-group drafter adapters need a separate Llama-family drafter served through the lean "
                             f"forward; this {self.name} drafter is not (trainer.adapter_key: none serves it)")
        if self.bank is None:
            lean = self.dkv.lean
            self.bank = self.dkv.bank = AdapterBank(len(lean.layers), lean.dtype, lean.device)
        self.bank.set(group, factors)
        self.dkv.adapters_changed()

    def adapter_groups(self) -> list[str]:
        return sorted(self.bank.groups) if self.bank is not None else []

    # ---------------------------------------------------------------- membership
    def join(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        self.dkv.add_rows(len(seqs), [s.req.group for s in seqs])
        self.pending.extend([int(t) for t in s.req.prompt_ids] for s in seqs)

    def release(self, finished: list[tuple[int, Seq, bool]], keep: list[int]) -> None:
        self.dkv.select_rows(keep)
        self.pending = [self.pending[i] for i in keep]

    def rebuild(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None = None,
                target_version: int | None = None, drafter_changed: bool = False) -> None:
        if drafter_changed or (target_version is not None and self.drafter.shares_weights_with_target()):
            self.dkv.rebuild([s.tokens()[:-1] for s in seqs])
            self.pending = [[s.tokens()[-1]] for s in seqs]

    def pending_tokens(self) -> int:
        """Tokens the drafter cache still lacks, over all rows (prices a catch-up)."""
        return sum(len(p) for p in self.pending)

    def with_drafter(self, drafter, make: MakeProposer) -> Proposer:
        """Same kind: this proposer, on the new drafter (`use`); another kind or None: that kind's proposer."""
        from dvi.drafters.learned import as_drafter

        d = as_drafter(drafter)
        if d is not None and d.kind == self.drafter.kind:
            self.use(d)
            return self
        return super().with_drafter(d, make)

    def use(self, drafter: Drafter) -> None:
        """A new drafter of this kind (hot swap): the rows' cache is rebuilt (`rebuild`, which the engine's swap
        runs at once); until then it holds one empty row per batch row, so rows can still leave (`release`)."""
        groups = getattr(self.dkv, "groups", None)
        self.drafter = drafter
        self.dkv = self._new_cache()
        if self.pending:
            self.dkv.add_rows(len(self.pending), groups)

    # ---------------------------------------------------------------- one step
    def propose(self, seqs: list[Seq], caps: list[int], pricing: Pricing, uniforms: Uniforms,
                params: BatchParams) -> Draft:
        b = len(seqs)
        rows = list(range(b))
        k = max(0, min(pricing.model_k(rows, self.pending_tokens), max(caps)))
        lens = pricing.model_lens(k, rows) if k else []
        if not any(lens):
            return Draft.empty(b, uniforms, self.device)
        sibs = pricing.siblings(k, rows)
        u = uniforms(2 * k + sum(sibs) + 1)
        ids, q = self.draft_model(k, u, params, max(sibs, default=0))  # every row: the drafter's cache stays current
        d = Draft(ids, q, lens, [SOURCE_MODEL if n else None for n in lens], u, model_forwards=k,
                  catchup=self.last_catchup)
        return with_siblings(d, self.alternatives, sibs) if any(sibs) else d

    def _forward(self, ids: torch.Tensor | None, first: bool) -> torch.Tensor:
        """One drafter forward: the first over every row's pending tokens, later ones over ids [B, 1] (the
        previous drafts) -> logits [B, V_draft] after each row's last input."""
        return self.dkv.forward_rows(self.pending) if first else self.dkv.forward(ids)

    def draft_model(self, k: int, u: torch.Tensor | None, params: BatchParams, alternatives: int = 0,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafter forwards. u [B, >= k] draft uniforms (None: greedy). Returns ids [B, k] and, when sampling,
        q [B, k, V]; with `alternatives` m, `self.alternatives` [B, k, m] holds each depth's next m candidates
        (the drafter's most likely tokens other than its draft there: a tree's siblings, no forward of their own)."""
        self.last_catchup = max(len(p) for p in self.pending) > 2
        self._k = k
        drafts, qs, alts = [], [], []
        ids = None
        for j in range(k):
            logits = fit_vocab(self._forward(ids, j == 0), self.vocab_size)  # [B, V]
            logits = params.transform(logits, drafts)  # penalized as the target's p (better α)
            if params.all_greedy:
                d, scores = greedy_tokens(logits), logits  # [B]
            else:
                scores = q = warp_probs(logits, params.temp, params.top_k, params.top_p)  # [B, V]
                d = sample_from(q, u[:, j])
                qs.append(q)
            if alternatives:
                alts.append(_others(scores, d, alternatives))
            drafts.append(d)
            ids = d.unsqueeze(1)  # [B, 1]
        self.alternatives = torch.stack(alts, 1) if alts else None
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def observe(self, draft: Draft, n: list[int], emitted: list[list[int]], feats: torch.Tensor | None) -> None:
        k, self._k = self._k, 0
        if k == 0:  # the drafter did not run: the emitted tokens join what its cache lacks
            for p, e in zip(self.pending, emitted, strict=True):
                p.extend(e)
        else:
            # It ran: its cache holds every pending token and d_1..d_{k-1}. A row keeps the drafts the target
            # accepted when they were the drafter's own (`_keeps`); whatever it emitted past them is pending.
            keep = self._keeps(draft, n, k)
            if k > 1:
                self.dkv.keep(k - 1, keep)
            self.pending = [list(e[c:]) for e, c in zip(emitted, keep, strict=True)]
        self.dkv.tidy()

    def _keeps(self, draft: Draft, n: list[int], k: int) -> list[int]:
        """Per row, how many of the k - 1 drafts fed to the drafter its cache keeps."""
        return [min(ni, k - 1) if draft.sources[i] == SOURCE_MODEL else 0 for i, ni in enumerate(draft.kept(n))]


def _others(scores: torch.Tensor, drafted: torch.Tensor, m: int) -> torch.Tensor:
    """Per row the m highest-scoring tokens other than the one drafted ([B, V], [B] -> [B, min(m, V - 1)])."""
    m = min(m, scores.shape[-1] - 1)
    top = scores.topk(m + 1, dim=-1).indices  # [B, m + 1]
    order = torch.argsort((top == drafted.unsqueeze(1)).to(torch.int8), dim=1, stable=True)
    return top.gather(1, order[:, :m])


def with_siblings(draft: Draft, alts: torch.Tensor, sibs: list[int]) -> Draft:
    """The chain `draft` (k drafts a row) as a tree: sibs[d - 1] of depth d's alternatives `alts` [B, k, m] beside
    its draft there, as leaves (point masses), after the chain in column order (so the chain is tried first)."""
    b, k = draft.ids.shape
    parents, ranks, cols = list(range(k)), [0] * k, []
    for d, m in enumerate(sibs):
        for r in range(min(m, alts.shape[2])):  # a vocabulary smaller than the width has no more candidates
            parents.append(d)
            ranks.append(r + 1)
            cols.append(d * alts.shape[2] + r)
    extra = alts.reshape(b, -1)[:, cols]  # [B, sum(sibs)]
    qmap = torch.full((b, len(parents)), -1, dtype=torch.long, device=draft.ids.device)
    if draft.q is not None:
        qmap[:, :k] = torch.arange(k, device=draft.ids.device)
    n = len(parents)
    return dataclasses.replace(draft, ids=torch.cat([draft.ids, extra], 1), lens=[n] * b, parents=[parents] * b,
                               spine=[k] * b, qmap=qmap, ranks=[ranks] * b)
