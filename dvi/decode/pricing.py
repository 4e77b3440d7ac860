"""How many tokens a step drafts (`KPolicy`), and what a proposer prices its draft with (`StepPricing`).

The engine owns one `KPolicy`: fixed K, or adaptive K (`dvi.decode.adaptive.AdaptiveK`) from calibrated costs per
batch-size bucket and each row's acceptance estimate, the goodput guard for history drafts, and the timings
that feed them after every step. Each step it hands the proposer a `StepPricing` bound to the batch: a learned
kind asks `model_k(rows, pending)`, a history kind `point_k(probs, longest)` (a point-mass proposal costs no
model pass: its width is priced against the verify cost alone) and reads `lookups` (no lookups where history
drafts measured slower than plain steps).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from dvi.decode.acceptance import AcceptanceTracker
from dvi.decode.adaptive import AdaptiveK, GoodputGuard
from dvi.decode.k_choice import choose_point_k
from dvi.decode.step_costs import CostModel, batch_bucket
from dvi.decode.tree_pricing import SiblingStats, choose_siblings, sibling_outcomes

__all__ = ["LOOKUP_BACKOFF_FROM", "LOOKUP_BACKOFF_MAX", "KPolicy", "StepPricing", "StepTimes"]

LOOKUP_BACKOFF_FROM = 4
"""Batch bucket from which history lookups that drafted nothing are skipped for a while (`KPolicy.lookups_due`)."""
LOOKUP_BACKOFF_MAX = 16
"""The most steps such a backoff skips lookups before looking again."""


class StepTimes(NamedTuple):
    """A step's seconds: its drafting, its verify forward, its host work after the verify, and the whole step."""

    draft: float
    verify: float
    host: float
    total: float


class KPolicy:
    """Fixed or adaptive K, its cost measurements and the per-row acceptance estimates it reads."""

    def __init__(self, adaptive: bool, num_draft_tokens: int, max_draft_tokens: int,
                 calibrate: Callable[[int], None], tree_width: int = 0):
        self.adaptive, self.num_draft_tokens = bool(adaptive), int(num_draft_tokens)
        self.tree_width = int(tree_width)  # siblings per depth at most (0: chains)
        self.siblings = SiblingStats()  # how often each sibling rank is accepted where the chain missed
        self.calibrate = calibrate  # measures a batch bucket's draft / verify costs (the engine's dummy rows)
        self.controller = AdaptiveK(max_draft_tokens, num_draft_tokens)
        self.suffix_guard = GoodputGuard()  # history drafts' measured goodput vs plain steps (adaptive)
        self.costs = CostModel()  # online step timings (reporting); K is chosen from calibrated costs
        self.acceptance = AcceptanceTracker()
        # Adaptive K optimises the completion of the current batch (its slowest row) when True, plain
        # throughput when False (a server that backfills finished rows continuously may prefer False).
        self.drain_aware = True
        self._drafted_last = False  # the last step drafted (`observe`)
        self._looked = False  # the last step looked its rows up in the history index (`lookups_due`)
        self._lookup_skip, self._lookup_wait = 0, 1  # steps left without lookups; the next backoff's length

    def drafter_changed(self) -> None:
        """A new drafter version or adapter serves: guards that refuse drafting retry it soon (`GoodputGuard.reset`)."""
        self.controller.goodput.reset()
        self.suffix_guard.reset()

    def for_step(self, seqs: list) -> StepPricing:
        return StepPricing(self, seqs)

    def lookups_due(self, batch: int, allowed: bool = True) -> bool:
        """Whether this step looks its rows up in the history index (adaptive K). Lookups cost host time every step
        whether they draft or not (real pair, bf16, 16 in flight: 2.2 ms a step of 30, where the verify's cost at 16
        rows priced nearly every proposal at K = 0), so from `LOOKUP_BACKOFF_FROM` rows a lookup step that drafted
        nothing skips the next 1, 2, 4 .. `LOOKUP_BACKOFF_MAX` steps' lookups; a step that drafted from them resets
        it. Below that, a lookup costs a few percent of a step and a missed draft much more: every step looks."""
        due = allowed and (self._lookup_skip <= 0 or batch_bucket(batch) < LOOKUP_BACKOFF_FROM)
        if allowed and not due:
            self._lookup_skip -= 1
        self._looked = due
        return due

    def _after_lookups(self, draft, batch: int) -> None:
        if not self._looked:
            return
        if draft.suffix_rows:
            self._lookup_skip, self._lookup_wait = 0, 1
        elif batch_bucket(batch) >= LOOKUP_BACKOFF_FROM:
            self._lookup_skip, self._lookup_wait = self._lookup_wait, min(2 * self._lookup_wait, LOOKUP_BACKOFF_MAX)

    def _ensure_costs(self, batch: int) -> None:
        if self.controller.needs_calibration(batch):
            self.calibrate(batch)

    def observe_tree(self, draft, view) -> None:
        """After a tree step: which sibling ranks were tried and accepted where the chain missed."""
        if draft.tree and draft.spine is not None:
            for tried, hit in sibling_outcomes(draft.parents, draft.spine, view.spine_kept, view.ranks,
                                               draft.node_sources, view.node_sources):
                self.siblings.observe(tried, hit)

    def observe(self, draft, batch: int, times: StepTimes, tokens: int, cpu: bool, joined: bool = False) -> None:
        """After a step: its timings (a drafter catch-up is not a typical draft cost, a step with history rows
        not a learned-drafter step) and the goodput guards' samples.

        A step that admitted rows (`joined`) is no guard sample: their prefills ride on its verify, so its seconds
        are mostly prompt tokens, whatever it drafted (real pair, AMD Zen3, fp32, 8 in flight: a joining step took
        420-830 ms against 80 ms without, and with those in the plain window the suffix guard judged drafts of 19
        tokens in 238 ms faster than plain steps of 7.6 tokens in 79 ms). Nor is the first drafting step after
        plain ones: its drafter catch-up is the price of the plain stretch (every row's tokens since), which
        `AdaptiveK` weighs before leaving K = 0, and counting it would condemn every retry of drafting (at 8 rows,
        256 plain steps leave ~2,000 tokens to catch up). A later drafting step counts with its catch-up: under
        load each joiner's prompt goes through the drafter before it drafts, a price plain decoding never pays
        (real pair, Intel AMX, bf16, 16 rows: drafting steps 1.09x plain without their catch-ups, 1.03x with
        them). A step that drafted from both the learned drafter and the history index is a sample of both
        guards: either kind's drafting is judged with the steps it shared."""
        k, forwards = draft.width, draft.model_forwards
        if not joined:
            self.costs.record_verify(batch, k, times.verify)
            if self.adaptive:  # what the step cost against its price: the price of the next ones
                positions = batch + sum(draft.lens) if self.controller.ragged and draft.ragged else batch * (k + 1)
                self.controller.observe_costs(batch, positions, forwards, times.verify, times.draft, draft.catchup)
        if self.adaptive and cpu and not joined:
            # On CPU the verify forward is synchronous, so t_host is the step's host work after it (on CUDA it
            # would include the kernels the first transfer waits for).
            self.controller.observe_host_work(batch, times.host, self.costs)
        if forwards > 0 and not draft.catchup:
            self.costs.record_draft(batch, times.draft / forwards)
        if not self.adaptive:
            return
        self._after_lookups(draft, batch)
        resumed = forwards > 0 and draft.catchup and not self._drafted_last
        self._drafted_last = k > 0
        if resumed and not joined:  # its catch-up is what the spell it starts costs should drafting measure slower
            self.controller.goodput.observe_catchup(batch, times.draft)
        if joined or resumed:
            return
        if forwards > 0 or not draft.suffix_rows:  # learned drafts (beside history rows or not), or a plain step
            self.controller.observe_step(batch, k, tokens, times.total)
        if draft.lookup_seconds is not None and (draft.suffix_rows or not forwards):  # history drafts, or plain
            # a plain step is judged as the guard's refusal would run it: without the lookups that found nothing
            # (a refused step looks nothing up, `lookups_due`), or drafting measured against a slower plain
            seconds = times.total if k > 0 else max(times.total - draft.lookup_seconds, 1e-9)
            self.suffix_guard.observe(batch, k > 0, tokens, seconds)


class StepPricing:
    """One step's pricing for a batch of rows `seqs` (`dvi.drafters.proposer.Pricing`)."""

    def __init__(self, policy: KPolicy, seqs: list):
        self.policy, self.seqs, self.batch = policy, seqs, len(seqs)
        # no lookups where history drafts measured slower than plain steps at this batch size, nor while lookups that
        # drafted nothing back off (`KPolicy.lookups_due`)
        self.lookups = not policy.adaptive or policy.lookups_due(self.batch, policy.suffix_guard.allow(self.batch))
        self.trees = policy.tree_width > 0

    def model_k(self, rows: list[int], pending: Callable[[], int]) -> int:
        p = self.policy
        if not p.adaptive:
            return p.num_draft_tokens
        p._ensure_costs(self.batch)
        seqs = [self.seqs[i] for i in rows]
        alphas = [p.acceptance.estimate(s.acc, s.pool) for s in seqs]
        rem = [s.remaining for s in seqs] if p.drain_aware and self.batch > 1 else None
        return p.controller.choose(self.batch, alphas, rem, pending)

    def model_lens(self, k: int, rows: list[int]) -> list[int]:
        """Per row of `rows` (as last passed to `model_k`), how many of the k learned drafts it proposes: all k, or
        where the target verifies only real drafts and adaptive K found that some rows' drafts do not pay for the
        positions they add, 0 for those (`dvi.decode.k_choice.choose_rows`)."""
        chosen = self.policy.controller.last_rows if self.policy.adaptive and k > 0 else None
        if chosen is None:
            return [k] * len(rows)
        keep = set(chosen)
        return [k if j in keep else 0 for j in range(len(rows))]

    def siblings(self, k: int, rows: list[int]) -> list[int]:
        """Siblings per depth 1..k beside a chain of k learned drafts for batch rows `rows` ([]: a chain): the tree
        width at most, as many as pay at this machine's calibrated verify costs (adaptive) or all of it (fixed)."""
        p = self.policy
        if p.tree_width <= 0 or k <= 0 or not rows or (p.adaptive and p.controller.last_rows is not None):
            return []  # (where only some rows draft, a ragged chain verify: no trees)
        if not p.adaptive:
            return [p.tree_width] * k
        p._ensure_costs(self.batch)
        ctl, n = p.controller, self.batch
        draft = ctl.draft_at(n)
        if draft is None or ctl.verify_at(n, k) is None:
            return []
        alphas = [p.acceptance.estimate(self.seqs[i].acc, self.seqs[i].pool) for i in rows]
        return choose_siblings(alphas, k, p.siblings.rates(), lambda w: k * draft + ctl.verify_at(n, w), p.tree_width)

    def point_k(self, probs: Sequence[Sequence[float]], longest: int) -> int:
        p = self.policy
        if not p.adaptive:
            return longest
        p._ensure_costs(self.batch)
        ctl, n = p.controller, self.batch
        return choose_point_k(probs, n, lambda k: ctl.verify_at(n, k), longest, ctl.margin)
