"""The registry's shared vocabulary, below its store, ledger and codecs: version names, safe directory names, and
what a version is refused for (`AdapterRejected`, its bounded categories, the tensor-spec check)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dvi.fsutil import TMP_PREFIX

Expected = Mapping[str, Any]
"""name -> (shape, dtype | None) or name -> reference tensor."""


def vname(version: int) -> str:
    """A version's directory name, `v000017`."""
    return f"v{version:06d}"


VERSION_RE = re.compile(r"^v(\d{6})$")
"""A version's directory name, parsed (`vname`'s inverse)."""


REFUSAL_CATEGORIES = ("missing", "symlink", "manifest", "files", "load", "shape", "nonfinite", "architecture",
                 "shadow", "other")
"""Bounded categories of a refusal (the `reason` label of dvi_drafter_refusals_total)."""


@dataclass(eq=False)
class AdapterRejected(Exception):
    """A published drafter version failed validation: a typed refusal (`reason` says why, `category` in REFUSAL_CATEGORIES).

    `transient` refusals (the version dir is not there yet: LATEST written before the rename
    became visible, a slow shared filesystem) may succeed later and are retried by the server.
    """

    reason: str
    version: int | None = None
    category: str = "other"
    transient: bool = False

    def __post_init__(self) -> None:
        if self.category not in REFUSAL_CATEGORIES:
            self.category = "other"
        super().__init__(str(self))

    def __str__(self) -> str:
        return f"{vname(self.version) if self.version is not None else 'drafter'} rejected: {self.reason}"


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
                              category="shape")
    if extra:
        raise AdapterRejected(f"unexpected tensor(s) {extra[:3]}{' ...' if len(extra) > 3 else ''}", version,
                              category="shape")
    for name, (shape, dtype) in spec.items():
        t = sd[name]
        if tuple(t.shape) != shape:
            raise AdapterRejected(f"tensor {name} has shape {tuple(t.shape)}, expected {shape}", version, category="shape")
        if dtype is not None and t.dtype != dtype:
            raise AdapterRejected(f"tensor {name} has dtype {t.dtype}, expected {dtype}", version, category="shape")


def is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _remove_tree(p: Path) -> None:
    """Delete a dir tree, or just the link if `p` is a symlink (never what it points at)."""
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A name that is a directory as it is (a replica's, a traffic group's) and never leaves its parent."""


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
