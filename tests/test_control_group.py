"""Issue 59 §1: the control group's parts alone: the arm a request draws, the uplift and its interval, the windows.

The live part (a control row drafts with the frozen base in the same batches, its record and response say so, and its
text equals the learned arm's) is `tests/test_adapters.py::test_control_rows_draft_with_the_frozen_base`.
"""

from __future__ import annotations

import math
import random

import pytest

from dvi.config import load_config
from dvi.decode.results import DraftCounts
from dvi.metrics.uplift import MIN_SAMPLES, ArmSample, compare, decode_rate, uplift
from serving.control import ControlGroups, control_values, draw_arm


def test_a_share_of_each_groups_keys_draws_the_control_arm_and_a_key_keeps_its_arm() -> None:
    keys = [f"req-{i}" for i in range(4000)]
    arms = [draw_arm(0.25, "code", k) for k in keys]
    n = arms.count("control")
    assert abs(n - 1000) < 4 * math.sqrt(4000 * 0.25 * 0.75)  # binomial, 4 SD
    assert arms == [draw_arm(0.25, "code", k) for k in keys]  # a retried request keeps its arm
    assert arms != [draw_arm(0.25, "sql", k) for k in keys]  # groups draw independently
    assert {draw_arm(0.0, "code", k) for k in keys} == {"learned"}
    assert {draw_arm(0.5, "", k) for k in keys} == {"learned"}  # no group, no adapter to hold back


def test_uplift_is_the_ratio_of_means_with_an_interval_that_narrows_with_requests() -> None:
    rng = random.Random(0)
    learned = [1.5 + rng.gauss(0, 0.2) for _ in range(40)]
    control = [1.0 + rng.gauss(0, 0.2) for _ in range(40)]
    u = uplift(learned, control)
    assert u.ratio == pytest.approx((sum(learned) / 40) / (sum(control) / 40))
    assert u.low < u.ratio < u.high and u.significant and u.low > 1.2
    wide = uplift(learned[:5], control[:5])
    assert wide.high - wide.low > u.high - u.low
    same = uplift(control[:20], control[20:])  # an A/A test: the interval holds 1
    assert same.low < 1.0 < same.high and not same.significant
    few = uplift(learned[: MIN_SAMPLES - 1], control)
    assert few.low is None and not few.significant
    assert uplift([], control) is None and uplift([0.0, 0.0, 0.0], control) is None


def _sample(arm: str, version: int, accepted: int, steps: int = 10, tokens: int = 20) -> ArmSample:
    counts = DraftCounts(num_steps=steps, num_drafted=4 * steps, num_accepted=accepted,
                         drafted_per_position=[steps, steps, steps, steps])
    return ArmSample.of(arm, version, counts, tokens, latency_s=1.1, ttft_s=0.1)


def test_a_sample_counts_tokens_per_pass_and_decode_rate_as_the_engine_timed_it() -> None:
    s = _sample("learned", 3, accepted=10)
    assert s.tokens_per_pass == 2.0 and s.decode_tokens_per_s == pytest.approx(19.0) and s.drafting_steps == 10
    assert decode_rate(1, 1.0, 0.5) is None and decode_rate(5, None, 0.5) is None and decode_rate(5, 0.5, 0.5) is None
    c = compare([s, _sample("control", 0, accepted=0)])
    assert c["learned"]["alpha"] == 0.25 and c["control"]["tokens_per_pass"] == 1.0
    assert c["uplift"]["tokens_per_pass"]["ratio"] == 2.0 and c["uplift"]["tokens_per_pass"]["low"] is None


def test_a_groups_window_restarts_when_its_served_version_changes() -> None:
    groups = ControlGroups(0.5)
    for _ in range(4):
        groups.observe("code", _sample("learned", 1, accepted=10))
        groups.observe("code", _sample("control", 0, accepted=2))
    groups.observe("", _sample("learned", 0, accepted=2))  # no group: not in any window
    r = groups.report()
    assert list(r) == ["code"] and r["code"]["adapter_version"] == 1 and r["code"]["learned"]["requests"] == 4
    assert r["code"]["uplift"]["tokens_per_pass"]["ratio"] == pytest.approx(2.0 / 1.2, abs=1e-4)
    row = control_values(r["code"])
    assert row["dvi_control_uplift/tokens_per_pass"] == pytest.approx(2.0 / 1.2, abs=1e-4)
    assert row["dvi_control_requests_total/control"] == 4
    groups.observe("code", _sample("learned", 2, accepted=5))  # a promotion: compare v2 with the control since
    r = groups.report()["code"]
    assert r["adapter_version"] == 2 and r["learned"]["requests"] == 1 and r["control"]["requests"] == 0


def test_control_share_names_what_it_needs(tmp_path) -> None:
    with pytest.raises(ValueError, match="serve.control_share .* trainer.adapter_key"):
        load_config(None, ["serve.control_share=0.1"])
    with pytest.raises(ValueError, match="control_share"):
        load_config(None, ["serve.control_share=0.9", "trainer.adapter_key=domain"])
    assert load_config(None, []).control_share == 0.0  # no groups, no control
    assert load_config(None, ["trainer.adapter_key=user"]).control_share == 0.05
    assert load_config(None, ["serve.control_share=0.2", "trainer.adapter_key=domain"]).control_share == 0.2
    assert load_config(None, ["serve.control_share=0", "trainer.adapter_key=domain"]).control_share == 0.0


def test_groups_past_the_cap_enter_only_with_an_adapter_and_the_oldest_leaves() -> None:
    """With adapter_key user every client is a group: the control group keeps at most max_groups of them (the
    metrics' group label stays bounded), the one seen longest ago leaving for a group an adapter serves."""
    groups = ControlGroups(0.5, max_groups=2)
    assert groups.observe("u1", _sample("learned", 0, 5)) and groups.observe("u2", _sample("control", 0, 5))
    assert not groups.observe("u3", _sample("learned", 0, 5))  # full, and no adapter serves u3
    assert groups.observe("u1", _sample("learned", 0, 5))  # u1 seen again: u2 is now the oldest
    assert groups.observe("u3", _sample("learned", 2, 5))  # an adapter serves u3: u2 leaves
    assert sorted(groups.report()) == ["u1", "u3"] and groups.take_evicted() == ["u2"] and groups.take_evicted() == []


def test_an_evicted_groups_series_leave_metrics(tmp_path) -> None:
    from dvi.config import load_config
    from serving.telemetry import ServerMetrics

    cfg = load_config(None, [f"run_dir={tmp_path}", "wandb.mode=disabled", "trainer.adapter_key=user",
                             "trainer.max_adapters=1"])
    m = ServerMetrics(cfg, control_share=0.5)
    m.control.observe("u1", _sample("learned", 1, 5))
    m.m["dvi_control_requests_total"].labels(group="u1", arm="learned").inc()
    m.update_control()
    assert 'group="u1"' in m.render()[0].decode()
    m.control.observe("u2", _sample("learned", 3, 5))
    m.update_control()
    text = m.render()[0].decode()
    assert 'group="u1"' not in text and 'dvi_control_uplift{bound="ratio",group="u2"' in text
    m.close()
