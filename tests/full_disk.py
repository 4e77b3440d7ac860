"""A real full filesystem for the tests: a small tmpfs mounted on a test's dir (root only; skips elsewhere).

Writes there fail with the kernel's own ENOSPC, in every process, through every library (parquet, safetensors,
json), which no patched `open` would reach. `fill(dir)` takes every free byte with a filler file, `free(dir)`
gives it back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FILLER = ".filler"


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    """Mount a tmpfs of `size` on `path` for the block (skips the test where mounting is not allowed)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("a full filesystem needs a tmpfs mount (root)")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> int:
    """Write a filler file in `path` until the filesystem refuses with ENOSPC; returns its size."""
    n = 0
    fd = os.open(path / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (65536, 4096, 512, 1):
            while True:
                try:
                    n += os.write(fd, b"\0" * chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    return n


def free(path: Path) -> None:
    (path / FILLER).unlink(missing_ok=True)
