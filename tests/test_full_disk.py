"""Issue 36 §6 and §7: full filesystems, for real (a small tmpfs, `full_disk.py`; skipped where it cannot be mounted).

§6: a full registry filesystem raised ENOSPC out of `maybe_publish` and killed the trainer at every publish.
Now the trainer process logs and counts the failure, keeps training and retries with backoff, and no
version, whole or half, appears until the disk has room; then the retry publishes.

§7: a full feedback filesystem kept failing writes even once the trainer had consumed every shard (records
held in memory until dropped). Now the server's writer deletes shards the trainer has consumed (it learns
which from `feedback/consumed.json`) and writes again.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from full_disk import fill, free, tmpfs
from test_faults import _status
from test_online import engine_records
from test_online_process import (
    _consumed,
    _ids,
    _reap,
    _start,
    _stop,
    _wait,
    tiny_pair,
    trainer_config,
    write_flushed,
)
from test_serving_helpers import ServerThread, tiny_config, wait_for

from dvi import metrics as M
from dvi.feedback import FeedbackWriter
from dvi.fsutil import TMP_PREFIX
from dvi.registry.store import DrafterRegistry

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def test_a_full_registry_costs_publishes_not_the_trainer(tiny_pair_dir, tmp_path, capsys) -> None:
    recs = engine_records(tiny_pair(tiny_pair_dir), "prose", 48, max_new_tokens=12, prefix="full")
    with tmpfs(tmp_path / "registry", "1m") as reg_dir:
        cfg, config = trainer_config(tiny_pair_dir, tmp_path, f"registry.dir={reg_dir}", "trainer.batch_size=4",
                                     "trainer.min_new_records=4", "trainer.poll_seconds=0.2",
                                     "trainer.publish_every_steps=1", "trainer.publish_margin=-1.0")
        w = FeedbackWriter(Path(cfg.feedback.dir), shard_records=4)
        write_flushed(w, recs[:32])
        reg = DrafterRegistry(reg_dir)
        fill(reg_dir)
        log = tmp_path / "trainer.log"
        proc = _start(config, log)
        try:
            _wait(lambda: _status(tmp_path).get(M.TRAINER_PUBLISH_FAILURES, 0) >= 2, 120, proc,
                  "a failed publish and its retry")
            write_flushed(w, recs[32:])  # training goes on meanwhile
            _wait(lambda: len(_ids(_consumed(tmp_path))) == len(recs), 60, proc, "every record trained")
            assert reg.list_versions() == [] and reg.latest() is None
            assert not [p for p in reg.dir.iterdir() if p.name.startswith(TMP_PREFIX)], "a half-written version"
            failed, freed_at = _status(tmp_path)[M.TRAINER_PUBLISH_FAILURES], time.monotonic()
            free(reg_dir)  # room again: the pending retry publishes
            _wait(lambda: reg.latest() is not None, 60, proc, "the retried publish")
            with capsys.disabled():
                print(f"\n[full registry] {failed} failed publishes while full, all {len(recs)} records trained, "
                      f"v{reg.latest()} published {time.monotonic() - freed_at:.1f} s after room was made")
            reg.open_version(reg.latest())
            pid = _status(tmp_path)["pid"]
            _stop(proc, log)
        finally:
            _reap(proc)
    assert pid == proc.pid
    text = log.read_text()
    assert "No space left on device" in text and "retrying in" in text and "publishing works again" in text
    assert "Traceback" not in text


def _request_ids(consumed: list[dict]) -> set[str]:
    return {i for e in consumed for k in ("trained", "heldout", "dropped") for i in e[k]}


def test_a_full_feedback_disk_makes_room_from_consumed_shards(tiny_pair_dir, tmp_path, capsys) -> None:
    with tmpfs(tmp_path / "feedback", "512k") as fb_dir:
        cfg = tiny_config(tiny_pair_dir, tmp_path / "run", f"feedback.dir={fb_dir}", "serve.trainer=supervised",
                          "feedback.shard_records=4", "feedback.flush_seconds=0.2", "trainer.min_new_records=4",
                          "trainer.poll_seconds=0.2", "trainer.batch_size=4", "trainer.checkpoint_seconds=0",
                          "trainer.publish_every_steps=1000000", "sampling.max_new_tokens=24")
        with ServerThread(cfg) as s, s.client() as c:
            fb = s.state.feedback
            wait_for(lambda: _status(Path(cfg.run_dir)).get("state") == "idle", 120, what="the trainer")
            sent, full_at = 0, None
            while full_at is None or sent < full_at + 40:  # until the disk has been full for 40 more requests
                r = c.post("/v1/completions", json={"prompt": f"def f{sent}(x):\n", "max_tokens": 24})
                assert r.status_code == 200, r.text
                sent += 1
                if full_at is None and (fb.flush_errors or fb.reclaimed_shards):
                    full_at = sent
                assert sent < 1000, "the feedback disk never filled"
            wait_for(lambda: not fb.failing and fb.pending() == 0, 120, what="feedback writes to work again")
            text = c.get("/metrics").text
            health = s.health()
            with capsys.disabled():
                print(f"\n[full feedback disk, 512 KiB] {sent} requests, full from request {full_at}: "
                      f"{fb.records_written} records written, {fb.reclaimed_shards} consumed shards deleted for room, "
                      f"{fb.flush_errors} failed writes, {fb.dropped_records} dropped")
        consumed = _consumed(Path(cfg.run_dir))
    assert fb.records_written == sent and fb.dropped_records == 0
    assert fb.reclaimed_shards > 0 and health["feedback"]["reclaimed_shards"] == fb.reclaimed_shards
    assert f"{M.FEEDBACK_RECLAIMED_SHARDS} {float(fb.reclaimed_shards)}" in text
    assert len(_request_ids(consumed)) <= sent
