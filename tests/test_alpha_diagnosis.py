"""Issue 59 §2: why live α moved. The rule names each staged cause from a window's numbers, and the measure behind
"serving disagrees" holds on real engine records of the tiny pair and falls when the drafts are not the weights'."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from test_online import engine_records
from tiny_models import tiny_llama  # noqa: F401 - builds the tiny pair's fixtures

from dvi.feedback.shadow import hf_logits_fn
from dvi.feedback.verdict import scorer
from dvi.models.loading import load_pair
from serving.drafter.diagnosis import CAUSES, Diagnosis, WindowStats, explain, measure


def _w(index: int, alpha: float, served: float, reference: float, consistency: float | None = 0.97,
       versions: tuple[int, ...] = (1,), targets: tuple[int, ...] = (0,)) -> WindowStats:
    drafted = 400
    return WindowStats(index=index, records=32, drafted=drafted, accepted=int(alpha * drafted), alpha_live=alpha,
                       alpha_served=served, alpha_reference=reference, consistency=consistency,
                       consistency_drafts=drafted, versions=versions, target_versions=targets)


def test_each_staged_cause_is_named_with_its_numbers() -> None:
    base = _w(1, 0.55, 0.60, 0.50)
    cases = {
        "traffic_changed": _w(2, 0.30, 0.35, 0.28),  # a new domain: the frozen base's α̂ fell with it
        "target_changed": _w(2, 0.40, 0.45, 0.42, targets=(1,)),  # a target update, the drafter held back
        "drafter_changed": _w(2, 0.35, 0.38, 0.50, versions=(2,)),  # a bad version promoted (and then rolled back)
        "serving_disagrees": _w(2, 0.20, 0.60, 0.50, consistency=0.30),  # drafts the weights do not say
        "unexplained": _w(2, 0.35, 0.60, 0.50),
    }
    for cause, after in cases.items():
        move = explain("sql", base, after, level=0.97)
        assert move is not None and move.cause == cause, (cause, move)
        assert "sql" in move.message and "0.550" in move.message or cause == "serving_disagrees"
    assert set(cases) == set(CAUSES)
    rolled_back = explain("sql", cases["drafter_changed"], _w(3, 0.55, 0.60, 0.50, versions=(1,)), level=0.97)
    assert rolled_back.cause == "drafter_changed"


def test_noise_and_a_healthy_engine_name_nothing() -> None:
    base = _w(1, 0.55, 0.60, 0.50)
    assert explain("code", base, _w(2, 0.53, 0.58, 0.49), level=0.97) is None  # under MIN_MOVE
    assert explain("code", None, _w(1, 0.55, 0.60, 0.50), level=None) is None  # a lane's first window
    # a fault shows even without a move of α, and a first window's fault is caught by the floor
    assert explain("code", base, _w(2, 0.54, 0.60, 0.50, consistency=0.5), level=0.97).cause == "serving_disagrees"
    assert explain("code", None, _w(1, 0.2, 0.6, 0.5, consistency=0.4), level=None).cause == "serving_disagrees"
    assert explain("code", base, _w(2, 0.55, 0.60, 0.50, consistency=None), level=0.97) is None  # too few drafts


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


def test_live_drafts_are_their_weights_own_argmax_and_a_corrupted_drafter_is_caught(pair) -> None:
    """Real greedy records of the engine: measured through the drafter that drafted them, the drafts agree with its
    argmax (consistency near 1); relabelled as drafted by other weights (the engine serving what the control plane
    does not know), they do not, and a window of them is named serving_disagrees."""
    records = engine_records(pair, "code", 32, max_new_tokens=24, prefix="dx")
    fns = {0: hf_logits_fn(pair.drafter)}
    scorers = {0: scorer(fns[0])}
    stats = measure(1, records, scorers, fns, group_lane=False)
    assert stats.consistency_drafts >= 32 and stats.consistency > 0.9, stats
    assert stats.alpha_live is not None and abs(stats.alpha_served - stats.alpha_reference) < 1e-9
    other = copy.deepcopy(pair.drafter)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * p.std() * 2.0)
    bad = {0: hf_logits_fn(other)}
    broken = measure(2, records, {0: scorer(bad[0])}, bad, group_lane=False)
    assert broken.consistency < 0.6, broken
    d = Diagnosis("", group_lane=False, window=16)
    for r in records:
        d.add(r)
    assert d.run(scorers, fns) is None and d.level > 0.9  # a healthy first window: no move, a level
    shifted = [dataclasses.replace(r) for r in records[16:]]
    for r in shifted:
        d.add(r)
    move = d.run({0: scorer(bad[0])}, bad)
    assert move is not None and move.cause == "serving_disagrees" and d.causes["serving_disagrees"] == 1
    assert d.info()["moves"][0]["cause"] == "serving_disagrees"
