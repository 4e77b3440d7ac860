"""What /health reports.

Both the app and the admin routes read it, and what makes the server "degraded" (engine loop, trainer, feedback
writer) is a policy apart from answering requests. It only reads a `ServerState`; it never changes one, and of the engine it reads only the
snapshot its thread last published (`Scheduler.snapshot`, `serving.engine_client`), and of the drafter versions the
snapshot the drafter thread last published (`DrafterClient.snapshot`, `serving.drafter.client`).
"""

from __future__ import annotations

import time
from typing import Any

from .wiring import ServerState


def degraded_reasons(s: ServerState, trainer: dict[str, Any]) -> list[str]:
    """Why /health is not ok (empty: ok); each line is what an operator must look at."""
    reasons = []
    if not s.scheduler.alive:
        reasons.append(s.scheduler.lost or "engine loop is not running")
    remote = s.scheduler.snapshot.engine_info
    if remote and not remote.get("ready", True):
        reasons.append(f"{remote.get('kind')} is (re)starting (restarts {remote.get('restarts')}; log {remote.get('log')})")
    if trainer["state"] == "restarting":
        reasons.append(f"trainer is restarting (last exit code {trainer['last_exit_code']}, "
                       f"restarts {trainer['restarts']})")
    if trainer.get("stale"):
        reasons.append(f"trainer heartbeat is {trainer['heartbeat_age_s']:.0f}s old "
                       f"(limit {s.cfg.serve.trainer_stale_s:g}s)")
    fb = s.feedback
    if fb is not None and fb.failing:
        reasons.append(f"feedback writes failing ({fb.last_error}); {fb.pending()} records buffered, "
                       f"{fb.dropped_records} dropped")
    return reasons


def public_health(s: ServerState) -> dict[str, Any]:
    """What /health tells a caller without the admin token: liveness and versions, nothing else.

    No paths, pids, limits or reasons (an error text may name a file): those are `health_info`'s,
    for the admin token only.
    """
    reasons = degraded_reasons(s, s.supervisor.info())
    d = s.drafter
    return {"status": "ok" if not reasons else ("degraded" if s.scheduler.alive else "down"),
            "drafter_version": d.snapshot.shared.live_version if d is not None else None,
            "target_version": s.target_version}


def health_info(s: ServerState) -> dict[str, Any]:
    """The full health document (`/health` with the admin token, `/admin/status`)."""
    alive = s.scheduler.alive
    snap = s.scheduler.snapshot
    drafter = s.drafter.snapshot if s.drafter is not None else None
    sw = drafter.shared.info() if drafter is not None else None
    trainer = s.supervisor.info()
    reasons = degraded_reasons(s, trainer)
    trainer["heap"] = s.supervisor.heap()
    fb = s.feedback
    return {
        "status": "ok" if not reasons else ("degraded" if alive else "down"),
        "reasons": reasons,
        "model": s.model_name,
        "replica": s.cfg.serve.replica or None,  # its server records in the shared registry are its own
        "uptime_s": round(time.time() - s.started_at, 3),
        "engine": {"alive": alive, "running": snap.running, "queue": snap.queue, "steps": snap.steps,
                   "completed": snap.completed, "step_errors": snap.step_errors, "request_errors": snap.request_errors,
                   "max_batch_size": s.cfg.serve.max_batch_size, "queue_limit": s.cfg.serve.queue_limit,
                   "kind": s.cfg.serve.engine, "heap": dict(snap.heap),  # the engine thread's trims (`dvi.memory`)
                   "pid": s.scheduler.pid,  # its own process (`serve.engine_process`) or this one
                   **dict(snap.engine_info)},  # vLLM: its url, readiness, restarts, swaps
        "drafter_version": sw["live_version"] if sw else None,
        "target_version": s.target_version,
        "drafter": sw,
        "adapters": drafter.adapters() if drafter is not None else None,  # per traffic group (trainer.adapter_key)
        # what learning buys, per traffic group: its learned arm against the frozen base's control arm (issue 59)
        "control": {"share": s.control_share, "groups": s.metrics.control.report()},
        "drafter_kind": s.cfg.models.drafter_kind,
        "learned_kind": s.cfg.models.learned_kind,
        "suffix": _suffix_info(s, snap.proposer_stats),
        "prefix_cache": dict(snap.prefix_cache) or None,  # serve.prefix_cache_tokens (None: off, the log says why)
        "draft_vocab_size": snap.draft_vocab_size,  # N of the live drafter's reduced vocabulary (None: full)
        # adaptive K's prices as real steps measured them, per batch-size bucket: "plain" and "draft" a factor on the
        # calibrated seconds, "position" the seconds a drafted position adds (`dvi.decode.step_costs.MeasuredCosts`)
        "step_costs": dict(snap.step_costs),
        "greedy_contract": dict(snap.greedy_contract),  # bitwise / near-tie, measured on this device at start-up
        "tokenizer": {"stop_token_ids": list(s.scheduler.eos_ids), "warnings": s.tokenizer_warnings},
        "trainer": trainer,
        "disk_bytes": s.metrics.disk_usage(s.supervisor.rundir),
        "feedback": {"dir": s.cfg.feedback.dir, "records_written": getattr(fb, "records_written", 0),
                     "pending": fb.pending() if fb is not None else 0,
                     "pending_bytes": fb.pending_bytes() if fb is not None else 0,
                     "write_errors": getattr(fb, "flush_errors", 0),
                     "dropped": getattr(fb, "dropped_records", 0),
                     "deleted_shards": getattr(fb, "deleted_shards", 0),
                     "reclaimed_shards": getattr(fb, "reclaimed_shards", 0),
                     "failing": bool(fb is not None and fb.failing),
                     "last_error": getattr(fb, "last_error", None),
                     "errors": s.feedback_log.errors},
    }


def _suffix_info(s: ServerState, st: Any) -> dict[str, Any] | None:
    """The suffix drafter's index size, lookups and hits (`st`: the snapshot's proposer stats), and what the tailer
    added (None: not a suffix kind)."""
    if not st:
        return None
    t = s.suffix_tailer
    return {**st, "tailed_records": t.records_added if t is not None else 0,
            "tail_errors": t.errors if t is not None else 0}
