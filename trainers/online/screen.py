"""`RecordScreen`: which feedback records this drafter can train on, decided before any of them is trained.

Issue 36 §5: one record whose prompt ids lay outside the vocabulary passed the record's own validation,
failed the forward, crashed the trainer, and the restarted trainer read the same shard again: a crash
loop the cursor could not pass. A record checks its own shape (`FeedbackRecord.validate`); only the
model knows its vocabulary and feature width, and only collation knows what it can batch. So every
record read for training (or for the held-out and replay buffers) is checked here first, the same way
on every rank: its ids against the drafter's vocabulary (`FeedbackRecord.check_ids`), an eagle record's
feature width against the head's, and a collation of it alone. What fails is quarantined, the record
and not its shard: written to `<run_dir>/trainer/quarantined_records.jsonl` with the reason (rotated
like the other logs), counted (`dvi_trainer_feedback_records_quarantined`) and logged; the rest of its
shard trains. `probe` finds the record behind a forward that failed anyway (the loop's last resort).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dvi.feedback import FeedbackRecord
from dvi.rundir import RunDir
from trainers.losses import batch_loss
from trainers.online.collate import build_batch

log = logging.getLogger("dvi.trainer")

Keyed = tuple[str, FeedbackRecord]  # (shard name, record): a record is quarantined under the shard it came from


def drafter_vocab_size(trainable: Any) -> int | None:
    """Token ids the drafter can embed and score (None when it cannot tell)."""
    drafter = getattr(trainable, "drafter", None)  # early-exit and eagle: the shared-target drafter
    if drafter is not None and getattr(drafter, "vocab_size", 0):
        return int(drafter.vocab_size)
    try:
        emb = trainable.module.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return int(emb.num_embeddings if hasattr(emb, "num_embeddings") else emb.weight.shape[0])


def _feature_width(trainable: Any) -> int | None:
    """The hidden size an eagle head reads (None for other kinds)."""
    if getattr(trainable, "kind", None) != "eagle":
        return None
    cfg = getattr(getattr(trainable, "drafter", None), "config", None)
    return int(cfg.hidden_size) if cfg is not None and hasattr(cfg, "hidden_size") else None


class RecordScreen:
    """Splits records into trainable ones and quarantined ones (with a reason)."""

    def __init__(self, vocab_size: int | None, pad_id: int, max_seq_len: int, feature_width: int | None = None,
                 rundir: RunDir | None = None, is_main: bool = True) -> None:
        self.vocab_size, self.pad_id, self.max_seq_len = vocab_size, pad_id, max_seq_len
        self.feature_width = feature_width
        self.rundir, self.is_main = rundir, is_main
        self.quarantined = 0  # records, by this process and the checkpoint it resumed (the loop restores it)
        self.refused: dict[tuple[str, str], str] = {}  # (shard, request id) -> why its forward failed: refused

    @classmethod
    def of(cls, trainer: Any, rundir: RunDir) -> RecordScreen:
        """The screen for an `OnlineTrainer`'s drafter, quarantining into `rundir`."""
        return cls(drafter_vocab_size(trainer.trainable), trainer.pad_id, trainer.tc.max_seq_len,
                   _feature_width(trainer.trainable), rundir, trainer.is_main)

    def reason(self, shard: str, record: FeedbackRecord) -> str | None:
        """Why this drafter cannot train on a compact `record` (None: it can)."""
        if (shard, record.request_id) in self.refused:
            return self.refused[(shard, record.request_id)]
        try:
            if self.vocab_size is not None:
                record.check_ids(self.vocab_size)
            if record.hidden and self.feature_width is not None and record.hidden_dim != self.feature_width:
                raise ValueError(f"hidden_dim {record.hidden_dim} != the eagle head's {self.feature_width}")
            build_batch([record], [1.0], self.pad_id, self.max_seq_len)
        except Exception as exc:  # noqa: BLE001 - whatever collation raises is this record's fault
            return f"{type(exc).__name__}: {exc}"
        return None

    def split(self, keyed: Iterable[Keyed]) -> tuple[list[Keyed], list[tuple[Keyed, str]]]:
        """(trainable records, compacted once for all that follows; [(record, reason)] that are not), in order."""
        good, bad = [], []
        for shard, rec in keyed:
            try:
                rec = rec.compact()
            except Exception as exc:  # noqa: BLE001 - a record that cannot even be compacted is unusable
                bad.append(((shard, rec), f"{type(exc).__name__}: {exc}"))
                continue
            why = self.reason(shard, rec)
            if why is None:
                good.append((shard, rec))
            else:
                bad.append(((shard, rec), why))
        return good, bad

    def quarantine(self, bad: Sequence[tuple[Keyed, str]]) -> list[str]:
        """Log, count and keep the records (main process); returns their request ids."""
        for (shard, rec), why in bad:
            self.quarantined += 1
            if not self.is_main:
                continue
            log.error("trainer: feedback record %s of %s cannot be trained on (%s); quarantined, the rest of its "
                      "shard trains", rec.request_id, shard, why)
            if self.rundir is not None:
                try:
                    self.rundir.append_quarantined_record(_entry(shard, rec, why))
                except OSError:
                    log.exception("cannot keep the quarantined record %s", rec.request_id)
        return [rec.request_id for (_, rec), _ in bad]

    def probe(self, module: torch.nn.Module, keyed: Sequence[Keyed], tc: Any, step: int,
              device: torch.device) -> list[tuple[Keyed, str]]:
        """The records whose own forward fails (no gradient, no step): what broke a round's forward."""
        bad = []
        was = module.training
        module.eval()
        try:
            for item in keyed:
                try:
                    batch = build_batch([item[1]], [1.0], self.pad_id, self.max_seq_len)
                    if batch is not None:
                        with torch.no_grad():
                            batch = batch.to(device)
                            batch_loss(module, batch, batch.model_inputs(), tc, step)
                except Exception as exc:  # noqa: BLE001 - the failure is what we look for
                    bad.append((item, f"forward: {type(exc).__name__}: {exc}"))
        finally:
            module.train(was)
        return bad


def _entry(shard: str, rec: FeedbackRecord, why: str) -> dict[str, Any]:
    """A quarantined record as one JSON line: every field (the eagle features by size only) and the reason."""
    fields = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in rec.__dict__.items() if k != "hidden"}
    return {"time": time.time(), "shard": shard, "request_id": rec.request_id, "reason": why,
            "hidden_bytes": len(rec.hidden), "record": fields}
