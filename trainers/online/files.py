"""The run-dir files the trainer shares with the server, the supervisor and RL loops.

One place in `trainers/` names them, so the trainer loop, the process set-up and `trainers.rl`
agree; `serving/` reads the same files (docs/contracts.md, "Trainer heartbeat").

Current target version: the larger of the newest `target_version` seen in the log and the
integer in `<run_dir>/target_version` (written by whoever updates the target, e.g. the server's
admin API or an RL loop), so a target update is honoured even before its first feedback lands.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dvi.fsutil import atomic_write_json

PAUSE_FILE = "trainer.pause"  # <run_dir>/trainer.pause: no steps while it exists (supervisor, admin)
TARGET_VERSION_FILE = "target_version"  # <run_dir>/target_version: the target's current version
TRAINER_DIR = "trainer"  # <run_dir>/trainer/: everything below is the trainer's own
CHECKPOINT_DIR = "checkpoint"  # <run_dir>/trainer/checkpoint/: weights, optimizer, counters, rounds
CONSUMED_LOG = "consumed.jsonl"  # <run_dir>/trainer/consumed.jsonl: one line per flushed round
STATUS_FILE = "status.json"  # <run_dir>/trainer/status.json: gauges + the supervisor's heartbeat


def read_target_version_file(run_dir: str | os.PathLike) -> int | None:
    """The integer in `<run_dir>/target_version`, or None when absent or unreadable."""
    try:
        return int(Path(run_dir, TARGET_VERSION_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, obj: Any, fsync: bool = True) -> None:
    """Readers see the old or the new content, never half (fsync for durability)."""
    atomic_write_json(path, obj, fsync=fsync)

