"""What a step costs: the calibration read at the positions a step scores, and corrected by what real steps measured."""

from __future__ import annotations

import pytest

from dvi.decode.adaptive import AdaptiveK
from dvi.decode.step_costs import MeasuredCosts

MS = 1e-3
VERIFY_8 = {0: 10 * MS, 1: 12 * MS, 2: 16 * MS, 4: 24 * MS}  # 8 rows: flat to 16 positions, then ~1 ms a position


def test_measured_costs_wait_for_a_few_steps_and_move_only_by_a_step():
    m = MeasuredCosts(window=5, least=3, step=0.02)
    assert m.value(8, "plain") == 1.0 and m.value(8, "position") == 0.0  # nothing measured: the calibration stands
    assert not m.observe(8, "plain", 3.0) and not m.observe(8, "plain", 1.2)  # one stalled step moves nothing
    assert m.observe(8, "plain", 1.1) and m.value(8, "plain") == pytest.approx(1.2)  # the median of three
    assert not m.observe(8, "plain", 1.2)  # the median stays
    assert not m.observe(8, "plain", float("nan"))
    assert m.observe(8, "position", 1 * MS) is False and m.values() == {"8/plain": pytest.approx(1.2)}


def test_a_verify_is_priced_at_the_positions_it_scores():
    """11 rows verifying 2 positions each score 22: the bucket's (8 rows) calibrated verify of 22 positions (K = 1.75
    there), not its 8 rows verifying 2 (16 positions)."""
    ctl = AdaptiveK(k_max=4, k_default=2)
    ctl.set_costs(8, VERIFY_8, draft=1 * MS)
    assert ctl.verify_at(8, 1) == pytest.approx(12 * MS)  # the calibrated batch: as calibrated
    assert ctl.verify_at(11, 1) == pytest.approx(15 * MS)  # 22 positions: between K = 1 (16) and 2 (24)
    assert ctl.verify_at(11, 0) == pytest.approx(10.75 * MS)
    assert ctl.verify_at(6, 0) == pytest.approx(9.5 * MS)  # 6 positions: below the calibrated 8, the first slope
    assert ctl.draft_at(11) == pytest.approx(1 * MS)


def test_drafting_steps_that_measure_dearer_than_their_price_price_drafting_out():
    """A drafting step pays what the calibration's bare forwards do not: at T = 1 the acceptance rule's work over the
    vocabulary at every drafted position, the drafter's sampled proposals (AMD Zen 5, bf16, 5 rows sampled at T = 1:
    21 ms a drafting step priced at 13). Three such steps and the price follows them: rows that drafted at the
    calibrated price stop; plain steps measured as priced change nothing."""
    ctl = AdaptiveK(k_max=4, k_default=2, probe_every=10**6)
    ctl.set_costs(8, VERIFY_8, draft=1 * MS)
    alphas = [0.5] * 8
    assert ctl.choose(8, alphas) > 0
    for _ in range(5):
        ctl.observe_costs(8, 8, 0, 10 * MS, 0.0, False)  # plain steps as priced
    assert ctl.choose(8, alphas) > 0
    for _ in range(3):  # K = 1 steps: 8 drafted positions, 0.75 ms each beyond the price; the drafter twice its price
        ctl.observe_costs(8, 16, 1, 12 * MS + 8 * 0.75 * MS, 2 * MS, False)
    assert ctl.verify_at(8, 1) == pytest.approx(18 * MS) and ctl.draft_at(8) == pytest.approx(2 * MS)
    assert ctl.choose(8, alphas) == 0


def test_a_catch_up_is_no_sample_of_what_a_drafter_forward_costs():
    ctl = AdaptiveK(k_max=4, k_default=2)
    ctl.set_costs(8, VERIFY_8, draft=1 * MS)
    for _ in range(3):
        ctl.observe_costs(8, 16, 1, 12 * MS, 40 * MS, True)  # the drafter caught up on every row's tokens
    assert ctl.draft_at(8) == pytest.approx(1 * MS)


def test_a_probe_waits_until_the_plain_steps_since_the_last_one_cover_its_price():
    """16 rows: probes are due at 16, 48, 112 .. plain steps, but run only once `probe_share` (1%) of the plain steps
    since the last one covers their priced loss (12 bf16 rows sampled at T = 1 on AMD Zen 5: a probe lost ~2 plain
    steps, its catch-up and a verify at the compute bound); where a probe costs nothing (drafts that nearly pay, no
    catch-up) the clock alone decides."""
    verify = {0: 15 * MS, 1: 21 * MS, 2: 27 * MS, 4: 39 * MS}  # K = 1 with its draft: 1.47 plain steps

    def probes(alpha: float, pending: int) -> list[int]:
        ctl = AdaptiveK(k_max=4, k_default=2, probe_every=16, max_probe_every=64, probe_k=1)
        ctl.set_costs(16, verify, draft=1 * MS, catchup_per_token=25e-6)
        return [i for i in range(600) if ctl.choose(16, [alpha] * 16, pending_tokens=pending)]

    # α 0.4, within reach at +0.15: loss = catch-up 20 + draft 1 + verify 6 - gain 6 = 21 ms, 1% of ~140 plain steps
    assert probes(0.4, 800) == [140, 281, 422, 563]
    assert probes(0.47, 0) == [15, 47, 111, 175, 239, 303, 367, 431, 495, 559]


def test_a_server_reports_what_its_steps_measured_against_their_prices(tiny_pair_dir, tmp_path):
    """Through `dvi serve` with adaptive K: /health's `step_costs` holds each bucket's measured factors, once three
    steps measured them (the tiny pair's steps: whatever this machine makes of them, positive factors)."""
    from test_serving_helpers import ServerThread, tiny_config

    cfg = tiny_config(tiny_pair_dir, tmp_path / "run", "speculation.adaptive=true")
    with ServerThread(cfg) as s, s.client() as c:
        for _ in range(3):
            r = c.post("/v1/completions", json={"prompt": "def merge(a, b):\n", "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
        costs = s.health()["step_costs"]
        assert costs and all(k.split("/")[1] in ("plain", "draft", "position") for k in costs)
        assert all(v > 0 for k, v in costs.items() if not k.endswith("/position"))
    fixed = tiny_config(tiny_pair_dir, tmp_path / "fixed")
    with ServerThread(fixed) as s, s.client() as c:
        c.post("/v1/completions", json={"prompt": "def merge(a, b):\n", "max_tokens": 8, "temperature": 0})
        assert s.health()["step_costs"] == {}  # fixed K prices nothing
