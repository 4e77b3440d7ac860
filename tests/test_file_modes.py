"""Feedback (every prompt and completion) and the run dir are private by default (issue 27 §4).

`files.access: private` (the default) makes every dir dvi creates for them 0700 and every file
0600, whatever the process umask; `group` gives the group the same rights (0770 / 0660) for a
trainer or replica running as another user; `umask` leaves the modes to the process umask.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from registry_doors import publish_files
from test_feedback import make_record
from test_serving_helpers import ServerThread, drafter_view, tiny_config, version_manifest, wait_for

from dvi.config import load_config
from dvi.feedback import FeedbackWriter
from dvi.metrics import MetricsLogger
from dvi.rundir import RunDir


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): _mode(p) for p in [root, *root.rglob("*")]}


def test_server_run_dir_and_feedback_are_private(tiny_pair_dir, tmp_path) -> None:
    run = tmp_path / "run"  # created by the server
    cfg = tiny_config(tiny_pair_dir, run)
    with ServerThread(cfg) as s, s.client() as c:
        for i in range(3):
            assert c.post("/v1/completions", json={"prompt": f"def f{i}(", "max_tokens": 4}).status_code == 200
        s.state.feedback.flush()
        from dvi.registry.store import DrafterRegistry

        reg = DrafterRegistry(cfg.registry.dir)
        v = publish_files(reg, {"adapter_model.safetensors": b"\x00garbage" * 8, "adapter_config.json": b"{}"},
                        version_manifest(format="lora"))
        wait_for(lambda: v in drafter_view(s).refused, 30, what="the garbage version refused")
        wait_for(lambda: RunDir.of(cfg).swap_events_path.exists(), 10, what="swap_events.jsonl")
    modes = _modes(run)
    shards = [k for k in modes if k.startswith("feedback/shard-")]
    assert shards, modes
    for name in ["", "feedback", "metrics.jsonl", "swap_events.jsonl", *shards]:
        want = 0o700 if (run / name).is_dir() else 0o600
        assert modes[name if name else "."] == want, (name, oct(modes[name if name else "."]))


def test_trainer_files_are_private(tmp_path) -> None:
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"feedback.dir={tmp_path / 'fb'}"])
    rd = RunDir.of(cfg)
    rd.write_trainer_status({"state": "idle"})
    rd.write_target_version(3)
    rd.pause_trainer()
    from serving.supervisor import TrainerSupervisor

    sup = TrainerSupervisor(cfg.model_copy(update={"serve": cfg.serve.model_copy(update={"trainer": "supervised"})}),
                            command=[sys.executable, "-c", "print('trainer output')"])
    sup._spawn().wait(30)
    assert "trainer output" in rd.trainer_log_path.read_text()
    with MetricsLogger(rd.trainer_dir, wandb_mode="disabled", access=cfg.files.access) as ml:
        ml.log({"x": 1.0})
    modes = _modes(rd.root)
    assert modes["."] == 0o700 and modes["trainer"] == 0o700, modes
    for name in ("trainer/status.json", "target_version", "trainer.pause", "trainer.log", "trainer/metrics.jsonl"):
        assert modes[name] == 0o600, (name, oct(modes[name]))


@pytest.mark.parametrize(("access", "dir_mode", "file_mode"), [("private", 0o700, 0o600), ("group", 0o770, 0o660)])
def test_feedback_writer_modes(tmp_path, access, dir_mode, file_mode) -> None:
    root = tmp_path / "a" / "feedback"
    with FeedbackWriter(root, shard_records=2, access=access) as w:
        for i in range(4):
            w.write(make_record(i))
    assert _mode(root) == dir_mode
    shards = list(root.glob("shard-*.parquet"))
    assert len(shards) == 2 and all(_mode(p) == file_mode for p in shards)
