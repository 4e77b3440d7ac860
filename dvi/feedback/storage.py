"""Shard layout and filesystem helpers shared by `FeedbackWriter` and `FeedbackReader`.

Both sides must agree on what a shard name looks like (`SHARD_RE`, `shard_time_ns`), which
files are complete shards (`_list_shards`) and how a root URL maps to an fsspec filesystem
(`_fs`, `_is_local`), so those live here once, next to `_atomic_write_bytes` (whole-or-absent
small files on any fsspec root; the reader's cursor). Roots are local paths or any fsspec URL;
fsync only applies locally.
"""

from __future__ import annotations

import os
import posixpath
import re
import threading

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dvi.fsutil import TMP_PREFIX, atomic_write_bytes

SHARD_RE = re.compile(r"^shard-(\d{20})-(\d+)-(\d{6})\.parquet$")


def _fs(root: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(os.fspath(root))
    return fs, path.rstrip("/") or "/"


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write to a temp name in the same dir, fsync (local) and rename over `path`."""
    d, base = posixpath.split(path)
    tmp = posixpath.join(d, f"{TMP_PREFIX}{base}-{os.getpid()}-{threading.get_ident()}")
    if _is_local(fs):
        os.makedirs(d, exist_ok=True)
        atomic_write_bytes(path, data)
    else:
        fs.makedirs(d, exist_ok=True)
        with fs.open(tmp, "wb") as f:
            f.write(data)
        if fs.exists(path):
            fs.rm(path)
        fs.mv(tmp, path)


def _list_shards(fs: fsspec.AbstractFileSystem, path: str) -> list[tuple[str, int]]:
    """Complete shards as (name, size), sorted by name; temp files are ignored."""
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for e in entries:
        name = posixpath.basename(e["name"].rstrip("/"))
        if SHARD_RE.match(name):
            out.append((name, int(e.get("size") or 0)))
    out.sort()
    return out


def shard_time_ns(name: str) -> int:
    """The wall-clock timestamp (ns) embedded in a shard name."""
    m = SHARD_RE.match(name)
    if not m:
        raise ValueError(f"not a shard name: {name!r}")
    return int(m.group(1))
