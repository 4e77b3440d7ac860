"""The online drafter trainer: tail the feedback log, train the drafter, publish versions.

Two layers, so the same training can run as a process or inside another loop:

* `OnlineTrainer` (in-process core): `train_on_records(records)` turns feedback records into
  batches (new records recent-first, a `replay_ratio` share of each batch replayed from older
  ones, stale target versions dropped or down-weighted), takes `trainers.losses.dvi_loss` steps
  (pure top-k KL first, the accept/reject reward ramped in), and holds back `heldout_fraction`
  of the records (by a hash of the request id) for evaluation. `maybe_publish()` compares the
  held-out shadow α (`dvi.shadow`) of the current weights with the registry's LATEST (the
  parent) and publishes only if it is not worse by `shadow_margin`. The drift benchmark and
  `trainers.rl` can drive it directly.
* `run_trainer(cfg)` (the `dvi train --online` process): a thin loop around it that tails the
  shards with a `FeedbackReader` cursor, honours `<run_dir>/trainer.pause` and SIGTERM, and
  checkpoints so that a killed trainer resumes without training a record twice or skipping one.

Exactly-once (process mode). Rounds train untrained shards; every `trainer.checkpoint_seconds`
(and when idle, paused or stopping) the trainer flushes: it writes `<run_dir>/trainer/checkpoint/`
atomically (weights, optimizer, counters, the names of trained-but-uncommitted shards, and the
consumed record ids of the rounds since the last flush), then appends those rounds to
`<run_dir>/trainer/consumed.jsonl`, then commits the reader's cursor up to the longest prefix of
trained shards. A kill loses only the rounds since the last flush, whose weight updates die with
them, so their shards are trained again; shards in the checkpoint are never retrained, and a round
the checkpoint holds but the log lacks is logged on restart. Replay (older records re-used in
batches) is separate and explicit, counted as `replayed`, never as new.

Recent-first: when shards pile up, the newest are trained first (the traffic that matters now);
older ones are trained when the trainer catches up. Their cursor commit waits for them.

Current target version: the larger of the newest `target_version` seen in the log and the
integer in `<run_dir>/target_version` (written by whoever updates the target, e.g. the server's
admin API or an RL loop), so a target update is honoured even before its first feedback lands.

The trainer's gauges also go to `<run_dir>/trainer/status.json` (atomically replaced) for the
server's /metrics; losses and α go to `<run_dir>/trainer/metrics.jsonl` and wandb.

CPU: the process uses `trainer.num_threads` torch threads and lowers its priority by `trainer.nice`,
so on a shared machine the server's engine thread wins any contended core.

Accelerate: one process on CPU; under `accelerate launch`, rank 0 picks the shards and the
stop/pause decisions and broadcasts them, every rank trains on its slice of each batch (DDP
averages gradients), and only rank 0 checkpoints, commits and publishes.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import random
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dvi import metrics as M
from dvi.config import DviConfig, dump_config
from dvi.feedback import FeedbackReader, FeedbackRecord
from dvi.fsutil import atomic_write_json
from dvi.registry import AdapterRejected, DrafterRegistry
from dvi.shadow import hf_logits_fn, shadow_alpha, shadow_passes
from dvi.vocab import find_subset_head, subset_mode
from trainers.losses import dvi_loss

log = logging.getLogger("dvi.trainer")

PAUSE_FILE = "trainer.pause"
TARGET_VERSION_FILE = "target_version"
TRAINER_DIR = "trainer"
CHECKPOINT_DIR = "checkpoint"
CONSUMED_LOG = "consumed.jsonl"
STATUS_FILE = "status.json"
SHADOW_MAX_POSITIONS = 8192
STALE_SHARD_S = 10.0  # train a pending shard below min_new_records once it is this old (x poll_seconds)
REPLAY_RECENT = 256  # idle replay draws from this many newest trained records


# ---------------------------------------------------------------------------------------------
# examples and batches


@dataclass
class Example:
    """One feedback record in compact numpy form (the replay buffer holds thousands).

    Field names match `FeedbackRecord`, so `dvi.shadow.shadow_alpha` reads it directly.
    """

    request_id: str
    domain: str
    target_version: int
    drafter_version: int
    finished_at: float
    temperature: float
    prompt_ids: np.ndarray
    token_ids: np.ndarray
    drafted_ids: np.ndarray
    accepted: np.ndarray
    topk_ids: np.ndarray  # [n, k]
    topk_logprobs: np.ndarray  # [n, k]

    @classmethod
    def of(cls, rec: FeedbackRecord | Mapping[str, Any] | Example) -> Example:
        """From a FeedbackRecord, a parquet row dict or an Example.

        Records logged without top-k (feedback_top_k=0) train on the target's own token as a
        one-hot target distribution (cross-entropy), the best the log allows.
        """
        if isinstance(rec, Example):
            return rec

        def g(name: str) -> Any:
            return rec[name] if isinstance(rec, Mapping) else getattr(rec, name)

        tokens = np.asarray(g("token_ids"), dtype=np.int64)
        tk, tl = g("topk_ids"), g("topk_logprobs")
        if len(tk) == len(tokens) and len(tokens):
            k = max(len(r) for r in tk)
            ids = np.full((len(tokens), k), -1, dtype=np.int64)
            lps = np.full((len(tokens), k), -np.inf, dtype=np.float32)
            for j, (a, b) in enumerate(zip(tk, tl, strict=True)):
                ids[j, : len(a)] = a
                lps[j, : len(b)] = b
        else:
            ids = tokens.reshape(-1, 1).copy()
            lps = np.zeros((len(tokens), 1), dtype=np.float32)
        return cls(
            request_id=str(g("request_id")),
            domain=str(g("domain")),
            target_version=int(g("target_version")),
            drafter_version=int(g("drafter_version")),
            finished_at=float(g("finished_at")),
            temperature=float(g("temperature")),
            prompt_ids=np.asarray(g("prompt_ids"), dtype=np.int64),
            token_ids=tokens,
            drafted_ids=np.asarray(g("drafted_ids"), dtype=np.int64),
            accepted=np.asarray(g("accepted"), dtype=bool),
            topk_ids=ids,
            topk_logprobs=lps,
        )


def is_heldout(request_id: str, fraction: float) -> bool:
    """Deterministic held-out split by request id (same answer on every rank and restart)."""
    if fraction <= 0:
        return False
    h = hashlib.sha256(("heldout/" + request_id).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


@dataclass
class Batch:
    """Left-padded inputs; the last `T` positions of each row predict its generated tokens."""

    input_ids: torch.Tensor  # [B, W]
    attention_mask: torch.Tensor  # [B, W]
    position_ids: torch.Tensor  # [B, W]
    weights: torch.Tensor  # [B, T] per-position loss weights (0 = padding)
    topk_ids: torch.Tensor  # [B, T, k]
    topk_logprobs: torch.Tensor  # [B, T, k]
    drafted_ids: torch.Tensor  # [B, T]
    accepted: torch.Tensor  # [B, T]
    tokens: int  # generated positions trained on

    @property
    def width(self) -> int:
        return int(self.topk_ids.shape[1])

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()})


def build_batch(
    examples: Sequence[Example], weights: Sequence[float], pad_id: int = 0, max_seq_len: int = 512
) -> Batch | None:
    """Teacher-forced batch over prompt + generated tokens.

    Left padding (with explicit position ids) puts every row's generated positions at the end,
    so the model computes logits only there (`logits_to_keep`): the vocabulary projection is
    most of a small drafter's cost. Rows longer than `max_seq_len` lose their oldest tokens.
    """
    rows = [(e, float(w)) for e, w in zip(examples, weights, strict=True) if len(e.token_ids) and w > 0]
    if not rows:
        return None
    seqs, keeps = [], []
    for e, _ in rows:
        seq = np.concatenate([e.prompt_ids, e.token_ids[:-1]])
        n = len(e.token_ids)
        n_keep = min(n, max_seq_len)
        seqs.append(seq[-max_seq_len:])
        keeps.append(n_keep)
    b, w_len, t_len = len(rows), max(len(s) for s in seqs), max(keeps)
    k = max(e.topk_ids.shape[1] for e, _ in rows)
    ids = torch.full((b, w_len), pad_id, dtype=torch.long)
    attn = torch.zeros((b, w_len), dtype=torch.long)
    weights_t = torch.zeros((b, t_len))
    tk = torch.full((b, t_len, k), -1, dtype=torch.long)
    tl = torch.full((b, t_len, k), float("-inf"))
    dr = torch.full((b, t_len), -1, dtype=torch.long)
    ac = torch.zeros((b, t_len), dtype=torch.bool)
    for i, ((e, w), seq, nk) in enumerate(zip(rows, seqs, keeps, strict=True)):
        ids[i, w_len - len(seq):] = torch.from_numpy(seq)
        attn[i, w_len - len(seq):] = 1
        n = len(e.token_ids)
        sl = slice(n - nk, n)
        c = slice(t_len - nk, t_len)
        weights_t[i, c] = w
        kk = e.topk_ids.shape[1]
        tk[i, c, :kk] = torch.from_numpy(e.topk_ids[sl])
        tl[i, c, :kk] = torch.from_numpy(e.topk_logprobs[sl].astype(np.float32))
        dr[i, c] = torch.from_numpy(e.drafted_ids[sl])
        ac[i, c] = torch.from_numpy(e.accepted[sl])
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return Batch(ids, attn, pos, weights_t, tk, tl, dr, ac, tokens=int(sum(keeps)))


# ---------------------------------------------------------------------------------------------
# the trainable drafter, three kinds behind one small interface


class _Trainable(ABC):
    """What the trainer needs from a drafter kind: params, forward, snapshot/restore, publish."""

    kind = "base"
    publish_kind = "lora"

    def __init__(self, module: nn.Module) -> None:
        self.module = module  # the nn.Module that is trained (accelerate prepares it)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward_module(self) -> nn.Module:
        return self.module

    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The trained weights, keyed as they are published."""

    @abstractmethod
    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Restore weights from `state()` (checkpoint resume, rollback to a published version)."""

    @abstractmethod
    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        """Write the current weights to the registry; returns the new version."""

    def load_version(self, registry: DrafterRegistry, version: int) -> dict[str, torch.Tensor]:
        """A published version's weights as a `state()`-shaped dict (validated by the registry)."""
        sd, man = registry.validate(version)
        if man.get("drafter_kind", self.kind) != self.kind and not (
            self.kind in ("lora", "full") and man.get("drafter_kind") is None
        ):
            raise AdapterRejected(f"published by a {man.get('drafter_kind')!r} trainer, this is {self.kind!r}", version)
        if man["kind"] != self.publish_kind:
            raise AdapterRejected(f"kind is {man['kind']!r}, this trainer needs {self.publish_kind!r}", version)
        own = self.state()
        missing = [k for k in own if k not in sd and not k.endswith("lm_head.weight")]
        bad = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
        if missing or bad:
            raise AdapterRejected(f"does not fit this drafter (missing {missing[:2]}, shape {bad[:2]})", version)
        return {k: sd[k].to(own[k].dtype) for k in own if k in sd}


def _clone(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


class _LoraTrainable(_Trainable):
    kind = "lora"
    publish_kind = "lora"

    def state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return _clone(get_peft_model_state_dict(self.module))

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        dev = next(self.module.parameters()).device
        res = set_peft_model_state_dict(self.module, {k: v.to(dev) for k, v in sd.items()})
        bad = list(getattr(res, "unexpected_keys", []) or [])
        if bad:
            raise ValueError(f"LoRA state has tensors this adapter lacks: {bad[:3]}")

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        return registry.publish_peft_adapter(self.module, manifest)


class _FullTrainable(_Trainable):
    kind = "full"
    publish_kind = "full"

    def state(self) -> dict[str, torch.Tensor]:
        return _clone(self.module.state_dict())

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        res = self.module.load_state_dict(dict(sd), strict=False)
        missing = [k for k in res.missing_keys if not k.endswith("lm_head.weight")]
        if missing or res.unexpected_keys:
            raise ValueError(f"full state does not fit: missing {missing[:3]}, unexpected {res.unexpected_keys[:3]}")
        if hasattr(self.module, "tie_weights"):
            self.module.tie_weights()

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        return registry.publish_full(self.module.state_dict(), self.module.config, manifest)


class _EarlyExitTrainable(_Trainable):
    """The early-exit drafter's LoRA + exit head (the target's shared weights stay frozen)."""

    kind = "early_exit"
    publish_kind = "lora"

    def __init__(self, drafter: Any) -> None:
        super().__init__(drafter.model)
        self.drafter = drafter

    def parameters(self) -> list[nn.Parameter]:
        return list(self.drafter.trainable_parameters())

    def state(self) -> dict[str, torch.Tensor]:
        return _clone(self.drafter.trainable_state_dict())

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.drafter.load_trainable_state_dict(dict(sd))

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        from safetensors.torch import save

        from dvi.drafters import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        blob = save(self.state(), metadata={"format": "pt"})
        cfg = json.dumps(self.drafter.config_dict(), indent=2)
        return registry.publish({ADAPTER_WEIGHTS: blob, ADAPTER_CONFIG: cfg.encode()}, {**manifest, "kind": "lora"})


def _make_trainable(drafter: Any, mode: str, cfg: DviConfig) -> _Trainable:
    from dvi.drafters import EarlyExitDrafter

    t = cfg.trainer
    if isinstance(drafter, EarlyExitDrafter):
        if mode == "full":
            raise ValueError("trainer.mode 'full' trains a separate drafter; the early-exit drafter trains LoRA + head")
        for p in drafter.target_ref.parameters():
            p.requires_grad_(False)
        for p in drafter.trainable_parameters():
            p.requires_grad_(True)
        return _EarlyExitTrainable(drafter)
    if mode == "full":
        if hasattr(drafter, "peft_config"):
            raise ValueError("trainer.mode 'full' needs a plain HF model, got a peft model")
        for p in drafter.parameters():
            p.requires_grad_(True)
        return _FullTrainable(drafter)
    if not hasattr(drafter, "peft_config"):
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
        targets = [x for x in t.lora_targets if x in names]
        if not targets:
            raise ValueError(f"trainer.lora_targets {t.lora_targets} match no Linear module of the drafter "
                             f"(it has {sorted(names)})")
        lcfg = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                          target_modules=targets, bias="none")
        drafter = get_peft_model(drafter, lcfg)
    return _LoraTrainable(drafter)


# ---------------------------------------------------------------------------------------------
# the in-process core


def read_target_version_file(run_dir: str | os.PathLike) -> int | None:
    """The integer in `<run_dir>/target_version`, or None when absent or unreadable."""
    try:
        return int(Path(run_dir, TARGET_VERSION_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: Path, obj: Any, fsync: bool = True) -> None:
    """Readers see the old or the new content, never half (fsync for durability)."""
    atomic_write_json(path, obj, fsync=fsync)


class OnlineTrainer:
    """Trains a drafter on feedback records with the DVI objective; publishes shadow-checked versions.

    `drafter`: a HF causal LM (wrapped in a LoRA when `cfg.trainer.mode == "lora"`, trained
    whole when "full"), a peft model (its adapter is trained), or a `dvi.drafters.EarlyExitDrafter`
    (its LoRA + exit head). The module is trained in place, so an engine in the same process that
    holds it sees every update (`trainers.rl` style); `model` is what to hand to an engine.
    Without a `registry`, `maybe_publish` only evaluates.
    """

    def __init__(
        self,
        cfg: DviConfig,
        drafter: Any,
        *,
        registry: DrafterRegistry | None = None,
        metrics: M.MetricsLogger | None = None,
        accelerator: Any = None,
        run_dir: str | os.PathLike | None = None,
        pad_id: int = 0,
    ) -> None:
        self.cfg = cfg
        self.tc = cfg.trainer
        if accelerator is None:
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=str(cfg.models.device) == "cpu")
        self.accelerator = accelerator
        self.registry = registry
        self.metrics = metrics
        self.run_dir = Path(run_dir if run_dir is not None else cfg.run_dir)
        self.pad_id = pad_id
        self.trainable = _make_trainable(drafter, self.tc.mode, cfg)
        self.base_state = self.trainable.state()  # version 0: the drafter as loaded (no updates)
        params = self.trainable.parameters()
        if not params:
            raise ValueError("the drafter has no trainable parameters")
        opt = torch.optim.AdamW(params, lr=self.tc.learning_rate, betas=(0.9, 0.99), weight_decay=0.0)
        self.module, self.optimizer = accelerator.prepare(self.trainable.module, opt)
        self.device = accelerator.device
        self.rng = random.Random(self.tc.seed)
        self.replay: collections.deque[Example] = collections.deque(maxlen=max(1, self.tc.replay_buffer_records))
        self.heldout: collections.deque[Example] = collections.deque(maxlen=self.tc.shadow_records)
        self.step = 0
        self.records_seen = 0  # records trained on as new
        self.replayed = 0
        self.heldout_seen = 0
        self.dropped_stale = 0
        self.train_seconds = 0.0
        self.tokens_trained = 0
        self.max_target_version = 0
        self.last_publish_step = 0
        self.last_published: int | None = None
        self.last_published_state: dict[str, torch.Tensor] | None = None
        self.last_heldout_alpha: float | None = None
        self.last_losses: dict[str, float] = {}
        self.publish_log: list[dict[str, Any]] = []

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

    # -- target versions -------------------------------------------------------------------------
    def current_target_version(self) -> int:
        file_v = read_target_version_file(self.run_dir)
        return max(self.max_target_version, file_v if file_v is not None else 0)

    def _weight(self, e: Example, current: int) -> float:
        if e.target_version >= current or self.tc.stale_target_policy == "keep":
            return 1.0
        if self.tc.stale_target_policy == "drop":
            return 0.0
        return float(self.tc.stale_weight)

    # -- training ----------------------------------------------------------------------------------
    def train_on_records(self, records: Iterable[FeedbackRecord | Mapping[str, Any] | Example]) -> dict[str, Any]:
        """Train on new records (each once), with replay; returns what happened.

        Held-out records (by request-id hash) are kept for evaluation and never trained on.
        New records go newest first, `round(batch_size * (1 - replay_ratio))` per batch, and each
        batch gets replayed records (sampled from the buffer of records trained on before) so
        that they are a `replay_ratio` share of it. Afterwards the new records join the buffer.
        """
        t0 = time.perf_counter()
        examples = [Example.of(r) for r in records]
        for e in examples:
            self.max_target_version = max(self.max_target_version, e.target_version)
        current = self.current_target_version()
        new, held, dropped = [], [], 0
        for e in examples:
            if is_heldout(e.request_id, self.tc.heldout_fraction):
                held.append(e)
            elif self._weight(e, current) <= 0:
                dropped += 1
            else:
                new.append(e)
        self.heldout.extend(sorted(held, key=lambda e: e.finished_at))
        self.heldout_seen += len(held)
        self.dropped_stale += dropped
        new.sort(key=lambda e: e.finished_at, reverse=True)  # recent first
        bs = self.tc.batch_size
        n_new = max(1, round(bs * (1.0 - self.tc.replay_ratio))) if self.replay else bs
        losses: list[dict[str, float]] = []
        replayed = 0
        for i in range(0, len(new), n_new):  # max_steps is checked between calls, never mid-records
            chunk = new[i: i + n_new]
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
        self.replay.extend(reversed(new))  # oldest first, so the deque drops the oldest
        self.replayed += replayed
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        stats: dict[str, Any] = {
            "new": len(new), "heldout": len(held), "dropped_stale": dropped, "replayed": replayed,
            "steps": len(losses), "seconds": dt, "target_version": current,
            "trained_ids": [e.request_id for e in new], "heldout_ids": [e.request_id for e in held],
            "dropped_ids": [e.request_id for e in examples
                            if not is_heldout(e.request_id, self.tc.heldout_fraction) and self._weight(e, current) <= 0],
        }
        if losses:
            mean = {k: sum(x[k] for x in losses) / len(losses) for k in losses[0]}
            stats.update(mean)
            self.last_losses = mean
            self._log({M.TRAINER_LOSS: mean["loss"], M.TRAINER_KL_LOSS: mean["kl"],
                       M.TRAINER_REWARD_LOSS: mean["reward"], M.TRAINER_REWARD_WEIGHT: mean["reward_weight"],
                       M.TRAINER_STEP: self.step, M.TRAINER_RECORDS_SEEN: self.records_seen,
                       "train_seconds": self.train_seconds, "tokens_per_s": mean["tokens"] / max(1e-9, mean["seconds"])})
        return stats

    def _sample_replay(self, n: int, recent: int | None = None) -> list[Example]:
        pool = len(self.replay) if recent is None else min(recent, len(self.replay))
        if not pool:
            return []
        lo = len(self.replay) - pool
        return [self.replay[lo + self.rng.randrange(pool)] for _ in range(n)]

    def train_on_replay(self, steps: int = 1, recent: int = REPLAY_RECENT) -> dict[str, Any]:
        """Replay-only steps on the `recent` newest trained records (an idle trainer's spare time).

        Counted as replay, never as new records; no cursor or checkpoint is involved.
        """
        t0 = time.perf_counter()
        current = self.current_target_version()
        losses = []
        for _ in range(steps):
            batch = self._sample_replay(self.tc.batch_size, recent)
            if not batch:
                break
            out = self._train_step(batch, current)
            if out is not None:
                losses.append(out)
            self.replayed += len(batch)
        dt = time.perf_counter() - t0
        self.train_seconds += dt
        stats: dict[str, Any] = {"steps": len(losses), "seconds": dt}
        if losses:
            stats.update({k: sum(x[k] for x in losses) / len(losses) for k in losses[0]})
            self.last_losses = {k: stats[k] for k in losses[0]}
            self._log({M.TRAINER_LOSS: stats["loss"], M.TRAINER_KL_LOSS: stats["kl"], M.TRAINER_STEP: self.step,
                       "replay_only": True, "train_seconds": self.train_seconds})
        return stats

    def _train_step(self, examples: list[Example], current: int) -> dict[str, float] | None:
        acc = self.accelerator
        if acc.num_processes > 1:  # each rank takes its slice; every rank gets at least one row
            while len(examples) < acc.num_processes:
                examples = examples + examples
            examples = examples[acc.process_index:: acc.num_processes]
        weights = [self._weight(e, current) for e in examples]
        batch = build_batch(examples, weights, self.pad_id, self.tc.max_seq_len)
        if batch is None:
            return None
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        self.module.train()
        # A reduced draft vocabulary trains on its [B, T, N] subset logits (never the served -inf padding).
        with subset_mode(self.trainable.module) as head:
            logits = self.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 position_ids=batch.position_ids, use_cache=False,
                                 logits_to_keep=batch.width).logits  # [B, T, V] or [B, T, N]
        out = dvi_loss(logits, batch.topk_ids, batch.topk_logprobs, batch.drafted_ids, batch.accepted,
                       batch.weights, step=self.step, kl_weight=self.tc.kl_weight,
                       reward_start=self.tc.reward_ramp_start, reward_ramp_steps=self.tc.reward_ramp_steps,
                       reward_max_weight=self.tc.reward_weight,
                       subset_index=head.index if head is not None else None)
        w = batch.weights
        # dvi_loss normalises by the weight sum; rescale so down-weighted rows count less in absolute terms
        scale = w.sum() / (w > 0).sum().clamp_min(1)
        loss = out.loss * scale
        acc.backward(loss)
        if self.tc.grad_clip:
            acc.clip_grad_norm_(self.trainable.parameters(), self.tc.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.module.eval()
        self.step += 1
        self.tokens_trained += batch.tokens
        return {"loss": float(loss.detach()), "kl": float(out.kl), "reward": float(out.reward),
                "reward_weight": float(out.reward_weight), "tokens": float(batch.tokens),
                "seconds": time.perf_counter() - t0}

    # -- evaluation and publishing --------------------------------------------------------------
    def _logits_fn(self):
        fn = hf_logits_fn(self.accelerator.unwrap_model(self.module))
        dev = self.device

        def f(ids: torch.Tensor) -> torch.Tensor:
            return fn(ids.to(dev))

        return f

    def shadow(self, records: Sequence[Any] | None = None, state: Mapping[str, torch.Tensor] | None = None):
        """Shadow α (teacher-forced, `dvi.shadow`) of the current weights, or of `state`, on held-out records."""
        recs = list(self.heldout) if records is None else [Example.of(r) for r in records]
        saved = None
        if state is not None:
            saved = self.trainable.state()
            self.trainable.load_state(state)
        was = self.module.training
        self.module.eval()
        try:
            return shadow_alpha(self._logits_fn(), recs, device=self.device, max_positions=SHADOW_MAX_POSITIONS)
        finally:
            if saved is not None:
                self.trainable.load_state(saved)
            self.module.train(was)

    def _parent_state(self, parent: int | None) -> tuple[dict[str, torch.Tensor], int | None]:
        """Weights of the version serving now (LATEST), to compare against; base if unknown."""
        if parent is None:
            return self.base_state, None
        if parent == self.last_published and self.last_published_state is not None:
            return self.last_published_state, parent
        try:
            return self.trainable.load_version(self.registry, parent), parent
        except (AdapterRejected, OSError, ValueError) as exc:
            log.warning("cannot compare against LATEST v%s (%s); comparing against the base drafter", parent, exc)
            return self.base_state, None

    def maybe_publish(self, force: bool = False) -> dict[str, Any] | None:
        """Every `publish_every_steps` steps: shadow-check against LATEST, publish if not worse.

        Returns the decision (published version or refusal reason), or None when not due. Only
        the main process publishes; other ranks return None.
        """
        if not force and self.step - self.last_publish_step < self.tc.publish_every_steps:
            return None
        if self.step == self.last_publish_step and not force:
            return None
        self.last_publish_step = self.step
        if not self.is_main:
            return None
        parent = self.registry.latest() if self.registry is not None else None
        parent_state, parent_cmp = self._parent_state(parent)
        decision: dict[str, Any] = {"step": self.step, "parent_version": parent, "time": time.time()}
        if len(self.heldout) >= 1:
            new = self.shadow()
            old = self.shadow(state=parent_state)
            decision.update(heldout_alpha=new.alpha, parent_heldout_alpha=old.alpha, heldout_records=new.records,
                            heldout_positions=new.positions)
            ok = shadow_passes(new.alpha, old.alpha, self.tc.shadow_margin)
            reason = (f"shadow α {new.alpha:.4f} vs parent {old.alpha:.4f} (v{parent_cmp if parent_cmp is not None else 0})"
                      f" on {new.records} held-out records")
        else:
            ok, reason = True, "no held-out records yet; published unchecked"
            decision.update(heldout_alpha=None, parent_heldout_alpha=None, heldout_records=0, heldout_positions=0)
        decision["reason"] = reason
        if self.registry is None or not ok:
            decision["published"] = None
            if not ok:
                decision["reason"] += f"; worse by more than {self.tc.shadow_margin}, not published"
                log.info("trainer: not publishing at step %d: %s", self.step, decision["reason"])
        else:
            manifest = {
                "parent_version": parent,
                "target_version": self.current_target_version(),
                "steps": self.step,
                "records_seen": self.records_seen,
                "heldout_alpha": decision["heldout_alpha"],
                "parent_heldout_alpha": decision["parent_heldout_alpha"],
                "heldout_records": decision["heldout_records"],
                "created_at": time.time(),
                "drafter_kind": self.trainable.kind,
                "trainer_mode": self.tc.mode,
                "draft_vocab_size": self.draft_vocab_size,
            }
            version = self.trainable.publish(self.registry, manifest)
            self.last_published = version
            self.last_published_state = self.trainable.state()
            decision["published"] = version
            log.info("trainer: published v%d at step %d: %s", version, self.step, reason)
        if decision.get("heldout_alpha") is not None:
            self.last_heldout_alpha = decision["heldout_alpha"]
        self.publish_log.append(decision)
        self._log({M.TRAINER_HELDOUT_ALPHA: decision.get("heldout_alpha"),
                   "parent_heldout_alpha": decision.get("parent_heldout_alpha"),
                   "published": decision["published"] is not None, M.TRAINER_STEP: self.step},
                  drafter_version=decision["published"])
        return decision

    def _log(self, values: Mapping[str, Any], drafter_version: int | None = None) -> None:
        if self.metrics is None or not self.is_main:
            return
        try:
            self.metrics.log(dict(values), step=self.step, drafter_version=drafter_version)
        except Exception:  # noqa: BLE001 - metrics never stop training
            log.exception("trainer metrics row dropped")

    def status(self) -> dict[str, Any]:
        """Gauges for the server's /metrics (also written to `<run_dir>/trainer/status.json`)."""
        return {
            M.TRAINER_STEP: self.step,
            M.TRAINER_RECORDS_SEEN: self.records_seen,
            M.TRAINER_HELDOUT_ALPHA: self.last_heldout_alpha,
            M.TRAINER_LOSS: self.last_losses.get("loss"),
            M.TRAINER_KL_LOSS: self.last_losses.get("kl"),
            M.TRAINER_REWARD_LOSS: self.last_losses.get("reward"),
            M.TRAINER_REWARD_WEIGHT: self.last_losses.get("reward_weight"),
            "last_published": self.last_published,
            "target_version": self.current_target_version(),
            "replayed": self.replayed,
            "heldout_seen": self.heldout_seen,
            "dropped_stale": self.dropped_stale,
            "train_seconds": self.train_seconds,
            "tokens_trained": self.tokens_trained,
            "time": time.time(),
        }

    # -- checkpoints (process mode) ---------------------------------------------------------------
    def save_checkpoint(self, path: Path, extra: Mapping[str, Any]) -> None:
        """Weights + optimizer + counters + `extra`, written to a temp dir and renamed over `path`."""
        from safetensors.torch import save_file

        path = Path(path)
        tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{time.time_ns()}")
        tmp.mkdir(parents=True)
        save_file(self.trainable.state(), str(tmp / "trainable.safetensors"))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        state = {
            "step": self.step, "records_seen": self.records_seen, "replayed": self.replayed,
            "heldout_seen": self.heldout_seen, "dropped_stale": self.dropped_stale,
            "train_seconds": self.train_seconds, "tokens_trained": self.tokens_trained,
            "max_target_version": self.max_target_version, "last_publish_step": self.last_publish_step,
            "last_published": self.last_published, "kind": self.trainable.kind, **dict(extra),
        }
        (tmp / "state.json").write_text(json.dumps(state))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        old = path.with_name(f".old-{path.name}-{os.getpid()}-{time.time_ns()}")
        if path.exists():
            os.rename(path, old)  # the only window without `path`; load_checkpoint falls back to it
        os.rename(tmp, path)
        if old.exists():
            import shutil

            shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self, path: Path) -> dict[str, Any] | None:
        """Restore from `save_checkpoint` output; returns its state dict (None if absent)."""
        from safetensors.torch import load_file

        path = Path(path)
        if not path.exists():
            olds = sorted(path.parent.glob(f".old-{path.name}-*"))
            if not olds:
                return None
            path = olds[-1]
        state = json.loads((path / "state.json").read_text())
        if state.get("kind") != self.trainable.kind:
            raise ValueError(f"checkpoint {path} is for a {state.get('kind')!r} drafter, this is {self.trainable.kind!r}")
        self.trainable.load_state(load_file(str(path / "trainable.safetensors")))
        try:
            self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        except Exception as exc:  # noqa: BLE001 - fresh moments are better than no resume
            log.warning("optimizer state not restored (%s); continuing with fresh moments", exc)
        for k in ("step", "records_seen", "replayed", "heldout_seen", "dropped_stale", "tokens_trained",
                  "max_target_version", "last_publish_step"):
            setattr(self, k, int(state.get(k, 0) or 0))
        self.train_seconds = float(state.get("train_seconds", 0.0))
        self.last_published = state.get("last_published")
        if self.last_published is not None:
            self.last_published_state = self.trainable.state()
        return state


def load_drafter_for_training(cfg: DviConfig, accelerator: Any = None) -> tuple[Any, int]:
    """The drafter to train, as the config describes it: (model or EarlyExitDrafter, pad id)."""
    from dvi.embedded import embedded_paths
    from dvi.models import find_tokenizer_path, load_causal_lm, load_tokenizer

    m = cfg.models
    device = accelerator.device if accelerator is not None else m.device
    # fp32 master weights for training on any device; bf16 autocast is accelerate's business.
    dtype = "float32"
    if m.target is not None:
        target_path, drafter_path = Path(m.target), (Path(m.drafter) if m.drafter else None)
        tok_path = Path(m.tokenizer) if m.tokenizer else find_tokenizer_path(target_path)
    else:
        p = embedded_paths(m.preset)
        target_path, drafter_path = p.target, (Path(m.drafter) if m.drafter else p.drafter)
        tok_path = Path(m.tokenizer) if m.tokenizer else p.tokenizer
    try:
        tok = load_tokenizer(tok_path)
        pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    except Exception:  # noqa: BLE001 - padding is masked anyway; any valid id will do
        pad_id = 0
    if m.drafter_kind == "early_exit":
        from dvi.models import load_early_exit_drafter

        target = load_causal_lm(target_path, device, dtype)
        return load_early_exit_drafter(target, target_path, cfg), pad_id  # the server builds the same one
    if drafter_path is None:
        raise ValueError("models.drafter is not set and there is no embedded drafter: nothing to train")
    from dvi.models import draft_vocab_size_for
    from dvi.vocab import apply_draft_vocab, load_draft_vocab

    drafter = load_causal_lm(drafter_path, device, dtype)
    rows = int(drafter.get_output_embeddings().weight.shape[0])
    ids = load_draft_vocab(m.draft_vocab or drafter_path, draft_vocab_size_for(m), rows)  # as `dvi.models.load_pair`
    return (apply_draft_vocab(drafter, ids) if ids is not None else drafter), pad_id


# ---------------------------------------------------------------------------------------------
# the process


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
        self.run_dir = Path(cfg.run_dir)
        self.dir = self.run_dir / TRAINER_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.dir / CHECKPOINT_DIR
        self.consumed_path = self.dir / CONSUMED_LOG
        self.pause_path = self.run_dir / PAUSE_FILE
        self.reader = FeedbackReader(cfg.feedback.dir, cursor_path=self.dir / "cursor.json")
        self.trained: set[str] = set()  # trained shards whose cursor commit may still be pending
        self.unflushed: list[dict[str, Any]] = []  # rounds trained since the last checkpoint
        self.last_flush = time.monotonic()
        self.seq = 0
        self.stop = _Stop()
        self.rounds = 0

    # -- startup ----------------------------------------------------------------------------------
    def restore(self) -> None:
        """Resume: weights/optimizer from the checkpoint (else LATEST from the registry), then the cursor."""
        t = self.trainer
        state = t.load_checkpoint(self.ckpt)  # every rank (the run dir is shared)
        if state is not None:
            self.trained = set(state.get("trained_uncommitted", []))
            self.seq = int(state.get("seq", 0))
            logged = self._last_logged_seq()
            for entry in state.get("rounds", []):
                if t.is_main and int(entry["seq"]) > logged:
                    self._append_consumed(entry)  # killed between the checkpoint and its log append
            log.info("trainer: resumed from checkpoint at step %d (%d records trained)", t.step, t.records_seen)
        elif t.registry is not None and (latest := t.registry.latest()) is not None:
            try:
                t.trainable.load_state(t.trainable.load_version(t.registry, latest))
                t.last_published, t.last_published_state = latest, t.trainable.state()
                log.info("trainer: no checkpoint; starting from registry LATEST v%d", latest)
            except (AdapterRejected, ValueError, OSError) as exc:
                log.warning("trainer: LATEST v%d does not load into this drafter (%s); starting from the base", latest, exc)
        self._commit_prefix()
        self._warm_buffers()

    def _warm_buffers(self, max_shards: int = 8) -> None:
        """Refill held-out and replay buffers from the newest already-consumed shards (replay only)."""
        t = self.trainer
        pending = set(self.reader.poll())
        done = [s for s in self.reader.list_shards() if s not in pending or s in self.trained][-max_shards:]
        if not done:
            return
        table = self.reader.read(done, validate=True)
        n_held = 0
        for row in table.to_pylist():
            e = Example.of(row)
            t.max_target_version = max(t.max_target_version, e.target_version)
            if is_heldout(e.request_id, t.tc.heldout_fraction):
                t.heldout.append(e)
                n_held += 1
            else:
                t.replay.append(e)
        log.info("trainer: warmed buffers from %d consumed shards (%d held-out, %d replay)", len(done), n_held,
                 len(t.replay))

    # -- bookkeeping --------------------------------------------------------------------------------
    def _last_logged_seq(self) -> int:
        try:
            lines = self.consumed_path.read_text().splitlines()
        except FileNotFoundError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line)["seq"])
            except (ValueError, KeyError):
                continue  # a torn last line from a kill mid-append
        return 0

    def _append_consumed(self, entry: Mapping[str, Any]) -> None:
        with open(self.consumed_path, "a") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _commit_prefix(self) -> None:
        """Commit the cursor up to the longest prefix of pending shards that were all trained."""
        if not self.trainer.is_main:
            return
        pending = self.reader.poll()
        upto = None
        for name in pending:
            if name not in self.trained:
                break
            upto = name
        if upto is not None:
            self.reader.commit(upto)
            self.trained = {s for s in self.trained if s > upto}

    # -- one round ----------------------------------------------------------------------------------
    def _choose(self) -> list[str]:
        """Newest untrained shards holding >= min_new_records records (recent-first)."""
        pending = [s for s in self.reader.poll() if s not in self.trained]
        if not pending:
            return []
        from dvi.feedback import shard_time_ns

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
            age = time.time() - shard_time_ns(pending[0]) / 1e9
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
            t.save_checkpoint(self.ckpt, {"seq": self.seq, "trained_uncommitted": sorted(self.trained),
                                          "rounds": self.unflushed})
            for entry in self.unflushed:
                self._append_consumed(entry)
            self.unflushed = []
            self._commit_prefix()
        else:
            self.unflushed = []

    def run_round(self) -> dict[str, Any] | None:
        """Train one round of shards (flushed every `checkpoint_seconds`). None when there was nothing to do."""
        t = self.trainer
        shards = self._broadcast(self._choose() if t.is_main else None)
        if not shards:
            return None
        table = self.reader.read(shards, validate=True)
        rows = table.to_pylist()
        stats = t.train_on_records(rows)
        self.seq += 1
        self.trained |= set(shards)
        entry = {"seq": self.seq, "shards": shards, "trained": stats["trained_ids"], "heldout": stats["heldout_ids"],
                 "dropped": stats["dropped_ids"], "step": t.step, "time": time.time()}
        self.unflushed.append(entry)
        if time.monotonic() - self.last_flush >= t.tc.checkpoint_seconds:
            self.flush()
        self.rounds += 1
        return stats

    def _write_status(self, state: str) -> None:
        if not self.trainer.is_main:
            return
        try:
            # also the heartbeat the server's supervisor watches (serve.trainer_stale_s)
            write_json_atomic(self.dir / STATUS_FILE, {"state": state, "pid": os.getpid(), "heartbeat": time.time(),
                                                       M.TRAINER_QUARANTINED_SHARDS: self.reader.quarantined_total(),
                                                       **self.trainer.status()},
                              fsync=False)  # a gauge, rewritten every round
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
            stop, paused = self._broadcast((self.stop.requested, self.pause_path.exists()) if t.is_main else None)
            if stop:
                break
            if t.tc.max_steps is not None and t.step >= t.tc.max_steps:
                log.info("trainer: reached max_steps=%d", t.tc.max_steps)
                break
            if paused:
                self.flush()
                self._write_status("paused")
                time.sleep(min(0.5, t.tc.poll_seconds))
                continue
            stats = self.run_round()
            if stats is None:
                self.flush()
                if t.tc.idle_replay_steps and t.replay:
                    t.train_on_replay(t.tc.idle_replay_steps)
                    t.maybe_publish()
                    self._write_status("idle")
                    continue
                self._write_status("idle")
                time.sleep(t.tc.poll_seconds)
                continue
            t.maybe_publish()
            self._write_status("running")
            log.info("trainer: step %d, +%d records (%d held out, %d replayed), loss %.4f", t.step, stats["new"],
                     stats["heldout"], stats["replayed"], stats.get("loss", float("nan")))
        # SIGTERM lands between rounds (the handler only sets a flag): checkpoint and commit what was
        # trained, then publish what was trained since the last publish.
        self.flush()
        if t.step > t.last_publish_step:
            try:
                t.maybe_publish(force=True)
            except Exception:  # noqa: BLE001 - exit cleanly; the checkpoint has the weights
                log.exception("final publish failed")
        self._write_status("stopped")
        return 0


def run_trainer(cfg: DviConfig) -> int:
    """`dvi train --online`: the trainer process. Returns the exit code (0 on SIGTERM)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.trainer.num_threads)
    if cfg.trainer.nice and hasattr(os, "nice"):
        try:
            os.nice(cfg.trainer.nice)  # serving never waits on training: lose every contended core to it
        except OSError:
            log.warning("cannot lower the trainer's CPU priority")
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(cfg.trainer.seed)
    accelerator = Accelerator(cpu=str(cfg.models.device) == "cpu")
    run_dir = Path(cfg.run_dir)
    (run_dir / TRAINER_DIR).mkdir(parents=True, exist_ok=True)
    metrics = None
    if accelerator.is_main_process:
        metrics = M.MetricsLogger(run_dir / TRAINER_DIR, wandb_mode=cfg.wandb.mode, project=cfg.wandb.project,
                                  entity=cfg.wandb.entity, config=dump_config(cfg),
                                  name=f"trainer-{int(time.time())}")
    try:
        trainer = OnlineTrainer.from_config(cfg, accelerator=accelerator, metrics=metrics)
        return TrainerLoop(trainer, cfg).run()
    finally:
        if metrics is not None:
            metrics.close()


__all__ = ["Example", "Batch", "build_batch", "is_heldout", "OnlineTrainer", "TrainerLoop", "run_trainer",
           "load_drafter_for_training", "read_target_version_file"]
