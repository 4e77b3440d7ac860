"""The server's side of `dvi.metrics`: Prometheus for /metrics, plus JSONL + wandb rows.

All names come from `dvi.metrics`; this module only decides *when* the server updates them:
per finished request (counters, rolling α, latency and TTFT measured from submission, so queue
time counts), per swap event, and at scrape time (queue depth, versions, trainer state; the engine's part read
from the `EngineSnapshot` its thread published, never from the engine). Every
`log_every` finished requests it appends one row per domain to `<run_dir>/metrics.jsonl` (and
wandb), with `step` = requests finished so far, which is what `dvi report` and the demo plot.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from dvi import metrics as M
from dvi.config import DviConfig, dump_config
from dvi.decode.sources import SUFFIX_SOURCE
from dvi.metrics.uplift import ARMS, MEASURES, ArmSample
from dvi.rundir import RunDir

from .control import ControlGroups, control_values

if TYPE_CHECKING:
    from dvi.feedback import FeedbackWriter

    from .drafter.client import DrafterSnapshot
    from .engine_client import EngineSnapshot
    from .finished import Finished
    from .suffix_tail import SuffixTailer
    from .supervisor import TrainerSupervisor

log = logging.getLogger(__name__)

DISK_SCAN_S = 10.0  # /metrics re-walks the dirs for dvi_disk_bytes at most this often

# Supervisor states -> dvi.metrics.TRAINER_STATES codes.
_TRAINER_STATE = {"running": "running", "starting": "starting", "restarting": "backoff", "paused": "paused",
                  "stopped": "stopped", "off": "off", "external": "external"}


REJECTION_REASONS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                     405: "method_not_allowed", 409: "conflict", 413: "body_too_large", 422: "invalid_request",
                     429: "queue_full", 503: "unavailable"}
"""A refused request's reason label where it has no error code of ours: one per HTTP status."""


def _or_nan(x: float | None) -> float:
    return float("nan") if x is None else x


class ServerMetrics:
    """Prometheus collectors on a private registry, and the JSONL/wandb logger of the run."""

    def __init__(self, cfg: DviConfig, log_every: int = 16, window: int = 200,
                 domains: list[str] | None = None, max_versions: int | None = None, control_share: float = 0.0) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry()
        self.m = M.Metrics(self.registry, window=window, domains=domains, max_versions=max_versions,
                           model_name=cfg.serve.model_name)
        self._synced: dict[str, float] = {}
        self._disk: tuple[float, dict[str, int]] | None = None
        self.log_every = log_every
        self.requests = 0
        self.rejected = 0
        self._recent: dict[str, deque] = {}
        self._fresh: set[str] = set()
        self._lock = threading.Lock()
        # each traffic group's learned and control arm (issue 59), as many groups as may have an adapter
        self.control = ControlGroups(control_share, max_groups=cfg.trainer.max_adapters)
        self.m[M.CONTROL_SHARE].set(control_share)
        self.logger: M.MetricsLogger | None = None
        try:
            self.logger = M.MetricsLogger(cfg.run_dir, wandb_mode=cfg.wandb.mode, project=cfg.wandb.project,
                                          entity=cfg.wandb.entity, config=dump_config(cfg),
                                          name=f"serve-{int(time.time())}", access=cfg.files.access,
                                          rotation=RunDir.of(cfg).rotation)
        except Exception:  # noqa: BLE001 - metrics must never stop the server
            log.exception("metrics logger failed to start; /metrics still works")

    def observe_request(self, fin: Finished) -> None:
        """Engine thread, a subscriber of the final records: once per finished request (aborted ones included,
        they carry stats; the result carries the final finish reason)."""
        if fin.result is None:
            return
        stats = self.m.observe_result(M.ResultStats.of(fin.result, domain=fin.domain,
                                                       latency=fin.latency_s, ttft=fin.ttft_s))
        if M.low_acceptance(stats):
            log.warning("request %s (traffic group %r, drafter v%d): %d of %d drafted tokens accepted; a garbled or "
                        "looping output, or a drafter that does not fit this traffic (dvi_requests_low_acceptance_total)",
                        fin.request_id, fin.domain, stats.drafter_version, stats.num_accepted, stats.num_drafted)
        if fin.group and self.control.observe(fin.group, ArmSample.of(
                fin.arm, fin.result.adapter_version, fin.result, len(fin.token_ids), fin.latency_s, fin.ttft_s)):
            self.m[M.CONTROL_REQUESTS].labels(group=fin.group, arm=fin.arm).inc()
        with self._lock:
            self.requests += 1
            q = self._recent.setdefault(fin.domain, deque(maxlen=self.log_every * 4))
            q.append(stats)
            self._fresh.add(fin.domain)
            due = self.requests % self.log_every == 0
        if due and self.logger is not None:
            self._log_rows()

    def _log_rows(self) -> None:
        with self._lock:
            # only domains with traffic since the last row: a quiet domain's α is not re-plotted flat
            snap = {d: list(q)[-self.log_every:] for d, q in self._recent.items() if q and d in self._fresh}
            self._fresh.clear()
            step = self.requests
        for domain, stats in snap.items():
            version = stats[-1].drafter_version
            rows = [s for s in stats if s.drafter_version == version] or stats
            values = M.summarize_results(rows)
            try:
                self.logger.log(values, step=step, domain=domain, drafter_version=version)
            except Exception:  # noqa: BLE001
                log.exception("metrics row dropped")
        if self.control.share > 0:
            for group, report in self.control.report().items():
                try:  # one row per group (its key: the group); wandb plots control/<arm>/... and uplift/<measure>
                    self.logger.log(control_values(report), step=step, domain=group)
                except Exception:  # noqa: BLE001
                    log.exception("control-group row dropped")

    def update_control(self) -> None:
        """Scrape time: each group's arms since its served version went live, and the learned arm's uplift (a group
        the control group let go: its series removed)."""
        for group in self.control.take_evicted():
            self._forget_control_group(group)
        for group, report in self.control.report().items():
            for arm in ARMS:
                a = report[arm]
                for name, key in ((M.CONTROL_ACCEPTANCE_RATE, "alpha"), (M.CONTROL_TOKENS_PER_PASS, "tokens_per_pass"),
                                  (M.CONTROL_DECODE_TOKENS_PER_SECOND, "decode_tokens_per_s")):
                    self.m[name].labels(group=group, arm=arm).set(_or_nan(a[key]))
            for measure, u in report["uplift"].items():  # NaN until both arms of the served version have requests
                for bound in ("ratio", "low", "high"):
                    self.m[M.CONTROL_UPLIFT].labels(group=group, measure=measure, bound=bound).set(
                        _or_nan(u[bound] if u is not None else None))

    def _forget_control_group(self, group: str) -> None:
        for name in (M.CONTROL_REQUESTS, M.CONTROL_ACCEPTANCE_RATE, M.CONTROL_TOKENS_PER_PASS,
                     M.CONTROL_DECODE_TOKENS_PER_SECOND):
            for arm in ARMS:
                with contextlib.suppress(KeyError):
                    self.m[name].remove(group, arm)
        for measure in MEASURES:
            for bound in ("ratio", "low", "high"):
                with contextlib.suppress(KeyError):
                    self.m[M.CONTROL_UPLIFT].remove(group, measure, bound)

    def observe_swap(self, event: str, version: int, reason: str = "", category: str = "",
                     publish_to_verdict_s: float | None = None, group: str = "") -> None:
        """A drafter lane's event (`serving.drafter.messages.VersionEvent`); `group` "" the shared drafter's."""
        shared = {} if group else {"drafter_version": version}  # a group's adapter version is not the drafter's
        if publish_to_verdict_s is not None and event in M.VERDICTS:
            self.m[M.DRAFTER_PUBLISH_TO_VERDICT].labels(verdict=event).observe(publish_to_verdict_s)
        if event == "alpha_move":
            self.observe_alpha_move(group, category, reason)
        elif event in ("promoted", "pinned"):
            self.m.record_promotion()
            self.m.set_versions(**shared)
        elif event == "refused":
            self.m.record_refusal(category or ("shadow" if "shadow" in reason else "other"))
        elif event == "rolled_back":
            self.m.record_rollback()
            self.m.set_versions(**shared)
        elif event == "restored":  # a restarted server serves its pin / last good version again
            self.m.set_versions(**shared)

    def observe_alpha_move(self, group: str, cause: str, message: str) -> None:
        """A move of live α a lane explained: counted by cause, and a row in metrics.jsonl / wandb at this step (the
        demo's wandb run shows when and why)."""
        self.m[M.ALPHA_MOVES].labels(group=group, cause=cause).inc()
        if self.logger is not None:
            try:
                self.logger.log({M.ALPHA_MOVES: 1, f"{M.ALPHA_MOVES}/{cause}": 1}, step=self.requests,
                                domain=group or None)
            except Exception:  # noqa: BLE001
                log.exception("alpha-move row dropped")

    def observe_refusal(self, status: int, code: str | None) -> None:
        """A request the server refused, counted by a bounded reason (a 500 is a failure, not a refusal)."""
        if status != 500:
            self.observe_rejected(code or REJECTION_REASONS.get(status, "other"))

    def observe_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected += 1
        self.m[M.REQUESTS_REJECTED].labels(reason=reason).inc()

    def observe_cut(self, stage: str, n: int) -> None:
        """Requests a shutdown ended after its drain window ("running" or "waiting")."""
        self.m[M.REQUESTS_CUT].labels(stage=stage).inc(n)

    def observe_target_update(self, version: int) -> None:
        self.m.set_versions(target_version=version)

    def _sync_counter(self, name: str, total: float, **labels: str) -> None:
        """Advance counter `name` (with `labels`) to `total` (a count another object keeps), never backwards."""
        key = name + "".join(f",{k}={v}" for k, v in sorted(labels.items()))
        with self._lock:
            delta = total - self._synced.get(key, 0.0)
            if delta > 0:
                self._synced[key] = total
                (self.m[name].labels(**labels) if labels else self.m[name]).inc(delta)

    def disk_usage(self, rundir: RunDir) -> dict[str, int]:
        """`RunDir.disk_usage`, walked at most every DISK_SCAN_S seconds (a scrape must stay cheap)."""
        now = time.monotonic()
        if self._disk is None or now - self._disk[0] >= DISK_SCAN_S:
            self._disk = (now, rundir.disk_usage())
        return self._disk[1]

    def observe_http_timeouts(self, counts: dict[str, int]) -> None:
        """Connections the server cut for slow headers / bodies (`serving.connection`)."""
        for phase, n in counts.items():
            self._sync_counter(M.HTTP_REQUEST_TIMEOUTS, n, phase=phase)

    def update_gauges(self, snap: EngineSnapshot, drafter: DrafterSnapshot | None, supervisor: TrainerSupervisor,
                      feedback: FeedbackWriter | None, target_version: int) -> None:
        """Scrape time: queue depth (the engine's last snapshot), versions and gates (the drafter thread's last
        snapshot), trainer state and heartbeat, feedback write health."""
        self.m.set_queue_depth(snap.queue)
        self._sync_counter(M.ENGINE_STEPS, snap.steps)
        self._sync_counter(M.ENGINE_BUSY_SECONDS, snap.busy_seconds)
        if snap.prefix_cache:
            self._sync_counter(M.PREFIX_CACHE_QUERIES, snap.prefix_cache["queried_tokens"])
            self._sync_counter(M.PREFIX_CACHE_HITS, snap.prefix_cache["reused_tokens"])
        dv = drafter.shared.live_version if drafter is not None else 0
        self.m.set_versions(drafter_version=dv, target_version=target_version)
        for group, version in snap.adapter_versions.items():
            self.m[M.DRAFTER_ADAPTER_VERSION].labels(group=group).set(version)
        if drafter is not None:
            self.update_gates(drafter)
        self.update_control()
        sup = supervisor
        self.m.set_trainer_state(_TRAINER_STATE.get(sup.state, "stopped"))
        self.m[M.TRAINER_RESTARTS].set(sup.restarts)
        self._sync_counter(M.TRAINER_STALE_RESTARTS, sup.stale_restarts)
        age = sup.heartbeat_age()
        if age is not None:
            self.m[M.TRAINER_HEARTBEAT_AGE].set(age)
        if sup.mode != "off":  # the trainer's losses and held-out α, from its last status write
            self.m.set_trainer(sup.rundir.read_trainer_status())
        fb = feedback
        if fb is not None:
            self._sync_counter(M.FEEDBACK_WRITE_ERRORS, fb.flush_errors)
            self._sync_counter(M.FEEDBACK_DROPPED_RECORDS, fb.dropped_records)
            self._sync_counter(M.FEEDBACK_RECLAIMED_SHARDS, fb.reclaimed_shards)
            self.m[M.FEEDBACK_PENDING_RECORDS].set(fb.pending())
            self.m[M.FEEDBACK_FAILING].set(1 if fb.failing else 0)
        for part, n in self.disk_usage(sup.rundir).items():
            self.m[M.DISK_BYTES].labels(part=part).set(n)

    def update_gates(self, drafter: DrafterSnapshot) -> None:
        """Scrape time: the held-out set's size and unfit records, the groups each gate judged or could not."""
        lane = drafter.shared
        self.m[M.DRAFTER_HELDOUT_RECORDS].set(lane.heldout.get("records", 0))
        for reason, n in lane.heldout.get("unfit", {}).items():
            self.m[M.DRAFTER_HELDOUT_UNFIT].labels(reason=reason).set(n)
        for gate, verdict in lane.verdicts.items():
            if gate in M.GATES:
                unjudged = len(verdict.unjudged)
                self.m[M.DRAFTER_GATE_GROUPS].labels(gate=gate, judged="true").set(len(verdict.groups) - unjudged)
                self.m[M.DRAFTER_GATE_GROUPS].labels(gate=gate, judged="false").set(unjudged)

    def update_suffix(self, snap: EngineSnapshot, step_seconds: list[float], tailer: SuffixTailer | None) -> None:
        """Scrape time: suffix index size and hits (the engine's last snapshot), the tree's host seconds per step
        (`step_seconds`: the samples published since the last scrape, `Scheduler.suffix_step_seconds`), tailed
        records."""
        st = snap.proposer_stats
        if not st:
            return
        self.m[M.SUFFIX_INDEX_TOKENS].set(st.get("tokens", 0))
        self.m[M.SUFFIX_INDEX_SEQS].set(st.get("seqs", 0))
        self._sync_counter(M.SUFFIX_LOOKUPS, st.get("lookups", 0))
        for index, src in SUFFIX_SOURCE.items():  # the /health keys hits_request, hits_global
            self._sync_counter(M.SUFFIX_HITS, st.get(f"hits_{index}", 0), source=src)
        h = self.m[M.SUFFIX_STEP_SECONDS]
        for x in step_seconds:
            h.observe(x)
        if tailer is not None:
            self._sync_counter(M.SUFFIX_TAILED_RECORDS, tailer.records_added)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        if self.logger is not None:
            try:
                self._log_rows()
            finally:
                self.logger.close()
                self.logger = None
