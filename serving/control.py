"""The control group on live traffic (issue 59): which arm a request draws, and each group's two arms live.

A share of each traffic group's requests (`serve.control_share`) drafts with the reference drafter, the frozen base
the group's adapter trains over, in the same engine and the same batches as the rest: the scheduler hands such a row
to the engine without its group, so no adapter drafts for it (`dvi.drafters.adapters`). Decoding is lossless in
both arms, so a user gets the same text distribution either way; only speed differs, and the difference between
the arms is what learning bought. The arm is a hash of the group and the request's key (the client's
`X-Request-Id` when it sends one), so a retried request keeps its arm.

The window of a group restarts when its served adapter version changes (a promotion or a rollback): the uplift
always compares the version serving now with the control over the same period.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from typing import Any

from dvi import metrics as M
from dvi.metrics.uplift import ARMS, ArmSample, compare

WINDOW = 512
"""Requests per arm a group's window keeps (the oldest leave first)."""


def draw_arm(share: float, group: str, key: str) -> str:
    """"control" for a `share` of the keys of a traffic group, else "learned"; a request of no group (no adapter
    serves it) is always "learned"."""
    if share <= 0 or not group:
        return "learned"
    h = hashlib.blake2b(f"{group}\0{key}".encode(), digest_size=8).digest()
    return "control" if int.from_bytes(h, "big") / 2.0**64 < share else "learned"


class _Window:
    def __init__(self, version: int, size: int) -> None:
        self.version = version
        self.arms: dict[str, deque[ArmSample]] = {a: deque(maxlen=size) for a in ARMS}


class ControlGroups:
    """Each traffic group's learned and control requests since its served adapter version went live.

    At most `max_groups` groups (the metrics' `group` label stays bounded with `adapter_key: user`): past it a group
    enters only once an adapter serves it, and the group seen longest ago leaves (`take_evicted`: its series go).
    Written on the engine thread (`observe`, a subscriber of finished requests); read by scrapes and /admin/status
    (`report`), under one lock."""

    def __init__(self, share: float, window: int = WINDOW, max_groups: int = 8) -> None:
        self.share = share
        self.window = window
        self.max_groups = max_groups
        self._groups: OrderedDict[str, _Window] = OrderedDict()
        self._evicted: list[str] = []
        self._lock = threading.Lock()

    def observe(self, group: str, sample: ArmSample) -> bool:
        """Count one finished request of `group`; False when the group is not kept (no group, or past the cap
        without an adapter)."""
        if not group:
            return False
        with self._lock:
            w = self._groups.get(group)
            if w is None and len(self._groups) >= self.max_groups:
                if sample.arm != "learned" or sample.adapter_version <= 0:
                    return False
                self._evicted.append(self._groups.popitem(last=False)[0])
            if w is None or (sample.arm == "learned" and sample.adapter_version != w.version):
                w = self._groups[group] = _Window(sample.adapter_version if sample.arm == "learned" else 0,
                                                  self.window)
            self._groups.move_to_end(group)
            w.arms[sample.arm].append(sample)
            return True

    def take_evicted(self) -> list[str]:
        """The groups dropped since the last call."""
        with self._lock:
            out, self._evicted = self._evicted, []
        return out

    def report(self) -> dict[str, dict[str, Any]]:
        """Per group: the served adapter version the window is of, both arms' numbers and the uplift per measure."""
        with self._lock:
            snap = {g: (w.version, [s for a in ARMS for s in w.arms[a]]) for g, w in self._groups.items()}
        return {g: {"adapter_version": v, **compare(samples)} for g, (v, samples) in snap.items()}


def control_values(report: dict[str, Any]) -> dict[str, float]:
    """One group's `ControlGroups.report` as a metrics row (metrics.jsonl, wandb): `<metric>/<arm>` per arm and
    `dvi_control_uplift/<measure>[/low|/high]`; numbers only."""
    out: dict[str, float] = {"adapter_version": report["adapter_version"]}
    for arm in ARMS:
        a = report[arm]
        out[f"{M.CONTROL_REQUESTS}/{arm}"] = a["requests"]
        for name, key in ((M.CONTROL_ACCEPTANCE_RATE, "alpha"), (M.CONTROL_TOKENS_PER_PASS, "tokens_per_pass"),
                          (M.CONTROL_DECODE_TOKENS_PER_SECOND, "decode_tokens_per_s")):
            if a[key] is not None:
                out[f"{name}/{arm}"] = a[key]
    for measure, u in report["uplift"].items():
        if u is not None:
            out[f"{M.CONTROL_UPLIFT}/{measure}"] = u["ratio"]
            for bound in ("low", "high"):
                if u[bound] is not None:
                    out[f"{M.CONTROL_UPLIFT}/{measure}/{bound}"] = u[bound]
    return out
