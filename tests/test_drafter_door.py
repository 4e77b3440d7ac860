"""One door to the drafter versions (issue 58 §1): only the drafter thread touches a lane (`serving.drafter.lane.Lane`:
its machine, its held-out set); the admin API's pins and rollbacks and the engine thread's finished requests are typed
messages on the door's one inbox (`serving.drafter.client.DrafterClient`), and /health, /metrics and /admin read the
frozen snapshot it publishes.

- the ownership check (`dvi.decode.owner`, as the engine's): a foreign thread's touch of a claimed lane raises;
- the door on a stub engine, the check on: pins, a rollback and its refusals come back through futures resolved after
  the snapshot that shows them, finished requests from another thread land in the held-out set, and no thread but
  the drafter's touched a lane.
"""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
from registry_doors import publish_peft_adapter
from test_serving_helpers import lora_copy, version_manifest, wait_for

from dvi.decode import owner
from dvi.feedback import FeedbackRecord
from dvi.registry.store import AdapterRejected, DrafterRegistry
from serving.drafter.client import DrafterClient, Observed, Pin, Rollback
from serving.drafter.lane import Lane
from serving.drafter.policy import LifecyclePolicy
from serving.engine_client import EngineSnapshot

POLICY = LifecyclePolicy(poll_seconds=0.05, shadow_margin=0.01, rollback_window=4, rollback_margin=0.05,
                         heldout_fraction=1.0)


class StubEngine:
    """What a lane asks of the engine's door: a command's future (applied at once), its snapshot, whether it is busy."""

    snapshot = EngineSnapshot()

    def __init__(self) -> None:
        self.commands: list = []

    def command(self, cmd) -> concurrent.futures.Future:
        self.commands.append(cmd)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    def busy(self) -> bool:
        return False


def _record(i: int) -> FeedbackRecord:
    return FeedbackRecord(request_id=f"door-{i}", domain="code", target_version=0, drafter_version=0, started_at=i,
                          finished_at=i, temperature=0.0, prompt_ids=[3, 4], token_ids=[5, 6, 7],
                          drafted_ids=[5, 6, 9], accepted=[True, True, False])


def test_the_owner_check_fires_for_a_foreign_thread_on_a_lane(tmp_path, owner_check):
    lane = Lane(DrafterRegistry(tmp_path / "registry"), None, object(), POLICY)  # version 0 is the drafter as given
    t = threading.Thread(target=lambda: (owner.claim(lane), lane.observe_record(_record(0)), lane.view()))
    t.start()
    t.join()
    assert owner_check == []  # the owner itself reads and writes freely
    touches = [lambda: lane.machine, lambda: lane.view(), lambda: lane.step(), lambda: lane.pin(0)]
    for touch in touches:
        with pytest.raises(owner.OwnershipError, match="owned by another thread"):
            touch()
    heldout = lane.__dict__["heldout"]  # a part of the lane, claimed with it
    with pytest.raises(owner.OwnershipError):
        heldout.offer(_record(1))
    assert len(owner_check) == len(touches) + 1 and "MainThread" in owner_check[0]
    owner.release(lane)
    assert lane.view().heldout["records"] == 1


def test_pins_rollbacks_and_records_go_through_the_door(tiny_pair_dir, tmp_path, owner_check):
    from dvi.models.loading import load_causal_lm

    drafter = load_causal_lm(tiny_pair_dir / "drafter", "cpu", "float32")
    reg = DrafterRegistry(tmp_path / "registry")
    v1 = publish_peft_adapter(reg, lora_copy(drafter), version_manifest())
    engine = StubEngine()
    door = DrafterClient(Lane(reg, engine, drafter, POLICY))
    with pytest.raises(RuntimeError, match="not running"):
        door.command(Pin(v1)).result(timeout=1)
    door.start()
    try:
        assert door.command(Pin(v1)).result(timeout=60) == v1
        snap = door.snapshot.shared  # the future resolves after the snapshot that shows it
        assert (snap.live_version, snap.pinned, snap.counts["pinned"]) == (v1, v1, 1)
        assert engine.commands[-1].version == v1 and reg.serving().pinned == v1
        with pytest.raises(ValueError, match="unpin it"):
            door.command(Rollback("under a pin")).result(timeout=60)
        with pytest.raises(AdapterRejected):
            door.command(Pin(v1 + 5)).result(timeout=60)  # no such version: the pin stands
        assert door.command(Pin(None)).result(timeout=60) == v1 and door.snapshot.shared.pinned is None
        assert door.command(Rollback("test")).result(timeout=60) == 0
        snap = door.snapshot.shared
        assert snap.live_version == 0 and "rolled back: test" in snap.refused[v1] and v1 in reg.refusals()
        sender = threading.Thread(target=lambda: [door.observe(Observed(3, 2, 0, _record(i))) for i in range(5)],
                                  name="engine-stand-in")
        sender.start()
        sender.join()
        wait_for(lambda: door.snapshot.shared.heldout["records"] == 5, 10, what="the records observed")
        assert door.snapshot.shared.live_alpha[0] == pytest.approx(2 / 3)
        with pytest.raises(owner.OwnershipError):
            door.lane.machine  # noqa: B018 - the touch is the test
    finally:
        door.stop()
    assert not door.alive
    with pytest.raises(RuntimeError, match="not running"):
        door.command(Pin(0)).result(timeout=1)
    assert len(owner_check) == 1 and "MainThread" in owner_check[0] and "Lane.machine" in owner_check[0]
