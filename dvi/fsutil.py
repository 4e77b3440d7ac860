"""Durable local file writes: readers see the old content or the new, never half of it.

The feedback log, the drafter registry and the trainer's cursor/status files all rely on
"write a temp name in the same directory, fsync, rename, fsync the directory"; this is the one
implementation of it.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path; a no-op where the OS does not allow it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


PRIVATE = 0o600
"""Mode of files that may hold a credential (a resolved config): owner read/write only."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically; `mode` (e.g. PRIVATE) is set when the temp file is
    created, so the content is never readable by others, not even for a moment."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)  # an existing temp file keeps its old mode otherwise
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync, mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str), fsync=fsync)
