"""The registry's parts below `DrafterRegistry`: what it refuses and why (`AdapterRejected`, its bounded
kinds, the tensor-spec check) and the server's durable records (`ServingState`, refusals).

Its own module so `dvi/registry/store.py` stays one readable file; `dvi.registry.store` re-exports every public name.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dvi.fsutil import TMP_PREFIX, atomic_write_text

Expected = Mapping[str, Any]
"""name -> (shape, dtype | None) or name -> reference tensor."""


def vname(version: int) -> str:
    """A version's directory name, `v000017`."""
    return f"v{version:06d}"


REFUSAL_KINDS = ("missing", "symlink", "manifest", "files", "load", "shape", "nonfinite", "architecture",
                 "shadow", "other")
"""Bounded categories of a refusal (the `reason` label of dvi_drafter_refusals_total)."""


class AdapterRejected(Exception):
    """A published drafter version failed validation; `reason` says why, `kind` in REFUSAL_KINDS.

    `transient` refusals (the version dir is not there yet: LATEST written before the rename
    became visible, a slow shared filesystem) may succeed later and are retried by the server.
    """

    def __init__(self, reason: str, version: int | None = None, kind: str = "other",
                 transient: bool = False) -> None:
        self.reason = reason
        self.version = version
        self.kind = kind if kind in REFUSAL_KINDS else "other"
        self.transient = transient
        super().__init__(f"{vname(version) if version is not None else 'drafter'} rejected: {reason}")


def _to_dtype(d: Any) -> torch.dtype | None:
    if d is None or isinstance(d, torch.dtype):
        return d
    name = str(d).removeprefix("torch.")
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {d!r}")
    return dt


def _expected_spec(expected: Expected) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    spec = {}
    for name, v in expected.items():
        if isinstance(v, torch.Tensor):
            spec[name] = (tuple(v.shape), v.dtype)
        else:
            shape, dtype = v
            spec[name] = (tuple(shape), _to_dtype(dtype))
    return spec


def check_state_dict(sd: Mapping[str, torch.Tensor], expected: Expected, version: int | None = None) -> None:
    """Names, shapes and dtypes of `sd` must equal `expected`; raise AdapterRejected otherwise."""
    spec = _expected_spec(expected)
    missing = sorted(set(spec) - set(sd))
    extra = sorted(set(sd) - set(spec))
    if missing:
        raise AdapterRejected(f"missing tensor(s) {missing[:3]}{' ...' if len(missing) > 3 else ''}", version,
                              kind="shape")
    if extra:
        raise AdapterRejected(f"unexpected tensor(s) {extra[:3]}{' ...' if len(extra) > 3 else ''}", version,
                              kind="shape")
    for name, (shape, dtype) in spec.items():
        t = sd[name]
        if tuple(t.shape) != shape:
            raise AdapterRejected(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}", version, kind="shape")
        if dtype is not None and t.dtype != dtype:
            raise AdapterRejected(f"tensor {name} has dtype {t.dtype}, expected {dtype}", version, kind="shape")


@dataclass(frozen=True)
class ServingState:
    """What the server serves (`<registry>/drafter/SERVING`), durable so a restart and the trainer agree.

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
        if not (_is_int(v) and _is_int(g) and (p is None or _is_int(p))):
            return cls()
        return cls(version=v, good=g, pinned=p)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _remove_tree(p: Path) -> None:
    """Delete a dir tree, or just the link if `p` is a symlink (never what it points at)."""
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


MAX_REFUSED = 1024
"""Refusals kept in REFUSED (newest versions): a version older than these is long gone from the registry."""


REPLICAS = "replicas"
"""`<registry>/drafter/replicas/<name>/`: the server records of one named replica (`serve.replica`)."""
SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A name that is a directory as it is (a replica's, a traffic group's) and never leaves its parent."""


class ServerRecords:
    """SERVING and REFUSED: what a server serves and what it must never serve again, durable so that a restarted
    server and the trainer agree with it (mixed into DrafterRegistry). The one server of a registry keeps them in
    `<registry>/drafter/`; a named replica (`replica`) in `replicas/<name>/`, so that replicas sharing a registry
    promote, refuse and roll back each on its own."""

    dir: Path
    replica: str  # "" (the one server, or the trainer reading) or this replica's name
    records_dir: Path  # where this server's SERVING and REFUSED live (`DrafterRegistry.__init__` makes it)
    _event: Callable[..., None]  # DrafterRegistry's history append

    def serving(self) -> ServingState:
        """What this server serves now, its last good version and its pin (`ServingState`)."""
        return _read_serving(self.records_dir / "SERVING")

    def served_everywhere(self) -> dict[str, ServingState]:
        """What every server of the registry serves: the one server ("", where it has written) and each replica."""
        out = {"": _read_serving(self.dir / "SERVING")} if (self.dir / "SERVING").exists() else {}
        for d in sorted((self.dir / REPLICAS).glob("*/SERVING")):
            out[d.parent.name] = _read_serving(d)
        return out or {"": ServingState()}

    def set_serving(self, state: ServingState) -> None:
        """Record what this server serves (atomically; the trainer compares its candidates with it)."""
        atomic_write_text(self.records_dir / "SERVING", json.dumps({
            "version": state.version, "good": state.good, "pinned": state.pinned, "time": time.time()}))

    def refusals(self) -> dict[int, str]:
        """Versions this server refused or rolled back from, with the reason: never promoted again."""
        try:
            raw = json.loads((self.records_dir / "REFUSED").read_text())
            return {int(k): str(v) for k, v in raw.items()}
        except (FileNotFoundError, ValueError, AttributeError):
            return {}

    def refuse(self, version: int, reason: str) -> None:
        """Make a refusal durable (REFUSED keeps the newest `MAX_REFUSED`); a restarted server skips it."""
        refused = self.refusals()
        refused[version] = reason[:500]
        keep = sorted(refused)[-MAX_REFUSED:]
        atomic_write_text(self.records_dir / "REFUSED", json.dumps({str(v): refused[v] for v in keep}))
        self._event(event="refuse", version=version, reason=reason[:500], replica=self.replica or None)

    def rolled_back(self) -> set[int]:
        """Versions refused or rolled back from (skipped by `rollback(None)`)."""
        return set(self.refusals())


def _read_serving(path: Path) -> ServingState:
    try:
        return ServingState.parse(json.loads(path.read_text()))
    except (FileNotFoundError, ValueError):
        return ServingState()


def _publisher_dead(name: str) -> bool:
    """Whether the process that made a registry temp entry is gone (a SIGKILLed trainer's half-written
    version or LATEST): `.tmp-<pid>-<ns>` (publish), `.tmp-gc-<version>-<pid>`, `.tmp-<FILE>-<pid>-<tid>`."""
    parts = name[len(TMP_PREFIX):].split("-")
    pid = parts[0] if parts[0].isdigit() else (parts[-1] if parts[0] == "gc" else (parts[1:2] or [""])[0])
    if not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
