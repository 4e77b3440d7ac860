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


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True) -> None:
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str), fsync=fsync)
