"""The `suffix` and `hybrid` proposers (`dvi.drafters.proposers` interface) over a `dvi.drafters.suffix.SuffixCache`.

`suffix` (SuffixDecoding, arXiv 2411.04975): per row, the continuation that followed the longest match of
its context's suffix, in the row's own prompt + output or in recently finished outputs; no model pass, so a
long draft is almost free. A proposal is a point mass: the engine accepts draft x with probability p(x) and
after a rejection samples from p with x removed (`dvi.decode.sampling.point_mass_accept`), lossless at any
temperature. `hybrid`: per row and step the suffix proposal when its score clears `threshold`, else the
learned drafter (`separate`, `eagle` or `early_exit`, a `dvi.drafters.proposers` proposer it wraps).

Every finished row's output joins the cache's global index at once (`close_row`), with the last `prompt_tail`
tokens of its prompt in front, so a later request with the same prompt (an RL prompt's next samples, its
siblings still running, a repeated agent call) drafts its first tokens from it too. When the target's weights
change (`target_updated`, RL), outputs of older versions decay: weight `version_decay ** age`. The time spent
on lookups and appends is counted (`stats()["seconds"]`, on /metrics).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from dvi.drafters.proposers import Draft, Plan, Proposer

if TYPE_CHECKING:
    from dvi.config import SuffixConfig
    from dvi.decode.seq import BatchParams, Seq
    from dvi.drafters.learned import Drafter
    from dvi.drafters.suffix import SuffixCache

__all__ = ["SuffixProposer", "HybridProposer", "PROMPT_TAIL", "finished_entry", "source_of"]


PROMPT_TAIL = 16  # prompt tokens kept in front of a finished output in the global index


def finished_entry(prompt_ids, output_ids: list[int], prompt_tail: int = PROMPT_TAIL) -> list[int]:
    """What a finished row adds to the global index: its prompt's last `prompt_tail` tokens, then its output (a
    later request with the same prompt drafts its first tokens from it)."""
    tail = [int(t) for t in prompt_ids[len(prompt_ids) - prompt_tail:]] if prompt_tail > 0 else []
    return tail + [int(t) for t in output_ids]


def source_of(proposal) -> str:
    """The `dvi.drafters.proposers.SOURCES` entry of a suffix proposal ("request" -> "suffix_request")."""
    return "suffix_global" if proposal.source == "global" else "suffix_request"


class SuffixProposer(Proposer):
    """Suffix-tree drafts from a `SuffixCache` (per-request index + global index of finished outputs)."""

    kind = "suffix"

    def __init__(self, cache: SuffixCache, vocab_size: int, device: torch.device, max_tokens: int = 16,
                 min_prob: float = 0.1, prompt_tail: int = PROMPT_TAIL, version_decay: float = 0.5):
        super().__init__(vocab_size, device)
        self.cache, self.max_tokens, self.min_prob = cache, int(max_tokens), float(min_prob)
        self.prompt_tail, self.version_decay = int(prompt_tail), float(version_decay)
        self.version = 0  # the target's weights version (outputs of older ones decay)
        self._versions: OrderedDict[str, int] = OrderedDict()  # finished seq id -> its target version (bounded)
        self.rids: list[str] = []
        self.seconds = 0.0  # host time in lookups and appends (the tree's own work)
        self.step_seconds = 0.0  # that time in the current step (the engine observes it per step)

    def _timed(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.seconds += dt
        self.step_seconds += dt

    def admit(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        t0 = time.perf_counter()
        for s in seqs:
            self.cache.start(s.req.request_id, [int(t) for t in s.req.prompt_ids])
            self.rids.append(s.req.request_id)
        self._timed(t0)

    def select_rows(self, keep: list[int], idx: torch.Tensor) -> None:
        self.rids = [self.rids[i] for i in keep]

    def rebuild(self, seqs: list[Seq]) -> None:
        """Nothing to rebuild: the tree holds tokens, not weights."""

    def close_row(self, i: int, seq: Seq, keep: bool) -> None:
        """A finished row's prompt tail + output joins the global index now; an aborted one is forgotten."""
        t0 = time.perf_counter()
        rid = self.rids[i]
        self.cache.forget(rid)
        out = [int(t) for t in seq.res.token_ids]
        if keep and out:
            self.cache.add_finished(rid, finished_entry(seq.req.prompt_ids, out, self.prompt_tail))
            self._versions[rid] = self.version
            self._versions.move_to_end(rid)
            while len(self._versions) > 100_000:
                self._versions.popitem(last=False)
        self._timed(t0)

    def target_updated(self, version: int) -> None:
        """New target weights: finished outputs of older versions count `version_decay ** age` in proposals."""
        self.version = int(version)
        for sid, v in list(self._versions.items()):
            try:
                self.cache.set_weight(sid, max(self.version_decay ** max(self.version - v, 0), 1e-6))
            except ValueError:  # evicted from the bounded index meanwhile
                del self._versions[sid]

    def with_drafter(self, drafter: Drafter | None) -> Proposer:
        """A learned drafter joins the suffix tree as a `hybrid` (score threshold 1 expected token)."""
        if drafter is None:
            return self
        from dvi.drafters.proposers import model_proposer

        return HybridProposer(model_proposer(drafter, self.vocab_size, self.device), self)

    def plan(self, seqs: list[Seq], k_cap: list[int], suffix: bool = True) -> Plan:
        t0 = time.perf_counter()
        self.step_seconds = 0.0
        out = Plan()
        if not suffix:
            return out
        for i, rid in enumerate(self.rids):
            cap = min(self.max_tokens, k_cap[i])
            if cap <= 0:
                continue
            p = self.cache.propose(rid, cap, min_prob=self.min_prob)
            if p.tokens:
                out.suffix[i] = p
        self._timed(t0)
        return out

    def propose(self, plan: Plan, k_model: int, k: int, u: torch.Tensor | None, params: BatchParams) -> Draft:
        return point_drafts(plan, len(self.rids), k, self.device)

    def observe(self, draft: Draft | None, n: list[int], emitted: list[list[int]],
                feats: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        for rid, e in zip(self.rids, emitted, strict=True):
            self.cache.append(rid, e)
        self._timed(t0)

    def stats(self) -> dict:
        s = dict(self.cache.stats())
        s["seconds"] = self.seconds
        return s


def point_drafts(plan: Plan, b: int, k: int, device: torch.device) -> Draft:
    """Rows of `plan.suffix` draft their proposal (up to k tokens), the others nothing: ids [b, k] (padding 0)."""
    rows = [[0] * k for _ in range(b)]
    lens, sources, point = [0] * b, [None] * b, [False] * b
    for i, p in plan.suffix.items():
        toks = [int(t) for t in p.tokens[:k]]
        rows[i][: len(toks)] = toks
        lens[i], sources[i], point[i] = len(toks), source_of(p), True
    return Draft(torch.tensor(rows, dtype=torch.long, device=device).view(b, k), None, lens, sources, point)


class HybridProposer(Proposer):
    """Per row and step: the suffix proposal when its score clears the bar, else the learned drafter.

    The bar is `threshold` (expected accepted tokens) until the learned drafter has drafted, then the lower of
    it and what the drafter measurably delivers: accepted drafts per row-step it drafted, averaged over
    about the last `1 / gain_rate` of them. A suffix proposal costs no model pass, so one that promises as
    much as the drafter delivers wins; with a fixed bar of 1, a drafter accepting 0.3 tokens a step took the
    rows of proposals scoring 0.3-1 and paid its forwards for it."""

    kind = "hybrid"
    gain_rate = 0.05

    def __init__(self, learned: Proposer, suffix: SuffixProposer, threshold: float = 1.0):
        super().__init__(suffix.vocab_size, suffix.device)
        self.learned, self.suffix, self.threshold = learned, suffix, float(threshold)
        self.model_gain: float | None = None  # accepted drafts per model-drafted row-step (moving average)

    @property
    def bar(self) -> float:
        """The score a suffix proposal needs this step."""
        return self.threshold if self.model_gain is None else min(self.threshold, self.model_gain)

    @property
    def needs_features(self) -> bool:  # type: ignore[override]
        return self.learned.needs_features

    @property
    def drafter(self) -> Drafter | None:  # type: ignore[override]
        return self.learned.drafter

    @property
    def max_tokens(self) -> int:  # type: ignore[override]
        return self.suffix.max_tokens

    @property
    def last_catchup(self) -> bool:  # type: ignore[override]
        return self.learned.last_catchup

    @property
    def step_seconds(self) -> float:  # type: ignore[override]
        return self.suffix.step_seconds

    def admit(self, seqs: list[Seq], feats: list[torch.Tensor | None] | None) -> None:
        self.learned.admit(seqs, feats)
        self.suffix.admit(seqs, feats)

    def select_rows(self, keep: list[int], idx: torch.Tensor) -> None:
        self.learned.select_rows(keep, idx)
        self.suffix.select_rows(keep, idx)

    def close_row(self, i: int, seq: Seq, keep: bool) -> None:
        self.learned.close_row(i, seq, keep)
        self.suffix.close_row(i, seq, keep)

    def rebuild(self, seqs: list[Seq]) -> None:
        self.learned.rebuild(seqs)

    def set_features(self, feats: list[torch.Tensor | None]) -> None:
        self.learned.set_features(feats)

    def pending_tokens(self) -> int:
        return self.learned.pending_tokens()

    def maybe_compact(self) -> None:
        self.learned.maybe_compact()

    def with_drafter(self, drafter: Drafter | None) -> Proposer:
        self.learned = self.learned.with_drafter(drafter)
        return self

    def stats(self) -> dict:
        return self.suffix.stats()

    def target_updated(self, version: int) -> None:
        self.suffix.target_updated(version)

    def plan(self, seqs: list[Seq], k_cap: list[int], suffix: bool = True) -> Plan:
        sp = self.suffix.plan(seqs, k_cap, suffix)
        if self.learned.drafter is None:  # no learned part (swapped out): every proposal drafts
            return sp
        bar = self.bar
        chosen = {i: p for i, p in sp.suffix.items() if p.score >= bar}
        return Plan(model_rows=[i for i in range(len(seqs)) if i not in chosen], suffix=chosen)

    def propose(self, plan: Plan, k_model: int, k: int, u: torch.Tensor | None, params: BatchParams) -> Draft:
        """The learned drafter runs (all rows, one batch) only when some row uses it; suffix rows overwrite theirs."""
        d = point_drafts(plan, len(self.suffix.rids), k, self.device)
        if not plan.model_rows or k_model <= 0:
            return d
        ids, q = self.learned.draft_model(k_model, u, params)  # [B, k_model], [B, k_model, V] or None
        for i in plan.model_rows:
            d.ids[i, :k_model] = ids[i]
            d.lens[i], d.sources[i] = k_model, "model"
        if q is not None:  # sampled: suffix rows' point masses as one-hot rows of q (lossless, one rule)
            full = q.new_zeros(q.shape[0], k, q.shape[2])  # [B, K, V]
            full[:, :k_model] = q
            for i in plan.suffix:
                full[i] = 0
                full[i, torch.arange(d.lens[i]), d.ids[i, : d.lens[i]]] = 1.0
            d.q = full
        return d

    def observe(self, draft: Draft | None, n: list[int], emitted: list[list[int]],
                feats: torch.Tensor | None) -> None:
        if draft is not None:
            for i, (src, ln) in enumerate(zip(draft.sources, draft.lens, strict=True)):
                if src == "model" and ln > 0:
                    g = float(min(n[i], ln))
                    self.model_gain = g if self.model_gain is None else self.model_gain + self.gain_rate * (
                        g - self.model_gain)
        self.learned.observe(draft, n, emitted, feats)
        self.suffix.observe(draft, n, emitted, feats)


def build_proposer(kind: str, drafter: Drafter | None, vocab_size: int, device: torch.device | str,
                   cache: SuffixCache | None = None, settings: SuffixConfig | None = None) -> Proposer:
    """The proposer of a drafter kind: `suffix` (the tree alone), `hybrid` (the tree, else `drafter`), or any
    learned kind (`drafter` as is). `cache` defaults to a fresh `SuffixCache` bounded by `settings` (the config's
    `suffix:` section; default: its defaults); pass one to share it."""
    from dvi.config import SuffixConfig
    from dvi.drafters.proposers import model_proposer

    device = torch.device(device)
    if kind not in ("suffix", "hybrid"):
        return model_proposer(drafter, vocab_size, device)
    sx = settings or SuffixConfig()
    if cache is None:
        from dvi.drafters.suffix import SuffixCache

        cache = SuffixCache(max_tokens=sx.max_tokens, max_seqs=sx.max_seqs, max_depth=sx.max_depth)
    sp = SuffixProposer(cache, vocab_size, device, max_tokens=sx.max_draft_tokens, min_prob=sx.min_prob,
                        version_decay=sx.version_decay)
    if kind == "suffix":
        return sp
    if drafter is None:
        raise ValueError("drafter_kind hybrid needs a learned drafter")
    return HybridProposer(model_proposer(drafter, vocab_size, device), sp, sx.threshold)
