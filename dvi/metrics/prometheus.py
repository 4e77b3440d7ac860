"""The server's Prometheus collectors: one per spec in `METRICS` and `VLLM_METRICS`, plus the
helpers that update them.

Separate from the name catalogue so that importing a metric name never imports
prometheus_client (it is imported lazily, when a `Metrics` is built).

Counters only count; rates are PromQL's job (as in vLLM). Recipes, over a 5-minute window:

* acceptance rate α (accepted / drafted tokens)::

    sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m]))
      / sum(rate(vllm:spec_decode_num_draft_tokens_total[5m]))

* mean accepted length (tokens per draft, the bonus token included)::

    1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total[5m]))
          / sum(rate(vllm:spec_decode_num_drafts_total[5m]))

* acceptance at each draft position (vLLM's convention: per draft; ours per drafted token)::

    sum by (position) (rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[5m]))
      / scalar(sum(rate(vllm:spec_decode_num_drafts_total[5m])))
    sum by (position) (rate(dvi_spec_decode_num_accepted_tokens_per_pos_total[5m]))
      / sum by (position) (rate(dvi_spec_decode_num_drafted_tokens_per_pos_total[5m]))

* α by domain, or by drafter version (`drafter_version` is kept for the newest
  `serve.metrics_versions` versions only; `dvi_drafter_version`, a gauge, says which one serves)::

    sum by (domain) (rate(dvi_spec_decode_num_accepted_tokens_total[5m]))
      / sum by (domain) (rate(dvi_spec_decode_num_draft_tokens_total[5m]))

* generated tokens per second: ``sum(rate(dvi_generation_tokens_total[1m]))``;
  publishes, rollbacks: ``changes(dvi_drafter_version[1h])``, ``increase(dvi_drafter_rollbacks_total[1h])``.

The `vllm:` counters count exactly what their `dvi_` twins count, summed over domains and versions.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from dvi.decode.results import GenerationResult
from dvi.metrics.names import (
    ACCEPTANCE_RATE,
    ACCEPTANCE_RATE_PER_POS,
    DRAFTER_PROMOTIONS,
    DRAFTER_REFUSALS,
    DRAFTER_ROLLBACKS,
    DRAFTER_VERSION,
    GENERATION_TOKENS,
    L_DOMAIN,
    L_DRAFTER_VERSION,
    L_MODEL_NAME,
    LOW_ACCEPTANCE_REQUESTS,
    MEAN_ACCEPTED_LENGTH,
    METRICS,
    NUM_ACCEPTED_PER_POS,
    NUM_ACCEPTED_PER_RANK,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTED_PER_POS,
    NUM_DRAFTS,
    OTHER_DOMAIN,
    QUEUE_DEPTH,
    REQUEST_ACCEPTANCE,
    REQUEST_ACCEPTANCE_MIN_DRAFTED,
    REQUEST_LATENCY,
    REQUESTS,
    SOURCE_ACCEPTANCE_RATE,
    SOURCE_ACCEPTED_TOKENS,
    SOURCE_DRAFT_TOKENS,
    SOURCE_DRAFTS,
    SOURCE_MEAN_ACCEPTED_LENGTH,
    TARGET_VERSION,
    TIME_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    TRAINER_GAUGES,
    TRAINER_STATE,
    TRAINER_STATES,
    VLLM_ALIASES,
    VLLM_METRICS,
)
from dvi.metrics.stats import AlphaWindow, ResultStats, low_acceptance


class Metrics:
    """Prometheus collectors for every spec in METRICS, plus helpers that update them.

    Label values are bounded, so no client and no long run can grow the series without limit:
    with `domains` set, any other domain is counted as "other"; with `max_versions` set, only
    the most recently served that many drafter versions keep their per-version series (others are removed;
    `dvi_drafter_version` says which version serves now). The `vllm:` twins of the spec-decode
    counters carry only `model_name` (and `position`).
    """

    def __init__(self, registry: Any, window: int = 200, rate_window_s: float = 10.0,
                 domains: Iterable[str] | None = None, max_versions: int | None = None,
                 model_name: str = "dvi") -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = registry
        self.model_name = model_name
        self.collectors: dict[str, Any] = {}
        for spec in (*METRICS.values(), *VLLM_METRICS.values()):
            if spec.metric_type == "counter":
                c = Counter(spec.name, spec.help, spec.labels, registry=registry)
            elif spec.metric_type == "gauge":
                c = Gauge(spec.name, spec.help, spec.labels, registry=registry)
            else:
                c = Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)
            self.collectors[spec.name] = c
        self.alpha_window = AlphaWindow(window)
        self.rate_window_s = rate_window_s
        self._tok_times: deque[tuple[float, int]] = deque()
        self.domains = frozenset(domains) if domains is not None else None
        self.max_versions = max_versions
        self._source_totals: dict[str, list[int]] = {}  # source -> [drafts, drafted, accepted] since start
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

    def observe_result(self, result: GenerationResult | ResultStats, domain: str | None = None) -> ResultStats:
        """Count one finished request and refresh the rolling α gauges of its (domain, version)."""
        s = result if isinstance(result, ResultStats) else ResultStats.of(result, domain=domain)
        if domain is not None:
            s.domain = domain
        s.domain = self.bounded_domain(s.domain)
        self._track_version(s.drafter_version)
        lv = {L_DRAFTER_VERSION: str(s.drafter_version), L_DOMAIN: s.domain}
        c = self.collectors
        self._count(NUM_DRAFTS, lv, s.num_drafts)
        self._count(NUM_DRAFT_TOKENS, lv, s.num_drafted)
        self._count(NUM_ACCEPTED_TOKENS, lv, s.num_accepted)
        for i, (a, d) in enumerate(zip(s.accepted_per_position, s.drafted_per_position, strict=False)):
            self._count(NUM_ACCEPTED_PER_POS, {**lv, "position": str(i)}, a)
            c[NUM_DRAFTED_PER_POS].labels(**lv, position=str(i)).inc(d)
        for r, a in enumerate(s.accepted_by_rank):
            if a:
                c[NUM_ACCEPTED_PER_RANK].labels(**lv, rank=str(r)).inc(a)
        c[GENERATION_TOKENS].labels(**lv).inc(s.num_tokens)
        c[REQUESTS].labels(**lv, finish_reason=s.finish_reason).inc()
        if s.latency is not None:
            c[REQUEST_LATENCY].labels(domain=s.domain).observe(s.latency)
        if s.ttft is not None:
            c[TIME_TO_FIRST_TOKEN].labels(domain=s.domain).observe(s.ttft)
        if s.num_drafted >= REQUEST_ACCEPTANCE_MIN_DRAFTED:
            c[REQUEST_ACCEPTANCE].labels(domain=s.domain).observe(s.num_accepted / s.num_drafted)
        if low_acceptance(s):
            c[LOW_ACCEPTANCE_REQUESTS].labels(domain=s.domain).inc()
        key = self.alpha_window.observe(s)
        alpha, mal = self.alpha_window.rates(*key)
        if alpha is not None:
            c[ACCEPTANCE_RATE].labels(**lv).set(alpha)
        if mal is not None:
            c[MEAN_ACCEPTED_LENGTH].labels(**lv).set(mal)
        for i, a in enumerate(self.alpha_window.per_position(*key)):
            if a is not None:
                c[ACCEPTANCE_RATE_PER_POS].labels(**lv, position=str(i)).set(a)
        self._observe_sources(s)
        self._observe_tokens(s.num_tokens)
        return s

    def _observe_sources(self, s: ResultStats) -> None:
        """Per draft source (a bounded label: `dvi.decode.sources.SOURCES`): counts, and α / mean accepted length since start."""
        from dvi.decode.results import acceptance_rate, mean_accepted_length
        from dvi.decode.sources import SOURCES

        c = self.collectors
        for src, (drafts, drafted, accepted) in s.by_source.items():
            if src not in SOURCES:
                continue
            c[SOURCE_DRAFTS].labels(source=src).inc(drafts)
            c[SOURCE_DRAFT_TOKENS].labels(source=src).inc(drafted)
            c[SOURCE_ACCEPTED_TOKENS].labels(source=src).inc(accepted)
            t = self._source_totals.setdefault(src, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + drafts, t[1] + drafted, t[2] + accepted
            a, m = acceptance_rate(t[2], t[1]), mean_accepted_length(t[2], t[0])
            if a is not None:
                c[SOURCE_ACCEPTANCE_RATE].labels(source=src).set(a)
            if m is not None:
                c[SOURCE_MEAN_ACCEPTED_LENGTH].labels(source=src).set(m)

    def _count(self, name: str, labels: Mapping[str, str], n: float) -> None:
        """Increment counter `name` and, if it has one, its vLLM-named twin (model_name [+ position])."""
        self.collectors[name].labels(**labels).inc(n)
        twin = VLLM_ALIASES.get(name)
        if twin is not None:
            extra = {"position": labels["position"]} if "position" in labels else {}
            self.collectors[twin].labels(**{L_MODEL_NAME: self.model_name}, **extra).inc(n)

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

