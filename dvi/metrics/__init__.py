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

from dvi.metrics import names as _names
from dvi.metrics.logger import MetricsLogger, log  # noqa: F401  (log: private, kept importable)
from dvi.metrics.names import *  # noqa: F403  (the catalogue: every name in names.__all__)
from dvi.metrics.names import _DV  # noqa: F401  (private, kept importable)
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
    low_acceptance,
    summarize_results,
)

__all__ = [
    *_names.__all__,
    "ResultStats",
    "AlphaWindow",
    "summarize_results",
    "low_acceptance",
    "Metrics",
    "build_prometheus_metrics",
    "MetricsLogger",
    "read_jsonl",
    "plot_alpha",
    "report",
]
