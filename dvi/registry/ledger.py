"""The ledger of drafter-version facts: one file per fact, one writer per fact, on one thread.

| fact | file, under `<registry>/drafter/` | its one writer | called by, on |
|---|---|---|---|
| the newest published version | `LATEST` | `TrainerFacts._set_latest` | the trainer's publish and `promote`, its loop |
| what a server serves, its last good version, its admin pin | `SERVING` | `ServerFacts.set_serving` | the server's drafter lane, its drafter thread |
| what a server refused or rolled back from, and why | `REFUSED` | `ServerFacts.refuse` | the server's drafter lane, its drafter thread |

A named replica (`serve.replica`) keeps its SERVING and REFUSED in `replicas/<name>/`, so replicas sharing a
registry promote, refuse and roll back each on its own, and each file has one writer: one replica's drafter thread
(`serving.drafter.client`; REFUSED's read-modify-write runs there alone). A server never writes LATEST: its rollback
refuses the version it leaves (REFUSED) and serves the last good one, and the trainer's next publish moves LATEST on.
An admin pin is SERVING's `pinned`: gc keeps what any server serves, would roll back to or pins (`served_everywhere`).
Registries written before it also hold a PINNED file (every server's pins, repeating SERVING's): a server reads it
once at start, logs what it held and removes it (`retire_pinned`). Transient refusals (a version dir not there yet)
are the server's memory only (`serving.drafter.lifecycle`), never durable. The store
(`dvi.registry.store.DrafterRegistry`, which holds both sets of facts) keeps versions and their files; it reads these
facts and writes none of them. `tests/test_ledger.py` checks the writers and the threads they write from.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dvi.fsutil import atomic_write_text
from dvi.registry.base import VERSION_RE, is_count, vname

__all__ = ["FACT_FILES", "MAX_REFUSED", "REPLICAS", "ServerFacts", "ServingState", "TrainerFacts"]

log = logging.getLogger(__name__)

LATEST, SERVING, REFUSED = "LATEST", "SERVING", "REFUSED"
FACT_FILES = {LATEST: "TrainerFacts._set_latest", SERVING: "ServerFacts.set_serving", REFUSED: "ServerFacts.refuse"}
"""Each fact's file and its one writer (the table above)."""
RETIRED_PINNED = "PINNED"
"""A file older registries hold (the pins of every server, repeating SERVING's): read once, then removed."""

MAX_REFUSED = 1024
"""Refusals kept in REFUSED (newest versions): a version older than these is long gone from the registry."""
REPLICAS = "replicas"
"""`<registry>/drafter/replicas/<name>/`: the server records of one named replica (`serve.replica`)."""


@dataclass(frozen=True)
class ServingState:
    """What a server serves (SERVING), durable so a restart and the trainer agree.

    `version`: served now (0 = the bootstrap drafter); `good`: the newest version that passed its rollback
    watch (what a rollback returns to, and what a restarted server serves); `pinned`: an admin pin that
    no automatic promotion or rollback overrides (None = not pinned)."""

    version: int = 0
    good: int = 0
    pinned: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> ServingState:
        if not isinstance(raw, dict):
            return cls()
        v, g, p = raw.get("version", 0), raw.get("good", 0), raw.get("pinned")
        if not (is_count(v) and is_count(g) and (p is None or is_count(p))):
            return cls()
        return cls(version=v, good=g, pinned=p)


def _read_serving(path: Path) -> ServingState:
    try:
        return ServingState.parse(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return ServingState()


class TrainerFacts:
    """LATEST: the trainer's one fact (mixed into `DrafterRegistry`, whose publish and `promote` call the writer)."""

    dir: Path  # <registry>/drafter

    def latest(self) -> int | None:
        """The version LATEST points at, or None if nothing was published (or LATEST is garbage)."""
        try:
            text = (self.dir / LATEST).read_text().strip()
        except FileNotFoundError:
            return None
        m = VERSION_RE.match(text)
        if not m:
            log.warning("drafter registry LATEST holds %r, not a version name; ignoring it", text)
            return None
        return int(m.group(1))

    def _set_latest(self, version: int) -> None:
        atomic_write_text(self.dir / LATEST, vname(version) + "\n")


class ServerFacts:
    """SERVING and REFUSED: a server's facts (mixed into `DrafterRegistry`; its drafter lane calls the writers, on the
    drafter thread). The one server of a registry keeps them in `<registry>/drafter/`; a named replica in
    `replicas/<name>/`."""

    dir: Path
    replica: str  # "" (the one server, or the trainer reading) or this replica's name
    records_dir: Path  # where this server's SERVING and REFUSED live (`DrafterRegistry.__init__` makes it)
    _event: Callable[..., None]  # the registry's history append

    def serving(self) -> ServingState:
        """What this server serves now, its last good version and its pin (`ServingState`)."""
        return _read_serving(self.records_dir / SERVING)

    def served_everywhere(self) -> dict[str, ServingState]:
        """What every server of the registry serves: the one server ("", where it has written) and each replica."""
        out = {"": _read_serving(self.dir / SERVING)} if (self.dir / SERVING).exists() else {}
        for d in sorted((self.dir / REPLICAS).glob(f"*/{SERVING}")):
            out[d.parent.name] = _read_serving(d)
        return out or {"": ServingState()}

    def set_serving(self, state: ServingState) -> None:
        """Record what this server serves (atomically; the trainer compares its candidates with it, gc keeps it); a
        pin set or lifted goes to the registry's history too."""
        before = self.serving().pinned
        atomic_write_text(self.records_dir / SERVING, json.dumps({
            "version": state.version, "good": state.good, "pinned": state.pinned, "time": time.time()}))
        if state.pinned != before:
            self._event(event="pin" if state.pinned is not None else "unpin",
                        version=state.pinned if state.pinned is not None else before, replica=self.replica or None)

    def refusals(self) -> dict[int, str]:
        """Versions this server refused or rolled back from, with the reason: never promoted again."""
        try:
            raw = json.loads((self.records_dir / REFUSED).read_text())
            return {int(k): str(v) for k, v in raw.items()}
        except (FileNotFoundError, ValueError, AttributeError):
            return {}

    def refuse(self, version: int, reason: str) -> None:
        """Make a refusal durable (REFUSED keeps the newest `MAX_REFUSED`); a restarted server skips it."""
        refused = self.refusals()
        refused[version] = reason[:500]
        keep = sorted(refused)[-MAX_REFUSED:]
        atomic_write_text(self.records_dir / REFUSED, json.dumps({str(v): refused[v] for v in keep}))
        self._event(event="refuse", version=version, reason=reason[:500], replica=self.replica or None)

    def rolled_back(self) -> set[int]:
        """Versions refused or rolled back from."""
        return set(self.refusals())

    def retire_pinned(self) -> list[int] | None:
        """An older registry's PINNED file, read once and removed (SERVING carries each server's pin): the versions
        it held, or None when there is none (a registry written since, or another replica retired it first)."""
        path = self.dir / RETIRED_PINNED
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            raw = []
        held = sorted(v for v in raw if is_count(v)) if isinstance(raw, list) else []
        try:
            path.unlink()
        except FileNotFoundError:
            return None
        self._event(event="retire_pinned", versions=held, replica=self.replica or None)
        return held
