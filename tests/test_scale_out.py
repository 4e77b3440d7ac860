"""Scale-out, end to end: two `dvi serve` replicas and one online trainer share a feedback log and a
drafter registry (the run-dir contract, `dvi.rundir`: each process has its own run dir, the
feedback and registry dirs are shared), and the trainer runs under `accelerate launch
--num_processes 2` (CPU, gloo).

Every record either replica logs is consumed exactly once (trained, held out or dropped, one
`consumed.jsonl` entry, written by rank 0 only), both replicas promote what the trainer publishes,
and SIGTERM stops both trainer ranks cleanly (status "stopped").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml
from test_serving_helpers import PROMPTS, tiny_config, wait_for

from dvi.config import dump_config
from dvi.feedback import FeedbackReader
from dvi.registry.store import DrafterRegistry
from dvi.rundir import RunDir

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
REQUESTS_PER_REPLICA = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(cfg, path: Path) -> Path:
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    return path


def _launch_trainer(config: Path, log: Path) -> subprocess.Popen:
    """`accelerate launch --multi_gpu --num_processes 2` on CPU: torchrun starts two ranks, and the
    trainer's `Accelerator(cpu=True)` makes them a gloo group (accelerate's `--cpu` launcher would start
    one process unless given an MPI host file)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(_free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", "-m", "dvi.cli", "train", "--online", "--config", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)


def _stop(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _consumed_ids(rundir: RunDir) -> list[str]:
    if not rundir.consumed_path.exists():
        return []
    ids = []
    for line in rundir.consumed_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        ids += [i for k in ("trained", "heldout", "dropped") for i in entry[k]]
    return ids


def _logged_ids(feedback_dir: Path) -> list[str]:
    return [i for p in sorted(feedback_dir.glob("shard-*.parquet"))
            for i in pq.read_table(p, columns=["request_id"]).column("request_id").to_pylist()]


def _traffic(url: str, n: int) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 16})
            assert r.status_code == 200, r.text


def test_two_replicas_one_accelerate_trainer_share_feedback_and_registry(tiny_pair_dir, tmp_path) -> None:
    from serving.server_process import ServerProcess

    shared = [f"feedback.dir={tmp_path / 'shared' / 'feedback'}", f"registry.dir={tmp_path / 'shared' / 'registry'}",
              "trainer.shadow_margin=1.0", "trainer.publish_margin=-1.0", "feedback.shard_records=4"]
    replicas = [tiny_config(tiny_pair_dir, tmp_path / name, *shared, "serve.trainer=external",
                            "serve.rollback_margin=1.0") for name in ("replica-a", "replica-b")]
    trainer_cfg = tiny_config(tiny_pair_dir, tmp_path / "trainer", *shared, "trainer.batch_size=4",
                              "trainer.min_new_records=2", "trainer.poll_seconds=0.2",
                              "trainer.publish_every_steps=2")  # the replicas' held-out slice (tiny_config)
    trainer_dir = RunDir.of(trainer_cfg)
    fb = Path(trainer_cfg.feedback.dir)
    trainer = _launch_trainer(_write_config(trainer_cfg, tmp_path / "trainer.yaml"), tmp_path / "trainer.log")
    try:
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(ServerProcess(
                ["--config", str(_write_config(cfg, tmp_path / f"serve-{i}.yaml"))], tmp_path / f"server-{i}.log"))
                for i, cfg in enumerate(replicas)]
            for srv in servers:
                _traffic(srv.url, REQUESTS_PER_REPLICA)
            reg = DrafterRegistry(trainer_cfg.registry.dir)
            wait_for(lambda: reg.latest() is not None, 180, interval=0.5, what="the trainer's first publish")
            for srv in servers:  # both replicas promote what the one trainer published
                wait_for(lambda srv=srv: httpx.get(srv.url + "/health", timeout=30).json()["drafter_version"] >= 1,
                         60, interval=0.5, what=f"{srv.url} to promote a trained drafter")
        # replicas stopped (SIGTERM): their last feedback is flushed
        logged = _logged_ids(fb)
        assert len(logged) == 2 * REQUESTS_PER_REPLICA and len(set(logged)) == len(logged)
        writers = {p.name.split("-")[2] for p in fb.glob("shard-*.parquet")}  # shard-<ns>-<pid>-<seq>
        assert len(writers) == 2, "both replicas write to the shared feedback log"
        wait_for(lambda: sorted(_consumed_ids(trainer_dir)) == sorted(logged)
                 or len(_consumed_ids(trainer_dir)) > len(logged), 180, interval=0.5, what="every record consumed")
        assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        _stop(trainer)
    log = (tmp_path / "trainer.log").read_text()
    ids = _consumed_ids(trainer_dir)
    assert len(ids) == len(set(ids)), "a record was consumed twice"
    assert sorted(ids) == sorted(logged), "a record was skipped"
    status = trainer_dir.read_trainer_status()
    assert status["state"] == "stopped" and status["processes"] == 2, log[-3000:]
    assert FeedbackReader(fb, cursor_path=trainer_dir.cursor_path).poll() == []
    assert "Traceback" not in log.split("Received 15 death signal")[0], log[-3000:]
