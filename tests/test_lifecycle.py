"""The lifecycle state machine (`serving.drafter.lifecycle.Lifecycle`) on its own: no thread, no model, no file. It
holds all of the promotion state: what the lane loaded (here a stand-in with a `version`), the candidate waiting
for its check, the check it passed, the version waiting for evidence."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from serving.drafter.lifecycle import GOOD_HISTORY, MAX_REFUSED_SHOWN, Lifecycle

MIN = 16  # held-out positions a shadow check needs


@dataclass(frozen=True)
class V:
    """What a lane loads: the machine reads only its version."""

    version: int


def _machine() -> Lifecycle:
    return Lifecycle(rollback_window=4, startup=V(0))


def _promote(m: Lifecycle, v: int) -> None:
    """v from LATEST to watched, the way the lane walks it."""
    assert m.next_step(v, MIN, MIN).action == "validate"
    m.validated(v, V(v))
    assert m.next_step(v, MIN, MIN).action == "judge"
    m.judged(v, True, "better")
    assert m.next_step(v, MIN, MIN).action == "swap"
    m.swapped(v, "promoted", m.pending)


def _end_watch(m: Lifecycle, failed: bool) -> str:
    if m.pending is None:
        m.next_step(99, MIN, MIN)
        m.validated(99, V(99))  # v99 validated, waiting behind the watch
    w, early = m.watch_ends(idle_s=0.0, busy=False) or (None, None)
    assert w is not None and early  # idle, v99 waiting behind it, no window filled: ends early
    return m.watch_judged(w, failed)


def test_a_version_walks_candidate_validated_judged_watched_kept():
    m = _machine()
    assert m.next_step(None, 0, MIN).action == "idle"
    assert m.next_step(1, 0, MIN).action == "validate" and m.state[1] == "candidate"
    m.validated(1, V(1))
    assert m.state[1] == "validated" and m.pending == V(1)
    step = m.next_step(1, MIN - 1, MIN)  # too few held-out positions
    assert (step.action, step.news, m.waiting, m.waiting_scored) == ("wait", True, 1, None)
    assert not m.next_step(1, MIN - 1, MIN).news  # still waiting: said once
    assert m.next_step(1, MIN, MIN).action == "judge" and m.waiting is None
    m.waits(1, 5)  # the check scored too few positions where it counts
    assert (m.waiting, m.waiting_scored) == (1, 5)
    assert m.next_step(1, MIN, MIN).action == "judge"
    m.judged(1, True, "better")
    assert m.state[1] == "judged" and m.passed.against == 0
    assert m.next_step(1, MIN, MIN).action == "swap"
    assert m.swapped(1, "promoted", m.pending) == 0
    assert m.live == 1 and m.state[1] == "watched" and m.watch.version == 1 and m.watch.good == 0
    assert set(m.loaded) == {0, 1} and m.pending is None and m.passed is None
    assert m.next_step(1, MIN, MIN).action == "idle"  # served already
    m.next_step(2, MIN, MIN)
    m.validated(2, V(2))
    assert m.next_step(2, MIN, MIN).action == "hold"  # a watch runs: v2 waits behind it
    assert _end_watch(m, failed=False) == "kept"
    assert m.good == 1 and m.state[1] == "kept" and m.watch is None
    assert m.next_step(2, MIN, MIN).action == "judge"
    assert 1 in m.verdict_seen and 2 not in m.verdict_seen  # a promotion or a refusal is a verdict, a wait is not


def test_a_pin_beats_a_promotion_that_passed_its_check():
    """Issue 58 §2: a check passed, then a pin: no swap (and `swapped` refuses one); once unpinned the version is
    judged again, against what is served then."""
    m = _machine()
    m.next_step(1, MIN, MIN)
    m.validated(1, V(1))
    assert m.next_step(1, MIN, MIN).action == "judge"
    m.judged(1, True, "better")
    m.pin(0)
    assert m.next_step(1, MIN, MIN).action == "idle" and m.passed is None and m.state[1] == "validated"
    with pytest.raises(ValueError, match="pinned"):
        m.swapped(1, "promoted", V(1))
    m.pin(None)
    assert m.next_step(1, MIN, MIN).action == "judge"
    m.judged(1, True, "better")  # against v0
    m.pin(2)
    m.swapped(2, "pinned", V(2))
    m.pin(None)
    assert m.live == 2 and m.next_step(1, MIN, MIN).action == "judge"  # against v2 now


def test_a_failed_watch_rolls_back_to_the_last_good_version_and_refuses_for_good():
    m = _machine()
    _promote(m, 1)
    _end_watch(m, failed=False)
    _promote(m, 2)
    assert _end_watch(m, failed=True) == "rollback"
    bad, target = m.rollback_plan()
    assert (bad, target) == (2, 1)
    m.rolled_back(bad, target, "live α fell")
    m.swapped(target, "rolled_back", V(target))
    assert m.live == 1 and m.good == 1 and m.state[2] == "rolled_back" and m.watch is None
    assert "rolled back" in m.refused[2] and m.next_step(2, MIN, MIN).action == "idle"
    # from a good version, an admin rollback goes to the one before it
    assert m.rollback_plan() == (1, 0)


def test_refusals_shadow_transient_and_durable():
    m = _machine()
    m.next_step(3, MIN, MIN)
    m.validated(3, V(3))
    m.judged(3, False)
    assert m.state[3] == "refused" and m.passed is None
    m.refuse(3, "held-out shadow α fell")
    assert m.next_step(3, MIN, MIN).action == "idle" and m.pending is None and 3 in m.verdict_seen
    m.refuse(4, "no such dir yet", transient=True)
    assert 4 in m.retry and "(will retry)" in m.refused[4]
    assert m.next_step(4, MIN, MIN).action == "validate"  # retried at every poll
    m.validated(4, V(4))
    m.judged(4, True)
    m.swapped(4, "promoted", V(4))
    assert 4 not in m.retry and 4 not in m.refused  # a retried version made it after all
    m.remember_refusal(9, "refused before the restart")
    assert m.state[9] == "refused" and m.next_step(9, MIN, MIN).action == "idle"
    for v in range(100, 100 + 2 * MAX_REFUSED_SHOWN):
        m.refuse(v, "x")
    assert len(m.refused) == MAX_REFUSED_SHOWN and len(m.state) <= 4 * MAX_REFUSED_SHOWN


def test_a_pin_stops_promotions_and_turns_a_failed_watch_into_an_alert():
    m = _machine()
    _promote(m, 1)
    assert m.pin(1) is None and m.watch is not None  # the pinned version's own watch goes on
    assert m.next_step(2, MIN, MIN).action == "idle"
    assert _end_watch(m, failed=True) == "alert" and m.live == 1
    with pytest.raises(ValueError, match="pinned"):
        m.rollback_plan()
    assert m.pin(None) == 1 and m.next_step(2, MIN, MIN).action == "validate"
    _promote(m, 2)
    m.pin(0)
    assert m.watch is None  # a pin of another version ends the watch without a verdict


def test_restore_serves_the_pin_else_the_last_good_unless_refused_since():
    m = _machine()
    assert m.restore({5: "rolled back"}, pinned=None, good=5) == 0
    m = _machine()
    assert m.restore({5: "rolled back"}, pinned=5, good=3) == 5  # a pin holds even over a refusal
    m.restored(5, pinned=5)
    assert m.pinned == 5 and m.good == 5 and m.state[5] == "kept"
    m = _machine()
    want = m.restore({}, pinned=7, good=3)
    m.restored(0, pinned=7)  # v7 would not load: the startup drafter, and the pin is gone
    assert want == 7 and m.pinned is None and m.good == 0


def test_the_good_history_is_bounded_and_skips_rolled_back_versions():
    m = _machine()
    for v in range(1, GOOD_HISTORY + 3):
        _promote(m, v)
        _end_watch(m, failed=False)
    assert len(m.good_history) == GOOD_HISTORY and m.good_history[-1] == GOOD_HISTORY + 2
    with pytest.raises(ValueError, match="startup drafter"):
        _machine().rollback_plan()
