"""Per traffic group, a drafter swapper of its own (issue 40): `GroupSwappers`.

With `trainer.adapter_key` set the trainer publishes each group's LoRA adapter versions to the group's registry
(`dvi.registry.groups`); here every such group gets a `DrafterSwapper` with the group's `SwapLane`: it judges a
version on that group's held-out records only, serves it to that group's rows only (a `SetAdapter` command), and
watches, rolls back, refuses and restores it in that group's registry. One group's verdicts never touch another's.
One watcher thread drives them all in turn (a promotion's checks are the CPU's work; two at once only compete).
At most `trainer.max_adapters` groups are served; a group past the cap drafts with the shared drafter.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from dvi.config import DviConfig
from dvi.drafters.adapters import projection_sizes
from dvi.feedback import FeedbackRecord
from dvi.feedback.heldout import adapter_group
from dvi.fsutil import AppendLog
from dvi.registry.codec import scoring_module
from dvi.registry.groups import group_names, group_registry

from ..engine_client import EngineClient
from .lane import DrafterSwapper
from .policy import SwapEvent, SwapLane, SwapPolicy

__all__ = ["GroupSwappers"]

log = logging.getLogger(__name__)


class GroupSwappers:
    """The group swappers of one server, found as groups appear in the registry."""

    def __init__(self, cfg: DviConfig, scheduler: EngineClient, base_drafter: Any, policy: SwapPolicy,
                 on_event: Callable[[SwapEvent], None] | None = None, event_log: str | AppendLog | None = None,
                 feedback_dir: str | None = None) -> None:
        self.cfg, self.key = cfg, cfg.trainer.adapter_key
        self.scheduler, self.base, self.policy = scheduler, base_drafter, policy
        self.on_event, self.event_log, self.feedback_dir = on_event, event_log, feedback_dir
        model = scoring_module(base_drafter)
        self.sizes, self.num_layers = projection_sizes(model), int(model.config.num_hidden_layers)
        self.swappers: dict[str, DrafterSwapper] = {}
        self.over_cap: set[str] = set()  # groups with a registry but no room here (logged once)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def discover(self) -> None:
        """A swapper for every group the registry holds, up to `trainer.max_adapters`."""
        for group in group_names(self.cfg.registry.dir):
            if group in self.swappers or group in self.over_cap:
                continue
            if len(self.swappers) >= self.cfg.trainer.max_adapters:
                self.over_cap.add(group)
                log.warning("group %s has adapter versions but %d groups are served (trainer.max_adapters): its "
                            "rows draft with the shared drafter", group, len(self.swappers))
                continue
            lane = SwapLane(group, self.key, self.sizes, self.num_layers)
            reg = group_registry(self.cfg.registry.dir, group, self.cfg.registry.keep_last, self.cfg.serve.replica)
            sw = DrafterSwapper(reg, self.scheduler, self.base, self.policy, on_event=self.on_event,
                                event_log=self.event_log, feedback_dir=self.feedback_dir, lane=lane)
            with self._lock:
                self.swappers[group] = sw
            log.info("group %s: its adapter versions are judged on its own records and served to its rows", group)

    def observe_record(self, record: FeedbackRecord) -> None:
        """Engine thread: a finished request's record goes to its group's swapper (if the group has one)."""
        sw = self.swappers.get(adapter_group(self.key, record.domain, getattr(record, "client", "")))
        if sw is not None:
            sw.observe_record(record)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dvi-group-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                self.discover()
            except OSError:
                log.exception("cannot list the registry's groups")
            for sw in list(self.swappers.values()):
                if self._stop.is_set():
                    break
                sw.tick()
            self._stop.wait(self.policy.poll_seconds)

    def stop(self, timeout: float = 30.0) -> None:
        """No more verdicts in any group; wait up to `timeout` for the thread (0: do not)."""
        self._stop.set()
        for sw in list(self.swappers.values()):
            sw.stop(timeout=0)
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def info(self) -> dict[str, Any]:
        """Per group: what /health shows of its swapper."""
        with self._lock:
            swappers = dict(self.swappers)
        keep = ("live_version", "serving", "good", "pinned", "watch", "latest", "heldout_positions", "waiting",
                "gates", "counts", "events")
        out = {g: {k: v for k, v in sw.info().items() if k in keep} for g, sw in sorted(swappers.items())}
        return {"adapter_key": self.key, "max_adapters": self.cfg.trainer.max_adapters, "groups": out,
                "over_cap": sorted(self.over_cap)}
