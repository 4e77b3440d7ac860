"""What the offline builds (`trainers.builds.bootstrap`, `trainers.builds.pretrained_build`, `trainers.builds.eagle_build`) share
besides training: the training schedule a preset's token budget buys, per-stage wall times for the manifest and
the batches held-out agreement is scored on."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator

import torch

from dvi.models.embedded import PretrainedPreset
from trainers.builds.offline import TrainSchedule

__all__ = ["schedule", "timed", "scoring_batches", "log", "jsonable"]


def schedule(p: PretrainedPreset, tokens: int, desc: str, progress: bool, lr: float | None = None) -> TrainSchedule:
    """The optimizer steps and LR schedule that spend `tokens` token-passes in `p.distill_batch` windows."""
    return TrainSchedule(steps=max(1, tokens // (p.distill_batch * p.seq_len)), lr=lr or p.distill_lr,
                         warmup=p.distill_warmup, min_lr_ratio=p.min_lr_ratio, grad_clip=1.0, progress=progress,
                         desc=desc)


def scoring_batches(windows: list[list[int]], skip: list[int] | None = None,
                    batch: int = 8) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Held-out windows for agreement scoring, `batch` at a time: ids [B, T] right-padded (causal attention never
    looks at the padding), real [B, T] (the tokens, as an attention mask) and valid [B, T] (the positions scored:
    after `skip[i]`, before each row's last)."""
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        width = max(map(len, chunk))
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        real = torch.zeros((len(chunk), width), dtype=torch.long)
        valid = torch.zeros((len(chunk), width), dtype=torch.bool)
        for r, w in enumerate(chunk):
            ids[r, : len(w)] = torch.tensor(w)
            real[r, : len(w)] = 1
            valid[r, (skip[i + r] if skip else 0): len(w) - 1] = True
        yield ids, real, valid


@contextlib.contextmanager
def timed(walls: dict[str, float], key: str) -> Iterator[None]:
    """Wall seconds of the block into `walls[key]` (a build's per-stage times, kept in its manifest)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        walls[key] = time.perf_counter() - t0


def log(msg: str, progress: bool) -> None:
    """A build's one-line progress message (stderr, `[bootstrap]`), when `progress`."""
    if progress:
        print(f"[bootstrap] {msg}", file=sys.stderr, flush=True)


def jsonable(x):
    """A manifest made JSON-safe: keys as strings, tuples as lists, non-finite floats as None."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
