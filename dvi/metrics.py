"""Every metric name dvi reports, and the three sinks that use them: Prometheus, wandb, JSONL.

Names follow vLLM's spec-decode counters with a `dvi_` prefix, so dashboards built for vLLM
read naturally. Use the constants below everywhere (server, trainer, benchmarks) so a figure
has one name on /metrics, in wandb and in `metrics.jsonl`.

JSONL rows (`MetricsLogger.log`) are flat objects::

    {"time": 1700000000.0, "step": 12, "domain": "code", "drafter_version": 3,
     "dvi_spec_decode_acceptance_rate": 0.71, ...}

`step`, `domain` and `drafter_version` may be null. In wandb the same numbers are logged as
`<name>/<domain>` (or `<name>` without a domain), plus `drafter_version` and `step`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# -- names ------------------------------------------------------------------------------------
NUM_DRAFTS = "dvi_spec_decode_num_drafts_total"
NUM_DRAFT_TOKENS = "dvi_spec_decode_num_draft_tokens_total"
NUM_ACCEPTED_TOKENS = "dvi_spec_decode_num_accepted_tokens_total"
NUM_ACCEPTED_PER_POS = "dvi_spec_decode_num_accepted_tokens_per_pos_total"
NUM_DRAFTED_PER_POS = "dvi_spec_decode_num_drafted_tokens_per_pos_total"
ACCEPTANCE_RATE = "dvi_spec_decode_acceptance_rate"
MEAN_ACCEPTED_LENGTH = "dvi_spec_decode_mean_accepted_length"
ACCEPTANCE_RATE_PER_POS = "dvi_spec_decode_acceptance_rate_per_pos"
GENERATION_TOKENS = "dvi_generation_tokens_total"
REQUESTS = "dvi_requests_total"
TOKENS_PER_SECOND = "dvi_tokens_per_second"
REQUEST_LATENCY = "dvi_request_latency_seconds"
TIME_TO_FIRST_TOKEN = "dvi_time_to_first_token_seconds"
QUEUE_DEPTH = "dvi_queue_depth"
DRAFTER_VERSION = "dvi_drafter_version"
TARGET_VERSION = "dvi_target_version"
TRAINER_STATE = "dvi_trainer_state"
DRAFTER_PROMOTIONS = "dvi_drafter_promotions_total"
DRAFTER_REFUSALS = "dvi_drafter_refusals_total"
DRAFTER_ROLLBACKS = "dvi_drafter_rollbacks_total"
TRAINER_LOSS = "dvi_trainer_loss"
TRAINER_KL_LOSS = "dvi_trainer_kl_loss"
TRAINER_REWARD_LOSS = "dvi_trainer_reward_loss"
TRAINER_REWARD_WEIGHT = "dvi_trainer_reward_weight"
TRAINER_STEP = "dvi_trainer_step"
TRAINER_RECORDS_SEEN = "dvi_trainer_records_seen"
TRAINER_HELDOUT_ALPHA = "dvi_trainer_heldout_alpha"
TRAINER_LOST_SHARDS = "dvi_trainer_feedback_shards_lost"
TRAINER_RESTARTS = "dvi_trainer_restarts"
REQUESTS_REJECTED = "dvi_requests_rejected_total"
FEEDBACK_WRITE_ERRORS = "dvi_feedback_write_errors_total"
FEEDBACK_DROPPED_RECORDS = "dvi_feedback_dropped_records_total"
FEEDBACK_PENDING_RECORDS = "dvi_feedback_pending_records"
FEEDBACK_FAILING = "dvi_feedback_failing"
TRAINER_HEARTBEAT_AGE = "dvi_trainer_heartbeat_age_seconds"
TRAINER_STALE_RESTARTS = "dvi_trainer_stale_restarts_total"
TRAINER_QUARANTINED_SHARDS = "dvi_trainer_feedback_shards_quarantined"
OTHER_DOMAIN = "other"

# labels
L_DRAFTER_VERSION = "drafter_version"
L_DOMAIN = "domain"
L_POSITION = "position"
L_REASON = "reason"
L_FINISH = "finish_reason"

TRAINER_STATES = {"stopped": 0, "starting": 1, "running": 2, "backoff": 3, "failed": 4, "paused": 5, "off": 6,
                  "external": 7}
"""Numeric codes of `dvi_trainer_state` (a gauge, so wandb and JSONL can plot it too)."""

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_DV = (L_DRAFTER_VERSION, L_DOMAIN)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


METRICS: dict[str, MetricSpec] = {
    s.name: s
    for s in [
        MetricSpec(
            NUM_DRAFTS, "counter", "Draft proposals (steps in which the drafter proposed >= 1 token).", _DV
        ),
        MetricSpec(NUM_DRAFT_TOKENS, "counter", "Drafted tokens proposed to the target.", _DV),
        MetricSpec(NUM_ACCEPTED_TOKENS, "counter", "Drafted tokens accepted by the target.", _DV),
        MetricSpec(
            NUM_ACCEPTED_PER_POS, "counter", "Accepted drafted tokens by draft position.", (*_DV, L_POSITION)
        ),
        MetricSpec(NUM_DRAFTED_PER_POS, "counter", "Drafted tokens by draft position.", (*_DV, L_POSITION)),
        MetricSpec(ACCEPTANCE_RATE, "gauge", "Rolling acceptance rate alpha = accepted / drafted.", _DV),
        MetricSpec(MEAN_ACCEPTED_LENGTH, "gauge", "Rolling tokens per step = 1 + accepted / steps.", _DV),
        MetricSpec(
            ACCEPTANCE_RATE_PER_POS, "gauge", "Rolling acceptance rate by draft position.", (*_DV, L_POSITION)
        ),
        MetricSpec(GENERATION_TOKENS, "counter", "Generated (new) tokens.", _DV),
        MetricSpec(REQUESTS, "counter", "Finished requests.", (*_DV, L_FINISH)),
        MetricSpec(TOKENS_PER_SECOND, "gauge", "Generated tokens per second over a recent window."),
        MetricSpec(REQUEST_LATENCY, "histogram", "End-to-end request latency.", (L_DOMAIN,), LATENCY_BUCKETS),
        MetricSpec(
            TIME_TO_FIRST_TOKEN, "histogram", "Time to first generated token.", (L_DOMAIN,), TTFT_BUCKETS
        ),
        MetricSpec(QUEUE_DEPTH, "gauge", "Requests waiting for a batch slot."),
        MetricSpec(DRAFTER_VERSION, "gauge", "Drafter version serving now."),
        MetricSpec(TARGET_VERSION, "gauge", "Target weights version serving now."),
        MetricSpec(TRAINER_STATE, "gauge", f"Online trainer state code {TRAINER_STATES}."),
        MetricSpec(DRAFTER_PROMOTIONS, "counter", "Drafter versions swapped into serving."),
        MetricSpec(
            DRAFTER_REFUSALS, "counter", "Drafter versions refused (validation / shadow).", (L_REASON,)
        ),
        MetricSpec(DRAFTER_ROLLBACKS, "counter", "Drafter rollbacks after live alpha fell."),
        MetricSpec(TRAINER_LOSS, "gauge", "Online trainer total loss."),
        MetricSpec(TRAINER_KL_LOSS, "gauge", "Online trainer top-k KL loss."),
        MetricSpec(TRAINER_REWARD_LOSS, "gauge", "Online trainer accept/reject reward loss."),
        MetricSpec(TRAINER_REWARD_WEIGHT, "gauge", "Current weight of the reward loss."),
        MetricSpec(TRAINER_STEP, "gauge", "Online trainer optimizer steps."),
        MetricSpec(TRAINER_RECORDS_SEEN, "gauge", "Feedback records the trainer has trained on."),
        MetricSpec(
            TRAINER_HELDOUT_ALPHA, "gauge", "Shadow alpha of the last published drafter on held-out feedback."
        ),
        MetricSpec(
            TRAINER_LOST_SHARDS, "gauge", "Feedback shards deleted by retention before the trainer read them."
        ),
        MetricSpec(TRAINER_RESTARTS, "gauge", "Times the supervisor restarted the trainer process."),
        MetricSpec(REQUESTS_REJECTED, "counter", "Requests refused before decoding, by reason (queue_full, "
                   "invalid_request, body_too_large, unauthorized, ...).", (L_REASON,)),
        MetricSpec(FEEDBACK_WRITE_ERRORS, "counter", "Failed feedback shard writes (records kept and retried)."),
        MetricSpec(FEEDBACK_DROPPED_RECORDS, "counter",
                   "Feedback records dropped because the write buffer hit feedback.max_buffer_bytes."),
        MetricSpec(FEEDBACK_PENDING_RECORDS, "gauge", "Feedback records buffered in memory, not yet in a shard."),
        MetricSpec(FEEDBACK_FAILING, "gauge", "1 while feedback shard writes fail, else 0."),
        MetricSpec(TRAINER_HEARTBEAT_AGE, "gauge", "Seconds since the online trainer's last heartbeat."),
        MetricSpec(TRAINER_STALE_RESTARTS, "counter",
                   "Trainer processes killed and restarted because their heartbeat went stale (stopped or hung)."),
        MetricSpec(TRAINER_QUARANTINED_SHARDS, "gauge",
                   "Unreadable feedback shards the trainer moved to quarantine/ (skipped, not retried)."),
    ]
}

TRAINER_GAUGES = (
    TRAINER_LOSS,
    TRAINER_KL_LOSS,
    TRAINER_REWARD_LOSS,
    TRAINER_REWARD_WEIGHT,
    TRAINER_STEP,
    TRAINER_RECORDS_SEEN,
    TRAINER_HELDOUT_ALPHA,
    TRAINER_LOST_SHARDS,
    TRAINER_QUARANTINED_SHARDS,
)


def _get(result: Any, name: str, default: Any = None) -> Any:
    if isinstance(result, Mapping):
        return result.get(name, default)
    return getattr(result, name, default)


@dataclass
class ResultStats:
    """The spec-decode numbers of one GenerationResult-like object (duck-typed)."""

    domain: str
    drafter_version: int
    num_drafts: int
    num_drafted: int
    num_accepted: int
    num_steps: int
    num_tokens: int
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    finish_reason: str
    latency: float | None
    ttft: float | None

    @classmethod
    def of(cls, result: Any, domain: str | None = None) -> ResultStats:
        acc_pos = list(_get(result, "accepted_per_position", None) or [])
        dr_pos = list(_get(result, "drafted_per_position", None) or [])
        drafted = _get(result, "num_drafted", None)
        if drafted is None:
            drafted = sum(1 for d in _get(result, "drafted_ids", None) or [] if d >= 0)
        accepted = _get(result, "num_accepted", None)
        if accepted is None:
            accepted = sum(1 for a in _get(result, "accepted", None) or [] if a)
        steps = int(_get(result, "num_steps", 0) or 0)
        # drafted_per_position[0] counts the steps in which at least one token was drafted.
        num_drafts = dr_pos[0] if dr_pos else (steps if drafted else 0)
        started, finished = _get(result, "started_at", None), _get(result, "finished_at", None)
        latency = (
            finished - started
            if started is not None and finished is not None and finished >= started
            else None
        )
        first = _get(result, "first_token_at", None)
        ttft = first - started if first is not None and started is not None and first >= started else None
        if ttft is None:
            ttft = _get(result, "ttft", None)
        return cls(
            domain=str(domain if domain is not None else (_get(result, "domain", None) or "default")),
            drafter_version=int(_get(result, "drafter_version", 0) or 0),
            num_drafts=int(num_drafts),
            num_drafted=int(drafted),
            num_accepted=int(accepted),
            num_steps=steps,
            num_tokens=len(_get(result, "token_ids", None) or []),
            accepted_per_position=[int(x) for x in acc_pos],
            drafted_per_position=[int(x) for x in dr_pos],
            finish_reason=str(_get(result, "finish_reason", None) or "unknown"),
            latency=latency,
            ttft=ttft,
        )


class AlphaWindow:
    """Rolling α, mean accepted length and per-position acceptance per (domain, drafter_version)."""

    def __init__(self, window: int = 200) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self._q: dict[tuple[str, int], deque[ResultStats]] = {}

    def observe(self, result: Any, domain: str | None = None) -> tuple[str, int]:
        """Add a result (GenerationResult-like or ResultStats); returns its (domain, version) key."""
        s = result if isinstance(result, ResultStats) else ResultStats.of(result, domain)
        key = (s.domain, s.drafter_version)
        self._q.setdefault(key, deque(maxlen=self.window)).append(s)
        return key

    def keys(self) -> list[tuple[str, int]]:
        return list(self._q)

    def forget_version(self, drafter_version: int) -> None:
        for key in [k for k in self._q if k[1] == drafter_version]:
            del self._q[key]

    def count(self, domain: str, drafter_version: int) -> int:
        return len(self._q.get((domain, drafter_version), ()))

    def alpha(self, domain: str, drafter_version: int) -> float | None:
        q = self._q.get((domain, drafter_version))
        drafted = sum(s.num_drafted for s in q) if q else 0
        return sum(s.num_accepted for s in q) / drafted if drafted else None

    def mean_accepted_length(self, domain: str, drafter_version: int) -> float | None:
        q = self._q.get((domain, drafter_version))
        steps = sum(s.num_steps for s in q) if q else 0
        return 1.0 + sum(s.num_accepted for s in q) / steps if steps else None

    def per_position(self, domain: str, drafter_version: int) -> list[float | None]:
        q = self._q.get((domain, drafter_version)) or ()
        n = max((len(s.drafted_per_position) for s in q), default=0)
        acc, dr = [0] * n, [0] * n
        for s in q:
            for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position, strict=False)):
                acc[i] += a
                dr[i] += d
        return [a / d if d else None for a, d in zip(acc, dr, strict=True)]

    def summary(self) -> dict[tuple[str, int], dict[str, Any]]:
        """{(domain, version): {ACCEPTANCE_RATE, MEAN_ACCEPTED_LENGTH, ACCEPTANCE_RATE_PER_POS, n}}."""
        return {
            k: {
                ACCEPTANCE_RATE: self.alpha(*k),
                MEAN_ACCEPTED_LENGTH: self.mean_accepted_length(*k),
                ACCEPTANCE_RATE_PER_POS: self.per_position(*k),
                "n": self.count(*k),
            }
            for k in self._q
        }


def summarize_results(results: Iterable[Any], domain: str | None = None) -> dict[str, float]:
    """Aggregate a batch of results into {metric name: number} (for JSONL / wandb / benchmarks)."""
    stats = [r if isinstance(r, ResultStats) else ResultStats.of(r, domain) for r in results]
    drafted = sum(s.num_drafted for s in stats)
    accepted = sum(s.num_accepted for s in stats)
    steps = sum(s.num_steps for s in stats)
    out: dict[str, float] = {
        REQUESTS: len(stats),
        NUM_DRAFTS: sum(s.num_drafts for s in stats),
        NUM_DRAFT_TOKENS: drafted,
        NUM_ACCEPTED_TOKENS: accepted,
        GENERATION_TOKENS: sum(s.num_tokens for s in stats),
    }
    if drafted:
        out[ACCEPTANCE_RATE] = accepted / drafted
    if steps:
        out[MEAN_ACCEPTED_LENGTH] = 1.0 + accepted / steps
    return out


class Metrics:
    """Prometheus collectors for every spec in METRICS, plus helpers that update them.

    Label values are bounded, so no client and no long run can grow the series without limit:
    with `domains` set, any other domain is counted as "other"; with `max_versions` set, only
    the most recently served that many drafter versions keep their per-version series (others are removed;
    `dvi_drafter_version` says which version serves now).
    """

    def __init__(self, registry: Any, window: int = 200, rate_window_s: float = 10.0,
                 domains: Iterable[str] | None = None, max_versions: int | None = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        self.collectors: dict[str, Any] = {}
        for spec in METRICS.values():
            if spec.kind == "counter":
                c = Counter(spec.name, spec.help, spec.labels, registry=registry)
            elif spec.kind == "gauge":
                c = Gauge(spec.name, spec.help, spec.labels, registry=registry)
            else:
                c = Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)
            self.collectors[spec.name] = c
        self.alpha_window = AlphaWindow(window)
        self.rate_window_s = rate_window_s
        self._tok_times: deque[tuple[float, int]] = deque()
        self.domains = frozenset(domains) if domains is not None else None
        self.max_versions = max_versions
        self._versions: dict[int, None] = {}  # drafter versions with series, least recently used first

    def bounded_domain(self, domain: str) -> str:
        return domain if self.domains is None or domain in self.domains else OTHER_DOMAIN

    def _track_version(self, version: int) -> None:
        """Mark `version` used; drop every series of the least recently used versions beyond `max_versions`."""
        self._versions.pop(version, None)
        self._versions[version] = None
        while self.max_versions is not None and len(self._versions) > self.max_versions:
            oldest = next(iter(self._versions))
            del self._versions[oldest]
            self._forget_version(oldest)

    def _forget_version(self, version: int) -> None:
        value = str(version)
        for spec in METRICS.values():
            if L_DRAFTER_VERSION not in spec.labels:
                continue
            c = self.collectors[spec.name]
            i = spec.labels.index(L_DRAFTER_VERSION)
            with c._lock:  # prometheus_client keeps its label tuples in `_metrics`, guarded by `_lock`
                keys = [k for k in c._metrics if k[i] == value]
            for key in keys:
                c.remove(*key)
        self.alpha_window.forget_version(version)

    def __getitem__(self, name: str) -> Any:
        return self.collectors[name]

    def observe_result(self, result: Any, domain: str | None = None) -> ResultStats:
        """Count one finished request and refresh the rolling α gauges of its (domain, version)."""
        s = ResultStats.of(result, domain)
        s.domain = self.bounded_domain(s.domain)
        self._track_version(s.drafter_version)
        lv = {L_DRAFTER_VERSION: str(s.drafter_version), L_DOMAIN: s.domain}
        c = self.collectors
        c[NUM_DRAFTS].labels(**lv).inc(s.num_drafts)
        c[NUM_DRAFT_TOKENS].labels(**lv).inc(s.num_drafted)
        c[NUM_ACCEPTED_TOKENS].labels(**lv).inc(s.num_accepted)
        for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position, strict=False)):
            c[NUM_ACCEPTED_PER_POS].labels(**lv, position=str(i)).inc(a)
            c[NUM_DRAFTED_PER_POS].labels(**lv, position=str(i)).inc(d)
        c[GENERATION_TOKENS].labels(**lv).inc(s.num_tokens)
        c[REQUESTS].labels(**lv, finish_reason=s.finish_reason).inc()
        if s.latency is not None:
            c[REQUEST_LATENCY].labels(domain=s.domain).observe(s.latency)
        if s.ttft is not None:
            c[TIME_TO_FIRST_TOKEN].labels(domain=s.domain).observe(s.ttft)
        key = self.alpha_window.observe(s)
        alpha = self.alpha_window.alpha(*key)
        if alpha is not None:
            c[ACCEPTANCE_RATE].labels(**lv).set(alpha)
        mal = self.alpha_window.mean_accepted_length(*key)
        if mal is not None:
            c[MEAN_ACCEPTED_LENGTH].labels(**lv).set(mal)
        for i, a in enumerate(self.alpha_window.per_position(*key)):
            if a is not None:
                c[ACCEPTANCE_RATE_PER_POS].labels(**lv, position=str(i)).set(a)
        self._observe_tokens(s.num_tokens)
        return s

    def _observe_tokens(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._tok_times.append((now, n))
        while self._tok_times and self._tok_times[0][0] < now - self.rate_window_s:
            self._tok_times.popleft()
        span = max(now - self._tok_times[0][0], 1e-3) if len(self._tok_times) > 1 else self.rate_window_s
        self.collectors[TOKENS_PER_SECOND].set(sum(k for _, k in self._tok_times) / span)

    def set_versions(self, drafter_version: int | None = None, target_version: int | None = None) -> None:
        if drafter_version is not None:
            self.collectors[DRAFTER_VERSION].set(drafter_version)
        if target_version is not None:
            self.collectors[TARGET_VERSION].set(target_version)

    def set_queue_depth(self, n: int) -> None:
        self.collectors[QUEUE_DEPTH].set(n)

    def set_trainer_state(self, state: str | int) -> None:
        code = TRAINER_STATES[state] if isinstance(state, str) else int(state)
        self.collectors[TRAINER_STATE].set(code)

    def set_trainer(self, values: Mapping[str, float]) -> None:
        """Copy trainer gauges (e.g. read from the trainer's metrics.jsonl) into Prometheus."""
        for name in TRAINER_GAUGES:
            v = values.get(name)
            if isinstance(v, int | float) and math.isfinite(v):
                self.collectors[name].set(v)

    def record_promotion(self) -> None:
        self.collectors[DRAFTER_PROMOTIONS].inc()

    def record_refusal(self, reason: str) -> None:
        self.collectors[DRAFTER_REFUSALS].labels(reason=reason).inc()

    def record_rollback(self) -> None:
        self.collectors[DRAFTER_ROLLBACKS].inc()


def build_prometheus_metrics(registry: Any, window: int = 200) -> Metrics:
    """All dvi metrics registered on `registry` (a prometheus_client.CollectorRegistry)."""
    return Metrics(registry, window=window)


# -- JSONL + wandb -----------------------------------------------------------------------------
class MetricsLogger:
    """Writes the same numbers to `run_dir/metrics.jsonl` and to wandb.

    wandb runs offline by default (files under run_dir, no login). If wandb fails to start or
    to log, a warning is logged and JSONL keeps going.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        wandb_mode: str = "offline",
        project: str = "dvi",
        config: Mapping[str, Any] | None = None,
        name: str | None = None,
        entity: str | None = None,
    ) -> None:
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode must be offline, online or disabled, got {wandb_mode!r}")
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._f = open(self.path, "a", buffering=1)
        self._run: Any = None
        if wandb_mode != "disabled":
            try:
                import wandb

                self._run = wandb.init(
                    project=project,
                    entity=entity,
                    dir=str(self.run_dir),
                    mode=wandb_mode,
                    config=dict(config or {}),
                    name=name,
                )
            except Exception as e:  # never let wandb take the server or trainer down
                log.warning("wandb init failed (%s); logging to %s only", e, self.path)
                self._run = None

    @property
    def wandb_run(self) -> Any:
        return self._run

    def log(
        self,
        values: Mapping[str, Any],
        step: int | None = None,
        domain: str | None = None,
        drafter_version: int | None = None,
    ) -> dict[str, Any]:
        """Append one row; returns it. Non-finite and non-numeric values are dropped from wandb."""
        row: dict[str, Any] = {
            "time": time.time(),
            "step": step,
            "domain": domain,
            "drafter_version": drafter_version,
        }
        for k, v in values.items():
            if isinstance(v, float) and not math.isfinite(v):
                v = None
            row[k] = v
        self._f.write(json.dumps(row, default=str) + "\n")
        if self._run is not None:
            data: dict[str, Any] = {}
            for k, v in values.items():
                if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                    continue
                data[f"{k}/{domain}" if domain else k] = v
            if drafter_version is not None:
                data["drafter_version"] = drafter_version
            if step is not None:
                data["step"] = step
            try:
                self._run.log(data)
            except Exception as e:
                log.warning("wandb log failed (%s); continuing with JSONL only", e)
                self._run = None
        return row

    def close(self) -> None:
        self._f.close()
        if self._run is not None:
            try:
                self._run.finish()
            except Exception as e:
                log.warning("wandb finish failed: %s", e)
            self._run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (crash mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def plot_alpha(jsonl_path: str | os.PathLike, out_png: str | os.PathLike, step_label: str = "step") -> Path:
    """α per domain over steps (or time), with a vertical line wherever the drafter version changes;
    `step_label` names what a row's `step` counts (trainer steps, requests served, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_jsonl(jsonl_path) if isinstance(r.get(ACCEPTANCE_RATE), int | float)]
    use_step = bool(rows) and all(r.get("step") is not None for r in rows)
    t0 = min((r["time"] for r in rows), default=0.0)

    def x_of(r: dict[str, Any]) -> float:
        return r["step"] if use_step else r["time"] - t0

    rows.sort(key=x_of)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    by_domain: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        by_domain.setdefault(r.get("domain") or "all", []).append((x_of(r), r[ACCEPTANCE_RATE]))
    for dom, pts in sorted(by_domain.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=dom)
    prev = None
    for r in rows:
        v = r.get("drafter_version")
        if v is None:
            continue
        if prev is not None and v != prev:
            ax.axvline(x_of(r), color="grey", linestyle="--", linewidth=0.8)
            ax.annotate(f"v{v}", (x_of(r), 1.0), fontsize=7, color="grey", ha="left", va="top")
        prev = v
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(step_label if use_step else "seconds")
    ax.set_ylabel("acceptance rate α")
    ax.set_title("α by domain (dashed: drafter version change)")
    if by_domain:
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no α rows in metrics.jsonl", ha="center", transform=ax.transAxes)
    ax.grid(alpha=0.3)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def report(run_dir: str | os.PathLike) -> Path:
    """Backs `dvi report RUN_DIR`: plots run_dir/metrics.jsonl to run_dir/alpha.png."""
    run_dir = Path(run_dir)
    src = run_dir / "metrics.jsonl"
    if not src.is_file():
        raise FileNotFoundError(f"{src} not found (is {run_dir} a dvi run directory?)")
    return plot_alpha(src, run_dir / "alpha.png")
