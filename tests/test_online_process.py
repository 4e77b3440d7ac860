"""The real trainer process (`python -m dvi.cli train --online`): SIGKILL + restart, pause file, SIGTERM.

Feedback shards come from the real engine on the tiny pair. The trainer logs every round's record
ids to `<run_dir>/trainer/consumed.jsonl`; across a SIGKILL and a restart each record must appear
exactly once (trained, held out or dropped), and the cursor must end past every shard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_online import engine_records, online_config

from dvi import metrics as M
from dvi.config import dump_config
from dvi.feedback import FeedbackReader, FeedbackWriter
from dvi.registry.store import DrafterRegistry
from dvi.rundir import CONSUMED_LOG, PAUSE_FILE, STATUS_FILE, TRAINER_DIR

pytestmark = pytest.mark.slow
torch.set_num_threads(1)
REPO = Path(__file__).resolve().parent.parent


def _consumed(run_dir: Path) -> list[dict]:
    p = run_dir / TRAINER_DIR / CONSUMED_LOG
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line torn by SIGKILL mid-append; the restart re-logs that round
    return out


def _ids(entries: list[dict]) -> list[str]:
    return [i for e in entries for k in ("trained", "heldout", "dropped") for i in e[k]]


def tiny_pair(pair_dir: Path):
    from dvi.models.loading import load_pair

    return load_pair(pair_dir / "target", pair_dir / "drafter", pair_dir / "tokenizer", device="cpu")


def trainer_config(pair_dir: Path, run_dir: Path, *overrides: str):
    """(`online_config`, the path of its YAML) for a `dvi train --online` process in `run_dir`."""
    cfg = online_config(pair_dir, run_dir, *overrides)
    config = run_dir / "trainer.yaml"
    config.write_text(yaml.safe_dump(dump_config(cfg)))
    return cfg, config


def write_flushed(writer: FeedbackWriter, records) -> None:
    for r in records:
        writer.write(r)
    writer.flush()


def _start(config: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "dvi.cli", "train", "--online", "--config", str(config)],
                            cwd=REPO, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115


def _wait(pred, timeout: float, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM: the trainer finishes its round and exits 0."""
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]


def _reap(proc: subprocess.Popen) -> None:
    """A trainer a failed test left running is killed, not leaked."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_trainer_sigkill_restart_resumes_exactly_once_pause_and_sigterm(tiny_pair_dir, tmp_path) -> None:
    pair = tiny_pair(tiny_pair_dir)
    cfg, config = trainer_config(tiny_pair_dir, tmp_path, "trainer.batch_size=2", "trainer.publish_every_steps=4",
                                 "trainer.min_new_records=2", "trainer.poll_seconds=0.1",
                                 "trainer.publish_margin=-1.0")
    fb = Path(cfg.feedback.dir)
    recs = engine_records(pair, "prose", 48, max_new_tokens=16, prefix="p")
    w = FeedbackWriter(fb, shard_records=2)
    write_flushed(w, recs[:32])
    log = tmp_path / "trainer.log"

    proc = _start(config, log)
    try:
        _wait(lambda: len(_consumed(tmp_path)) >= 3, 90, proc, "three rounds")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.returncode == -signal.SIGKILL
        first = _consumed(tmp_path)
        # traffic continues while the trainer is down
        for r in recs[32:]:
            w.write(r)
        w.close()
        # restart paused: it must not train while the pause file exists
        (tmp_path / PAUSE_FILE).write_text("")
        proc = _start(config, log)
        status = tmp_path / TRAINER_DIR / STATUS_FILE
        _wait(lambda: status.exists() and json.loads(status.read_text())["state"] == "paused", 90, proc, "paused")
        n_paused = len(_consumed(tmp_path))
        time.sleep(1.0)
        assert len(_consumed(tmp_path)) == n_paused
        (tmp_path / PAUSE_FILE).unlink()
        all_ids = sorted(r.request_id for r in recs)
        _wait(lambda: sorted(_ids(_consumed(tmp_path))) == all_ids or len(_ids(_consumed(tmp_path))) > len(all_ids),
              90, proc, "every record consumed")
        _stop(proc, log)
    finally:
        _reap(proc)
    entries = _consumed(tmp_path)
    ids = _ids(entries)
    assert len(ids) == len(set(ids)), "a record was trained (or held out) twice"
    assert sorted(ids) == all_ids, "a record was skipped"
    assert len(entries) > len(first) and entries[: len(first)] == first
    text = log.read_text()
    assert "resumed from checkpoint" in text
    # the cursor is past every shard; the last state is "stopped"; versions were published and validate
    assert FeedbackReader(fb, cursor_path=tmp_path / TRAINER_DIR / "cursor.json").poll() == []
    assert json.loads((tmp_path / TRAINER_DIR / STATUS_FILE).read_text())["state"] == "stopped"
    reg = DrafterRegistry(cfg.registry.dir)
    latest = reg.latest()
    assert latest is not None
    _, man = reg.open_version(latest)
    assert man.records_seen == sum(len(e["trained"]) for e in entries)


def test_python_m_trainers_online_is_dvi_train_online() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-m", "trainers.online", "--help"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage: dvi train" in out.stdout and "--online" in out.stdout


def _tmp_dirs(reg: DrafterRegistry) -> set[str]:
    from dvi.fsutil import TMP_PREFIX

    try:
        return {p.name for p in reg.dir.iterdir() if p.name.startswith(TMP_PREFIX)}
    except FileNotFoundError:
        return set()


def test_trainer_kill9_during_publish_leaves_a_valid_registry_and_restarts(tiny_pair_dir, tmp_path) -> None:
    """Issue 27 §7: SIGKILL the real trainer while a version is being written (its temp dir exists), three
    times; every listed version and LATEST must validate each time, and the restarted trainer carries on."""
    from dvi.models.loading import load_pair
    from dvi.registry.store import VERSION_RE

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.batch_size=2", "trainer.publish_every_steps=1",
                        "trainer.min_new_records=2", "trainer.publish_margin=-1.0", "trainer.idle_replay_steps=1",
                        "trainer.checkpoint_seconds=0")
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump(dump_config(cfg)))
    w = FeedbackWriter(Path(cfg.feedback.dir), shard_records=2)
    for r in engine_records(pair, "prose", 32, max_new_tokens=16, prefix="k"):
        w.write(r)
    w.close()
    reg = DrafterRegistry(cfg.registry.dir)
    log = tmp_path / "trainer.log"
    status = tmp_path / TRAINER_DIR / STATUS_FILE
    for _ in range(3):
        before = _tmp_dirs(reg)
        proc = _start(config, log)
        try:
            _wait(lambda: bool(_tmp_dirs(reg) - before), 120, proc, "a publish in progress")  # noqa: B023
        finally:
            proc.kill()
            proc.wait()
        for v in reg.list_versions():
            reg.open_version(v)  # never a half-written version under a version name
        assert VERSION_RE.match((reg.dir / "LATEST").read_text().strip()) if reg.latest() else True
        if reg.latest() is not None:
            reg.open_version(reg.latest())

    def step() -> int:
        return json.loads(status.read_text())[M.TRAINER_STEP] if status.exists() else 0

    # the newest version's number, not the count: the registry keeps the last `registry.keep_last`, so once the
    # killed runs published that many (polls that miss short publishes let a run go on) the count stays put
    newest, step0 = max(reg.list_versions(), default=0), step()
    proc = _start(config, log)
    try:
        _wait(lambda: max(reg.list_versions(), default=0) > newest and step() > step0,
              120, proc, "the restarted trainer to train and publish")
        _stop(proc, log)
    finally:
        _reap(proc)
    assert "resumed from checkpoint" in log.read_text()
    reg.open_version(reg.latest())
    assert not _tmp_dirs(reg), "the killed publishers' temp dirs were left behind"
