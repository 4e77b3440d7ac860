"""`OnlineTrainer`, the in-process core: feedback records in, DVI steps, shadow-checked publishes.

Its own module so it runs without the process around it: the trainer loop (`loop.py`) drives it
from the feedback log, and the drift benchmark and `trainers.rl` drive it directly.

`train_on_records(records)` turns records into batches (new records recent-first, a
`replay_ratio` share of each batch replayed from older ones, stale target versions dropped or
down-weighted), takes `trainers.losses.dvi_loss` steps (pure top-k KL first, the accept/reject
reward ramped in; `warmup_steps` ramps the LR up, `anchor_weight` adds an L2 trust region towards the
weights it started from), and holds back `heldout_fraction` of the records (by a hash of the request id) in
its `dvi.feedback.heldout.HeldOutSet`, never trained on. `maybe_publish()` asks its `publisher` (`publishing.py`,
the publish gate) with the facts a version's manifest needs.
Checkpoints (weights, optimizer, counters) are the loop's resume point.

Compute budget: with `trainer.feedback_tokens_per_step = N > 0` the trainer takes at most one step
(new or replay) per N feedback tokens read (`feedback_tokens`: generated tokens of every record
read, held-out ones included), so its share of compute per served token is fixed, not whatever a
machine's speed leaves; records beyond the budget are counted in `budget_deferred` and kept for
replay. Both counters and `steps_allowed` are in `status()`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dvi import metrics as M
from dvi.config import DviConfig
from dvi.drafters.vocab import find_subset_head
from dvi.feedback import FeedbackRecord
from dvi.feedback.heldout import HeldOutSet, group_of
from dvi.feedback.verdict import gates
from dvi.registry.store import DrafterRegistry
from dvi.rundir import RunDir
from trainers.losses import LossWeights, batch_loss, chained_features, step_totals
from trainers.online.accel import make_accelerator
from trainers.online.checkpoint import COUNTERS, load_checkpoint, save_checkpoint
from trainers.online.collate import micro_batches
from trainers.online.publishing import PublishDecision, Publisher
from trainers.online.trainables import load_drafter_for_training, make_trainable

if TYPE_CHECKING:
    from dvi.drafters.learned import Drafter

log = logging.getLogger("dvi.trainer")

REPLAY_RECENT = 256  # idle replay draws from this many newest trained records
# `trainer.micro_batch_tokens` null on a CPU: no slower there than one pass, and a step's memory no longer follows the
# traffic's prompt lengths (measured: docs/design.md "Memory of a long-serving process")
CPU_MICRO_BATCH_TOKENS = 256


@dataclass
class RoundStats:
    """One round: how many records were new, held out (never trained on) or dropped as stale, how many replayed
    ones joined them, the optimizer steps taken and their mean losses (`losses`: loss, kl, reward,
    reward_weight, feature, tokens and seconds per step; empty when no step ran). `budget_deferred`: new records
    beyond the step budget (they join the replay buffer untrained)."""

    steps: int
    seconds: float
    losses: dict[str, float] = field(default_factory=dict)
    new: int = 0
    heldout: int = 0
    dropped_stale: int = 0
    replayed: int = 0
    target_version: int = 0
    budget_deferred: int = 0
    trained_ids: list[str] = field(default_factory=list)
    heldout_ids: list[str] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)
    # read but trained by no adapter, ever (trainer.adapter_key: no group, past the cap, a gathering group evicted)
    untrained_ids: list[str] = field(default_factory=list)

    @property
    def loss(self) -> float:
        """The mean loss of the round's steps (nan without a step)."""
        return self.losses.get("loss", math.nan)


def _mean(losses: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per-key mean of the step results (keys of the first)."""
    return {k: sum(x[k] for x in losses) / len(losses) for k in losses[0]}


class OnlineTrainer:
    """Trains a drafter on feedback records with the DVI objective; publishes shadow-checked versions.

    `drafter`: a HF causal LM (wrapped in a LoRA when `cfg.trainer.mode == "lora"`, trained
    whole when "full"), a peft model (its adapter is trained), or a `dvi.drafters.learned.EarlyExitDrafter`
    (its LoRA + exit head). The module is trained in place, so an engine in the same process that
    holds it sees every update (`trainers.rl` style); `model` is what to hand to an engine.
    Without a `registry`, `maybe_publish` only evaluates.
    """

    def __init__(
        self,
        cfg: DviConfig,
        drafter: nn.Module | Drafter,
        *,
        registry: DrafterRegistry | None = None,
        metrics: M.MetricsLogger | None = None,
        accelerator: Any = None,
        run_dir: str | os.PathLike | None = None,
        pad_id: int = 0,
        adapter: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.tc = cfg.trainer
        self.accelerator = accelerator = accelerator if accelerator is not None else make_accelerator(cfg)
        self.registry = registry
        self.metrics = metrics
        self.rundir = RunDir(run_dir if run_dir is not None else cfg.run_dir)
        self.pad_id = pad_id
        self.trainable = make_trainable(drafter, self.tc.mode, cfg, adapter)
        params = self.trainable.parameters()
        if not params:
            raise ValueError("the drafter has no trainable parameters")
        eagle = self.trainable.kind == "eagle"
        self.lr = self.tc.eagle_learning_rate if eagle else self.tc.learning_rate
        self.warmup = self.tc.eagle_warmup_steps if eagle else self.tc.warmup_steps
        opt = torch.optim.AdamW(params, lr=self.lr, betas=(0.9, 0.99), weight_decay=0.0)
        # trust region: an L2 pull towards the weights the trainer started from (the served version)
        self.anchor = [p.detach().clone() for p in params] if self.tc.anchor_weight > 0 else None
        self.module, self.optimizer = accelerator.prepare(self.trainable.module, opt)
        self.device = accelerator.device
        self.rng = random.Random(self.tc.seed)
        self.replay: collections.deque[FeedbackRecord] = collections.deque(maxlen=max(1, self.tc.replay_buffer_records))
        self.heldout = HeldOutSet(self.tc.shadow_records, self.tc.heldout_fraction)  # never trained on
        self.step = 0
        self.records_seen = 0  # records trained on as new
        self.replayed = 0
        self.heldout_seen = 0
        self.dropped_stale = 0
        self.train_seconds = 0.0
        self.tokens_trained = 0
        self.records_read = 0  # every record read as new: trained, deferred, held out or dropped
        self.feedback_tokens = 0  # their generated tokens (the budget's unit)
        self.budget_deferred = 0  # records read whose step the budget withheld (kept for replay)
        self.max_target_version = 0
        self.last_losses: dict[str, float] = {}
        self.publisher = Publisher(self.trainable, self.module, accelerator, self.heldout, registry, gates(cfg).publish,
                                   self.tc.publish_every_steps, self._log)

    # -- construction from a config ------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: DviConfig, accelerator: Any = None, **kw: Any) -> OnlineTrainer:
        """Load the drafter the config names (and the target for early-exit), registry and metrics."""
        drafter, pad_id = load_drafter_for_training(cfg, accelerator)
        registry = DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last)
        return cls(cfg, drafter, registry=registry, accelerator=accelerator, pad_id=pad_id, **kw)

    @property
    def model(self) -> nn.Module:
        """The trained module (peft model, HF model, or the early-exit drafter's shallow model)."""
        return self.trainable.module

    @property
    def draft_vocab_size(self) -> int | None:
        """N of a reduced draft vocabulary (None = full); recorded in every published manifest."""
        head = find_subset_head(self.trainable.module)
        return None if head is None else head.num_ids

    @property
    def is_main(self) -> bool:
        return bool(self.accelerator.is_main_process)

    # -- publishing: trainers.online.publishing ----------------------------------------------------
    def maybe_publish(self, force: bool = False) -> PublishDecision | None:
        """The publish gate every `publish_every_steps` steps (`Publisher.maybe_publish`); None when not due."""
        return self.publisher.maybe_publish(self.step, self._manifest_facts, self.is_main, force)

    def _manifest_facts(self) -> dict[str, Any]:
        return {"target_version": self.current_target_version(), "steps": self.step, "records_seen": self.records_seen,
                "drafter_kind": self.trainable.kind, "trainer_mode": self.tc.mode,
                "draft_vocab_size": self.draft_vocab_size}

    # -- target versions -------------------------------------------------------------------------
    def current_target_version(self) -> int:
        file_v = self.rundir.read_target_version()
        return max(self.max_target_version, file_v if file_v is not None else 0)

    def _weight(self, e: FeedbackRecord, current: int) -> float:
        if e.target_version >= current or self.tc.stale_target_policy == "keep":
            return 1.0
        if self.tc.stale_target_policy == "drop":
            return 0.0
        return float(self.tc.stale_weight)

    # -- the compute budget ----------------------------------------------------------------------
    def steps_allowed(self) -> int | None:
        """Steps the budget allows so far (`trainer.feedback_tokens_per_step`): one per N feedback tokens
        read; None when unlimited."""
        n = self.tc.feedback_tokens_per_step
        return None if not n else self.feedback_tokens // n

    def budget_left(self) -> bool:
        allowed = self.steps_allowed()
        return allowed is None or self.step < allowed

    def may_replay_idle(self) -> bool:
        """An idle replay step may run: records to replay, budget left, and fewer replays than
        `trainer.idle_replay_epochs` per record trained (0: no such bound)."""
        cap = self.tc.idle_replay_epochs
        return bool(self.replay) and self.budget_left() and (not cap or self.replayed < cap * self.records_seen)

    # -- training ----------------------------------------------------------------------------------
    def train_on_records(self, records: Iterable[FeedbackRecord]) -> RoundStats:
        """Train on new records (each once), with replay; returns what happened.

        Held-out records (by request-id hash) are kept for evaluation and never trained on.
        New records go newest first, `round(batch_size * (1 - replay_ratio))` per batch, and each
        batch gets replayed records (sampled group by group from the buffer of records trained on before,
        `_sample_replay`) so that they are a `replay_ratio` share of it. Afterwards the new records join the buffer.
        """
        t0 = time.perf_counter()
        examples = [r.compact() for r in records]
        for e in examples:
            self.max_target_version = max(self.max_target_version, e.target_version)
            self.feedback_tokens += len(e.token_ids)
        self.records_read += len(examples)
        deferred0 = self.budget_deferred
        current = self.current_target_version()
        new, held, dropped = self._split(examples, current)
        self.heldout_seen += len(held)
        self.dropped_stale += len(dropped)
        new.sort(key=lambda e: e.finished_at, reverse=True)  # recent first
        losses, replayed = self._train_new(new, current)
        self.replay.extend(reversed(new))  # oldest first, so the deque drops the oldest
        self.replayed += replayed
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        stats = RoundStats(
            steps=len(losses), seconds=dt, losses=_mean(losses) if losses else {}, new=len(new), heldout=len(held),
            dropped_stale=len(dropped), replayed=replayed, target_version=current,
            budget_deferred=self.budget_deferred - deferred0, trained_ids=[e.request_id for e in new],
            heldout_ids=[e.request_id for e in held], dropped_ids=[e.request_id for e in dropped])
        if losses:
            mean = self.last_losses = stats.losses
            self._log({M.TRAINER_LOSS: mean["loss"], M.TRAINER_KL_LOSS: mean["kl"],
                       M.TRAINER_REWARD_LOSS: mean["reward"], M.TRAINER_REWARD_WEIGHT: mean["reward_weight"],
                       M.TRAINER_STEP: self.step, M.TRAINER_RECORDS_SEEN: self.records_seen,
                       "train_seconds": self.train_seconds, "tokens_per_s": mean["tokens"] / max(1e-9, mean["seconds"])})
        return stats

    def _split(self, examples: list[FeedbackRecord], current: int) -> tuple[list[FeedbackRecord], list[FeedbackRecord], list[FeedbackRecord]]:
        """(new, held out, dropped as stale), each in the order given; the held-out ones join `self.heldout`."""
        new, held, dropped = [], [], []
        for e in examples:
            if self.heldout.offer(e):
                held.append(e)
            elif self._weight(e, current) <= 0:
                dropped.append(e)
            else:
                new.append(e)
        return new, held, dropped

    def _train_new(self, new: list[FeedbackRecord], current: int) -> tuple[list[dict[str, float]], int]:
        """One step per chunk of `new` records, topped up with replayed ones; (step losses, replayed).

        Chunks beyond the step budget (`budget_left`) take no step: they are counted as deferred and,
        like every new record, join the replay buffer afterwards.
        """
        bs = self.tc.batch_size
        n_new = max(1, round(bs * (1.0 - self.tc.replay_ratio))) if self.replay else bs
        losses: list[dict[str, float]] = []
        replayed = 0
        for i in range(0, len(new), n_new):  # max_steps is checked between calls, never mid-records
            chunk = new[i: i + n_new]
            if not self.budget_left():
                self.budget_deferred += len(chunk)
                continue
            extra = []
            if self.replay and self.tc.replay_ratio > 0:
                r = self.tc.replay_ratio
                m = bs - len(chunk) if r >= 1 else min(bs - len(chunk), round(len(chunk) * r / (1 - r)))
                extra = self._sample_replay(max(0, m))
            out = self._train_step(chunk + extra, current)
            if out is not None:
                losses.append(out)
            replayed += len(extra)
            self.records_seen += len(chunk)
        return losses, replayed

    def _sample_replay(self, n: int, recent: int | None = None) -> list[FeedbackRecord]:
        """`n` records of the buffer's newest `recent`, group by group (`group_of`: what a gate judges apart):
        each group an equal share, so a domain whose traffic stopped keeps its share of every batch while the
        buffer still holds it, instead of fading as new traffic fills the buffer (a shared drafter that forgets a
        group is refused by the gate for that group)."""
        pool = len(self.replay) if recent is None else min(recent, len(self.replay))
        if not pool or n <= 0:
            return []
        by_group: dict[str, list[FeedbackRecord]] = collections.defaultdict(list)
        for i in range(len(self.replay) - pool, len(self.replay)):
            by_group[group_of(self.replay[i])].append(self.replay[i])
        groups = [by_group[g] for g in sorted(by_group)]
        out = []
        for _ in range(n):
            group = groups[self.rng.randrange(len(groups))]
            out.append(group[self.rng.randrange(len(group))])
        return out

    def train_on_replay(self, steps: int = 1, recent: int = REPLAY_RECENT) -> RoundStats:
        """Replay-only steps on the `recent` newest trained records (an idle trainer's spare time).

        Counted as replay, never as new records; no cursor or checkpoint is involved.
        """
        t0 = time.perf_counter()
        current = self.current_target_version()
        losses = []
        for _ in range(steps):
            if not self.budget_left():
                break
            batch = self._sample_replay(self.tc.batch_size, recent)
            if not batch:
                break
            out = self._train_step(batch, current)
            if out is not None:
                losses.append(out)
            self.replayed += len(batch)
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        stats = RoundStats(steps=len(losses), seconds=dt, losses=_mean(losses) if losses else {})
        if losses:
            self.last_losses = stats.losses
            self._log({M.TRAINER_LOSS: stats.losses["loss"], M.TRAINER_KL_LOSS: stats.losses["kl"], M.TRAINER_STEP: self.step,
                       "replay_only": True, "train_seconds": self.train_seconds})
        return stats

    @property
    def micro_batch_tokens(self) -> int:
        """`trainer.micro_batch_tokens`, null resolved for this device."""
        if self.tc.micro_batch_tokens is not None:
            return self.tc.micro_batch_tokens
        return CPU_MICRO_BATCH_TOKENS if torch.device(self.device).type == "cpu" else 0

    def _train_step(self, examples: list[FeedbackRecord], current: int) -> dict[str, float] | None:
        acc = self.accelerator
        # Each rank trains its slice (DDP averages the gradients); padding repeats the last row so that no
        # rank is left without one (a rank without a backward would hang the others' all-reduce).
        with acc.split_between_processes(examples, apply_padding=True) as mine:
            examples = list(mine)
        weights = [self._weight(e, current) for e in examples]
        parts = micro_batches(examples, weights, self.pad_id, self.tc.max_seq_len, self.micro_batch_tokens)
        if not parts:
            return None
        t0 = time.perf_counter()
        # several passes: each part's loss is divided by the whole step's totals, so the gradients they accumulate
        # are the one-pass step's (`trainers.losses.StepTotals`)
        head = find_subset_head(self.module)
        totals = step_totals(parts, LossWeights.of(self.tc), head.index if head is not None else None) \
            if len(parts) > 1 else None
        self.trainable.activate()
        self.module.train()
        for group in self.optimizer.param_groups:  # linear warm-up (trainer.warmup_steps; eagle_warmup_steps)
            group["lr"] = self.lr * min(1.0, (self.step + 1) / max(1, self.warmup))
        total, kl, reward, feature, reward_weight, tokens = 0.0, 0.0, 0.0, 0.0, 0.0, 0
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            part = part.to(self.device)
            # DDP all-reduces once, at the step's last backward
            with contextlib.nullcontext() if last else acc.no_sync(self.module):
                loss, out, feat_loss, fwd = batch_loss(self.module, part, part.model_inputs(), self.tc, self.step,
                                                       totals)
                if part.features is not None and self.tc.eagle_chained:  # drafts 2..K read the head's own features
                    loss = loss + batch_loss(self.module, part, {"features": chained_features(part, fwd)}, self.tc,
                                             self.step, totals)[0]
                if last and self.anchor is not None:
                    loss = loss + self.tc.anchor_weight * sum(((p - a) ** 2).sum() for p, a in
                                                               zip(self.trainable.parameters(), self.anchor,
                                                                   strict=True))
                acc.backward(loss)
            del fwd
            total += float(loss.detach())
            kl, reward, reward_weight = kl + float(out.kl), reward + float(out.reward), float(out.reward_weight)
            feature += float(feat_loss.detach()) if feat_loss is not None else 0.0
            tokens += part.tokens
        if self.tc.grad_clip:
            acc.clip_grad_norm_(self.trainable.parameters(), self.tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.eval()
        self.step += 1
        self.tokens_trained += tokens
        return {"loss": total, "kl": kl, "reward": reward, "feature": feature, "reward_weight": reward_weight,
                "tokens": float(tokens),
                "seconds": time.perf_counter() - t0}

    def reset_anchor(self) -> None:
        """Re-centre the trust region (`trainer.anchor_weight`) on the current weights (after a resume)."""
        if self.anchor is not None:
            self.anchor = [p.detach().clone() for p in self.trainable.parameters()]

    def _log(self, values: Mapping[str, Any], drafter_version: int | None = None) -> None:
        if self.metrics is None or not self.is_main:
            return
        try:
            self.metrics.log(dict(values), step=self.step, drafter_version=drafter_version)
        except Exception:  # noqa: BLE001 - metrics never stop training
            log.exception("trainer metrics row dropped")

    def status(self) -> dict[str, Any]:
        """Gauges for the server's /metrics (also `RunDir.write_trainer_status`'s content)."""
        return {
            M.TRAINER_STEP: self.step,
            M.TRAINER_RECORDS_SEEN: self.records_seen,
            M.TRAINER_HELDOUT_ALPHA: self.publisher.heldout_alpha,
            M.TRAINER_LOSS: self.last_losses.get("loss"),
            M.TRAINER_KL_LOSS: self.last_losses.get("kl"),
            M.TRAINER_REWARD_LOSS: self.last_losses.get("reward"),
            M.TRAINER_REWARD_WEIGHT: self.last_losses.get("reward_weight"),
            "last_published": self.publisher.published,
            "target_version": self.current_target_version(),
            "replayed": self.replayed,
            "heldout_seen": self.heldout_seen,
            "dropped_stale": self.dropped_stale,
            "train_seconds": self.train_seconds,
            "tokens_trained": self.tokens_trained,
            "records_read": self.records_read,
            "feedback_tokens": self.feedback_tokens,
            "feedback_tokens_per_step": self.tc.feedback_tokens_per_step,
            "steps_allowed": self.steps_allowed(),
            "budget_deferred": self.budget_deferred,
            "time": time.time(),
        }

    def reset_progress(self) -> None:
        """Counters, weights and the publisher as a fresh process has them (the loop's rewind; the optimizer's
        moments are the caller's to clear)."""
        self.trainable.load_state(self.publisher.base_state)
        for k in COUNTERS:
            setattr(self, k, 0)
        self.train_seconds = 0.0
        self.publisher.reset()
        self.heldout.clear()
        self.replay.clear()

    # -- checkpoints (process mode): trainers.online.checkpoint ------------------------------------
    def save_checkpoint(self, path: Path, extra: Mapping[str, Any], write_more: Any = None) -> None:
        counters = {k: getattr(self, k) for k in COUNTERS}
        save_checkpoint(path, self.trainable, self.optimizer, {
            **counters, "train_seconds": self.train_seconds, "last_published": self.publisher.published,
            "last_publish_step": self.publisher.last_step, **dict(extra)},
            write_more)

    def load_checkpoint(self, path: Path) -> dict[str, Any] | None:
        """Weights, moments and counters from `save_checkpoint`; the state dict (with the loop's extra) or None."""
        state = load_checkpoint(path, self.trainable, self.optimizer)
        if state is None:
            return None
        for k in COUNTERS:
            setattr(self, k, int(state.get(k, 0) or 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.publisher.last_step = int(state.get("last_publish_step", 0) or 0)
        self.publisher.adopt(state.get("last_published"))
        return state

