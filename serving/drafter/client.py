"""The drafter wing's one door, `DrafterClient`, and the drafter thread behind it (as `serving.scheduler.Scheduler`
is the engine's).

- In: typed messages on one inbox (`serving.drafter.messages`). The admin API's `Pin` / `Rollback` through
  `command(cmd)`, which returns a future; the engine thread's `Observed` (a finished request) through `observe`,
  which returns nothing. The drafter thread applies them between two of its steps, publishes a fresh snapshot and
  only then resolves their futures, so whoever waited on one reads a snapshot that shows it.
- Out: a `DrafterSnapshot` after every batch of messages and every step, published by one reference assignment
  (atomic under the GIL). /health, /metrics and /admin read only that.
- The drafter thread: one, for every lane (`serving.drafter.lane.Lane`): the shared drafter's, or with
  `trainer.adapter_key` each traffic group's (issue 40: found as groups appear in the registry, at most
  `trainer.max_adapters`; a group past the cap drafts with the shared drafter; the shared lane then takes no step,
  its drafter stays as started). It drains the inbox, steps each lane (restore, validate, judge, swap, end a watch:
  a promotion's checks are the CPU's work, two at once only compete), publishes, and waits for the next message or
  `serve.registry_poll_seconds`. No other thread touches a lane: in debug runs (`$DVI_ENGINE_OWNER_CHECK=1`,
  `dvi.decode.owner`) the thread claims each one, and any other thread's touch raises.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dvi.config import DviConfig
from dvi.decode import owner
from dvi.drafters.adapters import projection_sizes
from dvi.feedback.heldout import adapter_group
from dvi.fsutil import AppendLog
from dvi.registry.codec import scoring_module
from dvi.registry.groups import group_names, group_registry
from dvi.registry.store import DrafterRegistry

from ..engine_client import EngineClient
from .lane import Lane
from .messages import Command, DrafterSnapshot, Observed, Pin, Rollback, VersionEvent
from .policy import GroupScope, LifecyclePolicy

__all__ = ["Command", "DrafterClient", "DrafterSnapshot", "Observed", "Pin", "Rollback", "VersionEvent"]

log = logging.getLogger(__name__)

MAX_OBSERVED = 4096
"""Finished requests the inbox holds for the drafter thread (a shadow check takes seconds); more are dropped, counted
(`DrafterSnapshot.dropped`): the held-out set and a watch then miss them, no request waits for them."""


class DrafterClient:
    """What the server's threads may do with the drafter versions: send messages, read the snapshot."""

    def __init__(self, lane: Lane, groups: DviConfig | None = None) -> None:
        self.lane = lane  # the shared drafter's lane: the drafter thread's (tests read it, as `Scheduler.engine`)
        self.policy = lane.policy
        self._groups_cfg = groups  # trainer.adapter_key set: the traffic groups' lanes (found in the registry)
        self._group_lanes: dict[str, Lane] = {}
        self._over_cap: set[str] = set()  # groups with a registry but no room here (logged once)
        self._scope: tuple[dict[str, int], int] | None = None  # the startup drafter's projection sizes and layers
        self._inbox: collections.deque[tuple[Command | Observed, concurrent.futures.Future | None]] = collections.deque()
        self._observed = 0  # Observed messages waiting
        self._dropped = 0
        self._cv = threading.Condition()
        self._stop = lane.stopping  # every lane's: a check under way decides nothing once it is set
        self._thread: threading.Thread | None = None
        self.snapshot = DrafterSnapshot()  # replaced (never changed) by the drafter thread
        self._publish()

    @classmethod
    def of(cls, cfg: DviConfig, engine: EngineClient, drafter: Any, on_event: Callable[[VersionEvent], None],
           event_log: str | AppendLog | None, groups: bool = False) -> DrafterClient:
        """The server's: the shared registry's lane over the startup `drafter`, and with `groups` the traffic groups'."""
        registry = DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last, replica=cfg.serve.replica)
        lane = Lane(registry, engine, drafter, LifecyclePolicy.of(cfg), on_event=on_event, event_log=event_log,
                    feedback_dir=cfg.feedback.dir)
        return cls(lane, cfg if groups else None)

    # -- the door (any thread) ----------------------------------------------------------------------
    def command(self, cmd: Command) -> concurrent.futures.Future:
        """Apply `cmd` on the drafter thread between two of its steps; the future holds its result and resolves after
        the snapshot that shows it is published."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stop.is_set() or not self.alive:
                fut.set_exception(RuntimeError("the drafter thread is not running"))
                return fut
            self._inbox.append((cmd, fut))
            self._cv.notify_all()
        return fut

    def observe(self, msg: Observed) -> None:
        """A finished request (the engine thread); never waits (nothing is kept once the drafter thread stops)."""
        with self._cv:
            if self._stop.is_set():
                return
            if self._observed >= MAX_OBSERVED:
                self._dropped += 1
                return
            self._observed += 1
            self._inbox.append((msg, None))
            self._cv.notify_all()

    def queued(self) -> int:
        """Commands waiting for the drafter thread (observations not counted)."""
        with self._cv:
            return len(self._inbox) - self._observed

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dvi-drafter", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """No more verdicts (a check under way ends without one); wait up to `timeout` for the thread (0: do not)."""
        with self._cv:
            self._stop.set()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    # -- the drafter thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(1)
        owner.claim(self.lane)  # debug runs: any other thread touching a lane now raises
        try:
            self._serve()
        finally:
            for lane in (self.lane, *self._group_lanes.values()):
                owner.release(lane)
            with self._cv:
                left, self._inbox = list(self._inbox), collections.deque()
            for _msg, fut in left:
                if fut is not None:
                    fut.cancel()

    def _serve(self) -> None:
        """Step every lane (the first step restores it, before any message is applied), drain the inbox between two
        steps, and wait for a message or the next poll once no lane has work now."""
        due = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= due:
                more = False
                for lane in self._lanes():
                    more |= lane.step()
                    self._publish()
                    self._drain(0.0)  # a pin sent while the lane judged lands before the swap it would have lost to
                    if self._stop.is_set():
                        return
                due = time.monotonic() + (0.0 if more else self.policy.poll_seconds)
            self._drain(max(0.0, due - time.monotonic()))

    def _drain(self, wait_s: float) -> None:
        """Apply what waits on the inbox (waiting up to `wait_s` for a first message), publish, then answer."""
        with self._cv:
            if not self._inbox and wait_s > 0 and not self._stop.is_set():
                self._cv.wait(timeout=wait_s)
            batch, self._inbox = list(self._inbox), collections.deque()
            self._observed = 0
        if not batch:
            return
        answers = []
        for msg, fut in batch:
            if fut is None:
                self._apply_observed(msg)
            elif fut.set_running_or_notify_cancel():
                try:
                    answers.append((fut, self._apply(msg), None))
                except BaseException as exc:  # noqa: BLE001 - reported through the future
                    answers.append((fut, None, exc))
        self._publish()
        for fut, result, exc in answers:
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _apply(self, cmd: Command) -> Any:
        if isinstance(cmd, Pin):
            return self.lane.pin(cmd.version)
        if isinstance(cmd, Rollback):
            return self.lane.rollback(cmd.reason)
        raise TypeError(f"not a drafter command: {cmd!r}")

    def _apply_observed(self, msg: Observed) -> None:
        """The live-α window (the learned drafter's own drafts; hybrid: not the suffix ones) and the record the
        held-out checks and a watch score, to the shared lane and the record's group's."""
        self.lane.observe(msg.drafted, msg.accepted, msg.drafter_version)
        if msg.record is None:
            return
        counts = (msg.drafted, msg.accepted)  # the engine's: behind vLLM a record does not name rejected drafts
        self.lane.observe_record(msg.record, msg.at, counts)
        if self._groups_cfg is not None:
            key = self._groups_cfg.trainer.adapter_key
            lane = self._group_lanes.get(adapter_group(key, msg.record.domain, getattr(msg.record, "client", "")))
            if lane is not None:
                lane.observe_record(msg.record, msg.at, counts)

    def _publish(self) -> None:
        """The drafter thread (and the constructor, before it runs): a new snapshot by one reference assignment."""
        cfg = self._groups_cfg
        try:
            self.snapshot = DrafterSnapshot(
                seq=self.snapshot.seq + 1, shared=self.lane.view(), dropped=self._dropped,
                groups=None if cfg is None else {g: lane.view() for g, lane in self._group_lanes.items()},
                adapter_key=cfg.trainer.adapter_key if cfg is not None else "none",
                max_adapters=cfg.trainer.max_adapters if cfg is not None else 0, over_cap=tuple(sorted(self._over_cap)))
        except Exception:  # noqa: BLE001 - a stale snapshot costs a scrape's freshness, never a version
            log.exception("drafter snapshot failed")

    # -- the traffic groups' lanes (issue 40) ---------------------------------------------------------------
    def _lanes(self) -> list[Lane]:
        """The lanes that take steps: the shared one, or with traffic groups each group's (found first)."""
        if self._groups_cfg is None:
            return [self.lane]
        try:
            self._discover(self._groups_cfg)
        except OSError:
            log.exception("cannot list the registry's groups")
        return list(self._group_lanes.values())

    def _discover(self, cfg: DviConfig) -> None:
        """A lane for every group the registry holds, up to `trainer.max_adapters`: it judges a version on that
        group's held-out records only, serves it to that group's rows only (`SetAdapter`), and watches, rolls back,
        refuses and restores it in that group's registry. One group's verdicts never touch another's."""
        for group in group_names(cfg.registry.dir):
            if group in self._group_lanes or group in self._over_cap:
                continue
            if len(self._group_lanes) >= cfg.trainer.max_adapters:
                self._over_cap.add(group)
                log.warning("group %s has adapter versions but %d groups are served (trainer.max_adapters): its "
                            "rows draft with the shared drafter", group, len(self._group_lanes))
                continue
            if self._scope is None:
                model = scoring_module(self.lane.base)
                self._scope = projection_sizes(model), int(model.config.num_hidden_layers)
            scope = GroupScope(group, cfg.trainer.adapter_key, *self._scope)
            reg = group_registry(cfg.registry.dir, group, cfg.registry.keep_last, cfg.serve.replica)
            lane = self._group_lanes[group] = self.lane.for_group(scope, reg)
            owner.claim(lane)
            log.info("group %s: its adapter versions are judged on its own records and served to its rows", group)
