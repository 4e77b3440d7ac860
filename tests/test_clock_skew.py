"""Issue 36 §4, through the real trainer process: replicas sharing `feedback.dir` whose clocks disagree.

One writer with the right clock (this process), one replica 10 minutes fast and one stepped back 10 minutes
(`clock_skew_writer.py`, each its own process), one `dvi train --online` process. Before the fix the fast
replica's shard became the cursor and every shard named before it counted as consumed: the trainer's
`records_read` stopped at the fast shard's records for good, with nothing on /metrics or in its log.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_online import engine_records
from test_online_process import (
    REPO,
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

from dvi import metrics as M
from dvi.feedback import FeedbackWriter

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


def _replica(offset_s: float, records, tmp_path: Path, feedback: Path, name: str) -> None:
    """`records` written into `feedback` by a replica process whose clock is `offset_s` off."""
    stage = tmp_path / f"stage-{name}"
    with FeedbackWriter(stage, shard_records=len(records)) as w:
        for r in records:
            w.write(r)
    subprocess.run([sys.executable, str(REPO / "tests" / "clock_skew_writer.py"), str(offset_s), str(stage),
                    str(feedback)], check=True, cwd=REPO, timeout=120)


def test_skewed_replica_clocks_lose_no_record(tiny_pair_dir, tmp_path) -> None:
    cfg, config = trainer_config(tiny_pair_dir, tmp_path, "trainer.batch_size=8", "trainer.min_new_records=16",
                                 "trainer.poll_seconds=0.2", "trainer.checkpoint_seconds=0",
                                 "trainer.publish_every_steps=1000000")
    fb = Path(cfg.feedback.dir)
    recs = engine_records(tiny_pair(tiny_pair_dir), "prose", 88, max_new_tokens=8, prefix="skew")
    right = FeedbackWriter(fb, shard_records=4)
    write_flushed(right, recs[:32])
    log = tmp_path / "trainer.log"
    proc = _start(config, log)
    try:
        def consumed() -> int:
            return len(_ids(_consumed(tmp_path)))

        _wait(lambda: consumed() == 32, 120, proc, "the first 32 records")
        _replica(600, recs[32:36], tmp_path, fb, "fast")  # one shard from a replica 10 minutes fast
        _wait(lambda: consumed() == 36, 60, proc, "the fast replica's shard")
        write_flushed(right, recs[36:84])  # 48 more requests on the right clock, named 10 minutes before the fast shard
        _replica(-600, recs[84:], tmp_path, fb, "slow")  # and a replica whose clock was stepped back
        _wait(lambda: consumed() >= 88, 60, proc, f"every record trained (at {consumed()} of 88)")

        def status() -> dict:  # written after the round that consumed the last shard, so read it once it counts 88
            return json.loads((tmp_path / "trainer" / "status.json").read_text())
        _wait(lambda: status().get("records_read", 0) >= 88, 30, proc, "the trainer's status to count every record")
        status = status()
        _stop(proc, log)
    finally:
        _reap(proc)
    ids = _ids(_consumed(tmp_path))
    assert sorted(ids) == sorted(r.request_id for r in recs), "a record was trained twice or never"
    assert status["records_read"] == 88
    assert status[M.TRAINER_LOST_SHARDS] == 0 and status[M.TRAINER_SKIPPED_SHARDS] == 0
