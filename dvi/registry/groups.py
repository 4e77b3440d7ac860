"""Per traffic group, a registry of its own (issue 40): `<registry.dir>/groups/<group>/`, a `DrafterRegistry` like
the shared one (versions, LATEST, SERVING, REFUSED, pins), holding the group's LoRA adapter versions over the shared
base drafter. The trainer publishes a group's versions there, the server's group swapper promotes, watches and rolls
them back there: a group's refusal or rollback is written where no other group reads.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dvi.fsutil import atomic_write_text
from dvi.registry.base import SAFE_NAME
from dvi.registry.store import DrafterRegistry

GROUP_FILE = "GROUP"

__all__ = ["group_dir_name", "group_names", "group_registry"]



def group_dir_name(group: str) -> str:
    """The group's directory name: the group itself where it is a plain name (a domain, a client hash), else a
    hash of it (a name never leaves the registry's groups dir)."""
    if not group:
        raise ValueError("the empty group has no adapter: its rows draft with the shared drafter")
    if SAFE_NAME.fullmatch(group):
        return group
    return "h" + hashlib.sha256(group.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def group_registry(root: str | os.PathLike, group: str, keep_last: int = 5, replica: str = "") -> DrafterRegistry:
    """The group's registry (made, with its GROUP file naming the group, on first use); a named replica's server
    records in it are its own (`dvi.registry.ledger.ServerFacts`)."""
    reg = DrafterRegistry(Path(root) / "groups" / group_dir_name(group), keep_last=keep_last, replica=replica)
    name = reg.root / GROUP_FILE
    if not name.is_file():
        atomic_write_text(name, group)
    return reg


def group_names(root: str | os.PathLike) -> list[str]:
    """The groups that have a registry under `root`, sorted."""
    d = Path(root) / "groups"
    try:
        dirs = [p for p in d.iterdir() if p.is_dir() and SAFE_NAME.fullmatch(p.name)]
    except FileNotFoundError:
        return []
    out = []
    for p in dirs:
        try:
            group = (p / GROUP_FILE).read_text()
        except (OSError, UnicodeDecodeError):
            continue  # being made
        if group and group_dir_name(group) == p.name:
            out.append(group)
    return sorted(out)
