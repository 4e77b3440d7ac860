"""Supervision of the online trainer process.

Serving never waits on training (DESIGN.md invariant 3): the trainer runs as its own OS process
(`python -m dvi.cli train --online --config <run_dir>/trainer_config.yaml`), its output goes to
`<run_dir>/trainer.log` (both paths are `dvi.rundir.RunDir`'s), and when it dies it is restarted with exponential back-off
(`serve.trainer_restart_backoff_s` doubling up to `serve.trainer_restart_backoff_max_s`; the
delay resets after the process stays up for 60 s).

Modes (`serve.trainer`):
- ``off``: no trainer; state ``off``.
- ``supervised``: as above; states ``starting`` / ``running`` / ``restarting`` / ``paused`` /
  ``stopped``.
- ``external``: a trainer started elsewhere (e.g. `accelerate launch` on other GPUs) shares the
  feedback and registry dirs; the server only reports ``external``.

Liveness: a process that exists is not necessarily working (SIGSTOP, a deadlock, a hung
filesystem). The trainer rewrites `<run_dir>/trainer/status.json` on every loop iteration (running,
idle or paused); when that heartbeat is older than `serve.trainer_stale_s` (or, before the first
one, the spawn is older than `serve.trainer_start_grace_s`), the supervisor kills the process group with SIGKILL (which also ends a
stopped process), counts a stale restart, logs it and restarts as after a crash. `/health` shows
the heartbeat age and is degraded while the trainer restarts.

Stopping: a server that stops sends the trainer SIGTERM on its signal (`request_stop`), so the trainer's last round,
checkpoint and publish overlap the drain; after the drain `stop` waits a bounded time for what is left, then SIGKILLs
it (its state is crash-safe: a kill costs at most the rounds since its last checkpoint, trained again).

Pause / resume: the supervisor writes / removes `<run_dir>/trainer.pause`; the online trainer
(`trainers.online`) checks it before every round and takes no steps while it exists, so the same
mechanism works for supervised and external trainers, and a paused trainer stays responsive to
SIGTERM (no SIGSTOP). A paused trainer is alive, and is reported as ``paused``.

The child runs in its own session (so the whole group can be signalled) and, on Linux, gets
PR_SET_PDEATHSIG so it dies with the server even when the server is SIGKILLed. Spawning happens
only on the supervisor's own long-lived thread, because the death signal follows the thread that
forked.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from dvi.config import DviConfig, dump_config
from dvi.fsutil import open_append, rotate_log
from dvi.rundir import RunDir

log = logging.getLogger(__name__)

STABLE_AFTER_S = 60.0
LOG_CHECK_S = 5.0  # how often the watch loop looks at trainer.log's size


def _pdeathsig() -> None:  # pragma: no cover - runs in the child
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class TrainerSupervisor:
    """Starts, watches and restarts the trainer process; reports state and restart count."""

    def __init__(self, cfg: DviConfig, on_event: Callable[[str], None] | None = None,
                 command: list[str] | None = None) -> None:
        self.cfg = cfg
        self.mode = cfg.serve.trainer
        self.rundir = RunDir.of(cfg)
        self.command = command or [sys.executable, "-m", "dvi.cli", "train", "--online",
                                   "--config", str(self.rundir.trainer_config_path)]
        self.on_event = on_event or (lambda _event: None)
        self.restarts = 0
        self.stale_restarts = 0
        self.stale_after_s = cfg.serve.trainer_stale_s
        self.start_grace_s = max(cfg.serve.trainer_start_grace_s, cfg.serve.trainer_stale_s)
        self._spawned_at: float | None = None  # wall clock, comparable with file mtimes
        self.state = "off" if self.mode == "off" else ("external" if self.mode == "external" else "starting")
        # `suffix` alone has no learned drafter: nothing to train, so no trainer is started (said on /health)
        self.note: str | None = None
        if cfg.models.learned_kind is None and self.mode == "supervised":
            self.state, self.note = "off", "models.drafter_kind is suffix: no learned drafter, nothing to train"
        self.paused = False
        self.last_exit_code: int | None = None
        self.proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._log_checked = 0.0
        self._termed: subprocess.Popen | None = None  # the process SIGTERM was sent to, and when
        self._termed_at: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.rundir.make_root()
        if self.mode != "supervised" or self.note is not None:
            return
        self.write_config()
        self.rundir.resume_trainer()
        self._thread = threading.Thread(target=self._run, name="dvi-trainer-supervisor", daemon=True)
        self._thread.start()

    def write_config(self) -> Path:
        """The resolved config the trainer runs with (so it sees the server's dirs and preset).

        `dump_config` leaves the secrets out; the file is still owner-only, as it names the run's dirs.
        """
        return self.rundir.write_trainer_config(yaml.safe_dump(dump_config(self.cfg), sort_keys=False))

    def request_stop(self) -> None:
        """Stop supervising and send the trainer SIGTERM now, without waiting for it: a server that stops calls this
        on the signal, so the trainer's last round, checkpoint and publish run while the requests drain; `stop`
        then waits for what is left of it."""
        self._stop.set()
        self._wake.set()
        with self._lock:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            self._term(proc)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop supervising and terminate the trainer (SIGTERM unless `request_stop` sent it, then SIGKILL after
        `timeout` more seconds)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)  # told to stop, it returns at once (it never waits on the trainer)
        self._terminate(timeout)
        if self.mode == "supervised":
            self.state = "stopped"

    def _term(self, proc: subprocess.Popen) -> None:
        """SIGTERM to the trainer's group, once per process (its handler only sets a flag; a second one is noise)."""
        with self._lock:
            if self._termed is proc:
                return
            self._termed = proc
            self._termed_at = time.monotonic()
        self._signal(proc, signal.SIGTERM)

    def _terminate(self, timeout: float) -> None:
        with self._lock:
            proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self._term(proc)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # The trainer's state is crash-safe (checkpoint, then the cursor; versions renamed in whole): a kill costs
            # at most the rounds since its last flush, which the next trainer trains again.
            told = time.monotonic() - (self._termed_at or time.monotonic())
            st = self.rundir.read_trainer_status()
            done = st.get("state") == "stopped" and st.get("pid") == proc.pid
            log.log(logging.INFO if done else logging.WARNING, "trainer pid %d still running %.1fs after SIGTERM "
                    "(%s); killing it", proc.pid, told, "it had checkpointed and published: only its interpreter's "
                    "exit was left" if done else "the rounds since its last checkpoint are trained again at the next start")
            self._signal(proc, signal.SIGKILL)
            proc.wait(timeout=5)

    @staticmethod
    def _signal(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    # -- the watch loop (the only thread that spawns) ------------------------------------------
    def _spawn(self) -> subprocess.Popen:
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(self.cfg.trainer.num_threads))
        self._rotate_log(force=True)
        logf = open_append(self.rundir.trainer_log_path, self.rundir.file_mode)  # the child keeps its own copy
        try:
            return subprocess.Popen(
                self.command, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
                preexec_fn=_pdeathsig if sys.platform.startswith("linux") else None,
            )
        finally:
            os.close(logf)

    def _rotate_log(self, force: bool = False) -> None:
        """Rotate trainer.log at `files.log_max_bytes` (copy + truncate: the child holds it O_APPEND)."""
        now = time.monotonic()
        if not force and now - self._log_checked < LOG_CHECK_S:
            return
        self._log_checked = now
        try:
            rotate_log(self.rundir.trainer_log_path, self.rundir.rotation, copy_truncate=True)
        except OSError as exc:
            log.warning("cannot rotate %s: %s", self.rundir.trainer_log_path, exc)

    def _run(self) -> None:
        backoff = self.cfg.serve.trainer_restart_backoff_s
        max_backoff = self.cfg.serve.trainer_restart_backoff_max_s
        while not self._stop.is_set():
            try:
                proc = self._spawn()
            except OSError as exc:
                log.error("cannot start trainer: %s", exc)
                proc = None
            started = time.monotonic()
            if proc is not None:
                with self._lock:
                    self.proc = proc
                    self._spawned_at = time.time()
                self.state = "paused" if self.paused else "running"
                log.info("trainer started (pid %d, restarts %d)", proc.pid, self.restarts)
                self.on_event("started")
                while not self._stop.is_set() and proc.poll() is None:
                    self._wake.wait(0.2)
                    self._wake.clear()
                    self._rotate_log()
                    if self._check_stale(proc):
                        break
                if self._stop.is_set():
                    return
                proc.wait()
                self.last_exit_code = proc.returncode
                log.warning("trainer exited with code %s; restarting in %.1fs (see %s)",
                            proc.returncode, backoff, self.rundir.trainer_log_path)
            if time.monotonic() - started >= STABLE_AFTER_S:
                backoff = self.cfg.serve.trainer_restart_backoff_s
            self.state = "restarting"
            self.on_event("died")
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, max_backoff)
            self.restarts += 1
            self.on_event("restarted")

    def _heartbeat(self) -> tuple[float, float] | None:
        """(seconds since the running trainer's last heartbeat or, before its first, its spawn; the
        limit that age is held to), or None when no trainer process runs."""
        with self._lock:
            spawned, proc = self._spawned_at, self.proc
        if spawned is None or proc is None or proc.poll() is not None:
            return None
        beat = self.rundir.heartbeat_time() or 0.0
        if beat >= spawned:
            return max(0.0, time.time() - beat), self.stale_after_s
        return max(0.0, time.time() - spawned), self.start_grace_s

    def heartbeat_age(self) -> float | None:
        hb = self._heartbeat()
        return None if hb is None else hb[0]

    def _check_stale(self, proc: subprocess.Popen) -> bool:
        """Kill a trainer whose heartbeat is older than `serve.trainer_stale_s` (stopped or hung)."""
        hb = self._heartbeat()
        if hb is None or hb[0] <= hb[1]:
            return False
        age = hb[0]
        self.stale_restarts += 1
        log.error("trainer pid %d: no heartbeat for %.1fs (limit %.1fs): stopped or hung; killing it and "
                  "restarting (stale restarts %d)", proc.pid, age, self.stale_after_s, self.stale_restarts)
        self.on_event("stale")
        self._signal(proc, signal.SIGKILL)
        return True

    # -- pause / resume ----------------------------------------------------------------------
    def pause(self) -> None:
        self._set_paused(True)

    def resume(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        """Set / clear the run dir's pause flag; a running trainer is reported as paused / running."""
        if self.mode == "off":
            raise RuntimeError("trainer is off (serve.trainer=off)")
        if paused:
            self.rundir.pause_trainer()
        else:
            self.rundir.resume_trainer()
        with self._lock:
            self.paused = paused
            if self.proc is not None and self.proc.poll() is None:
                self.state = "paused" if paused else "running"

    # -- reporting ---------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        with self._lock:
            p = self.proc
        return p.pid if p is not None and p.poll() is None else None

    def heap(self) -> dict | None:
        """The running trainer's last heap trim as its status reports it (`dvi.memory.HeapTrimmer.status`: RSS before
        and after, what trims gave back); None without a running trainer. Reads the status file: the full health
        document's, not every probe's."""
        pid = self.pid
        st = self.rundir.read_trainer_status() if pid is not None else {}
        return st.get("heap") if st.get("pid") == pid else None

    def info(self) -> dict:
        hb = self._heartbeat()
        return {"mode": self.mode, "state": self.state, "restarts": self.restarts, "pid": self.pid,
                "heartbeat_age_s": None if hb is None else round(hb[0], 3),
                "stale": hb is not None and hb[0] > hb[1], "stale_after_s": self.stale_after_s,
                "stale_restarts": self.stale_restarts,
                "paused": self.paused or self.rundir.trainer_paused(), "last_exit_code": self.last_exit_code,
                "log": str(self.rundir.trainer_log_path) if self.mode == "supervised" else None,
                "note": self.note}
