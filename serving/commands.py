"""The engine's front door, the write side: what other threads ask the engine thread to do between two steps.

Each command is a small frozen dataclass; `Scheduler.command(cmd)` queues it and returns a future, and the engine
thread (`serving.scheduler.Scheduler._run`) applies it between steps, publishes a fresh snapshot
(`serving.snapshot`) and only then resolves the future, so whoever waited on it reads a snapshot that shows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["AddHistory", "Command", "CutAll", "SetDrafter", "UpdateTarget"]


@dataclass(frozen=True)
class SetDrafter:
    """Serve `drafter` as drafter version `version` (`SpeculativeEngine.set_drafter`; the swapper's promotions,
    rollbacks and pins)."""

    drafter: Any
    version: int


@dataclass(frozen=True)
class UpdateTarget:
    """New target weights (a state dict read off the engine thread) as target version `version`
    (`SpeculativeEngine.update_target_weights`; `POST /admin/target`)."""

    weights: Any
    version: int
    complete: bool = True


@dataclass(frozen=True)
class AddHistory:
    """Outputs other replicas finished, (seq id, tokens) each, for history drafting (`serving.suffix_tail`)."""

    items: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class SetAdapter:
    """`group`'s rows draft through the LoRA `factors` as its adapter version `version` (None, 0: the shared drafter
    again; `SpeculativeEngine.set_adapter`; a group swapper's promotions, rollbacks and pins)."""

    group: str
    factors: Any
    version: int


@dataclass(frozen=True)
class CutAll:
    """End every request now (the drain's deadline passed, `serving.drain`); the future holds (running, waiting)."""


Command = SetDrafter | SetAdapter | UpdateTarget | AddHistory | CutAll
