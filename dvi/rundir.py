"""The run directory: every path and file that the server, the trainer, the supervisor, the admin
API and the benchmarks share, with typed reads and writes (docs/contracts.md, "Run dir").

Layout::

    <run_dir>/
      trainer.pause           exists while the trainer must take no steps (supervisor, admin API)
      target_version          the target's current version, one integer (admin API, RL loops)
      trainer_config.yaml     the resolved config a supervised trainer runs with (owner-only)
      trainer.log             a supervised trainer's stdout and stderr
      metrics.jsonl           the server's metric rows (`dvi.metrics.MetricsLogger`)
      swap_events.jsonl       the server's promotions, refusals and rollbacks
      trainer/                the trainer's own
        status.json           its gauges and a `heartbeat` time, replaced every loop iteration;
                              the file's mtime is the heartbeat the supervisor watches
        checkpoint/           weights, optimizer, counters (replaced whole)
        consumed.jsonl        one line per flushed round (exactly-once accounting)
        cursor.json           the feedback reader's consumed state (`dvi.feedback.consumed`), per writer
        quarantined_records.jsonl  records the trainer could not train on, with the reason (rotated)
        metrics.jsonl         the trainer's metric rows
    <feedback.dir>            parquet shards (`dvi.feedback`; a local dir or an fsspec URL), and
                              consumed.json: a copy of the cursor, what writers may delete on a full disk
    <registry.dir>/drafter/   published versions and LATEST (`dvi.registry.store`)

Writers replace files atomically (`dvi.fsutil`), so a reader sees the old content or the new.
The target version is written as plain text (``"7\\n"``) and read as an integer; a JSON integer
(``7``) reads the same. Readers that find a file absent or torn get None / {} instead of an error:
these files are signals between processes, and a missing one means "nothing said yet".
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dvi.config import FilesConfig
from dvi.fsutil import (
    PRIVATE,
    AppendLog,
    LogRotation,
    access_modes,
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    make_dirs,
    tree_bytes,
)

if TYPE_CHECKING:
    from dvi.config import DviConfig

PAUSE_FILE = "trainer.pause"
TARGET_VERSION_FILE = "target_version"
TRAINER_CONFIG_FILE = "trainer_config.yaml"
TRAINER_LOG_FILE = "trainer.log"
METRICS_FILE = "metrics.jsonl"
SWAP_EVENTS_FILE = "swap_events.jsonl"
TRAINER_DIR = "trainer"
STATUS_FILE = "status.json"  # under TRAINER_DIR
CHECKPOINT_DIR = "checkpoint"  # under TRAINER_DIR
CONSUMED_LOG = "consumed.jsonl"  # under TRAINER_DIR
CURSOR_FILE = "cursor.json"  # under TRAINER_DIR
QUARANTINED_RECORDS_LOG = "quarantined_records.jsonl"  # under TRAINER_DIR


class RunDir:
    """One run's shared files. `RunDir.of(cfg)` for a config's run; paths only, nothing is created
    until `make()` or a write. `feedback_dir` (a path or fsspec URL) and `registry_dir` are
    configured separately and may lie elsewhere (shared by several servers, see docs/design.md)."""

    def __init__(self, root: str | os.PathLike, feedback_dir: str | os.PathLike | None = None,
                 registry_dir: str | os.PathLike | None = None, files: FilesConfig | None = None) -> None:
        self.root = Path(root)
        self.feedback_dir = None if feedback_dir is None else str(feedback_dir)
        self.registry_dir = None if registry_dir is None else Path(registry_dir)
        self.files = files if files is not None else FilesConfig()
        self.dir_mode, self.file_mode = access_modes(self.files.access)
        self.rotation = LogRotation(self.files.log_max_bytes, self.files.log_backups)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r}, feedback_dir={self.feedback_dir!r}, registry_dir={self.registry_dir!r})"

    @classmethod
    def of(cls, cfg: DviConfig) -> RunDir:
        """The run dir of a `dvi.config.DviConfig` (its `run_dir`, `feedback.dir` and `registry.dir`)."""
        return cls(cfg.run_dir, cfg.feedback.dir, cfg.registry.dir, cfg.files)

    def make(self) -> RunDir:
        """Create `<run_dir>/` and `<run_dir>/trainer/` (with `files.access`'s dir mode); returns self."""
        make_dirs(self.root, self.files.access)
        make_dirs(self.trainer_dir, self.files.access)
        return self

    def make_root(self) -> Path:
        """Create `<run_dir>/` (with `files.access`'s dir mode); returns it."""
        return make_dirs(self.root, self.files.access)

    def log(self, path: Path) -> AppendLog:
        """A log of this run dir: rotated at `files.log_max_bytes`, created with `files.access`'s mode."""
        return AppendLog(path, self.rotation, self.file_mode)

    # -- paths --------------------------------------------------------------------------------------
    @property
    def pause_path(self) -> Path:
        return self.root / PAUSE_FILE

    @property
    def target_version_path(self) -> Path:
        return self.root / TARGET_VERSION_FILE

    @property
    def trainer_config_path(self) -> Path:
        return self.root / TRAINER_CONFIG_FILE

    @property
    def trainer_log_path(self) -> Path:
        return self.root / TRAINER_LOG_FILE

    @property
    def metrics_path(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def swap_events_path(self) -> Path:
        return self.root / SWAP_EVENTS_FILE

    @property
    def trainer_dir(self) -> Path:
        return self.root / TRAINER_DIR

    @property
    def status_path(self) -> Path:
        return self.trainer_dir / STATUS_FILE

    @property
    def checkpoint_dir(self) -> Path:
        return self.trainer_dir / CHECKPOINT_DIR

    @property
    def consumed_path(self) -> Path:
        return self.trainer_dir / CONSUMED_LOG

    @property
    def cursor_path(self) -> Path:
        return self.trainer_dir / CURSOR_FILE

    @property
    def quarantined_records_path(self) -> Path:
        return self.trainer_dir / QUARANTINED_RECORDS_LOG

    # -- trainer pause flag ---------------------------------------------------------------------------
    def pause_trainer(self) -> None:
        """No trainer steps from the next round on (supervised and external trainers alike)."""
        self.make_root()
        atomic_write_text(self.pause_path, f"paused at {time.time()}\n", fsync=False, mode=self.file_mode)

    def resume_trainer(self) -> None:
        self.pause_path.unlink(missing_ok=True)

    def trainer_paused(self) -> bool:
        return self.pause_path.exists()

    # -- target version -------------------------------------------------------------------------------
    def write_target_version(self, version: int) -> None:
        """Tell the trainer about a new target before its first feedback record arrives."""
        self.make_root()
        atomic_write_text(self.target_version_path, f"{int(version)}\n", mode=self.file_mode)

    def read_target_version(self) -> int | None:
        """The integer in `<run_dir>/target_version`, or None when absent or unreadable."""
        try:
            return int(self.target_version_path.read_text().strip())
        except (OSError, ValueError):
            return None

    # -- trainer status (gauges + heartbeat) ----------------------------------------------------------
    def write_trainer_status(self, status: dict[str, Any]) -> None:
        """Replace `trainer/status.json` (not fsynced: a gauge, rewritten every round). Adds `heartbeat`."""
        make_dirs(self.trainer_dir, self.files.access)
        atomic_write_json(self.status_path, {"heartbeat": time.time(), **status}, fsync=False, mode=self.file_mode)

    def read_trainer_status(self) -> dict[str, Any]:
        """The trainer's last status ({} if absent or torn)."""
        try:
            data = json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def heartbeat_time(self) -> float | None:
        """Wall-clock time of the trainer's last status write (the file's mtime), None if never."""
        try:
            return self.status_path.stat().st_mtime
        except OSError:
            return None

    # -- supervised trainer config ----------------------------------------------------------------------
    def write_trainer_config(self, text: str) -> Path:
        """The resolved config a supervised trainer runs with; owner-only (it names the run's dirs)."""
        self.make_root()
        atomic_write_text(self.trainer_config_path, text, mode=PRIVATE)
        return self.trainer_config_path

    # -- consumed log (the trainer's exactly-once accounting) ---------------------------------------------
    def append_consumed(self, entry: Mapping[str, Any]) -> None:
        """Append one flushed round to `trainer/consumed.jsonl`. Past `files.consumed_log_max_bytes` the
        log is compacted (`_compact_consumed`), so it never grows with the records served."""
        make_dirs(self.trainer_dir, self.files.access)
        append_jsonl(AppendLog(self.consumed_path, None, self.file_mode), entry)
        try:
            if self.consumed_path.stat().st_size > self.files.consumed_log_max_bytes:
                self._compact_consumed()
        except OSError:
            pass  # compaction is an economy; the append itself succeeded

    def _compact_consumed(self) -> None:
        """Replace the log by one summary line (`compacted`: the rounds, records and shards it stands for,
        their seqs and times; empty id lists) and the newest rounds, a quarter of the limit at most.

        Nothing reads the dropped rounds' ids: every round in the log is already in a checkpoint and
        committed or about to be, and a restart needs only the last seq (`last_consumed_seq`)."""
        pairs = []
        for line in self.consumed_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a torn line from a kill mid-append
            if isinstance(entry, dict) and "seq" in entry:
                pairs.append((entry, line))
        kept, size = 0, 0
        for _, line in reversed(pairs):
            if kept and size + len(line) + 1 > self.files.consumed_log_max_bytes // 4:
                break
            kept, size = kept + 1, size + len(line) + 1
        dropped = pairs[: len(pairs) - kept]
        if not dropped:
            return
        total = {"rounds": 0, "records": 0, "shards": 0, "first_seq": None, "first_time": None}
        for e, _ in dropped:
            c = e.get("compacted") or {"rounds": 1, "shards": len(e.get("shards", [])), "first_seq": e["seq"],
                                       "first_time": e.get("time"),
                                       "records": sum(len(e.get(k, [])) for k in ("trained", "heldout", "dropped"))}
            for k in ("rounds", "records", "shards"):
                total[k] += int(c.get(k, 0))
            for k in ("first_seq", "first_time"):
                total[k] = c.get(k) if total[k] is None else total[k]
        last = dropped[-1][0]
        summary = {"seq": last["seq"], "time": last.get("time"), "step": last.get("step"),
                   "compacted": total, "shards": [], "trained": [], "heldout": [], "dropped": []}
        text = "\n".join([json.dumps(summary)] + [line for _, line in pairs[len(pairs) - kept:]]) + "\n"
        atomic_write_text(self.consumed_path, text, mode=self.file_mode)

    def append_quarantined_record(self, entry: Mapping[str, Any]) -> None:
        """Keep a record the trainer could not train on (one JSON line, for a person to look at); rotated at
        `files.log_max_bytes` like the other logs, so a stream of bad records cannot fill the disk."""
        make_dirs(self.trainer_dir, self.files.access)
        append_jsonl(self.log(self.quarantined_records_path), entry)

    def last_consumed_seq(self, chunk: int = 64 * 1024) -> int:
        """The `seq` of the log's last whole line (0 when there is none), read from the end: a restart
        reads a few KB, not the whole log."""
        try:
            f = open(self.consumed_path, "rb")  # noqa: SIM115 - closed below
        except FileNotFoundError:
            return 0
        with f:
            end = f.seek(0, os.SEEK_END)
            start = end
            while True:
                start = max(0, start - chunk)
                f.seek(start)
                lines = f.read(end - start).splitlines()
                for line in reversed(lines[1:] if start > 0 else lines):  # the first may be cut
                    try:
                        return int(json.loads(line)["seq"])
                    except (ValueError, KeyError, TypeError):
                        continue  # a torn last line from a kill mid-append
                if start == 0:
                    return 0
                chunk *= 2

    # -- disk use -------------------------------------------------------------------------------------------
    LOG_NAMES = (TRAINER_LOG_FILE, METRICS_FILE, SWAP_EVENTS_FILE, CONSUMED_LOG, QUARANTINED_RECORDS_LOG)

    def disk_usage(self) -> dict[str, int]:
        """Bytes on disk per part (`dvi.metrics.DISK_PARTS`): feedback shards (a local feedback dir only),
        the registry, the run dir's logs (rotated copies included), the trainer's checkpoint, wandb."""
        logs = 0
        for d in (self.root, self.trainer_dir):
            for name in self.LOG_NAMES:
                for p in d.glob(name + "*"):
                    with contextlib.suppress(OSError):
                        logs += p.stat().st_size
        local_feedback = self.feedback_dir is not None and "://" not in self.feedback_dir
        return {"feedback": tree_bytes(self.feedback_dir) if local_feedback else 0,
                "registry": tree_bytes(self.registry_dir), "logs": logs,
                "checkpoint": tree_bytes(self.checkpoint_dir), "wandb": tree_bytes(self.root / "wandb") + tree_bytes(self.trainer_dir / "wandb")}

