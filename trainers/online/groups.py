"""Per traffic group, an online trainer of the group's own LoRA adapter (issue 40): `GroupLanes`.

With `trainer.adapter_key` set, the shared drafter stops learning (a drafter that learns sql forgets code, and the
per-group gate then refuses every version of it); each group that has sent `trainer.adapter_min_records` records
gets a lane instead: an `OnlineTrainer` over its own named adapter on the one shared peft model (a fresh LoRA's B is
zero, so a lane starts as the base), with its own held-out set, replay buffer, optimizer, publish gate and registry
(`dvi.registry.groups`). A lane trains and is judged on its group's records only, so one group's traffic, garbage
included, moves no other group's adapter. At most `trainer.max_adapters` lanes; records of no group, of a group
still gathering its first records, or of a group past the cap train nothing and are counted.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dvi.config import DviConfig
from dvi.feedback import FeedbackRecord
from dvi.feedback.heldout import adapter_group
from dvi.registry.groups import group_dir_name, group_names, group_registry
from dvi.registry.store import AdapterRejected
from dvi.rundir import RunDir
from trainers.online.publishing import PublishDecision
from trainers.online.trainer import OnlineTrainer, RoundStats

log = logging.getLogger("dvi.trainer")

WAITING_GROUPS_PER_LANE = 4  # groups gathering their first records, at most this many per lane of the cap
ACTIVE_S = 60.0  # an idle trainer replays for the lanes whose group sent records within this many seconds


def adapter_name(group: str) -> str:
    """The group's adapter name in the shared peft model (a module-dict key: no dots)."""
    return "g_" + group_dir_name(group).replace("-", "_")


class GroupLanes:
    """The lanes of one trainer process, beside its (frozen) shared trainer `main`."""

    def __init__(self, main: OnlineTrainer, cfg: DviConfig, rundir: RunDir) -> None:
        if main.accelerator.num_processes > 1:
            raise ValueError("trainer.adapter_key trains its group adapters in one process (each lane is its own "
                             "optimizer over a shared model); launch the trainer without accelerate's --num_processes")
        self.main, self.cfg, self.rundir = main, cfg, rundir
        tc = cfg.trainer
        self.key, self.min_records, self.cap = tc.adapter_key, tc.adapter_min_records, tc.max_adapters
        self.lanes: dict[str, OnlineTrainer] = {}
        self.waiting: collections.OrderedDict[str, list[FeedbackRecord]] = collections.OrderedDict()
        self.untrained: collections.Counter[str] = collections.Counter()  # why records trained no adapter
        self._dropped: list[FeedbackRecord] = []  # this round's
        self.last_new: dict[str, float] = {}  # group -> when its lane last trained new records (monotonic)

    def group_of(self, record: FeedbackRecord) -> str:
        return adapter_group(self.key, record.domain, getattr(record, "client", ""))

    @property
    def step(self) -> int:
        return sum(lane.step for lane in self.lanes.values())

    def _open(self, group: str) -> OnlineTrainer:
        m = self.main
        reg = group_registry(self.cfg.registry.dir, group, self.cfg.registry.keep_last)
        lane = OnlineTrainer(self.cfg, m.trainable.drafter, registry=reg, metrics=m.metrics, accelerator=m.accelerator,
                             run_dir=self.rundir.root, pad_id=m.pad_id, adapter=adapter_name(group))
        self.lanes[group] = lane
        log.info("trainer: group %s has its own adapter now (%d of %d)", group, len(self.lanes), self.cap)
        return lane

    # -- training ---------------------------------------------------------------------------------
    def train_on_records(self, records: Iterable[FeedbackRecord]) -> RoundStats:
        """Each group's records to its lane (a group's first records wait for `adapter_min_records`)."""
        parts: dict[str, list[FeedbackRecord]] = {}
        for r in records:
            parts.setdefault(self.group_of(r), []).append(r)
        rounds, self._dropped = [], []
        for group, recs in parts.items():
            lane, recs = self._lane_for(group, recs)
            if lane is not None:
                rounds.append(lane.train_on_records(recs))
                self.last_new[group] = time.monotonic()
        return _merged(rounds, [r.request_id for r in self._dropped])

    def train_on_replay(self, steps: int) -> RoundStats:
        """An idle trainer's spare time, lane by lane: `steps` replay-only steps for each lane whose group sent
        records in the last `ACTIVE_S` seconds (a group's own records only, within its budget), so a group that is
        sending traffic learns between feedback shards (up to `trainer.idle_replay_epochs` replays per record it
        trained), and a silent one costs nothing."""
        now = time.monotonic()
        active = [g for g, t in self.last_new.items() if now - t <= ACTIVE_S and g in self.lanes]
        rounds = [self.lanes[g].train_on_replay(steps) for g in active if self.lanes[g].may_replay_idle()]
        return _merged(rounds, [])

    def _lane_for(self, group: str, recs: list[FeedbackRecord]) -> tuple[OnlineTrainer | None, list[FeedbackRecord]]:
        """(the group's lane, the records it trains on now: the waiting ones too when it opens), or (None, []): the
        records wait for their group's lane (logged when it trains them), or train nothing (`_dropped`)."""
        if group in self.lanes:
            return self.lanes[group], recs
        why = "no_group" if not group else ("over_cap" if len(self.lanes) >= self.cap else "")
        if why:
            self._drop(why, recs)
            return None, []
        waiting = self.waiting.setdefault(group, [])
        waiting.extend(recs)
        self.waiting.move_to_end(group)
        if len(waiting) >= self.min_records:
            return self._open(group), self.waiting.pop(group)
        while len(self.waiting) > WAITING_GROUPS_PER_LANE * self.cap:  # a client minting groups cannot grow this
            self._drop("evicted", self.waiting.popitem(last=False)[1])
        return None, []

    def _drop(self, why: str, recs: list[FeedbackRecord]) -> None:
        self.untrained[why] += len(recs)
        self._dropped.extend(recs)

    def maybe_publish(self, force: bool = False) -> list[PublishDecision]:
        out = []
        for lane in self.lanes.values():
            if not force or lane.step > lane.publisher.last_step:
                d = lane.maybe_publish(force=force)
                if d is not None:
                    out.append(d)
        return out

    # -- resume ------------------------------------------------------------------------------------
    def save(self, checkpoint: Path) -> None:
        """Every lane's checkpoint inside the shared one's `checkpoint` dir (written before its rename, so the cursor
        and every lane move together)."""
        for group, lane in self.lanes.items():
            lane.save_checkpoint(checkpoint / "groups" / group_dir_name(group), {"group": group})

    def restore(self, checkpoint: Path) -> None:
        """A lane for every group with a registry (up to the cap): its checkpoint in `checkpoint`, else its served
        version."""
        for group in group_names(self.cfg.registry.dir):
            if group in self.lanes or len(self.lanes) >= self.cap:
                continue
            lane = self._open(group)
            if lane.load_checkpoint(checkpoint / "groups" / group_dir_name(group)) is not None:
                continue
            served = lane.publisher.served_version()
            if served:
                try:
                    lane.trainable.load_state(lane.trainable.load_version(lane.registry, served))
                    lane.publisher.adopt(served)
                except (AdapterRejected, ValueError, OSError) as exc:
                    log.warning("trainer: group %s's served v%d does not load (%s); it starts fresh", group,
                                served, exc)

    def warm(self, records: list[FeedbackRecord]) -> None:
        """Consumed records read again at start: each lane's held-out set and replay buffer, or a group's wait."""
        for r in records:
            group = self.group_of(r)
            if not group or group not in self.lanes and len(self.lanes) >= self.cap:
                continue  # counted when it was consumed
            lane, recs = self._lane_for(group, [r])
            if lane is not None:
                lane.heldout.split(recs, lane.replay.append)

    def reset(self) -> None:
        """Forget every lane (a rewind: `restore` reopens them from the checkpoint, fresh where it has none)."""
        model = self.main.trainable.drafter
        model.set_adapter("default")
        for group in self.lanes:
            model.delete_adapter(adapter_name(group))
        self.lanes.clear()
        self.waiting.clear()
        self.last_new.clear()

    def status(self) -> dict[str, Any]:
        return {"adapter_key": self.key, "groups": {g: {
            "step": lane.step, "records_seen": lane.records_seen, "last_published": lane.publisher.published,
            "heldout_alpha": lane.publisher.heldout_alpha, "heldout_positions": lane.heldout.positions()}
            for g, lane in sorted(self.lanes.items())},
            "waiting": {g: len(w) for g, w in self.waiting.items()}, "untrained_records": dict(self.untrained)}


def _merged(rounds: list[RoundStats], untrained: list[str]) -> RoundStats:
    """One round's stats over its lanes (losses: the mean over lanes that stepped, weighted by steps)."""
    out = RoundStats(steps=sum(r.steps for r in rounds), seconds=sum(r.seconds for r in rounds),
                     untrained_ids=untrained)
    for r in rounds:
        out.new += r.new
        out.heldout += r.heldout
        out.dropped_stale += r.dropped_stale
        out.replayed += r.replayed
        out.budget_deferred += r.budget_deferred
        out.target_version = max(out.target_version, r.target_version)
        out.trained_ids += r.trained_ids
        out.heldout_ids += r.heldout_ids
        out.dropped_ids += r.dropped_ids
    stepped = [r for r in rounds if r.steps]
    if stepped:
        out.losses = {k: sum(r.losses[k] * r.steps for r in stepped) / out.steps for k in stepped[0].losses}
    return out
