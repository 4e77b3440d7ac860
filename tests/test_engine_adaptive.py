"""Adaptive K: the chooser switches speculation off when it cannot pay, on when it does."""

from __future__ import annotations

import pytest

import dvi.engine.calibration
from dvi.decode.acceptance import AcceptanceEMA
from dvi.decode.adaptive import AdaptiveK, GoodputGuard
from dvi.decode.k_choice import choose_k, choose_rows, expected_tokens, predicted_speedup
from dvi.decode.step_costs import CostModel


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def cpu_batch1(k: int) -> float:
    return 0.012 * (1 + 0.12 * k)  # (K+1)-token verify ~1.6x a plain step at K=5


def cpu_batch16(k: int) -> float:
    return 0.030 * (k + 1)  # compute bound: cost grows with every token verified


def test_choose_k_off_when_alpha_low_or_drafter_expensive():
    assert choose_k([0.1], draft_cost=0.002, verify_cost=cpu_batch1, k_max=8) == 0
    assert choose_k([0.8], draft_cost=0.012, verify_cost=cpu_batch1, k_max=8) == 0
    assert choose_k([0.9] * 16, draft_cost=0.004, verify_cost=cpu_batch16, k_max=8) == 0


def test_drain_mode_follows_the_slowest_row():
    alphas = [0.9] * 15 + [0.05]
    flat = lambda k: 0.025 + 0.002 * k  # noqa: E731 - verify barely grows: throughput says speculate
    assert choose_k(alphas, 0.003, flat, 8) > 0
    # ... but the low-alpha row needs as many steps either way, so for draining the batch it does not pay
    assert choose_k(alphas, 0.003, flat, 8, remaining=[64] * 16) == 0
    assert choose_k(alphas, 0.003, flat, 8, remaining=[64] * 15 + [1]) > 0


def test_choose_k_on_when_alpha_high_and_drafter_cheap():
    k = choose_k([0.85], draft_cost=0.002, verify_cost=cpu_batch1, k_max=8)
    assert 2 <= k <= 8
    assert choose_k([0.99], draft_cost=0.0005, verify_cost=cpu_batch1, k_max=8) >= 5
    # GPU-like flat verify cost: speculate even at batch 16
    assert choose_k([0.8] * 16, draft_cost=0.001, verify_cost=lambda k: 0.02, k_max=8) > 0
    assert predicted_speedup(0.85, k, 0.002, cpu_batch1(k), cpu_batch1(0)) > 1.3


def test_cost_model_interpolates():
    c = CostModel(window=1)
    assert c.verify_cost(1, 3) is None
    c.record_verify(1, 0, 0.010)
    assert c.verify_cost(1, 4) == pytest.approx(0.010 * (1 + 0.12 * 4))
    c.record_verify(1, 4, 0.018)
    assert c.verify_cost(1, 2) == pytest.approx(0.014)
    assert c.verify_cost(1, 6) == pytest.approx(0.022)
    assert c.verify_cost(2, 0) == pytest.approx(0.010)  # nearest batch size
    assert c.draft_cost(1) == pytest.approx(0.0025)  # prior until measured
    c.record_draft(1, 0.001)
    assert c.draft_cost(1) == 0.001


def test_adaptive_controller_switches_off_at_batch_16():
    ctl = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
    alphas = [0.7] * 16
    assert ctl.needs_calibration(16) and ctl.choose(16, alphas) == 4  # default until calibrated
    ctl.set_costs(16, {k: cpu_batch16(k) for k in (0, 1, 2, 4, 8)}, draft=0.004)
    assert not ctl.needs_calibration(16) and not ctl.needs_calibration(13)  # same bucket
    # verify cost ~ (K+1) tokens: no K could pay even at alpha = 1, so no probes either
    assert [ctl.choose(16, alphas) for _ in range(40)] == [0] * 40
    # a bucket where speculation pays only at high alpha: off at 0.7, probes back off exponentially
    ctl = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
    ctl.set_costs(4, {k: 0.030 * (1 + 0.5 * k) for k in (0, 1, 2, 4, 8)}, draft=0.004)
    picks = [ctl.choose(4, [0.7] * 4) for _ in range(40)]
    probes = [i for i, k in enumerate(picks) if k]
    assert all(picks[i] == 2 for i in probes) and probes == [4, 14, 34]
    assert ctl.choose(4, [0.99] * 4) > 0
    ctl.set_costs(16, {k: cpu_batch16(k) for k in (0, 1, 2, 4, 8)}, draft=0.004)
    # batch 1 with a cheap drafter and high alpha: on
    ctl.set_costs(1, {k: cpu_batch1(k) for k in (0, 1, 2, 4, 8)}, draft=0.002)
    assert ctl.choose(1, [0.85]) >= 2
    assert ctl.choose(1, [0.2]) == 0


def test_drafting_in_a_drained_tail_does_not_restart_the_full_batchs_probes():
    """Probes back off per batch-size bucket: a few rows that draft (and pay) say nothing about the full batch."""
    ctl = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
    ctl.set_costs(4, {k: 0.030 * (1 + 0.5 * k) for k in (0, 1, 2, 4, 8)}, draft=0.004)  # pays at high alpha only
    ctl.set_costs(1, {k: cpu_batch1(k) for k in (0, 1, 2, 4, 8)}, draft=0.002)
    picks = []
    for i in range(40):
        picks.append(ctl.choose(4, [0.7] * 4))
        if i % 8 == 7:  # the batch drains: one row drafts, as it pays there
            assert ctl.choose(1, [0.85]) >= 2
    assert [i for i, k in enumerate(picks) if k] == [4, 14, 34]  # the same doubling as without the tails


def test_probes_skipped_when_catchup_would_cost_more_than_they_can_win():
    """A probe first runs the drafter over every token skipped while K = 0; with many rows x pending
    tokens that catch-up costs more than the probe could win back, so it is skipped (and backs off)."""
    costs = {k: 0.030 * (1 + 0.5 * k) for k in (0, 1, 2, 4, 8)}
    cheap, dear = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0), AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
    for ctl in (cheap, dear):
        ctl.set_costs(4, costs, draft=0.004, catchup_per_token=1e-4)  # 2 plain steps = 600 tokens
    assert [i for i in range(40) if cheap.choose(4, [0.7] * 4, pending_tokens=400)] == [4, 14, 34]
    assert not any(dear.choose(4, [0.7] * 4, pending_tokens=4 * 200) for _ in range(40))
    assert dear.choose(4, [0.99] * 4, pending_tokens=10_000) > 0  # a K that pays is still chosen directly


def test_resuming_drafting_needs_a_clear_gain_where_catch_ups_are_every_rows():
    """Hysteresis from `GoodputGuard.MIN_ROWS` rows on: a gain that keeps drafting going does not restart it after K = 0
    (at break-even α the choice flipped every few steps, each restart a catch-up of every row); one or two rows
    choose alike either way."""
    verify = {0: 10e-3, 1: 11.5e-3, 2: 13e-3, 4: 16e-3}  # K = 1 with a 1 ms draft: 1.25 plain steps
    ctl = AdaptiveK(4, 2, probe_every=10**6)
    ctl.set_costs(8, verify, 1e-3)
    gain = [0.35] * 8  # 1.35 tokens for 1.25 steps: 1.08x, over the margin (1.05), under it twice (1.1025)
    assert ctl.choose(8, gain) == 1
    assert ctl.choose(8, gain) == 1  # kept going
    assert ctl.choose(8, [0.2] * 8) == 0
    assert [ctl.choose(8, gain) for _ in range(5)] == [0] * 5  # not restarted by the same gain
    assert ctl.choose(8, [0.45] * 8) == 1  # 1.16x: restarted
    one = AdaptiveK(4, 2, probe_every=10**6)
    one.set_costs(1, verify, 1e-3)
    assert one.choose(1, [0.35]) == 1 and one.choose(1, [0.2]) == 0 and one.choose(1, [0.35]) == 1


def test_a_step_of_drafting_keeps_the_probes_backoff():
    """Probes back off while K = 0 holds; a spell of drafting shorter than `settled_spell` steps (break-even α) does
    not restart them at `probe_every`, a lasting one does."""
    costs = {k: 0.030 * (1 + 0.5 * k) for k in (0, 1, 2, 4, 8)}  # pays at high α only

    def probes_after(spell: int) -> list[int]:
        ctl = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
        ctl.set_costs(4, costs, draft=0.004)
        assert [i for i in range(15) if ctl.choose(4, [0.7] * 4)] == [4, 14]  # the interval doubled to 20
        assert all(ctl.choose(4, [0.99] * 4) for _ in range(spell))
        return [i for i in range(40) if ctl.choose(4, [0.7] * 4)]

    assert probes_after(1) == [19]  # the backoff's interval, from the spell's end
    assert probes_after(4) == [4, 14, 34]  # a fresh clock


def test_no_probes_where_a_plausible_rise_of_alpha_could_not_pay():
    """16 bf16 rows on an AMD EPYC (AVX512-BF16, calibrated): a two-position verify costs 1.7 plain steps, so
    drafting pays only at α ~0.99. Rows at α 0.5 are not probed (each probe a drafter catch-up for an answer that
    cannot change K); rows whose α is within `probe_reach` of the break-even are."""
    verify = {0: 0.0209, 1: 0.0362, 2: 0.0516, 4: 0.0815, 8: 0.14}
    far, near = AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0), AdaptiveK(k_max=8, k_default=4, probe_every=5, probe_share=1.0)
    for ctl in (far, near):
        ctl.set_costs(16, verify, draft=0.0039)
    assert not any(far.choose(16, [0.5] * 16) for _ in range(40))
    assert [i for i in range(40) if near.choose(16, [0.9] * 16)] == [4, 14, 34]


def test_step_overhead_counts_for_every_k_and_favours_speculation():
    """Host work per step (measured online) is paid once per step: plain decoding pays it per token,
    speculation shares it over the accepted tokens, so a marginal alpha tips towards K > 0."""
    ctl = AdaptiveK(k_max=8, k_default=2, probe_every=10**6)
    ctl.set_costs(1, {k: cpu_batch1(k) for k in (0, 1, 2, 4, 8)}, draft=0.004)
    a = next(x / 100 for x in range(1, 100) if ctl.choose(1, [x / 100]) > 0)  # break-even alpha
    ctl.set_step_overhead(1, 0.004)
    assert ctl.choose(1, [a - 0.03]) > 0
    ctl.set_step_overhead(1, 0.0)
    assert ctl.choose(1, [a - 0.03]) == 0


def test_cost_model_ignores_stalls():
    c = CostModel()
    for x in [0.010] * 8 + [0.02] * 5:  # a stretch of descheduled steps
        c.record_verify(1, 0, x)
    assert c.verify_cost(1, 0) == pytest.approx(0.010)


def test_acceptance_ema():
    a = AcceptanceEMA(prior=0.5)
    for _ in range(30):
        a.update(4, 4)
    assert a.alpha > 0.9
    for _ in range(30):
        a.update(4, 0)
    assert a.alpha < 0.3
    assert a.estimate(prior=0.1) < 0.15
    # Steps without drafts fade the row's own evidence back toward the prior.
    for _ in range(60):
        a.update(0, 0)
    assert a.alpha == pytest.approx(0.5, abs=0.02)


def test_adaptive_k_weighs_the_drafter_catch_up():
    """Speculation that barely pays is not started when the drafter must first catch up on whole prompts;
    the same gain with nothing to catch up, or a big gain, is taken."""
    ctl = AdaptiveK(4, 2, margin=1.0)
    # Batch 16 on this CPU: verify(K) grows fast, a draft costs ~1/5 of a plain step.
    ctl.set_costs(16, {0: 10e-3, 1: 13.5e-3, 2: 17e-3, 4: 24e-3}, 2e-3, catchup_per_token=20e-6)
    rows = 16
    assert ctl.choose(16, [0.6] * rows, pending_tokens=2 * rows) == 1  # 1.6 / 1.55: a 3% gain
    assert ctl.choose(16, [0.6] * rows, pending_tokens=lambda: rows * 80) == 0  # 16 prompts to catch up
    assert ctl.choose(16, [0.95] * rows, pending_tokens=lambda: rows * 80) > 0  # a big gain pays for it


def _simulate(true_alphas: dict[str, float], rows: int = 60, seed: int = 0) -> dict[str, float]:
    """Rows of 64 tokens, one at a time, drafts accepted i.i.d. at their domain's rate; returns, per
    domain, the fraction of steps on which the controller drafted. Costs: the small pair on this CPU
    (break-even acceptance ~0.55)."""
    import random

    from dvi.decode.acceptance import AcceptanceTracker

    rng = random.Random(seed)
    ctl = AdaptiveK(8, 4)
    ctl.set_costs(1, {0: 7.16e-3, 1: 9.13e-3, 2: 9.85e-3, 4: 10.2e-3, 8: 10.1e-3}, 1.26e-3)
    tracker = AcceptanceTracker()
    drafted = {d: [0, 0] for d in true_alphas}
    for _ in range(rows):
        domain = rng.choice(sorted(true_alphas))
        row, rem = tracker.new_row(), 64
        while rem > 0:
            k = ctl.choose(1, [tracker.estimate(row, domain)])
            n = 0
            while n < k and rng.random() < true_alphas[domain]:
                n += 1
            tracker.update(row, domain, k, n)
            drafted[domain][0] += 1
            drafted[domain][1] += k > 0
            tracker.end_step(k)
            rem -= n + 1
    return {d: v[1] / v[0] for d, v in drafted.items()}


def test_adaptive_k_does_not_lock_itself_out():
    """A row whose estimate dips below break-even by chance must not stop drafting for good (K = 0
    produces no evidence); rows whose drafts really fail must stop; domains are pooled separately."""
    for seed in range(3):
        assert _simulate({"code": 0.68}, seed=seed)["code"] > 0.85
        assert _simulate({"prose": 0.2}, seed=seed)["prose"] < 0.1
        mixed = _simulate({"code": 0.68, "prose": 0.2}, seed=seed)
        assert mixed["code"] > 0.85 and mixed["prose"] < 0.1


def test_choose_k_matches_reference_formula():
    """The inlined hot path picks the K the plain formula (`expected_tokens` per row and K) picks."""
    import random

    from dvi.decode.k_choice import choose_k, expected_tokens

    def ref(alphas, dc, vc, k_max, margin, remaining):
        if remaining is not None:
            def drain(k):
                return max(r / expected_tokens(a, k) for a, r in zip(alphas, remaining, strict=True)) * (k * dc + vc[k])
            best_k, best = 0, drain(0) / margin
            for k in range(1, k_max + 1):
                if drain(k) < best * 0.9999:
                    best_k, best = k, drain(k)
            return best_k
        best_k, best = 0, len(alphas) / max(vc[0], 1e-12) * margin
        for k in range(1, k_max + 1):
            rate = sum(expected_tokens(a, k) for a in alphas) / max(k * dc + vc[k], 1e-12)
            if rate > best * 1.0001:
                best_k, best = k, rate
        return best_k

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 16)
        al = [rng.choice([0.0, 1.0, rng.random()]) for _ in range(n)]
        vc = sorted(rng.uniform(0.005, 0.05) for _ in range(9))
        dc = rng.uniform(0.0005, 0.01)
        rem = [rng.randint(1, 64) for _ in range(n)] if rng.random() < 0.5 else None
        assert choose_k(al, dc, vc, 8, 1.05, rem) == ref(al, dc, vc, 8, 1.05, rem)


def test_choose_rows_matches_the_full_pass():
    """The bound that skips a K row by row never skips the K and rows the full pass over every K would choose."""
    import itertools
    import random

    def ref(alphas, dc, verify, rows, k_max, margin):  # every K, and for each the m most likely rows, m = 1..n
        by_alpha = sorted(range(len(alphas)), key=lambda i: -alphas[i])
        best, choice = len(alphas) / verify[0] * margin, (0, [])
        for k, m in itertools.product(range(1, k_max + 1), range(1, len(alphas) + 1)):
            drafting = by_alpha[:m]
            rate = (len(alphas) + sum(expected_tokens(alphas[i], k) - 1.0 for i in drafting)) / (
                k * dc + verify[0] + m * max(verify[k] - verify[0], 0.0) / rows)
            if rate > best * 1.0001:
                best, choice = rate, (k, sorted(drafting))
        return choice

    rng = random.Random(1)
    drafted = 0
    for _ in range(3000):
        n = rng.randint(1, 16)
        al = [rng.choice([0.0, 1.0, rng.random(), 0.9 + 0.1 * rng.random()]) for _ in range(n)]
        plain = rng.uniform(0.005, 0.05)
        verify = [plain + k * n * rng.uniform(0.0, 0.004) for k in range(9)]
        dc = rng.uniform(0.0001, 0.01)
        got = choose_rows(al, dc, verify, n, 8, 1.05)
        assert got == ref(al, dc, verify, n, 8, 1.05)
        drafted += got[0] > 0
    assert 300 < drafted < 2700  # both outcomes exercised


def test_adaptive_cost_cache_follows_set_costs():
    from dvi.decode.adaptive import AdaptiveK

    c = AdaptiveK(4, 2)
    c.set_costs(1, {0: 0.010, 1: 0.011, 2: 0.012, 4: 0.014}, 0.001)
    assert c.choose(1, [0.9]) > 0
    c.set_costs(1, {0: 0.010, 1: 0.050, 2: 0.090, 4: 0.170}, 0.010)  # speculation now far too expensive
    c._clock(1).due = 10**9  # no probe due
    assert c.choose(1, [0.9]) == 0


def test_measured_goodput_overrides_a_calibration_that_favours_speculation():
    """Real pair, CPU, batch 16: the calibration said K = 1 pays (predicted 1.4x) while whole steps
    measured 0.74x of plain decoding. Once speculative and plain steps are measured, the slower one
    loses; the speculative measurement is forgotten after `max_probe_every` guarded steps."""
    ctl = AdaptiveK(k_max=4, k_default=2, max_probe_every=32, goodput_window=4)
    ctl.goodput.budget = 1.0  # the schedule alone (what a spell lost may wait longer: test_a_retry_waits_until_...)
    ctl.set_costs(16, {0: 0.100, 1: 0.102, 2: 0.104, 4: 0.108}, draft=0.002)
    alphas = [0.6] * 16
    assert ctl.choose(16, alphas) > 0  # the calibrated model alone speculates
    for _ in range(4):  # speculative steps measured: 16 rows x 1.6 tokens in 0.3 s
        ctl.observe_step(16, 2, 26, 0.300)
    assert ctl.measured_verdict(16) == "measure_plain"
    assert ctl.choose(16, alphas) == 0  # plain steps next, to measure them
    for _ in range(4):  # plain steps: 16 tokens in 0.1 s, twice the speculative goodput
        ctl.observe_step(16, 0, 16, 0.100)
    assert ctl.measured_verdict(16) == "plain"
    ks = [ctl.choose(16, alphas) for _ in range(31)]
    assert ks == [0] * 31  # not even probes: each would cost what plain decoding measured faster
    ctl.choose(16, alphas)  # the 32nd guarded step forgets the speculative measurement
    assert ctl.measured_verdict(16) == "unknown" and ctl.choose(16, alphas) > 0
    # another bucket is unaffected; a measured win keeps speculating
    for _ in range(4):
        ctl.observe_step(1, 3, 3, 0.040)
        ctl.observe_step(1, 0, 1, 0.035)
    ctl.set_costs(1, {0: 0.035, 1: 0.036, 2: 0.037, 4: 0.040}, draft=0.002)
    assert ctl.measured_verdict(1) == "spec" and ctl.choose(1, [0.8]) > 0


class _FakeRows:
    """Calibration rows whose forwards 'take' scripted seconds; logs what runs, in order."""

    tokens = 100

    def __init__(self):
        self.log: list[tuple] = []
        self.rep = 0

    def sync(self) -> None:
        pass

    def prefill_drafter(self):
        self.log.append(("prefill",))
        return 0.02

    def verify(self, k):
        self.log.append(("verify", k))
        return lambda: 0.010 * (1 + 0.1 * k) + 0.001 * self.rep  # later reps slower: the min is the first

    def undo_verify(self, k):
        self.log.append(("undo_verify", k))

    def draft(self, j):
        self.log.append(("draft", j))
        return lambda: 0.002 if j == 0 else 0.001  # the first draft after a verify runs cold

    def undo_drafts(self, n):
        self.log.append(("undo_drafts", n))
        self.rep += 1


def test_calibrate_interleaves_and_prices_chains(monkeypatch):
    monkeypatch.setattr(dvi.engine.calibration, "_timed", lambda run, sync: run())  # the scripted seconds
    rows = _FakeRows()
    c = dvi.engine.calibration.calibrate(rows, k_max=4, reps=2)
    one_rep = [("verify", 0), ("undo_verify", 0), ("verify", 1), ("undo_verify", 1), ("verify", 2),
               ("undo_verify", 2), ("verify", 4), ("undo_verify", 4),
               ("draft", 0), ("draft", 1), ("draft", 2), ("draft", 3), ("undo_drafts", 5)]
    assert rows.log == [("prefill",)] + one_rep * 2
    assert c.catchup_per_token == pytest.approx(0.02 / 100)
    assert c.draft == pytest.approx(0.001)  # the warm marginal draft
    chain = [0.002, 0.003, 0.004, 0.005]
    for k in (0, 1, 2, 4):
        # K * draft + verify(K) is the measured chain of K drafts plus the (fastest) verify of K + 1 tokens
        assert k * c.draft + c.verify[k] == pytest.approx((chain[k - 1] if k else 0.0) + 0.010 * (1 + 0.1 * k))
    assert set(c.verify) == {0, 1, 2, 4}


def test_goodput_is_judged_on_whole_windows_not_on_the_median_step():
    """Real pair, Intel AMX, bf16, batch 1 (serve_speed, code): drafting steps emit 1 token when the draft is
    rejected and 3 when it is not, so the median drafting step is a rejected one, slower than a plain step, while
    drafting wins on the whole (the requests that drafted finished sooner). The window's tokens over its seconds
    decide; a stall in the plain window does not flip the verdict."""
    g = GoodputGuard(window=8, margin=1.05)
    for i in range(8):  # 5 rejected drafts (1 token, 50 ms), 3 accepted (3 tokens, 52 ms): 34 tok/s
        g.observe(1, True, 3 if i % 3 == 0 else 1, 0.052 if i % 3 == 0 else 0.050)
    for i in range(8):  # plain steps: 1 token in 42 ms (24 tok/s), one of them stalled for a second
        g.observe(1, False, 1, 1.0 if i == 4 else 0.042)
    assert g.verdict(1) == "spec"
    g2 = GoodputGuard(window=8, margin=1.05)
    for i in range(8):  # only 1 of 8 drafts accepted: 10 tokens in 0.402 s (25 tok/s), within the margin of plain
        g2.observe(1, True, 3 if i == 0 else 1, 0.052 if i == 0 else 0.050)
        g2.observe(1, False, 1, 0.042)
    assert g2.verdict(1) == "plain"


def test_one_row_is_not_switched_off_by_an_unlucky_window():
    """At batch 1 a window of steps is one prompt's luck; the calibrated costs (with the measured host work) and the
    row's own acceptance decide there. From 3 rows on the measured verdict overrides the calibration."""
    ctl = AdaptiveK(k_max=4, k_default=2, goodput_window=4)
    for b in (1, 16):
        ctl.set_costs(b, {0: 0.040, 1: 0.045, 2: 0.047, 4: 0.050}, draft=0.002)
        for _ in range(4):  # an unlucky spell: every draft rejected, slower than plain
            ctl.observe_step(b, 2, b, 0.049)
            ctl.observe_step(b, 0, b, 0.040)
        assert ctl.measured_verdict(b) == "plain"
    assert ctl.choose(1, [0.6]) > 0
    assert ctl.choose(16, [0.6] * 16) == 0


def test_a_ragged_verify_drafts_only_the_rows_that_pay():
    """8 rows, verify cost linear in positions (a CPU at batch 8: a drafted position costs half what a row's plain
    token does): drafting every row at any K loses, drafting the two rows whose drafts are almost always kept wins;
    with every α low nothing drafts, with every α high every row does."""
    plain, per_position = 0.08, 0.08 / 16
    verify = [plain + 8 * k * per_position for k in range(5)]  # calibrated for 8 rows, full width
    alphas = [0.95, 0.9] + [0.2] * 6
    assert choose_k(alphas, 0.002, verify, 4, 1.05) == 0
    k, rows = choose_rows(alphas, 0.002, verify, 8, 4, 1.05)
    assert k > 0 and rows == [0, 1]
    rate = (8 + sum(expected_tokens(a, k) - 1 for a in alphas[:2])) / (k * 0.002 + plain + 2 * k * per_position)
    assert rate > 1.05 * 8 / plain
    assert choose_rows([0.2] * 8, 0.002, verify, 8, 4, 1.05) == (0, [])
    k, rows = choose_rows([0.99] * 8, 0.0005, [plain + k * 0.004 for k in range(5)], 8, 4, 1.05)
    assert k > 0 and rows == list(range(8))


def test_adaptive_k_hands_the_paying_rows_to_the_proposer():
    a = AdaptiveK(k_max=4, k_default=2)
    a.set_costs(8, {k: 0.08 + 0.04 * k for k in range(5)}, 0.002)
    a.ragged = True
    k = a.choose(8, [0.2, 0.95, 0.2, 0.2, 0.9, 0.2, 0.2, 0.2])
    assert k > 0 and a.last_rows == [1, 4]
    a.ragged = False  # the target scores every position: all rows or none
    assert a.choose(8, [0.2, 0.95, 0.2, 0.2, 0.9, 0.2, 0.2, 0.2]) == 0 and a.last_rows is None


def test_the_goodput_guard_charges_drafting_with_its_catch_ups():
    """Under load rows join every few steps and each joiner's prompt goes through the drafter first: drafting steps
    that win without their catch-ups but lose with them must read as losing (real pair, Intel AMX, 16 rows: 1.09x
    plain without, 1.03x with, under the 1.05 margin). The first drafting step after plain ones is left out: its
    catch-up pays for the plain stretch, and counting it would condemn every retry."""
    import torch

    from dvi.decode.pricing import KPolicy, StepTimes
    from dvi.drafters.proposer import Draft

    def draft(k: int, catchup: bool) -> Draft:
        return Draft(torch.zeros(16, k, dtype=torch.long), None, [k] * 16, ["model" if k else None] * 16, None,
                     model_forwards=k, catchup=catchup)

    def run(joiners: bool, resume_seconds: float) -> str:
        policy = KPolicy(True, 2, 4, calibrate=lambda b: None)
        for _ in range(8):  # plain steps: 16 tokens in 70 ms
            policy.observe(draft(0, False), 16, StepTimes(0.0, 0.07, 0.006, 0.070), 16, cpu=True)
        # drafting resumes with a catch-up of the plain stretch, then 23 tokens in 90 ms a step, every other step
        # with a joiner's catch-up (107 ms) where rows join
        policy.observe(draft(1, True), 16, StepTimes(0.2, 0.085, 0.012, resume_seconds), 23, cpu=True)
        for i in range(policy.controller.goodput.window // 2):  # the guard's least: half its window
            slow = joiners and i % 2 == 1
            policy.observe(draft(1, slow), 16, StepTimes(0.017 if slow else 0.008, 0.085, 0.012,
                                                         0.107 if slow else 0.090), 23, cpu=True)
        return policy.controller.measured_verdict(16)

    assert run(joiners=True, resume_seconds=0.15) == "plain"  # 1.03x plain with the joiners' catch-ups
    assert run(joiners=False, resume_seconds=0.15) == "spec"  # 1.09x: the resuming catch-up is not held against it


def test_steps_that_admit_rows_are_no_guard_samples_and_mixed_steps_feed_both_guards():
    """A step that admitted rows carries their prefills in its verify (real pair, AMD Zen3, fp32, 8 in flight: 420-830
    ms against 80 ms without): counted as a plain sample it made drafting that lost look faster than plain steps.
    A step that drafted from the learned drafter and the history index at once is a sample of both guards (it was
    one of neither, so a hybrid server's mixed steps were never judged)."""
    import torch

    from dvi.decode.pricing import KPolicy, StepTimes
    from dvi.drafters.proposer import Draft

    def draft(k: int, model: bool, suffix: bool) -> Draft:
        d = Draft(torch.zeros(8, k, dtype=torch.long), None, [k] * 8, ["model" if k else None] * 8, None,
                  model_forwards=k if model else 0, catchup=False)
        d.suffix_rows, d.lookup_seconds = suffix and k > 0, 0.001
        return d

    def run(prefills_counted: bool) -> tuple[str, str]:
        policy = KPolicy(True, 2, 4, calibrate=lambda b: None)
        policy.observe(draft(1, True, True), 8, StepTimes(0.01, 0.1, 0.005, 0.110), 10, cpu=True)  # drafting resumed: no sample
        for i in range(policy.controller.goodput.window):
            # plain steps: 8 tokens in 80 ms, every other one with a joiner's prefill (600 ms)
            joined = i % 2 == 1
            policy.observe(draft(0, False, False), 8, StepTimes(0.0, 0.6 if joined else 0.08, 0.005,
                                                                0.600 if joined else 0.080), 8, cpu=True,
                           joined=joined and not prefills_counted)
            # mixed drafting steps: 14 tokens in 160 ms (8.75 a row a second against 12.5 for plain)
            policy.observe(draft(2, True, True), 8, StepTimes(0.02, 0.13, 0.005, 0.160), 14, cpu=True)
        return policy.controller.measured_verdict(8), policy.suffix_guard.verdict(8)

    assert run(prefills_counted=False) == ("plain", "plain")
    # with the prefills in the plain window the same steps read as faster than plain
    assert run(prefills_counted=True) == ("spec", "spec")


def test_the_history_guard_judges_plain_steps_without_the_lookups_that_found_nothing():
    """A step the history guard refuses looks nothing up (`KPolicy.lookups_due`), so its plain samples are judged as
    they would run refused: without their lookups' host work. History drafts of 11 tokens in 100 ms beside plain
    steps of 8 tokens in 80 ms, 10 of them lookups that found nothing: 1.1x plain with the lookups, 0.96x without."""
    import torch

    from dvi.decode.pricing import KPolicy, StepTimes
    from dvi.drafters.proposer import Draft

    def draft(k: int, lookups: float) -> Draft:
        d = Draft(torch.zeros(8, k, dtype=torch.long), None, [k] * 8, ["suffix" if k else None] * 8, None,
                  model_forwards=0, catchup=False)
        d.suffix_rows, d.lookup_seconds = k > 0, lookups
        return d

    policy = KPolicy(True, 2, 4, calibrate=lambda b: None)
    for _ in range(policy.suffix_guard.window):
        policy.observe(draft(2, 0.010), 8, StepTimes(0.0, 0.085, 0.005, 0.100), 11, cpu=True)
        policy.observe(draft(0, 0.010), 8, StepTimes(0.0, 0.065, 0.005, 0.080), 8, cpu=True)
    assert policy.suffix_guard.verdict(8) == "plain"


def test_a_refusing_guard_retries_soon_then_backs_off_and_a_new_drafter_brings_the_retry_near():
    from dvi.decode.adaptive import GoodputGuard

    g = GoodputGuard(window=4, retry_every=16, retry_first=4, budget=1.0)  # (a budget that never waits longer)

    def measure(spec_rate: float) -> None:  # drafting, then plain: 1 token a row in 0.1 s
        for _ in range(2):
            g.observe(8, True, int(8 * spec_rate), 0.100)
            g.observe(8, False, 8, 0.100)

    measure(0.5)
    assert g.judged(8) == "plain"
    assert refusals_until_retry(g) == 4
    retries = []
    for _ in range(3):
        measure(0.5)  # every retry measures drafting slower again
        retries.append(refusals_until_retry(g))
    assert retries == [8, 16, 16]  # doubling to retry_every
    measure(2.0)
    assert g.judged(8) == "spec"  # drafting pays again: the back-off is gone
    measure(0.5)
    measure(0.5)  # a full window of slower drafting
    assert refusals_until_retry(g) == 4
    measure(0.5)
    assert refusals_until_retry(g) == 8
    measure(0.5)
    for _ in range(3):
        g.refused(8)
    g.reset()  # a new drafter serves: the retry is due within retry_first refusals of the spell
    assert g.judged(8) == "plain" and refusals_until_retry(g) == 1


def test_a_retry_waits_until_its_plain_steps_pay_for_what_the_last_spell_lost():
    """Exploring drafting that measured slower costs at most `budget` of the plain time: a spell losing 0.1 s (two
    drafting steps of half a plain step's tokens, 0.1 s each) waits 0.1 / (0.05 x 0.1 s) = 20 refusals at a 5% budget
    (the schedule alone: 4), its drafter catch-up counted (0.2 s more: 60); a new drafter's first spell waits only the
    schedule."""
    from dvi.decode.adaptive import GoodputGuard

    g = GoodputGuard(window=4, retry_every=16, retry_first=4, budget=0.05)

    def spell(catchup: float = 0.0) -> None:
        if catchup:
            g.observe_catchup(8, catchup)
        for _ in range(2):
            g.observe(8, True, 4, 0.100)
            g.observe(8, False, 8, 0.100)

    spell()
    assert refusals_until_retry(g) == 20
    spell(catchup=0.2)
    assert refusals_until_retry(g) == 60
    spell()
    g.reset()  # a new drafter serves: its first spell is not charged the old one's loss
    assert refusals_until_retry(g) == 4
    spell(catchup=0.3)
    g.observe(8, True, 16, 0.100)  # a drafting step that pays clears the spell's catch-up
    g.observe(8, True, 16, 0.100)
    assert g.judged(8) == "spec"
    spell(), spell()
    assert refusals_until_retry(g) == 40  # 0.2 s lost (the window's four slow steps), not the cleared catch-up


def test_drafting_judged_faster_keeps_its_verdict_until_it_measures_slower_than_plain():
    """Hysteresis: drafting must measure `margin` x plain's rate to be judged faster, then keeps that verdict while it
    measures at least `HOLD` x (a window of drafting that pays dips under the margin by the batch's luck: each dip was
    a retry's wait of plain steps); under `HOLD` it is judged slower, and back in the band it stays so."""
    from dvi.decode.adaptive import GoodputGuard

    g = GoodputGuard(window=4, margin=1.05)

    def window(ratio: float) -> str:
        for _ in range(4):
            g.observe(8, True, 8 * ratio, 0.100)
            g.observe(8, False, 8, 0.100)
        return g.judged(8)

    assert window(1.02) == "plain"  # never judged faster: the margin decides
    assert window(1.20) == "spec"
    assert window(1.02) == "spec"  # within the band: held
    assert window(0.97) == "plain"
    assert window(1.02) == "plain"  # within the band again: held the other way
    assert window(1.10) == "spec"
    g.reset()  # a new drafter: nothing held
    assert window(1.02) == "plain"


def test_a_stall_in_a_drafting_spell_is_not_what_the_spell_lost():
    """A step `STALL` times the window's median (the machine: a swap, the trainer) is left out of what a spell lost as
    it is of its rate: a spell of three steps at the plain rate and one stalled 10x waits the schedule, not the stall."""
    from dvi.decode.adaptive import GoodputGuard

    g = GoodputGuard(window=4, retry_every=16, retry_first=4, budget=0.05)
    for s in (0.100, 0.100, 0.100, 1.000):
        g.observe(8, True, 8, s)
        g.observe(8, False, 8, 0.100)
    assert g.judged(8) == "plain"  # equal rates: drafting does not win by the margin
    assert refusals_until_retry(g) == 4  # charged, the 0.9 s stall alone would wait 0.9 / (0.05 x 0.1 s) = 180


def refusals_until_retry(guard, batch: int = 8) -> int:
    """Steps a refusing guard refuses drafting at `batch` rows before it retries (forgets its drafting samples)."""
    n = 0
    while guard.judged(batch) == "plain":
        guard.refused(batch)
        n += 1
    return n


def test_history_lookups_that_draft_nothing_back_off_in_large_batches_and_resume_when_they_draft():
    """From `LOOKUP_BACKOFF_FROM` rows a lookup step that drafted nothing skips the next 1, 2, 4 .. steps' lookups
    (capped), one that drafted resets it; smaller batches look every step; fixed K always looks."""
    from types import SimpleNamespace

    from dvi.decode.pricing import LOOKUP_BACKOFF_FROM, LOOKUP_BACKOFF_MAX, KPolicy, StepTimes

    def run(policy: KPolicy, rows: int, drafted: list[bool]) -> list[bool]:
        looked = []
        for i in range(len(drafted)):
            p = policy.for_step([SimpleNamespace()] * rows)
            looked.append(p.lookups)
            hit = p.lookups and drafted[i]
            draft = SimpleNamespace(width=2 if hit else 0, model_forwards=0, catchup=False, suffix_rows=hit,
                                    lookup_seconds=0.001 if p.lookups else 0.0, tree=False)
            policy.observe(draft, rows, StepTimes(0.001, 0.02, 0.001, 0.022), rows + 2 * hit, cpu=True)
        return looked

    adaptive = KPolicy(True, 2, 4, calibrate=lambda b: None)
    looked = run(adaptive, LOOKUP_BACKOFF_FROM * 4, [False] * 40)
    gaps = [i for i, x in enumerate(looked) if x]
    assert gaps[:5] == [0, 2, 5, 10, 19] and max(b - a for a, b in zip(gaps, gaps[1:], strict=False)) \
        <= LOOKUP_BACKOFF_MAX + 1
    # a step whose lookups drafted resets the backoff: the next step looks again
    looked = run(adaptive, LOOKUP_BACKOFF_FROM * 4, [True] * 60)
    assert looked[-5:] == [True] * 5
    assert all(run(KPolicy(True, 2, 4, calibrate=lambda b: None), 2, [False] * 12))  # small batches: every step
    assert all(run(KPolicy(False, 2, 4, calibrate=lambda b: None), 16, [False] * 12))  # fixed K
