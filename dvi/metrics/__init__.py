"""Every metric name dvi reports, and the three sinks that use them: Prometheus, wandb, JSONL.

`dvi.metrics` is the one import callers use (`from dvi import metrics as M`); it re-exports
the package's modules, each with one job:

| module | job |
|---|---|
| `names` | the catalogue: every metric name, label, bucket and `MetricSpec` (the ONE place names live) |
| `stats` | per-result numbers: `ResultStats`, rolling `AlphaWindow`, `summarize_results` |
| `prometheus` | `Metrics`: the server's Prometheus collectors and their update helpers |
| `logger` | `MetricsLogger`: rows to `metrics.jsonl` and wandb |
| `reporting` | `read_jsonl`, `plot_alpha`, `report` (backs `dvi report RUN_DIR`) |

Split so no one file does all five jobs; nothing outside this package needs to know the split.
"""

from dvi.metrics.logger import MetricsLogger, log  # noqa: F401  (log: private, kept importable)
from dvi.metrics.names import (
    _DV,  # noqa: F401  (private, kept importable)
    ACCEPTANCE_RATE,
    ACCEPTANCE_RATE_PER_POS,
    DRAFTER_PROMOTIONS,
    DRAFTER_REFUSALS,
    DRAFTER_ROLLBACKS,
    DRAFTER_VERSION,
    FEEDBACK_DROPPED_RECORDS,
    FEEDBACK_FAILING,
    FEEDBACK_PENDING_RECORDS,
    FEEDBACK_WRITE_ERRORS,
    GENERATION_TOKENS,
    L_DOMAIN,
    L_DRAFTER_VERSION,
    L_FINISH,
    L_POSITION,
    L_REASON,
    LATENCY_BUCKETS,
    MEAN_ACCEPTED_LENGTH,
    METRICS,
    NUM_ACCEPTED_PER_POS,
    NUM_ACCEPTED_TOKENS,
    NUM_DRAFT_TOKENS,
    NUM_DRAFTED_PER_POS,
    NUM_DRAFTS,
    OTHER_DOMAIN,
    QUEUE_DEPTH,
    REQUEST_LATENCY,
    REQUESTS,
    REQUESTS_REJECTED,
    TARGET_VERSION,
    TIME_TO_FIRST_TOKEN,
    TOKENS_PER_SECOND,
    TRAINER_GAUGES,
    TRAINER_HEARTBEAT_AGE,
    TRAINER_HELDOUT_ALPHA,
    TRAINER_KL_LOSS,
    TRAINER_LOSS,
    TRAINER_LOST_SHARDS,
    TRAINER_QUARANTINED_SHARDS,
    TRAINER_RECORDS_SEEN,
    TRAINER_RESTARTS,
    TRAINER_REWARD_LOSS,
    TRAINER_REWARD_WEIGHT,
    TRAINER_STALE_RESTARTS,
    TRAINER_STATE,
    TRAINER_STATES,
    TRAINER_STEP,
    TTFT_BUCKETS,
    MetricSpec,
)
from dvi.metrics.prometheus import (
    Metrics,
    build_prometheus_metrics,
)
from dvi.metrics.reporting import (
    plot_alpha,
    read_jsonl,
    report,
)
from dvi.metrics.stats import (
    AlphaWindow,
    ResultStats,
    _get,  # noqa: F401  (private, kept importable)
    summarize_results,
)

__all__ = [
    "NUM_DRAFTS",
    "NUM_DRAFT_TOKENS",
    "NUM_ACCEPTED_TOKENS",
    "NUM_ACCEPTED_PER_POS",
    "NUM_DRAFTED_PER_POS",
    "ACCEPTANCE_RATE",
    "MEAN_ACCEPTED_LENGTH",
    "ACCEPTANCE_RATE_PER_POS",
    "GENERATION_TOKENS",
    "REQUESTS",
    "TOKENS_PER_SECOND",
    "REQUEST_LATENCY",
    "TIME_TO_FIRST_TOKEN",
    "QUEUE_DEPTH",
    "DRAFTER_VERSION",
    "TARGET_VERSION",
    "TRAINER_STATE",
    "DRAFTER_PROMOTIONS",
    "DRAFTER_REFUSALS",
    "DRAFTER_ROLLBACKS",
    "TRAINER_LOSS",
    "TRAINER_KL_LOSS",
    "TRAINER_REWARD_LOSS",
    "TRAINER_REWARD_WEIGHT",
    "TRAINER_STEP",
    "TRAINER_RECORDS_SEEN",
    "TRAINER_HELDOUT_ALPHA",
    "TRAINER_LOST_SHARDS",
    "TRAINER_RESTARTS",
    "REQUESTS_REJECTED",
    "FEEDBACK_WRITE_ERRORS",
    "FEEDBACK_DROPPED_RECORDS",
    "FEEDBACK_PENDING_RECORDS",
    "FEEDBACK_FAILING",
    "TRAINER_HEARTBEAT_AGE",
    "TRAINER_STALE_RESTARTS",
    "TRAINER_QUARANTINED_SHARDS",
    "OTHER_DOMAIN",
    "L_DRAFTER_VERSION",
    "L_DOMAIN",
    "L_POSITION",
    "L_REASON",
    "L_FINISH",
    "TRAINER_STATES",
    "LATENCY_BUCKETS",
    "TTFT_BUCKETS",
    "MetricSpec",
    "METRICS",
    "TRAINER_GAUGES",
    "ResultStats",
    "AlphaWindow",
    "summarize_results",
    "Metrics",
    "build_prometheus_metrics",
    "MetricsLogger",
    "read_jsonl",
    "plot_alpha",
    "report",
]
