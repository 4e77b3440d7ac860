"""The online trainer's checkpoint: its trainable weights, optimizer moments, counters and the loop's `extra`
(the consumed-log position), written to a temp dir, fsynced and renamed over the old one, so a kill at any
point leaves a whole checkpoint to resume from (`old_dirs` covers a kill between the two renames).

Not accelerate's `save_state`: that saves the whole prepared module, and an early-exit or eagle drafter's
module holds the target's shared layers (hundreds of MB per checkpoint for a few MB of trained weights);
`Trainable.state()` is exactly the trained tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from dvi.fsutil import fsync_tree, old_dirs, replace_dir, tmp_dir_beside
from trainers.online.trainables import Trainable

log = logging.getLogger("dvi.trainer")

COUNTERS = ("step", "records_seen", "replayed", "heldout_seen", "dropped_stale", "tokens_trained", "records_read",
            "feedback_tokens", "budget_deferred", "max_target_version")
"""The trainer's integer counters a resume restores (plus `train_seconds`, and its publisher's `last_published` and
`last_publish_step`)."""


def save_checkpoint(path: Path, trainable: Trainable, optimizer: torch.optim.Optimizer,
                    state: Mapping[str, Any], write_more: Callable[[Path], None] | None = None) -> None:
    """Weights + optimizer + `state` (the trainer's counters and the loop's extra, JSON-able), written to a temp
    dir and renamed over `path`; `write_more(tmp)` adds what must be renamed with them (the group lanes')."""
    tmp = tmp_dir_beside(path)
    tmp.mkdir(parents=True)
    if write_more is not None:
        write_more(tmp)
    save_file(trainable.state(), str(tmp / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({**dict(state), "drafter_kind": trainable.kind,
                                                "format": trainable.format}))
    fsync_tree(tmp)
    replace_dir(tmp, path)  # a kill between its two renames leaves `old_dirs(path)`; load_checkpoint reads it


def load_checkpoint(path: Path, trainable: Trainable, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """Restore `trainable` and `optimizer` from `save_checkpoint` output; returns its state dict (None if there is
    none), whose counters the trainer restores."""
    path = Path(path)
    if not path.exists():
        olds = old_dirs(path)
        if not olds:
            return None
        path = olds[-1]
    state = json.loads((path / "state.json").read_text())
    if _identity(state) != (trainable.kind, trainable.format):
        raise ValueError(f"checkpoint {path} is for a {'/'.join(map(str, _identity(state)))} drafter, this is "
                         f"{trainable.kind}/{trainable.format}")
    trainable.load_state(load_file(str(path / "trainable.safetensors")))
    try:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    except Exception as exc:  # noqa: BLE001 - fresh moments are better than no resume
        log.warning("optimizer state not restored (%s); continuing with fresh moments", exc)
    return state


def _identity(state: Mapping[str, Any]) -> tuple[Any, Any]:
    """(drafter kind, format) a checkpoint was written for; one from before `format` named only its `kind`: the
    format's name for a separate drafter (lora | full), else the kind (early_exit | eagle, in the lora format)."""
    if "format" in state:
        return state.get("drafter_kind"), state["format"]
    old = state.get("kind")
    return ("separate", old) if old in ("lora", "full") else (old, "lora")

