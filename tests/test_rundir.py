"""dvi.rundir.RunDir (the run-dir contract) and the dvi.fsutil helpers it writes through."""

from __future__ import annotations

import json
import os
import stat

import pytest

from dvi import fsutil
from dvi.config import DviConfig
from dvi.rundir import RunDir


def test_layout_matches_the_contract(tmp_path):
    rd = RunDir(tmp_path, feedback_dir=tmp_path / "fb", registry_dir=tmp_path / "reg")
    assert rd.pause_path == tmp_path / "trainer.pause"
    assert rd.target_version_path == tmp_path / "target_version"
    assert rd.trainer_config_path == tmp_path / "trainer_config.yaml"
    assert rd.trainer_log_path == tmp_path / "trainer.log"
    assert rd.metrics_path == tmp_path / "metrics.jsonl"
    assert rd.swap_events_path == tmp_path / "swap_events.jsonl"
    assert rd.status_path == tmp_path / "trainer" / "status.json"
    assert rd.checkpoint_dir == tmp_path / "trainer" / "checkpoint"
    assert rd.consumed_path == tmp_path / "trainer" / "consumed.jsonl"
    assert rd.cursor_path == tmp_path / "trainer" / "cursor.json"
    assert rd.feedback_dir == str(tmp_path / "fb") and rd.registry_dir == tmp_path / "reg"
    assert not rd.trainer_dir.exists()  # paths only until make() or a write
    assert rd.make() is rd and rd.trainer_dir.is_dir()


def test_of_config(tmp_path):
    cfg = DviConfig.model_validate({"run_dir": str(tmp_path / "run"), "feedback": {"dir": "memory://fb"},
                                    "registry": {"dir": str(tmp_path / "reg")}})
    rd = RunDir.of(cfg)
    assert rd.root == tmp_path / "run" and rd.feedback_dir == "memory://fb" and rd.registry_dir == tmp_path / "reg"


def test_pause_flag(tmp_path):
    rd = RunDir(tmp_path / "run")
    assert not rd.trainer_paused()
    rd.pause_trainer()
    assert rd.trainer_paused() and rd.pause_path.read_text().startswith("paused at ")
    rd.pause_trainer()  # idempotent
    rd.resume_trainer()
    assert not rd.trainer_paused()
    rd.resume_trainer()  # idempotent


def test_target_version_round_trip_and_both_spellings(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.read_target_version() is None
    rd.write_target_version(7)
    assert rd.target_version_path.read_text() == "7\n" and rd.read_target_version() == 7
    fsutil.atomic_write_json(rd.target_version_path, 3)  # how trainers.rl announces a version
    assert rd.read_target_version() == 3
    rd.target_version_path.write_text("garbage")
    assert rd.read_target_version() is None


def test_trainer_status_is_the_heartbeat(tmp_path):
    rd = RunDir(tmp_path)
    assert rd.read_trainer_status() == {} and rd.heartbeat_time() is None
    rd.write_trainer_status({"state": "running", "dvi_trainer_step": 3})
    st = rd.read_trainer_status()
    assert st["state"] == "running" and st["dvi_trainer_step"] == 3 and st["heartbeat"] > 0
    assert rd.heartbeat_time() == pytest.approx(os.stat(rd.status_path).st_mtime)
    rd.status_path.write_text('{"state": "runn')  # torn (never happens through write_trainer_status)
    assert rd.read_trainer_status() == {}
    rd.status_path.write_text("[1, 2]")  # not an object
    assert rd.read_trainer_status() == {}


def test_trainer_config_is_owner_only(tmp_path):
    rd = RunDir(tmp_path / "run")
    path = rd.write_trainer_config("run_dir: x\n")
    assert path.read_text() == "run_dir: x\n"
    assert stat.S_IMODE(path.stat().st_mode) == fsutil.PRIVATE


# -- dvi.fsutil ----------------------------------------------------------------------------------------
def test_atomic_file_replaces_only_on_success(tmp_path):
    p = tmp_path / "f.bin"
    fsutil.atomic_write_bytes(p, b"old")
    with pytest.raises(RuntimeError), fsutil.atomic_file(p) as f:
        f.write(b"half")
        raise RuntimeError("killed mid-write")
    assert p.read_bytes() == b"old"
    assert [x.name for x in tmp_path.iterdir()] == ["f.bin"]  # the temp file is gone
    with fsutil.atomic_file(p, fsync=False) as f:
        f.write(b"new")
    assert p.read_bytes() == b"new"


def test_append_jsonl(tmp_path):
    p = tmp_path / "events.jsonl"
    fsutil.append_jsonl(p, {"a": 1})
    fsutil.append_jsonl(p, {"b": 2}, fsync=False)
    assert [json.loads(x) for x in p.read_text().splitlines()] == [{"a": 1}, {"b": 2}]


def test_replace_dir(tmp_path):
    dst = tmp_path / "ckpt"
    for content in ("one", "two"):
        src = fsutil.tmp_dir_beside(dst)
        assert src.parent == tmp_path and not src.exists() and src.name.startswith(fsutil.TMP_PREFIX)
        src.mkdir()
        (src / "x").write_text(content)
        fsutil.fsync_tree(src)
        fsutil.replace_dir(src, dst)
        assert (dst / "x").read_text() == content and not src.exists()
    assert fsutil.old_dirs(dst) == []  # the replaced one was deleted


def test_replace_dir_keeps_theirs_only_when_told(tmp_path, monkeypatch):
    dst = tmp_path / "pair"
    ours = tmp_path / "ours"
    ours.mkdir()
    real_rename = os.rename

    def racing_rename(a, b):  # another builder renames its complete pair into place first
        if str(a) == str(ours):
            (tmp_path / "pair").mkdir(exist_ok=True)
            (tmp_path / "pair" / "theirs").write_text("")
            raise OSError("Directory not empty")
        return real_rename(a, b)

    monkeypatch.setattr(os, "rename", racing_rename)
    fsutil.replace_dir(ours, dst, keep_theirs=lambda d: (d / "theirs").exists())
    assert (dst / "theirs").exists()
    with pytest.raises(OSError):
        fsutil.replace_dir(ours, dst, keep_theirs=lambda d: False)
