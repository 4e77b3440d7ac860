"""Logs that grow forever, bounded (issue 27 §5).

`metrics.jsonl`, `swap_events.jsonl` and `trainer.log` are rotated by size through one helper
(`dvi.fsutil.rotate_log`), keeping `files.log_backups` old files; the trainer's `consumed.jsonl`
is compacted past `files.consumed_log_max_bytes` and a restart reads its tail, not the whole file.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from dvi.config import load_config
from dvi.fsutil import AppendLog, LogRotation, append_jsonl
from dvi.metrics import MetricsLogger
from dvi.rundir import RunDir

MAX = 4096


def _sizes(path: Path) -> list[int]:
    return [p.stat().st_size for p in sorted(path.parent.glob(path.name + "*"))]


def test_metrics_jsonl_rotates_with_bounded_backups(tmp_path) -> None:
    with MetricsLogger(tmp_path, wandb_mode="disabled", rotation=LogRotation(MAX, 2)) as ml:
        for i in range(2000):
            ml.log({"dvi_spec_decode_acceptance_rate": 0.5, "i": i}, step=i, domain="code")
    files = sorted(p.name for p in tmp_path.glob("metrics.jsonl*"))
    assert files == ["metrics.jsonl", "metrics.jsonl.1", "metrics.jsonl.2"], files
    row = max(len(line) + 1 for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert all(s <= MAX + row for s in _sizes(tmp_path / "metrics.jsonl")), _sizes(tmp_path / "metrics.jsonl")
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["i"] == 1999  # the newest rows are in the live file


def test_event_log_rotates(tmp_path) -> None:
    log = AppendLog(tmp_path / "swap_events.jsonl", LogRotation(MAX, 1))
    for v in range(1000):
        append_jsonl(log, {"kind": "refused", "version": v, "reason": "x" * 40}, fsync=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swap_events.jsonl", "swap_events.jsonl.1"]
    assert sum(_sizes(log.path)) <= 2 * (MAX + 100)


def test_trainer_log_rotates_while_the_trainer_writes(tmp_path, monkeypatch) -> None:
    import serving.supervisor as sup_mod

    monkeypatch.setattr(sup_mod, "LOG_CHECK_S", 0.05)
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "serve.trainer=supervised", f"files.log_max_bytes={MAX}",
                             "files.log_backups=2", "serve.trainer_restart_backoff_s=60"])
    # a "trainer" that writes ~60 KB over ~1.5 s to its stdout, then idles
    child = "import sys, time\nfor i in range(600):\n print('x' * 99, flush=True); time.sleep(0.0025)\ntime.sleep(60)"
    sup = sup_mod.TrainerSupervisor(cfg, command=[sys.executable, "-c", child])
    sup.start()
    try:
        time.sleep(3.0)
    finally:
        sup.stop(timeout=5)
    path = RunDir.of(cfg).trainer_log_path
    names = sorted(p.name for p in path.parent.glob("trainer.log*"))
    assert names == ["trainer.log", "trainer.log.1", "trainer.log.2"], names
    # the live file is cut at the next check after it passes the limit (the child writes ~40 KB/s)
    assert all(s <= MAX + 8192 for s in _sizes(path)), _sizes(path)


def test_consumed_log_is_compacted_and_read_from_its_tail(tmp_path) -> None:
    cfg = load_config(None, [f"run_dir={tmp_path}", "files.consumed_log_max_bytes=65536"])
    rd = RunDir.of(cfg)
    n_ids = 30
    for seq in range(1, 2001):
        ids = [f"cmpl-{seq:06d}-{i:02d}" for i in range(n_ids)]
        rd.append_consumed({"seq": seq, "shards": [f"shard-{seq}"], "trained": ids[:-3], "heldout": ids[-3:-1],
                            "dropped": ids[-1:], "step": seq, "time": float(seq)})
        assert rd.consumed_path.stat().st_size <= 65536 + 1024
    assert rd.last_consumed_seq() == 2000
    entries = [json.loads(line) for line in rd.consumed_path.read_text().splitlines()]
    summary, tail = entries[0], entries[1:]
    assert summary["compacted"]["first_seq"] == 1 and summary["compacted"]["first_time"] == 1.0
    assert [e["seq"] for e in tail] == list(range(summary["seq"] + 1, 2001))
    # every round and record is accounted for: in the summary's counts or in a kept line
    assert summary["compacted"]["rounds"] + len(tail) == 2000
    assert summary["compacted"]["records"] + sum(len(e["trained"]) + len(e["heldout"]) + len(e["dropped"])
                                                 for e in tail) == 2000 * n_ids
    # a kill mid-append tears the last line: the last whole one counts
    with open(rd.consumed_path, "a") as f:
        f.write('{"seq": 2001, "shards": ["sha')
    assert rd.last_consumed_seq() == 2000


@pytest.mark.parametrize("size", [10, 200_000])
def test_last_consumed_seq_reads_long_lines(tmp_path, size) -> None:
    rd = RunDir(tmp_path)
    rd.append_consumed({"seq": 7, "trained": ["x" * size]})
    rd.append_consumed({"seq": 8, "trained": ["y" * size]})
    assert rd.last_consumed_seq() == 8


def _gauge(text: str, name: str, **labels: str) -> float | None:
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return None


def test_disk_use_per_part_on_metrics(tiny_pair_dir, tmp_path) -> None:
    from test_serving_helpers import ServerThread, tiny_config

    from dvi import metrics as M
    from dvi.fsutil import tree_bytes

    cfg = tiny_config(tiny_pair_dir, tmp_path / "run")
    with ServerThread(cfg) as s, s.client() as c:
        for i in range(4):
            assert c.post("/v1/completions", json={"prompt": f"x{i} = ", "max_tokens": 4}).status_code == 200
        s.state.feedback.flush()
        text = c.get("/metrics").text
        feedback = tree_bytes(cfg.feedback.dir)
        assert feedback > 0 and _gauge(text, M.DISK_BYTES, part="feedback") == feedback
        for part in M.DISK_PARTS:
            assert _gauge(text, M.DISK_BYTES, part=part) is not None, part
        assert s.health()["disk_bytes"]["feedback"] == feedback
