"""The ledger of drafter-version facts: one file per fact, one writer per fact.

| fact | file, under `<registry>/drafter/` | its one writer | called by |
|---|---|---|---|
| the newest published version | `LATEST` | `TrainerFacts._set_latest` | the trainer's publish and `promote` |
| what a server serves, its last good version, its admin pin | `SERVING` | `ServerFacts.set_serving` | the server's swapper |
| what a server refused or rolled back from, and why | `REFUSED` | `ServerFacts.refuse` | the server's swapper |
| the versions kept from garbage collection | `PINNED` | `ServerFacts._write_pins` | the server's admin pin |

A named replica (`serve.replica`) keeps its SERVING and REFUSED in `replicas/<name>/`, so replicas sharing a
registry promote, refuse and roll back each on its own. A server never writes LATEST: its rollback refuses the version
it leaves (REFUSED) and serves the last good one, and the trainer's next publish moves LATEST on. Transient refusals
(a version dir not there yet) are the server's memory only (`serving.drafter.lifecycle`), never durable. The store
(`dvi.registry.store.DrafterRegistry`, which holds both sets of facts) keeps versions and their files; it reads these
facts (gc keeps what any server serves or pins) and writes none of them. `tests/test_ledger.py` checks the writers.
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

LATEST, SERVING, REFUSED, PINNED = "LATEST", "SERVING", "REFUSED", "PINNED"
FACT_FILES = {LATEST: "TrainerFacts._set_latest", SERVING: "ServerFacts.set_serving", REFUSED: "ServerFacts.refuse",
              PINNED: "ServerFacts._write_pins"}
"""Each fact's file and its one writer (the table above)."""

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
    """SERVING, REFUSED and PINNED: a server's facts (mixed into `DrafterRegistry`; its swapper calls the writers).
    The one server of a registry keeps SERVING and REFUSED in `<registry>/drafter/`; a named replica in
    `replicas/<name>/`."""

    dir: Path
    replica: str  # "" (the one server, or the trainer reading) or this replica's name
    records_dir: Path  # where this server's SERVING and REFUSED live (`DrafterRegistry.__init__` makes it)
    _event: Callable[..., None]  # the registry's history append
    list_versions: Callable[[], list[int]]

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
        """Record what this server serves (atomically; the trainer compares its candidates with it)."""
        atomic_write_text(self.records_dir / SERVING, json.dumps({
            "version": state.version, "good": state.good, "pinned": state.pinned, "time": time.time()}))

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

    def pinned(self) -> set[int]:
        """Versions an admin pinned on any server: kept from garbage collection."""
        try:
            return set(json.loads((self.dir / PINNED).read_text()))
        except FileNotFoundError:
            return set()

    def pin(self, version: int) -> None:
        """Protect a version from garbage collection."""
        if version not in self.list_versions():
            raise ValueError(f"no version {vname(version)}")
        self._write_pins(self.pinned() | {version})
        self._event(event="pin", version=version)

    def unpin(self, version: int) -> None:
        self._write_pins(self.pinned() - {version})
        self._event(event="unpin", version=version)

    def _write_pins(self, versions: set[int]) -> None:
        atomic_write_text(self.dir / PINNED, json.dumps(sorted(versions)))
