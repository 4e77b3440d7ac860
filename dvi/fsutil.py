"""Durable local file writes: readers see the old content or the new, never half of it.

The feedback log, the drafter registry, the run dir (`dvi.rundir`), the trainer's checkpoint and
the embedded-pair cache all rely on "write a temp name in the same directory, fsync, rename,
fsync the directory"; this is the one implementation of it:

* `atomic_write_bytes` / `_text` / `_json`: replace one file (`atomic_file` when the content is
  streamed);
* `fsync_tree` + `replace_dir`: replace a whole directory built under a temp name;
* `append_line` / `append_jsonl`: durable appends to an event log (a kill tears at most the
  last line, which readers skip); given an `AppendLog` they also rotate it by size;
* `rotate_log`: the one size-based rotation (`<log>.1` ... `<log>.N`, oldest dropped) of every
  log dvi keeps growing (`metrics.jsonl`, `swap_events.jsonl`, `trainer.log`);
* `make_dirs` / `access_modes`: the modes of what dvi creates (`files.access`: private 0700/0600 by
  default, group 0770/0660, or whatever the umask gives).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
"""`replace_dir` moves the replaced directory to `.old-<name>-...` for the instant between its two
renames; `old_dirs` finds it if a kill lands in that instant."""


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


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, fsync: bool = True, mode: int | None = None) -> Iterator[IO[bytes]]:
    """A binary file that replaces `path` when the block ends without an error (removed otherwise).

    `mode` (e.g. PRIVATE) is set when the temp file is created, so the content is never readable
    by others, not even for a moment.
    """
    path = Path(path)
    tmp = _tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666 if mode is None else mode)
    if mode is not None:
        os.fchmod(fd, mode)  # an existing temp file keeps its old mode otherwise
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_path(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, fsync: bool = True, mode: int | None = None) -> None:
    """Replace `path` with `data` atomically (see `atomic_file`)."""
    with atomic_file(path, fsync=fsync, mode=mode) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, fsync: bool = True, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode(), fsync=fsync, mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, fsync: bool = True, mode: int | None = None) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True, default=str), fsync=fsync, mode=mode)


ACCESS_MODES: dict[str, tuple[int | None, int | None]] = {
    "private": (0o700, PRIVATE), "group": (0o770, 0o660), "umask": (None, None)}
"""`files.access` -> (dir mode, file mode) of the dirs and files dvi creates (None: the umask decides)."""


def access_modes(access: str) -> tuple[int | None, int | None]:
    """(dir mode, file mode) for a `files.access` value."""
    try:
        return ACCESS_MODES[access]
    except KeyError:
        raise ValueError(f"files.access must be one of {sorted(ACCESS_MODES)}, got {access!r}") from None


def make_dirs(path: str | os.PathLike, access: str = "private") -> Path:
    """`mkdir -p path`, then give `path` itself the access's dir mode (when this user owns it).

    An existing dir is tightened (or loosened) too: the mode is the config's, not the history's.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dir_mode = access_modes(access)[0]
    if dir_mode is not None:
        st = path.stat()
        if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) != dir_mode:
            os.chmod(path, dir_mode)
    return path


def open_append(path: str | os.PathLike, mode: int | None = None) -> int:
    """An O_APPEND file descriptor on `path`; a file it creates gets `mode` (umask ignored)."""
    existed = os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666 if mode is None else mode)
    if mode is not None and not existed:
        os.fchmod(fd, mode)
    return fd


@dataclass(frozen=True)
class LogRotation:
    """A log is rotated once it holds `max_bytes`; `backups` old files are kept (`<log>.1` newest)."""

    max_bytes: int
    backups: int = 2


def rotate_log(path: str | os.PathLike, rotation: LogRotation, copy_truncate: bool = False) -> bool:
    """Rotate `path` if it holds at least `rotation.max_bytes`: `<log>.k` -> `<log>.k+1` (the oldest
    dropped), `<log>` -> `<log>.1`; returns whether it rotated.

    `copy_truncate` copies and then truncates in place instead of renaming, for a log another
    process holds open with O_APPEND (the trainer's stdout): its next write lands at the new start.
    Lines written between the copy and the truncation are lost; that is the price of not stopping it.
    """
    path = Path(path)
    try:
        if path.stat().st_size < rotation.max_bytes:
            return False
    except FileNotFoundError:
        return False
    old = [path.with_name(f"{path.name}.{k}") for k in range(1, rotation.backups + 1)]
    for k in range(len(old) - 1, 0, -1):
        if old[k - 1].exists():
            os.replace(old[k - 1], old[k])
    if copy_truncate:
        if old:
            shutil.copy2(path, old[0])
        os.truncate(path, 0)
    elif old:
        os.replace(path, old[0])
    else:
        path.unlink(missing_ok=True)
    return True


@dataclass(frozen=True)
class AppendLog:
    """An append-only log file, rotated by size and created with a mode (`append_line` takes one)."""

    path: Path
    rotation: LogRotation | None = None
    mode: int | None = PRIVATE

    def __fspath__(self) -> str:
        return str(self.path)

    def append(self, line: str, fsync: bool = True) -> None:
        if self.rotation is not None:
            rotate_log(self.path, self.rotation)
        fd = open_append(self.path, self.mode)
        try:
            os.write(fd, (line + "\n").encode())
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def append_line(path: str | os.PathLike | AppendLog, line: str, fsync: bool = True) -> None:
    """Append `line` (a newline is added) to `path`, flushed and (by default) fsynced; an `AppendLog`
    is rotated first when it is full, and created with its mode."""
    log = path if isinstance(path, AppendLog) else AppendLog(Path(path), mode=None)
    log.append(line, fsync=fsync)


def append_jsonl(path: str | os.PathLike | AppendLog, obj: Any, fsync: bool = True) -> None:
    """Append one JSON line to an event log (`consumed.jsonl`, the registry's `events.jsonl`, ...)."""
    append_line(path, json.dumps(obj), fsync=fsync)


def tree_bytes(path: str | os.PathLike | None) -> int:
    """Bytes of the regular files under `path` (symlinks not followed; 0 if it is missing)."""
    if path is None:
        return 0
    total, stack = 0, [os.fspath(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue  # removed while we looked
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
    return total


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file directly inside `directory`, then the directory itself."""
    for p in Path(directory).iterdir():
        if p.is_file():
            fsync_path(p)
    fsync_path(directory)


def tmp_dir_beside(path: str | os.PathLike) -> Path:
    """A fresh, not yet existing temp name in `path`'s directory, for a `replace_dir` source."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{time.time_ns()}")


def old_dirs(path: str | os.PathLike) -> list[Path]:
    """Directories `replace_dir` moved aside from `path` and did not get to delete, oldest first."""
    path = Path(path)
    return sorted(path.parent.glob(f"{OLD_PREFIX}{path.name}-*"))


def replace_dir(src: str | os.PathLike, dst: str | os.PathLike,
                keep_theirs: Callable[[Path], bool] | None = None) -> None:
    """Rename the complete directory `src` over `dst` (the old `dst` is moved aside, then deleted).

    Between the two renames `dst` is missing; `old_dirs(dst)` finds the previous content then.
    When the second rename fails because another process renamed its own `dst` into place first,
    `keep_theirs(dst)` decides whether that is fine (theirs is kept) or the error is raised.
    """
    src, dst = Path(src), Path(dst)
    old = None
    if dst.exists():
        old = dst.with_name(f"{OLD_PREFIX}{dst.name}-{os.getpid()}-{time.time_ns()}")
        os.rename(dst, old)
    try:
        os.rename(src, dst)
    except OSError:
        if keep_theirs is None or not keep_theirs(dst):
            raise
    fsync_path(dst.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
