"""benchmarks/field_engine.py: the field's workload through the engine in process (C in flight, a new request as one
finishes), its pooling and goals; a tiny pair stands in for the real one."""

from __future__ import annotations

import pytest
import torch
from test_engine import reference
from tiny_models import tiny_llama

from benchmarks import field_engine as fe
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine


def test_the_workload_keeps_c_in_flight_and_returns_each_prompts_answer_in_order():
    target = tiny_llama(0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (8 + i,), generator=g).tolist() for i in range(7)]
    off = SpeculativeEngine(target, None)
    spec = SpeculativeEngine(target, proposer_for(target, target), num_draft_tokens=3)
    seen = []
    step = spec.step
    spec.step = lambda: seen.append(spec.num_active()) or step()  # rows in the batch each step
    run = fe.run_workload(spec, prompts, 3, 6, (), "t")
    assert run.tokens == 7 * 6 and run.seconds > 0 and max(seen) == 3 and run.steps == len(seen)
    plain = fe.run_workload(off, prompts, 3, 6, (), "t")
    assert run.answers == plain.answers
    assert run.answers[4] == reference(target, prompts[4], 6)
    # what it drafted to get there: a drafter equal to the target drafts and is accepted, speculation off drafts none
    assert 0 < run.accepted <= run.drafted and run.steps < plain.steps and plain.drafted == plain.accepted == 0


def test_rounds_pool_by_tokens_over_seconds_and_every_kind_is_held_to_off():
    results = {"off": {8: [fe.Run(100, 1.0, [], 0, 0, 100), fe.Run(100, 2.0, [], 0, 0, 100)]},
               "suffix": {8: [fe.Run(100, 0.5, [], 40, 30, 80), fe.Run(100, 2.5, [], 0, 0, 100)]}}
    rows = fe.figures(results, {"suffix": 0})
    suffix, off = (next(r for r in rows if r["arm"] == a) for a in ("suffix", "off"))
    assert suffix["x_off"] == pytest.approx(1.0) and suffix["x_off_rounds"] == pytest.approx([2.0, 0.8])
    assert suffix["drafted_per_100"] == pytest.approx(20.0) and suffix["alpha"] == pytest.approx(0.75)
    assert suffix["tokens_per_step"] == pytest.approx(200 / 180)
    assert off["drafted_per_100"] == 0.0 and off["alpha"] is None
    gs = fe.goals(rows, "fp32", {"suffix": 0})
    assert [g["met"] for g in gs] == [True, True]
    assert not fe.goals(rows, "fp32", {"suffix": 1})[-1]["met"]


def test_arms_start_with_off_and_name_known_kinds():
    assert fe.parse_args(["--arms", "off,hybrid", "--concurrency", "4"]).levels == [4]
    with pytest.raises(SystemExit):
        fe.parse_args(["--arms", "hybrid,off"])
    with pytest.raises(SystemExit):
        fe.parse_args(["--arms", "off,eagle"])
