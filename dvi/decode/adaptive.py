"""Adaptive number of draft tokens K from calibrated costs and per-sequence acceptance rates.

What a K is worth is `dvi.decode.k_choice`'s arithmetic. On CPU c_verify grows with K and with batch size (small pair,
K = 2: ~1.15x a one-token step at batch 1, ~1.6x at batch 16, ~1.8x at batch 64), so speculation must switch itself
off in large batches, and not even probe there when the drafter's catch-up would cost more than a probe can win back.
Costs come from a short interleaved calibration per batch-size bucket (`calibrate`, fed to `AdaptiveK`), read at the
positions a step scores and corrected by what real steps measured (`dvi.decode.step_costs`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dvi.decode.k_choice import choose_k, choose_rows, expected_tokens
from dvi.decode.step_costs import CostModel, MeasuredCosts, batch_bucket

__all__ = ["AdaptiveK", "AdaptiveTuning", "GoodputGuard"]


@dataclasses.dataclass
class _ProbeClock:
    """One batch-size bucket's run of K = 0 choices and the streak at which its next probe is due. Per bucket: a
    batch drained to a few rows that drafts (and pays) says nothing about the full batch, whose probes would
    otherwise start over at `probe_every` after every such tail (every RL rollout batch ends in one)."""

    interval: int
    due: int
    streak: int = 0
    last: int = 0  # the streak at its last probe


class _BatchCosts(NamedTuple):
    draft: float
    verify: list[float]  # per K, 0..k_max
    can_pay: bool  # some K beats plain decoding at alpha = 1


@dataclass(frozen=True)
class AdaptiveTuning:
    """`AdaptiveK`'s knobs. While K = 0 is chosen, a probe with K = `probe_k` (default: min(2, k_max))
    runs after `probe_every` K = 0 steps, the interval doubling up to `max_probe_every`; a probe whose
    drafter catch-up would cost more than `probe_budget_steps` plain steps is skipped, and leaving
    K = 0 must pay for the catch-up within `catchup_horizon` steps and beat plain decoding by `margin` times
    `resume_margin` from `GoodputGuard.MIN_ROWS` rows on, where a catch-up is every row's (hysteresis: at break-even
    α the choice flipped every few steps, each restart a catch-up for a step that won nothing; docs/design.md,
    "Hysteresis at break-even"). Drafting that lasts `settled_spell` steps restarts the probes' backoff; shorter
    spells leave it. A probe asks whether the rows' α rose: it runs
    only where some K would beat plain decoding with every row's α `probe_reach` higher (a bucket whose break-even
    α lies farther, 16 bf16 rows on a CPU where a two-position verify costs 1.7 plain steps, would pay catch-ups
    for answers that cannot change K), and where its priced loss (the catch-up, and its verify's and drafts' seconds
    beyond the plain step's worth of the tokens it is expected to add) is at most `probe_share` of the bucket's plain
    steps since its last probe (a probe of 12 bf16 rows sampled at T = 1 lost ~2 plain steps on AMD Zen 5; probes at
    16, 48, 112 .. steps cost RL rollouts ~1% against plain decoding). A K must beat plain decoding by `margin`;
    measured goodput over `goodput_window` steps guards the prediction."""

    probe_every: int = 16
    probe_k: int | None = None
    max_probe_every: int = 256
    margin: float = 1.05
    probe_budget_steps: float = 2.0
    catchup_horizon: int = 16
    resume_margin: float = 1.05
    settled_spell: int = 4
    goodput_window: int = 16
    probe_reach: float = 0.15
    probe_share: float = 0.01


class AdaptiveK:
    """Chooses K each step from calibrated costs (per batch-size bucket) and per-sequence alphas.

    Costs come from `calibrate` (the engine runs K=0..k_max verifies and a draft step interleaved,
    min of a few repetitions, once per bucket): comparing K values needs their cost *ratios*, and
    on a CPU shared with other processes only interleaved measurements give those reliably (online
    timings of the K we happen to choose are biased by whichever stalls hit them). While K = 0 is
    chosen, probes with a small K keep alpha fresh, backing off exponentially.
    """

    def __init__(self, k_max: int, k_default: int, tuning: AdaptiveTuning | None = None, **overrides: Any):
        """`tuning` (default `AdaptiveTuning()`) with `overrides` (its fields, e.g. ``probe_every=5``) applied."""
        t = self.tuning = dataclasses.replace(tuning or AdaptiveTuning(), **overrides)
        probe_every, goodput_window = t.probe_every, t.goodput_window
        self.margin = t.margin
        # A probe first runs the drafter over every token it skipped while K = 0 (its catch-up); a probe
        # whose catch-up would cost more than this many plain steps is skipped (large CPU batches: a
        # 64-row catch-up costs more than the probes could win back).
        self.probe_budget_steps = t.probe_budget_steps
        self.catchup_horizon = t.catchup_horizon
        self.catchup_cost: dict[int, float] = {}  # seconds per caught-up token, per bucket
        self.k_max = k_max
        self.k_default = max(1, min(k_default, k_max)) if k_max > 0 else 0
        self.probe_every = probe_every
        self.max_probe_every = t.max_probe_every
        self.probe_k = t.probe_k
        self.costs = CostModel(window=1, quantile=0.0)
        self._probes: dict[int, _ProbeClock] = {}  # per bucket (`_clock`)
        self._spell: dict[int, int] = {}  # per bucket: the K > 0 choices in a row up to the last one (0: it chose K = 0)
        self.last_choice = self.k_default
        self._cost_cache: dict[int, _BatchCosts] = {}  # per batch size (`_costs_at`)
        self.measured = MeasuredCosts()  # real steps' seconds against their price, per bucket (`observe_costs`)
        # Seconds every engine step spends outside the model forwards (acceptance, log-probs, per-token
        # bookkeeping), per bucket, measured online: the calibration times bare forwards, and a cost
        # that K = 0 pays per token but speculation shares over several tokens must count.
        self.step_overhead: dict[int, float] = {}
        # Measured goodput of whole engine steps (catch-ups included), drafting vs plain, per bucket: the guard
        # against costs the calibration cannot see (real model, CPU, batch 16: calibrated verify(1) < verify(0),
        # predicted 1.4x, measured 0.74x of plain decoding).
        self.goodput = GoodputGuard(goodput_window, t.margin, retry_every=self.max_probe_every)
        self._host_steps = 0
        # the target verifies only real drafts (`dvi.decode.target.TargetRunner.ragged`): K is chosen with the rows
        # that pay for it (`choose_rows`) in throughput mode; `last_rows` those rows (None: every row)
        self.ragged = False
        self.last_rows: list[int] | None = None

    def observe_step(self, batch: int, k: int, tokens: int, seconds: float) -> None:
        """One finished engine step (its drafter catch-up included): feeds the goodput guard."""
        self.goodput.observe(batch, k > 0, tokens, seconds)

    def measured_verdict(self, batch: int) -> str:
        return self.goodput.verdict(batch)

    def needs_calibration(self, batch: int) -> bool:
        b = batch_bucket(batch)
        return self.k_max > 0 and (b not in self.costs.draft or 0 not in self.costs.verify.get(b, {}))

    def set_costs(self, batch: int, verify: dict[int, float], draft: float, catchup_per_token: float | None = None) -> None:
        b = batch_bucket(batch)
        if catchup_per_token is not None:
            self.catchup_cost[b] = catchup_per_token
        for k, v in verify.items():
            self.costs.record_verify(b, k, v)
        self.costs.record_draft(b, draft)
        self._cost_cache.clear()

    def observe_host_work(self, batch: int, seconds: float, costs: CostModel) -> None:
        """A step's host work after its verify forward. Only for one or two rows is that a fixed cost per step
        (with more rows the per-token loops dominate it, which plain steps pay per token just like speculative
        ones); its robust estimate becomes the step overhead every 16 observations."""
        if batch > 2:
            return
        b = batch_bucket(batch)
        o = costs.record_overhead(b, seconds)
        self._host_steps += 1
        if self._host_steps % 16 == 0:
            self.set_step_overhead(b, o)

    def set_step_overhead(self, batch: int, seconds: float) -> None:
        b = batch_bucket(batch)
        self.step_overhead[b] = max(0.0, float(seconds))
        self._cost_cache.clear()

    def _priced(self, batch: int, positions: int) -> float | None:
        """The calibrated seconds of a step scoring `positions` at `batch` rows: the bucket's calibrated verifies read
        at the same number of positions (its b rows verifying K a row score b (K + 1)), plus its host work. A verify
        costs what it scores: 11 rows verifying 2 positions each cost about what 22 rows' plain step does, not what
        the bucket's 8 rows verifying 2 do (AMD Zen 5, bf16: the target's matmuls cost the same from 1 to ~12 rows
        and grow with the rows from there)."""
        b = batch_bucket(batch)
        v = self.costs.verify_cost(b, positions / b - 1)
        return None if v is None else v + self.step_overhead.get(b, 0.0)

    def verify_at(self, batch: int, k: int) -> float | None:
        """Seconds of a step verifying k positions a row at `batch` rows (k = 0: a plain step), as real steps measured
        against their price here (`MeasuredCosts`: a factor on the positions' price, the work per drafted one)."""
        v = self._priced(batch, batch * (k + 1))
        if v is None:
            return None
        b = batch_bucket(batch)
        return max(v * self.measured.value(b, "plain") + batch * k * self.measured.value(b, "position"), 1e-9)

    def draft_at(self, batch: int) -> float | None:
        """Seconds of one drafter forward at `batch` rows, as measured against the calibrated ones."""
        b = batch_bucket(batch)
        d = self.costs.draft_cost(b)
        return None if d is None else d * self.measured.value(b, "draft")

    def observe_costs(self, batch: int, positions: int, forwards: int, verify: float, draft: float,
                      catchup: bool) -> None:
        """A finished step (no rows joined): its verify's seconds (forward and host work) for the `positions` it
        scored, and its drafting's for `forwards` drafter forwards (not where a catch-up fed the drafter), against
        their calibrated prices."""
        if self.needs_calibration(batch):
            return
        b, priced = batch_bucket(batch), self._priced(batch, positions)
        if not priced:
            return
        if positions > batch:
            base = priced * self.measured.value(b, "plain")
            moved = self.measured.observe(b, "position", (verify - base) / (positions - batch))
        else:
            moved = self.measured.observe(b, "plain", verify / priced)
        priced_draft = self.costs.draft_cost(b)
        if forwards > 0 and not catchup and priced_draft:
            moved |= self.measured.observe(b, "draft", draft / forwards / priced_draft)
        if moved:
            self._cost_cache.clear()

    def choose(self, batch: int, alphas: Sequence[float], remaining: Sequence[int] | None = None,
               pending_tokens: int | Callable[[], int] = 0) -> int:
        """K for the next step; `pending_tokens` (all rows' tokens the drafter has not seen yet, or a
        function giving it, called only when K > 0 or a probe is due) prices the drafter's catch-up."""
        if self.k_max <= 0 or not alphas:
            return 0
        c = self.costs
        b = batch_bucket(batch)
        if b not in c.draft or 0 not in c.verify.get(b, {}):
            return self.k_default
        cached = self._costs_at(batch)
        self.last_rows = None
        resuming = b >= GoodputGuard.MIN_ROWS and self._spell.get(b, 1) == 0  # (one or two rows: a catch-up is a row's)
        margin = self.margin * (self.tuning.resume_margin if resuming else 1.0)
        if self.ragged and remaining is None and len(alphas) > 1:
            k, rows = choose_rows(alphas, cached.draft, cached.verify, batch, self.k_max, margin)
            self.last_rows = rows if 0 < len(rows) < len(alphas) else None
        else:
            k = choose_k(alphas, cached.draft, cached.verify, self.k_max, margin, remaining)
        if k > 0 and not self._catchup_pays(b, k, alphas, cached, pending_tokens):
            k = 0
        verdict = self.goodput.judged(b)
        if verdict == "plain":
            # Measured: plain decoding is faster here, so no K > 0, not even a probe (real pair, batch 16:
            # probes kept hybrid at 0.93-0.95x of speculation off). Alpha rises as the drafter trains
            # online: every `max_probe_every` guarded steps the speculative measurement is forgotten.
            self.goodput.refused(b)
        if k > 0 and verdict in ("measure_plain", "plain"):
            k = 0  # measured: plain decoding is (or may be) faster here
        if k == 0:
            self.last_rows = None  # a probe drafts every row
            k = self._probe(batch, alphas, cached, verdict, pending_tokens)
        elif self._spell.get(b, 0) + 1 >= self.tuning.settled_spell:
            self._probes.pop(b, None)  # drafting lasts here: the next K = 0 run starts a fresh clock (`_clock`)
        else:  # a step or two of drafting says nothing new: the probes' backoff stays
            clock = self._clock(b)
            clock.streak, clock.due = 0, clock.interval
        self._spell[b] = self._spell.get(b, 0) + 1 if k > 0 else 0
        self.last_choice = k
        return k

    def _costs_at(self, batch: int) -> _BatchCosts:
        """Costs per K at `batch` rows (`verify_at`, `draft_at`), cached until the calibration, the host work or a
        measured factor changes (expected tokens scale with the rows: the costs are the batch's)."""
        cached = self._cost_cache.get(batch)
        if cached is None:
            draft, verify = self.draft_at(batch), [self.verify_at(batch, kk) for kk in range(self.k_max + 1)]
            # Verifying more tokens never costs less: a calibrated dip (real pair, batch 16, bf16: 2 tokens a
            # row timed 79 ms, 1 token 89 ms) is a kernel-choice artefact the engine's real steps do not see.
            verify = [max(verify[: i + 1]) for i in range(len(verify))]
            # Can any K beat plain decoding here even if every draft were accepted? If not (large
            # batches on CPU: verify cost grows ~linearly with K), speculation is structurally off
            # in this bucket and probing for alpha would only pay drafter catch-ups for nothing.
            can_pay = choose_k([1.0], draft, verify, self.k_max, self.margin) > 0
            cached = self._cost_cache[batch] = _BatchCosts(draft, verify, can_pay)
        return cached

    def _probe(self, batch: int, alphas: Sequence[float], cached: _BatchCosts, verdict: str,
               pending_tokens: int | Callable[[], int]) -> int:
        """K = 0 was chosen: a probe's K where one is due, else 0. Keeps alpha from going stale while speculation is
        off, backing off exponentially while probes keep confirming K = 0 (each probe costs a drafter catch-up)."""
        b = batch_bucket(batch)
        clock = self._clock(b)
        clock.streak += 1
        if not (cached.can_pay and verdict != "plain" and clock.streak >= clock.due):
            return 0
        k, pk = 0, max(1, min(self.probe_k or 2, self.k_max))  # (a probe_k past k_max has no verify price)
        pending = pending_tokens() if callable(pending_tokens) else pending_tokens
        catchup = pending * self.catchup_cost.get(b, 0.0)
        if catchup <= self.probe_budget_steps * cached.verify[0] and self._within_reach(alphas, cached, batch):
            plain = cached.verify[0]
            gain = sum(expected_tokens(a, pk) - 1.0 for a in alphas) * plain / len(alphas)
            loss = catchup + pk * cached.draft + cached.verify[pk] - plain - gain
            if loss > self.tuning.probe_share * (clock.streak - clock.last) * plain:
                return 0  # not yet: its plain steps since the last probe do not cover what it would cost
            k, clock.last = pk, clock.streak
        clock.interval = min(2 * clock.interval, self.max_probe_every)
        clock.due = clock.streak + clock.interval
        return k

    def _within_reach(self, alphas: Sequence[float], cached: _BatchCosts, batch: int) -> bool:
        """Whether a rise of the rows' α by `probe_reach` would make drafting pay here."""
        reach = [min(1.0, a + self.tuning.probe_reach) for a in alphas]
        if self.ragged and len(reach) > 1:
            return choose_rows(reach, cached.draft, cached.verify, batch, self.k_max, self.margin)[0] > 0
        return choose_k(reach, cached.draft, cached.verify, self.k_max, self.margin) > 0

    def _clock(self, b: int) -> _ProbeClock:
        clock = self._probes.get(b)
        if clock is None:
            clock = self._probes[b] = _ProbeClock(self.probe_every, self.probe_every)
        return clock

    def _catchup_pays(self, b: int, k: int, alphas: Sequence[float], cached: _BatchCosts,
                      pending_tokens: int | Callable[[], int]) -> bool:
        """Leaving K = 0 first runs the drafter over every token it skipped (whole prompts of rows that
        joined meanwhile: the drafter cache is filled lazily). Worth it only if the expected saving per
        step, over `catchup_horizon` steps, covers that catch-up (measured: batch 16, a marginal
        predicted gain, catch-ups on every admission made speculation 0.87x of plain in the server)."""
        pending = pending_tokens() if callable(pending_tokens) else pending_tokens
        excess = pending - 2 * len(alphas)  # a row always has 1-2 pending tokens after a draft
        if excess <= 0:
            return True
        catchup = excess * self.catchup_cost.get(b, 0.0)
        t_k = k * cached.draft + cached.verify[k]
        spec_tokens = sum(expected_tokens(a, k) for a in alphas)
        saved_per_step = spec_tokens * cached.verify[0] / len(alphas) - t_k
        return saved_per_step * self.catchup_horizon >= catchup


class GoodputGuard:
    """Measured goodput of drafting vs plain steps, per batch bucket: the check on a cost model's promise (suffix
    drafts at batch 16: predicted gains, measured 0.82x of plain). It judges from `MIN_ROWS` rows on (`judged`,
    `allow`): at one or two rows a step's tokens are one or two draws, so a window of them is mostly the prompt's
    luck (real pair, Intel AMX, batch 1: one unlucky window kept a drafter with position-0 acceptance 0.6 off for the
    next four requests), and there the cost model already carries the measured host work of a step
    (`AdaptiveK.observe_host_work`).

    A window's goodput is its tokens over its seconds, not the median of per-step rates: a drafting step emits
    1 to K+1 tokens, so its median step can be a rejected draft while drafting wins on the whole (real pair, Intel
    AMX, batch 1, position-0 acceptance 0.47: the median said "plain" while drafting requests finished 10% sooner).
    A step slower than `STALL` times the window's median step is a stall (the machine, not the policy) and left out.
    Drafting must measure `margin` times plain's rate to be judged faster, and once judged so keeps that verdict while
    it measures at least `HOLD` times it (hysteresis: a drafting step's tokens are the batch's luck, so a window of
    drafting that pays dips under the margin now and then, and each dip cost a retry's wait of plain steps).

    While it refuses, the drafting samples are frozen, so it explores by forgetting them: after `retry_first`
    refusals, then twice as many after every retry that measured plain again, up to `retry_every`; back to
    `retry_first` once drafting measures faster, and when a new drafter version or adapter serves (`reset`: a
    drafter that just learned must be able to show it soon, issue 59's control arm). Not at once: the online arm of
    RL rollouts swaps its drafter every policy step, and each retry costs a few drafting steps that may lose. Nor
    before its refusals' plain seconds, at `budget`, cover what the spell that measured slower lost (its drafting
    steps against the plain rate, and the drafter catch-up that started it: `observe_catchup`): at 16 bf16 rows on
    Intel AMX a spell cost ~3.5 plain steps, and retries every 64-256 steps cost speculation 2-4% against off
    where drafting never paid."""

    STALL = 3.0
    HOLD = 1.0
    MIN_ROWS = 3
    BUDGET = 0.01
    """The share of a bucket's plain time that re-measuring drafting which measured slower may cost."""
    MAX_WAIT = 1024
    """The most refusals a spell's cost makes a retry wait."""

    def __init__(self, window: int = 16, margin: float = 1.05, retry_every: int = 256, retry_first: int = 64,
                 budget: float = BUDGET):
        self.window, self.margin, self.retry_every, self.budget = window, margin, retry_every, float(budget)
        self.retry_first = min(retry_first, retry_every)
        self._steps: dict[tuple[int, bool], deque] = {}  # (tokens per row, seconds) of the last `window` steps
        self._refused: dict[int, int] = {}
        self._retry_at: dict[int, int] = {}  # per bucket: the refusals before the next retry (absent: retry_first)
        self._paid: dict[int, int] = {}  # per bucket: the refusals that pay for the last spell at `budget`
        self._catchup: dict[int, float] = {}  # per bucket: the drafter catch-ups' seconds of the spell measuring
        self._waive: set[int] = set()  # buckets whose next spell waits no budget (a new drafter's first look)
        self._faster: set[int] = set()  # buckets whose last clear verdict was drafting's (`HOLD`)

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        if seconds > 0 and batch > 0:
            b = batch_bucket(batch)
            self._steps.setdefault((b, drafted), deque(maxlen=self.window)).append((tokens / batch, seconds))
            if drafted and (b in self._retry_at or b in self._catchup) and self._ratio(b) >= self.margin:
                self._retry_at.pop(b, None)  # drafting pays again here: the next refusal spell retries soon
                self._catchup.pop(b, None)

    def observe_catchup(self, batch: int, seconds: float) -> None:
        """The drafter catch-up of a step that resumed drafting (no sample: it pays for the plain stretch before it),
        charged to the spell it starts should that spell measure slower."""
        b = batch_bucket(batch)
        self._catchup[b] = self._catchup.get(b, 0.0) + max(0.0, float(seconds))

    def reset(self) -> None:
        """A new drafter serves: the next retry within `retry_first` refusals, in every bucket, whatever the spells
        of the drafter before it lost."""
        self._retry_at.clear()
        self._paid.clear()
        self._catchup.clear()
        self._waive = {b for b, _ in self._steps}
        self._faster.clear()

    def _kept(self, steps: deque) -> list[tuple[float, float]]:
        """The window's steps without its stalls."""
        typical = statistics.median(s for _, s in steps)
        return [(t, s) for t, s in steps if s <= self.STALL * typical]

    def _rate(self, steps: deque) -> float:
        """Tokens per second per row over the window, stalls left out."""
        kept = self._kept(steps)
        return sum(t for t, _ in kept) / sum(s for _, s in kept)

    def verdict(self, batch: int) -> str:
        """"unknown" (too few drafting steps measured), "measure_plain" (drafting measured, plain decoding not yet:
        take plain steps, they lose nothing), "spec" or "plain" (whichever measured faster: drafting must win by
        `margin` to be judged so, and keeps that verdict while it measures at least `HOLD` times plain's rate)."""
        b = batch_bucket(batch)
        spec, plain = self._steps.get((b, True)), self._steps.get((b, False))
        need = max(2, self.window // 2)
        if spec is None or len(spec) < need:
            return "unknown"
        if plain is None or len(plain) < need:
            return "measure_plain"
        ratio = self._ratio(b)
        if ratio >= self.margin:
            self._faster.add(b)
        elif ratio < self.HOLD:
            self._faster.discard(b)
        return "spec" if b in self._faster else "plain"

    def _ratio(self, b: int) -> float:
        """Drafting's measured rate over plain's in bucket `b` (0 where either window is empty, inf where plain's rate
        is 0)."""
        spec, plain = self._steps.get((b, True)), self._steps.get((b, False))
        if not spec or not plain:
            return 0.0
        p = self._rate(plain)
        return self._rate(spec) / p if p > 0 else math.inf

    def judged(self, batch: int) -> str:
        """The verdict the policy acts on: "unknown" below `MIN_ROWS` rows, else `verdict`."""
        return self.verdict(batch) if batch_bucket(batch) >= self.MIN_ROWS else "unknown"

    def refused(self, b: int) -> None:
        """One step refused drafting in bucket `b`; the retry's refusal forgets the drafting samples."""
        n = self._refused[b] = self._refused.get(b, 0) + 1
        if n == 1:  # the spell just judged: the refusals its loss asks for
            self._paid[b] = 0 if b in self._waive else self._refusals_paying(b)
            self._waive.discard(b)
        scheduled = self._retry_at.get(b, self.retry_first)
        if n >= max(scheduled, self._paid.get(b, 0)):
            self._steps.pop((b, True), None)
            self._refused[b] = 0
            self._retry_at[b] = min(2 * scheduled, self.retry_every)

    def _refusals_paying(self, b: int) -> int:
        """Plain steps whose seconds at `budget` cover what bucket `b`'s drafting window lost against the plain rate,
        its spell's catch-ups included."""
        spec, plain = self._steps.get((b, True)), self._steps.get((b, False))
        catchup = self._catchup.pop(b, 0.0)
        if not spec or not plain or self.budget <= 0:
            return 0
        step = statistics.median(s for _, s in plain)
        # a stall is the machine's, not the spell's, as in `_rate` (docs/design.md, "The guard beside the trainer")
        kept = self._kept(spec)
        lost = sum(s for _, s in kept) - sum(t for t, _ in kept) / self._rate(plain) + catchup
        return min(self.MAX_WAIT, math.ceil(lost / (self.budget * step) - 1e-9)) if lost > 0 and step > 0 else 0

    def allow(self, batch: int) -> bool:
        """Whether history drafts may be looked up at this batch size (refusing counts toward a retry)."""
        if self.judged(batch) in ("unknown", "spec"):
            return True
        self.refused(batch_bucket(batch))
        return False
