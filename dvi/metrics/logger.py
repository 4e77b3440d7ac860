"""`MetricsLogger`: one row of numbers to `run_dir/metrics.jsonl` and to wandb at once.

JSONL rows (`MetricsLogger.log`) are flat objects::

    {"time": 1700000000.0, "step": 12, "domain": "code", "drafter_version": 3,
     "dvi_spec_decode_acceptance_rate": 0.71, ...}

`step`, `domain` and `drafter_version` may be null. In wandb the same numbers are logged as
`<name>/<domain>` (or `<name>` without a domain), plus `drafter_version` and `step`. Kept
apart because both the server and the trainer process write rows, and neither needs Prometheus.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping
from typing import Any

from dvi.fsutil import AppendLog, LogRotation, access_modes, make_dirs
from dvi.rundir import METRICS_FILE

log = logging.getLogger(__name__)


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
        access: str = "private",
        rotation: LogRotation | None = None,
    ) -> None:
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode must be offline, online or disabled, got {wandb_mode!r}")
        self.run_dir = make_dirs(run_dir, access)
        self.path = self.run_dir / METRICS_FILE
        # a row is appended whole per call (O_APPEND), rotated at `rotation` (files.log_max_bytes)
        self._log = AppendLog(self.path, rotation, access_modes(access)[1])
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
        self._log.append(json.dumps(row, default=str), fsync=False)
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
