"""The engine's front door: the only way another thread reaches the engine (`Scheduler`, whichever engine stands
behind it: dvi's own or a vLLM child).

- In: requests (`EngineClient.submit` / `cancel`) and typed between-step commands. Each command is a small frozen
  dataclass; `EngineClient.command(cmd)` queues it and returns a future, and the engine thread
  (`serving.scheduler.Scheduler._run`) applies it between steps, publishes a fresh snapshot and only then resolves
  the future, so whoever waited on it reads a snapshot that shows it.
- Out: after every engine step and every command the engine thread builds an `EngineSnapshot` (frozen; its dicts
  are read-only copies) and publishes it by one reference assignment (atomic under the GIL). /metrics, /health,
  /admin/status and the swapper read only that: no thread but the engine's reads the engine, its proposer or its
  suffix cache (`dvi.decode.owner` checks it in debug runs).
- Per-step samples (the suffix lookups' host seconds) are not a snapshot's: the engine thread hands each batch over
  once (`SampleOutbox.put`, a fresh list each time, `SpeculativeEngine.take_suffix_step_seconds`) and a scrape
  drains the published batches (`SampleOutbox.drain`): every sample is observed once, none twice.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from dvi.engine.report import EngineReport

__all__ = ["AddHistory", "Command", "CutAll", "Engine", "EngineClient", "EngineSnapshot", "SampleOutbox", "SetAdapter",
           "SetDrafter", "UpdateTarget", "take_snapshot"]

_EMPTY: Mapping[str, Any] = MappingProxyType({})


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



@dataclass(frozen=True)
class EngineSnapshot:
    """The engine and its loop as of one moment on the engine thread (`seq`: how many were published before)."""

    seq: int = 0
    at: float = field(default_factory=time.time)
    queue: int = 0  # requests waiting for a slot
    running: int = 0  # rows in the batch
    steps: int = 0
    busy_seconds: float = 0.0  # in engine steps since start
    completed: int = 0
    step_errors: int = 0
    request_errors: int = 0
    drafter_version: int = 0  # what the engine serves (the swapper's live version once its swap ran)
    target_version: int = 0
    # bitwise / near-tie, at start-up; behind vLLM also its measured deviation and bound (`serving.vllm_greedy`)
    greedy_contract: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    draft_vocab_size: int | None = None  # the learned drafter's reduced vocabulary (None: full or no drafter)
    proposer_stats: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # `Proposer.stats()`, copied (suffix: index size, lookups, hits)
    adapter_versions: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # per traffic group (issue 40)
    engine_info: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)  # a remote engine's state (vLLM: its url, restarts)
    # the engine thread's heap trims (`dvi.memory.HeapTrimmer.status`): resident size before / after the last one and
    # what trims gave back, which separates freed heap glibc held from memory the server still uses
    heap: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    prefix_cache: Mapping[str, int] = field(default_factory=lambda: _EMPTY)  # `PrefixCache.stats()` (empty: none)
    step_costs: Mapping[str, float] = field(default_factory=lambda: _EMPTY)  # `EngineReport.step_costs`

    def __reduce__(self):  # its read-only dicts as plain ones across a process boundary (`serving.engine_core`)
        state = {f: (dict(v) if isinstance(v, MappingProxyType) else v) for f, v in vars(self).items()}
        return _restore_snapshot, (state,)

    def served(self, lane: Any = None) -> int:
        """The drafter version the engine serves; with a group's `lane`, that group's adapter version (0: none)."""
        return self.drafter_version if lane is None else int(self.adapter_versions.get(lane.group, 0))


def _restore_snapshot(state: dict[str, Any]) -> EngineSnapshot:
    return EngineSnapshot(**{f: (MappingProxyType(v) if isinstance(v, dict) else v) for f, v in state.items()})


class Engine(Protocol):
    """What the scheduler drives and reads, on its engine thread only: dvi's `SpeculativeEngine` or
    `serving.vllm_engine.VllmEngine` (vLLM as the engine), each declaring all of it."""

    drafter_version: int
    target_version: int
    adapter_versions: Mapping[str, int]  # per traffic group (issue 40; {} behind vLLM)
    greedy_contract: Mapping[str, Any]

    def add_request(self, request: Any) -> None: ...

    def abort(self, request_id: str) -> Any: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def set_drafter(self, drafter: Any, version: int) -> None: ...

    def set_adapter(self, group: str, factors: Any, version: int | None) -> None: ...

    def update_target_weights(self, weights: Any, version: int, complete: bool = False) -> None: ...

    def add_history(self, seq_id: str, tokens: list[int]) -> None: ...

    def take_suffix_step_seconds(self) -> list[float]: ...

    def report(self) -> EngineReport: ...


def take_snapshot(engine: Engine, seq: int, heap: Mapping[str, Any] | None = None, **loop: float) -> EngineSnapshot:
    """Engine thread only: the engine's state now plus the loop's counts (`loop`: queue, running, steps, ...) and its
    heap trims' status."""
    r = engine.report()
    return EngineSnapshot(
        seq=seq, queue=int(loop.get("queue", 0)), running=int(loop.get("running", 0)), steps=int(loop.get("steps", 0)),
        busy_seconds=float(loop.get("busy_seconds", 0.0)), completed=int(loop.get("completed", 0)),
        step_errors=int(loop.get("step_errors", 0)), request_errors=int(loop.get("request_errors", 0)),
        drafter_version=int(engine.drafter_version), target_version=int(engine.target_version),
        greedy_contract=MappingProxyType(dict(engine.greedy_contract)), draft_vocab_size=r.draft_vocab_size,
        proposer_stats=MappingProxyType(dict(r.proposer_stats)) if r.proposer_stats else _EMPTY,
        adapter_versions=MappingProxyType(dict(engine.adapter_versions)),
        engine_info=MappingProxyType(dict(r.info)) if r.info else _EMPTY,
        heap=MappingProxyType(dict(heap)) if heap else _EMPTY,
        prefix_cache=MappingProxyType(dict(r.prefix_cache)) if r.prefix_cache else _EMPTY,
        step_costs=MappingProxyType(dict(r.step_costs)) if r.step_costs else _EMPTY)


class SampleOutbox:
    """Batches of samples the engine thread hands over and a reader drains, each sample once. `put` and `drain`
    use only a deque's append / popleft (atomic in CPython): no lock, no sample lost to a race or read twice.
    Bounded: with no reader, the oldest batches go (`max_batches`)."""

    def __init__(self, max_batches: int = 4096) -> None:
        self._batches: collections.deque[tuple[float, ...]] = collections.deque(maxlen=max_batches)

    def put(self, batch: list[float]) -> None:
        if batch:
            self._batches.append(tuple(batch))

    def drain(self) -> list[float]:
        out: list[float] = []
        while True:
            try:
                out.extend(self._batches.popleft())
            except IndexError:
                return out


class EngineClient(Protocol):
    """What the server's threads may do with the engine; `serving.scheduler.Scheduler` is the one implementation."""

    snapshot: EngineSnapshot  # the engine thread's latest publication
    alive: bool  # its loop runs
    pid: int  # the engine's process (the server's own, or `serve.engine_process`'s)
    lost: str | None  # why the engine is gone beyond a stopped loop (an engine process's death)

    def submit_choices(self, choices: list[tuple[list[int], Any]], domain: str = "default", **kw: Any) -> list[Any]: ...

    def cancel(self, handle: Any) -> None: ...

    def command(self, cmd: Command) -> concurrent.futures.Future: ...

    def busy(self) -> bool: ...
