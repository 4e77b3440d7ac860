"""Shard layout and filesystem helpers shared by `FeedbackWriter` and `FeedbackReader`.

Both sides must agree on what a shard name looks like (`SHARD_RE`, `parse_shard`, `shard_name`), which
files are complete shards (`_list_shards`) and how a root URL maps to an fsspec filesystem
(`_fs`, `_is_local`), so those live here once, next to `_atomic_write_bytes` (whole-or-absent
small files on any fsspec root; the reader's cursor). Roots are local paths or any fsspec URL;
fsync only applies locally.

A shard name is `shard-<ns>-<pid>-<writer>-<seq>.parquet`: `ns` the writer's wall clock at the rename (an
ordering hint, newest first, and nothing more: replicas' clocks disagree), `pid` the writing process,
`writer` a random id per `FeedbackWriter` and `seq` that writer's count of shards renamed into place (1, 2,
3, ... with no gaps: a writer renames one shard at a time and takes the next number only after a rename
succeeded). The consumed state (`dvi.feedback.consumed`) relies on `writer` and `seq` only. Names written
before writer ids existed (`shard-<ns>-<pid>-<6 digits>.parquet`, "legacy") still parse, with no writer.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import threading
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from dvi.fsutil import TMP_PREFIX, atomic_write_bytes

SHARD_RE = re.compile(r"^shard-(\d{20})-(\d+)-(?:([0-9a-f]{12})-(\d{12})|(\d{6}))\.parquet$")
"""Group 1: the writer's clock (ns), 2: its pid, 3 and 4: writer id and sequence number (5: a legacy name's count)."""


@dataclass(frozen=True)
class ShardName:
    """A parsed shard name; `writer` and `seq` are None for a legacy name."""

    time_ns: int
    pid: int
    writer: str | None
    seq: int | None


def parse_shard(name: str) -> ShardName | None:
    """The fields of a shard name, or None when `name` is not one."""
    m = SHARD_RE.match(name)
    if m is None:
        return None
    return ShardName(int(m.group(1)), int(m.group(2)), m.group(3), None if m.group(4) is None else int(m.group(4)))


def shard_name(time_ns: int, pid: int, writer: str, seq: int) -> str:
    """The name a writer gives its `seq`-th shard (see the module docstring)."""
    return f"shard-{time_ns:020d}-{pid}-{writer}-{seq:012d}.parquet"


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
    """The writer's wall-clock time (ns) in a shard name: an ordering hint, never a consumed test."""
    parsed = parse_shard(name)
    if parsed is None:
        raise ValueError(f"not a shard name: {name!r}")
    return parsed.time_ns


def is_disk_full(exc: BaseException) -> bool:
    """Whether an error says the filesystem (or the user's quota on it) has no room left."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
