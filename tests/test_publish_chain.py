"""Issue 24 §1: a publish chain that cannot promote a worse drafter. One test per gap (each failed on the
code before the fix), on real registries, real trainers and real servers with the tiny pair.

1. held-out slice: the server shadow-checks held-out records only; the trainer never publishes unchecked
2. candidates are compared with what the server SERVES (not LATEST, not the parent)
3. a promoted version's watch runs to its end before the next promotion; a rollback returns to the last good
4. one typed `Manifest` and one check of a version (`DrafterRegistry.open_version`) for server and trainer
5. the watch compares like with like: a version identical to the last good one is kept when traffic changes
6. an admin pin holds against a failed watch (alert only), is reported, and survives a restart
7. refusals are durable across a restart, and a start-up promotion waits for a check
"""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
import torch
from registry_doors import publish_peft_adapter
from test_online import engine_records, online_config
from test_serving_helpers import (
    PROMPTS,
    TEST_ADMIN_TOKEN,
    ServerThread,
    drafter_lane,
    drafter_view,
    lora_copy,
    tiny_config,
    version_manifest,
    wait_for,
)

from dvi.config import load_config
from dvi.feedback.shadow import is_heldout
from dvi.models.loading import load_pair
from dvi.registry.store import AdapterRejected, DrafterRegistry, Manifest, ServingState
from serving.drafter.lane import Lane
from serving.drafter.policy import LifecyclePolicy
from trainers.online.trainer import OnlineTrainer

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

OTHER = ["The weather today", "Once upon a time", "My favourite food is", "In the beginning"]


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


@pytest.fixture(scope="module")
def prose(pair):
    return engine_records(pair, "prose", 48, max_new_tokens=16, prefix="pc")


def _traffic(url: str, n: int, prompts=PROMPTS, **body) -> list[int]:
    """`n` completions; returns the drafter version each was served by."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"prompt": prompts[i % len(prompts)], "max_tokens": 16, **body})
            assert r.status_code == 200, r.text
            out.append(r.json()["dvi"]["drafter_version"])
    return out


def _heldout_traffic(s, **body) -> None:
    """Requests until the held-out records hold the positions a shadow check needs (half are held out)."""
    need = s.cfg.trainer.shadow_min_positions
    for _ in range(40):
        if drafter_view(s).heldout_positions >= need:
            return
        _traffic(s.url, 2, **body)
    raise AssertionError("no held-out records after 80 requests")


def _bad(s, seed: int = 1):
    return lora_copy(drafter_lane(s).base, 2.0, seed, ("q_proj", "v_proj", "up_proj"))


# -- 1. the held-out slice ---------------------------------------------------------------------------
def test_1_server_shadow_checks_heldout_records_only_and_trainer_never_publishes_unchecked(
        pair, prose, tiny_pair_dir, tmp_path) -> None:
    reg = DrafterRegistry(tmp_path / "registry")
    sw = Lane(reg, None, pair.drafter, LifecyclePolicy(0.1, 0.01, 8, 0.05, heldout_fraction=0.25))
    for r in prose:
        sw.observe_record(r)
    held = [r.request_id for r in prose if is_heldout(r.request_id, 0.25)]
    assert 0 < len(held) < len(prose) and [r.request_id for r in sw.heldout] == held
    # a trainer with no held-out record does not publish (it once published its first version unchecked)
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.heldout_fraction=0", "trainer.publish_margin=-1.0")
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=reg)
    tr.train_on_records(prose[:16])
    d = tr.maybe_publish(force=True)
    assert d.published is None and "held-out positions" in d.reason and reg.latest() is None


# -- 2. compared with what is served ------------------------------------------------------------------
def test_2_trainer_compares_with_the_served_version_not_latest(pair, prose, tiny_pair_dir, tmp_path) -> None:
    cfg = online_config(tiny_pair_dir, tmp_path)
    reg = DrafterRegistry(cfg.registry.dir)
    bad = publish_peft_adapter(reg, lora_copy(pair.drafter, 2.0, 1), version_manifest())  # LATEST, never served
    reg.set_serving(ServingState(version=0, good=0))
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=reg)
    tr.heldout.extend(r.compact() for r in prose)  # the candidate is the bootstrap drafter itself
    d = tr.maybe_publish(force=True)
    assert d.parent_version == 0 and d.published is None, d
    assert "vs served v0" in d.reason and "not better" in d.reason
    assert reg.latest() == bad and reg.list_versions() == [bad]


# -- 3. the watch runs to its end; a rollback returns to the last good version --------------------------
def test_3_watch_runs_to_its_end_and_rollback_returns_to_the_last_good(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.rollback_window=8", "trainer.shadow_margin=1.0")
    with ServerThread(cfg) as s:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)
        _heldout_traffic(s)
        v1 = publish_peft_adapter(reg, lora_copy(drafter_lane(s).base), version_manifest())
        wait_for(lambda: sw.live_version == v1, 30, what="v1 promoted")
        v2 = publish_peft_adapter(reg, lora_copy(drafter_lane(s).base), version_manifest())
        _traffic(s.url, 3)
        time.sleep(5 * cfg.serve.registry_poll_seconds)
        assert sw.live_version == v1 and sw.watch is not None, "v2 promoted before v1's watch ended"
        _traffic(s.url, 6)  # 9 requests since v1's promotion: its watch (8) ends
        wait_for(lambda: sw.live_version == v2, 30, what="v2 promoted once v1 passed its watch")
        assert sw.good == v1
        _traffic(s.url, 8)
        wait_for(lambda: sw.good == v2, 30, what="v2 passed its watch")
        v3 = publish_peft_adapter(reg, _bad(s), version_manifest())
        wait_for(lambda: sw.live_version == v3, 30, what="the bad v3 promoted (shadow margin 1.0)")
        _traffic(s.url, 8)
        wait_for(lambda: sw.counts["rolled_back"] == 1, 30, what="the rollback")
        assert sw.live_version == v2 and reg.latest() == v3 and v3 in reg.refusals()  # LATEST: the trainer's
        assert reg.serving() == ServingState(version=v2, good=v2, pinned=None)


# -- 4. one Manifest, one check -----------------------------------------------------------------------
def test_4_one_typed_manifest_and_one_check_for_server_and_trainer(pair, prose, tiny_pair_dir, tmp_path) -> None:
    import json

    reg = DrafterRegistry(tmp_path / "registry")
    v = publish_peft_adapter(reg, lora_copy(pair.drafter), version_manifest(drafter_kind="eagle"))
    man = reg.manifest(v)
    assert isinstance(man, Manifest) and man.version == v and man.format == "lora" and man.drafter_kind == "eagle"
    from dvi.registry.codec import load_drafter_version

    with pytest.raises(AdapterRejected, match="published by a 'eagle' trainer"):
        load_drafter_version(reg, v, copy.deepcopy(pair.drafter))
    tr = OnlineTrainer(online_config(tiny_pair_dir, tmp_path), copy.deepcopy(pair.drafter), registry=reg)
    with pytest.raises(AdapterRejected, match="published by a 'eagle' trainer"):
        tr.trainable.load_version(reg, v)
    raw = json.loads((reg.version_dir(v) / "manifest.json").read_text())
    (reg.version_dir(v) / "manifest.json").write_text(json.dumps({**raw, "steps": "many"}))
    with pytest.raises(AdapterRejected, match=r"\['steps'\] have the wrong type"):
        reg.open_version(v)


# -- 5. like with like -----------------------------------------------------------------------------------
def test_5_watch_keeps_a_version_identical_to_the_last_good_when_traffic_changes(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.rollback_window=8", "serve.rollback_margin=0.05")
    with ServerThread(cfg) as s:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)
        _traffic(s.url, 12, temperature=1.5)  # sampled code prompts: high α for v0 on the tiny pair
        _heldout_traffic(s, temperature=1.5)
        v1 = publish_peft_adapter(reg, lora_copy(drafter_lane(s).base), version_manifest())  # drafts exactly as v0
        wait_for(lambda: sw.live_version == v1, 30, what="v1 promoted")
        a0 = sw.live_alpha.get(0) if sw.live_alpha.get(0) is not None else 1.0
        _traffic(s.url, 10, OTHER)  # other prompts, greedy: a much lower α for any drafter
        wait_for(lambda: sw.counts["kept"] or sw.counts["rolled_back"], 60, what="v1's watch to end")
        assert sw.counts["rolled_back"] == 0 and sw.live_version == v1, sw.info()["events"]
        kept = [e for e in sw.events if e.event == "kept"][-1]
        assert "not worse on the same records" in kept.reason
        a1 = sw.live_alpha.get(v1)
        assert a1 is not None and a1 < a0 - 0.05, (a0, a1)  # the old rule (live α windows) would have rolled back


# -- 6. the pin holds and persists ---------------------------------------------------------------------
def test_6_pin_holds_against_a_failed_watch_and_survives_a_restart(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.rollback_window=8", "trainer.shadow_margin=1.0",
                      "serve.admin_token=tok")
    with ServerThread(cfg) as s, s.client(token="tok") as admin:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)
        _heldout_traffic(s)
        bad = publish_peft_adapter(reg, _bad(s), version_manifest())
        wait_for(lambda: sw.live_version == bad, 30, what="the bad version promoted")
        r = admin.post("/admin/drafter/pin", json={"version": bad})
        assert r.status_code == 200, r.text
        _traffic(s.url, 10)
        wait_for(lambda: sw.counts["alert"] == 1, 30, what="the failed watch to alert")
        assert sw.counts["rolled_back"] == 0 and sw.live_version == bad
        st = admin.get("/admin/status").json()
        assert st["drafter_version"] == bad and st["drafter"]["pinned"] == bad and st["drafter"]["serving"] == bad
        assert admin.post("/admin/drafter/rollback", json={}).status_code == 409  # unpin first
    assert reg.serving().pinned == bad
    with ServerThread(cfg) as s:
        wait_for(lambda: drafter_view(s).live_version == bad, 30, what="the pin served after a restart")
        assert drafter_view(s).pinned == bad and _traffic(s.url, 1) == [bad]


# -- 7. durable refusals; a start-up promotion waits for a check ----------------------------------------
def test_7_refused_versions_stay_refused_after_restart_and_startup_waits_for_a_check(tiny_pair_dir,
                                                                                    tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path)
    with ServerThread(cfg) as s:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)
        _heldout_traffic(s)
        bad = publish_peft_adapter(reg, _bad(s), version_manifest())
        wait_for(lambda: str(bad) in sw.info()["refused"], 30, what="the bad version refused")
    assert reg.latest() == bad and bad in reg.refusals()
    with ServerThread(cfg) as s:
        sw = drafter_view(s)
        time.sleep(5 * cfg.serve.registry_poll_seconds)
        assert sw.live_version == 0  # no records yet: nothing is promoted "validated only"
        _traffic(s.url, 8)
        time.sleep(5 * cfg.serve.registry_poll_seconds)
        assert sw.live_version == 0 and sw.counts["promoted"] == 0, "a refused version was promoted after a restart"
    # a fresh, good version on LATEST at start-up waits for held-out records, then is checked and promoted
    # (a server whose feedback log holds none: with one, it checks on the logged held-out records at once,
    # issue 36 §8, tests/test_gates.py)
    good = publish_peft_adapter(reg, lora_copy(pair_drafter(cfg)), version_manifest())
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"feedback.dir={tmp_path / 'empty-feedback'}")
    with ServerThread(cfg) as s:
        sw = drafter_view(s)
        time.sleep(5 * cfg.serve.registry_poll_seconds)
        assert sw.live_version == 0 and sw.heldout_positions < cfg.trainer.shadow_min_positions
        done = threading.Event()
        threading.Thread(target=lambda: (_traffic(s.url, 30), done.set()), daemon=True).start()
        done.wait(300)  # the traffic ends before the server does
        ev = wait_for(lambda: [e for e in list(sw.events) if e.event == "promoted" and e.version == good], 60,
                      what="the new version promoted after its check")
        assert "held-out shadow α" in ev[-1].reason and sw.live_version == good


def test_8_admin_status_names_the_version_waiting_for_held_out_positions(tiny_pair_dir, tmp_path) -> None:
    """Issue 42: a verdict waiting for held-out evidence is on /admin/status, not only in the log: which version
    waits, its held-out positions and the `trainer.shadow_min_positions` it needs; gone once it is checked."""
    need = 64
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"trainer.shadow_min_positions={need}")
    with ServerThread(cfg) as s, s.client(token=TEST_ADMIN_TOKEN) as admin:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)

        def waiting() -> dict | None:
            r = admin.get("/admin/status")
            assert r.status_code == 200, r.text
            return r.json()["drafter"]["waiting"]

        assert waiting() is None  # nothing published: no verdict waits
        v = publish_peft_adapter(reg, lora_copy(drafter_lane(s).base), version_manifest())
        assert wait_for(waiting, 30, what="the version waiting on /admin/status") == {
            "version": v, "heldout_positions": 0, "of": need}
        for _ in range(20):  # one held-out record (<= 16 positions) moves the count, far from the 64 needed
            _traffic(s.url, 1)
            if sw.heldout_positions:
                break
        have = sw.heldout_positions
        assert 0 < have < need and waiting() == {"version": v, "heldout_positions": have, "of": need}
        _heldout_traffic(s)
        wait_for(lambda: sw.live_version == v, 60, what="the version promoted after its check")
        assert waiting() is None


def pair_drafter(cfg):
    from dvi.models.loading import load_causal_lm

    return load_causal_lm(cfg.models.drafter, "cpu", "float32")


def test_config_fields_are_the_ones_both_sides_read(tiny_pair_dir, tmp_path) -> None:
    cfg = load_config(None, ["trainer.heldout_fraction=0.3", "trainer.shadow_min_positions=7"])
    pol = LifecyclePolicy.of(cfg)
    assert pol.heldout_fraction == 0.3 and pol.min_positions == 7


def test_swapper_memory_is_bounded(pair, tmp_path) -> None:
    """Issue 27 §5: the swapper's refusals and per-version α windows do not grow by one entry per version."""
    from serving.drafter.lifecycle import MAX_REFUSED_SHOWN

    reg = DrafterRegistry(tmp_path / "registry")
    sw = Lane(reg, None, pair.drafter, LifecyclePolicy(0.1, 0.01, 8, 0.05))
    for v in range(1, 3 * MAX_REFUSED_SHOWN):
        sw._refuse(v, "test")
        sw.observe(3, 1, v)
    refused = sw.view().refused
    assert len(refused) == MAX_REFUSED_SHOWN and list(refused)[-1] == 3 * MAX_REFUSED_SHOWN - 1
    assert set(sw._windows) <= set(sw.machine.loaded) and len(reg.refusals()) == 3 * MAX_REFUSED_SHOWN - 1


def test_6b_a_pin_issued_during_a_shadow_check_wins(tiny_pair_dir, tmp_path) -> None:
    """Issue 58 §2: an admin pin sent while a shadow check runs is not overridden by the promotion that check then
    passes (before: the candidate was swapped in as "promoted" over the pin): the pin waits on the drafter thread's
    inbox and lands between the check and the swap. Once unpinned, the version is judged again and promoted."""
    cfg = tiny_config(tiny_pair_dir, tmp_path, "trainer.shadow_margin=1.0", "serve.admin_token=tok")
    with ServerThread(cfg) as s, s.client(token="tok") as admin:
        sw, reg, lane = drafter_view(s), DrafterRegistry(cfg.registry.dir), drafter_lane(s)
        _heldout_traffic(s)
        judging, release = threading.Event(), threading.Event()
        compare = lane._compare

        def slow_compare(*args, **kw):
            judging.set()
            assert release.wait(30), "the test never released the shadow check"
            return compare(*args, **kw)

        lane._compare = slow_compare
        v1 = publish_peft_adapter(reg, lora_copy(lane.base), version_manifest())
        assert judging.wait(30), "v1's shadow check never started"
        answers: list = []
        pinning = threading.Thread(target=lambda: answers.append(admin.post("/admin/drafter/pin", json={"version": 0})))
        pinning.start()  # the endpoint awaits the pin's future: the drafter thread answers once the check is over
        wait_for(lambda: s.state.drafter.queued() >= 1, 30, what="the pin on the drafter thread's inbox")
        release.set()
        pinning.join(60)
        assert answers and answers[0].status_code == 200, answers
        wait_for(lambda: sw.waiting is None and sw.pinned == 0, 30, what="the shadow check to end")
        time.sleep(5 * cfg.serve.registry_poll_seconds)
        assert sw.live_version == 0 and sw.pinned == 0 and sw.counts["promoted"] == 0, list(sw.events)
        assert s.state.scheduler.snapshot.served(None) == 0 and reg.serving().pinned == 0  # pin 0: the startup one
        lane._compare = compare
        assert admin.post("/admin/drafter/pin", json={"version": None}).status_code == 200
        wait_for(lambda: sw.live_version == v1, 30, what="v1 promoted once unpinned")
