"""dvi's C kernels (`rows_kernel*.c`, `attention_kernel.c`): compiled with the system's C compiler on first use and
loaded with ctypes, where the CPU has the instructions a source needs; elsewhere the reason, and torch serves.

Built once per source (with the headers beside it), flags and compiler into `$XDG_CACHE_HOME/dvi/kernels` (default `~/.cache`): a temp name renamed
into place, so processes building one at once each load a whole file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from dvi.decode.numerics import cpu_flags

__all__ = ["load_library", "loaded_once"]

log = logging.getLogger(__name__)


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dvi" / "kernels"


def _build(compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what `#include "..."` may read
    key = hashlib.sha256(source.read_bytes() + headers + version.encode() + " ".join(flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{source.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_library(source: Path, flags: tuple[str, ...], needs: frozenset[str]) -> tuple[ctypes.CDLL | None, str | None]:
    """`source` built with `flags` and loaded (None and why where it cannot be: not x86-64 Linux, the CPU lacks one of
    `needs` (/proc/cpuinfo flags), no compiler, a failed build)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"not x86-64 Linux ({platform.system()} {platform.machine()})"
    missing = needs - cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, "no C compiler (cc, gcc or $CC) to build it"
    try:
        return ctypes.CDLL(str(_build(compiler, source, flags))), None
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, f"building it failed: {e}"


def loaded_once(source: Path, flags: tuple[str, ...], needs: frozenset[str], wrap: Callable[[ctypes.CDLL], Any],
                instead: str) -> Callable[[], tuple[Any | None, str | None]]:
    """A kernel's `(wrap(library), None)`, or `(None, why)` where it cannot run (logged once, saying what serves
    `instead`): built and loaded on the first call, the same answer after."""

    @cache
    def loaded() -> tuple[Any | None, str | None]:
        lib, why = load_library(source, flags, needs)
        if lib is None:
            log.info("%s unavailable (%s): %s", source.name, instead, why)
            return None, why
        return wrap(lib), None

    return loaded
