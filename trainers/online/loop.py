"""`TrainerLoop`: tails the feedback shards for an `OnlineTrainer`, exactly once across kills.

Its own module because the cursor, checkpoint and consumed-log ordering is the subtle part of
the trainer and reads best alone. It honours the run dir's pause flag (`dvi.rundir`) and SIGTERM, and
checkpoints so that a killed trainer resumes without training a record twice or skipping one.

Exactly-once. Rounds train untrained shards; every `trainer.checkpoint_seconds` (and when idle,
paused or stopping) the loop flushes: it writes `<run_dir>/trainer/checkpoint/` atomically
(weights, optimizer, counters, the names of trained-but-uncommitted shards, and the consumed
record ids of the rounds since the last flush), then appends those rounds to
`<run_dir>/trainer/consumed.jsonl`, then commits every trained shard to the reader's consumed state
(`dvi.feedback.consumed`: per writer, by the writer's own shard count, never by a clock). A kill loses
only the rounds since the last flush, whose weight updates die with them, so their shards are trained
again; shards in the checkpoint are never retrained, and a round the checkpoint holds but the log lacks
is logged on restart. Replay (older records re-used in batches) is separate and explicit, counted as
`replayed`, never as new.

Unusable records: every record read is screened first (`screen.py`: ids against the drafter's
vocabulary, feature width, a collation of it alone), on every rank alike; what fails is quarantined
record by record (logged, counted, kept in `trainer/quarantined_records.jsonl`, listed under
`quarantined` in its round's consumed-log line) and the rest of its shard trains. A forward that fails
anyway (one process) is traced to its record by probing each alone; that record is refused from then
on and the loop rewinds to its last flush, as a restart would, instead of crashing into a restart loop.

Recent-first: when shards pile up, the newest-named are trained first (the traffic that matters now);
older ones are trained when the trainer catches up. A writer's clock only orders them: a shard named in
the future or the past is trained like any other.

The trainer's gauges go to `RunDir.write_trainer_status` (`<run_dir>/trainer/status.json`,
atomically replaced, also the supervisor's heartbeat) for the server's /metrics.

Accelerate: rank 0 picks the shards and the stop/pause decisions and broadcasts them, every rank
trains on its slice of each batch, and only rank 0 checkpoints, commits and publishes.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from dvi import metrics as M
from dvi.config import DviConfig
from dvi.feedback import FeedbackReader
from dvi.memory import HeapTrimmer
from dvi.registry.store import AdapterRejected
from dvi.rundir import RunDir
from trainers.online.groups import GroupLanes
from trainers.online.screen import RecordScreen
from trainers.online.trainer import OnlineTrainer, RoundStats

log = logging.getLogger("dvi.trainer")

STALE_SHARD_S = 10.0  # train a pending shard below min_new_records once it is this old (x poll_seconds)


class _Stop:
    def __init__(self) -> None:
        self.requested = False
        self.signal: int | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        self.requested = True
        self.signal = signum


class TrainerLoop:
    """Tails the feedback shards for an `OnlineTrainer`, with checkpoints and an exactly-once cursor."""

    def __init__(self, trainer: OnlineTrainer, cfg: DviConfig) -> None:
        self.trainer = trainer
        self.cfg = cfg
        self.rundir = RunDir.of(cfg).make()
        self.reader = FeedbackReader(cfg.feedback.dir, cursor_path=self.rundir.cursor_path)
        self.trained: set[str] = set()  # trained shards whose cursor commit may still be pending
        self.unflushed: list[dict[str, Any]] = []  # rounds trained since the last checkpoint
        self.last_flush = time.monotonic()
        self.seq = 0
        self.stop = _Stop()
        self.rounds = 0
        self.screen = RecordScreen.of(trainer, self.rundir)
        # trainer.adapter_key: the shared drafter stays as served, each traffic group trains an adapter of its own
        self.lanes = GroupLanes(trainer, cfg, self.rundir) if cfg.trainer.adapter_key != "none" else None
        self.heap = HeapTrimmer(cfg.trainer.malloc_trim_seconds)  # between rounds: training churns tensor sizes

    # -- startup ----------------------------------------------------------------------------------
    def restore(self) -> None:
        """Resume: weights/optimizer from the checkpoint (else the version the server serves), then the cursor."""
        t = self.trainer
        state = t.load_checkpoint(self.rundir.checkpoint_dir)  # every rank (the run dir is shared)
        if state is not None:
            self.trained = set(state.get("trained_uncommitted", []))
            self.seq = int(state.get("seq", 0))
            self.screen.quarantined = int(state.get("quarantined_records", 0))
            t.publisher.backoff.failures = int(state.get("publish_failures", 0))
            self.screen.refused.update({(s, r): why for s, r, why in state.get("refused", [])})
            logged = self._last_logged_seq()
            for entry in state.get("rounds", []):
                if t.is_main and int(entry["seq"]) > logged:
                    self._append_consumed(entry)  # killed between the checkpoint and its log append
            log.info("trainer: resumed from checkpoint at step %d (%d records trained)", t.step, t.records_seen)
        elif t.registry is not None and (served := t.publisher.served_version()) != 0:
            try:
                t.trainable.load_state(t.trainable.load_version(t.registry, served))
                t.publisher.adopt(served)
                log.info("trainer: no checkpoint; starting from the served v%d", served)
            except (AdapterRejected, ValueError, OSError) as exc:
                log.warning("trainer: the served v%d does not load into this drafter (%s); starting from the base",
                            served, exc)
        t.reset_anchor()
        if self.lanes is not None:
            self.lanes.restore(self.rundir.checkpoint_dir)
        self._commit_trained()
        self._warm_buffers()

    def _warm_buffers(self, max_shards: int = 8) -> None:
        """Refill held-out and replay buffers from the newest already-consumed shards (replay only)."""
        t = self.trainer
        pending = set(self.reader.poll(self.trained))
        done = [s for s in self.reader.list_shards() if s not in pending or s in self.trained][-max_shards:]
        if not done:
            return
        keyed = [(name, rec) for name in done for rec in self.reader.iter_records([name], unread=False)]
        records = [rec.compact() for _, rec in self.screen.split(keyed)[0]]  # an unusable one was counted when consumed
        for e in records:
            t.max_target_version = max(t.max_target_version, e.target_version)
        if self.lanes is not None:
            self.lanes.warm(records)
            log.info("trainer: warmed group lanes from %d consumed shards (%s)", len(done), self.lanes.status())
            return
        n_held = t.heldout.split(records, t.replay.append)
        log.info("trainer: warmed buffers from %d consumed shards (%d held-out, %d replay)", len(done), n_held,
                 len(t.replay))

    # -- bookkeeping --------------------------------------------------------------------------------
    def _last_logged_seq(self) -> int:
        return self.rundir.last_consumed_seq()

    def _append_consumed(self, entry: Mapping[str, Any]) -> None:
        self.rundir.append_consumed(entry)

    def _commit_trained(self) -> None:
        """Mark every trained shard consumed (the reader's state takes them in any order)."""
        if not self.trainer.is_main or not self.trained:
            return
        self.reader.commit_shards(self.trained)
        self.trained = set()
        self.screen.refused = {k: v for k, v in self.screen.refused.items() if not self.reader.state.is_consumed(k[0])}

    def _rewind(self) -> None:
        """Forget the rounds since the last flush as a restart would: weights, optimizer and counters from the
        checkpoint (or as a fresh process has them), those rounds' shards untrained again, buffers warmed anew."""
        t = self.trainer
        t.optimizer.zero_grad(set_to_none=True)  # the failed backward may have left partial gradients
        t.optimizer.state.clear()
        t.reset_progress()
        if self.lanes is not None:
            self.lanes.reset()
        self.trained, self.unflushed, self.seq, self.screen.quarantined = set(), [], 0, 0
        self.restore()

    def _refuse_culprits(self, keyed: list[tuple[str, Any]]) -> bool:
        """After a failed round: find the records whose own forward fails and refuse them from now on; False when
        none does (or with several ranks, which a one-sided failure has already desynchronised)."""
        t = self.trainer
        if t.accelerator.num_processes > 1:
            return False
        bad = self.screen.probe(t.module, keyed, t.tc, t.step, t.device)
        for (shard, rec), why in bad:
            self.screen.refused[(shard, rec.request_id)] = why
            log.error("trainer: the forward failed on record %s of %s (%s); rewinding to the last checkpoint "
                      "without it", rec.request_id, shard, why)
        return bool(bad)

    # -- one round ----------------------------------------------------------------------------------
    def _choose(self) -> list[str]:
        """Newest untrained shards holding >= min_new_records records (recent-first)."""
        pending = [s for s in self.reader.poll(self.trained) if s not in self.trained]
        if not pending:
            return []
        chosen, n = [], 0
        for name in reversed(pending):
            rows = self.reader.num_rows(name)  # None: vanished, or unreadable and quarantined
            if rows is None:
                continue
            chosen.append(name)
            n += rows
            if n >= self.cfg.trainer.min_new_records:
                break
        if not chosen:
            return []
        if n < self.cfg.trainer.min_new_records:
            age = self.reader.waiting_seconds(pending)  # this reader's clock: a writer's may be off
            if age < STALE_SHARD_S * self.cfg.trainer.poll_seconds and not self.stop.requested:
                return []  # wait for more records
        return sorted(chosen)

    def _broadcast(self, obj: Any) -> Any:
        acc = self.trainer.accelerator
        if acc.num_processes <= 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def flush(self) -> None:
        """Checkpoint, then log the rounds it covers, then commit the cursor (the exactly-once order).

        Rounds trained since the previous flush live only in memory: a kill loses their weight
        updates and their log lines together, so their shards are simply trained again.
        """
        self.last_flush = time.monotonic()
        if not self.unflushed:
            return
        t = self.trainer
        if t.is_main:
            t.save_checkpoint(self.rundir.checkpoint_dir, {
                "seq": self.seq, "trained_uncommitted": sorted(self.trained), "rounds": self.unflushed,
                "quarantined_records": self.screen.quarantined, "publish_failures": t.publisher.backoff.failures,
                "refused": [[s, r, why] for (s, r), why in sorted(self.screen.refused.items())]},
                write_more=self.lanes.save if self.lanes is not None else None)  # one rename: exactly once
            for entry in self.unflushed:
                self._append_consumed(entry)
            self.unflushed = []
            self._commit_trained()
        else:
            self.unflushed = []

    def run_round(self) -> RoundStats | None:
        """Train one round of shards (flushed every `checkpoint_seconds`). None when there was nothing to do."""
        t = self.trainer
        shards = self._broadcast(self._choose() if t.is_main else None)
        if not shards:
            return None
        keyed = [(name, rec) for name in shards for rec in self.reader.iter_records([name])]
        good, bad = self.screen.split(keyed)
        quarantined = self.screen.quarantine(bad)
        try:
            stats = (self.lanes or t).train_on_records([rec for _, rec in good])
        except Exception:
            if not self._refuse_culprits(good):
                raise
            self._rewind()
            return None
        self.seq += 1
        self.trained |= set(shards)
        entry = {"seq": self.seq, "shards": shards, "trained": stats.trained_ids, "heldout": stats.heldout_ids,
                 "dropped": stats.dropped_ids, "quarantined": quarantined, "step": t.step, "time": time.time()}
        if stats.untrained_ids:
            entry["untrained"] = stats.untrained_ids
        self.unflushed.append(entry)
        if time.monotonic() - self.last_flush >= t.tc.checkpoint_seconds:
            self.flush()
        self.rounds += 1
        return stats

    def _idle_replay(self, steps: int) -> bool:
        """Replay-only steps while no new shard waits (the shared drafter's, or each active lane's; within the budget
        and `trainer.idle_replay_epochs`), then the publish gate; False when nothing could step."""
        t = self.trainer
        if self.lanes is not None:
            stepped = self.lanes.train_on_replay(steps).steps > 0
        else:
            stepped = t.may_replay_idle() and t.train_on_replay(steps).steps > 0
        if stepped:
            self._publish()
        return stepped

    def _publish(self, force: bool = False) -> None:
        """The publish gate: the shared drafter's, or every group lane's on its own records."""
        if self.lanes is not None:
            self.lanes.maybe_publish(force=force)
        else:
            self.trainer.maybe_publish(force=force)

    def _write_status(self, state: str) -> None:
        if not self.trainer.is_main:
            return
        try:
            # also the heartbeat the server's supervisor watches (serve.trainer_stale_s)
            self.rundir.write_trainer_status({"state": state, "pid": os.getpid(),
                                              "processes": self.trainer.accelerator.num_processes,
                                              M.TRAINER_QUARANTINED_SHARDS: self.reader.quarantined_total(),
                                              M.TRAINER_LOST_SHARDS: self.reader.state.lost,
                                              M.TRAINER_SKIPPED_SHARDS: self.reader.state.skipped,
                                              M.TRAINER_QUARANTINED_RECORDS: self.screen.quarantined,
                                              M.TRAINER_PUBLISH_FAILURES: self.trainer.publisher.backoff.failures,
                                              **self.trainer.status(), "heap": self.heap.status(),
                                              "adapters": self.lanes.status() if self.lanes is not None else None})
        except OSError:
            log.exception("cannot write trainer status")

    def run(self) -> int:
        t = self.trainer
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        self.restore()
        self._write_status("running")
        log.info("trainer: tailing %s (cursor %s), publishing to %s", self.cfg.feedback.dir, self.reader.cursor,
                 self.cfg.registry.dir)
        while True:
            stop, paused = self._broadcast((self.stop.requested, self.rundir.trainer_paused()) if t.is_main else None)
            if stop:
                break
            if t.tc.max_steps is not None and (self.lanes or t).step >= t.tc.max_steps:
                log.info("trainer: reached max_steps=%d", t.tc.max_steps)
                break
            if paused:
                self.flush()
                self._write_status("paused")
                time.sleep(min(0.5, t.tc.poll_seconds))
                continue
            stats = self.run_round()
            if stats is not None:
                self.heap.after_step()
            else:
                if self.heap.idle_due():  # caught up: what rounds freed goes back now, at no round's cost
                    self.heap.trim()
                self.flush()
                if self.lanes is not None:  # each lane's publish, retried when due
                    self.lanes.maybe_publish()
                elif t.publisher.backoff.pending:  # a publish the registry refused: retried when due, idle or not
                    t.maybe_publish()
                if t.tc.idle_replay_steps and self._idle_replay(t.tc.idle_replay_steps):
                    self.heap.after_step()
                    self._write_status("idle")
                    continue
                self._write_status("idle")
                time.sleep(t.tc.poll_seconds)
                continue
            self._publish()
            self._write_status("running")
            log.info("trainer: step %d, +%d records (%d held out, %d replayed), %s", (self.lanes or t).step, stats.new,
                     stats.heldout, stats.replayed,
                     f"loss {stats.loss:.4f}" if stats.steps else "no step (nothing new to train on)")
        # SIGTERM lands between rounds (the handler only sets a flag): checkpoint and commit what was
        # trained, then publish what was trained since the last publish.
        self.flush()
        if self.lanes is not None or t.step > t.publisher.last_step:
            try:
                self._publish(force=True)
            except Exception:  # noqa: BLE001 - exit cleanly; the checkpoint has the weights
                log.exception("final publish failed")
        self._write_status("stopped")
        return 0
