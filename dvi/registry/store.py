"""Versioned drafter registry shared by the trainer (publishes) and the server (loads).

Layout (docs/contracts.md)::

    <root>/drafter/v000017/{adapter_model.safetensors | model.safetensors,
                            adapter_config.json | config.json, manifest.json}
    <root>/drafter/LATEST          "v000017"                                  } the version facts, one writer
    <root>/drafter/SERVING         what the server serves, last good, its pin   } each (`dvi.registry.ledger`):
    <root>/drafter/REFUSED         versions the server refused or rolled back   } LATEST the trainer's, the rest
                                                                                } the server's drafter thread's
    <root>/drafter/replicas/<name>/{SERVING,REFUSED}   the same, of one replica (`serve.replica`) among several
    <root>/drafter/events.jsonl    publish / promote / refuse / pin / unpin / gc history (+ events.1.jsonl)

A version's files are written and read by its format's codec (`dvi.registry.codec`: LoRA, full, shared-target).
A version dir is built under a temp name, fsynced and renamed, and LATEST is replaced via
tmp + rename, so the server never sees a half-written version. Everything the server loads is
validated first; anything wrong raises `AdapterRejected` with a reason it can show.
Local filesystem only: directory renames are not atomic on object stores.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dvi.drafters.factory import PROPOSER_NAMES
from dvi.drafters.learned import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from dvi.fsutil import TMP_PREFIX, append_jsonl, fsync_path, fsync_tree
from dvi.registry.base import (
    REFUSAL_CATEGORIES,
    SAFE_NAME,
    VERSION_RE,
    AdapterRejected,
    Expected,
    _is_num,
    _publisher_dead,
    _remove_tree,
    check_state_dict,
    is_count,
    vname,
)
from dvi.registry.codec import FULL_CONFIG, FULL_WEIGHTS, DrafterCodec
from dvi.registry.ledger import REPLICAS, ServerFacts, ServingState, TrainerFacts

__all__ = ["REFUSAL_CATEGORIES", "AdapterRejected", "DrafterRegistry", "Expected", "Manifest", "ServingState",
           "check_state_dict", "vname"]

log = logging.getLogger(__name__)

LORA_WEIGHTS = ADAPTER_WEIGHTS
LORA_CONFIG = ADAPTER_CONFIG
MANIFEST = "manifest.json"
MANIFEST_FIELDS = ("version", "parent_version", "target_version", "format", "steps", "records_seen", "heldout_alpha",
                   "created_at")
FILES_BY_FORMAT = {"lora": (LORA_WEIGHTS, LORA_CONFIG), "full": (FULL_WEIGHTS, FULL_CONFIG)}
DRAFTER_KINDS = tuple(k for k in PROPOSER_NAMES if k not in ("none", "suffix", "hybrid"))
"""A version's drafter kind: the names of `dvi.drafters.factory.PROPOSER_NAMES` that are a learned drafter (a hybrid publishes
its learned half under that half's kind)."""

EVENTS_MAX_BYTES = 1 << 20
"""events.jsonl is rotated to events.1.jsonl past this size: the history costs at most twice this on disk."""
_ANY = object()


LEGACY_SEPARATE = ("lora", "full")
"""What a manifest written before `format` existed called a separate drafter's kind (its format's name)."""


def _upgraded(raw: dict[str, Any]) -> dict[str, Any]:
    """A manifest from before `format`: its `kind` was the format, and a separate drafter's `drafter_kind` was
    the format's name; read in today's vocabulary (a registry outlives an upgrade)."""
    if "format" in raw or "kind" not in raw:
        return raw
    out = {k: v for k, v in raw.items() if k != "kind"} | {"format": raw["kind"]}
    if out.get("drafter_kind") in LEGACY_SEPARATE:
        out["drafter_kind"] = "separate"
    return out


@dataclass(frozen=True)
class Manifest:
    """A version's manifest.json, typed. `Manifest.parse` is the one place its fields are checked;
    `check_fits` is the one place a version is matched with the drafter that would load it."""

    version: int
    parent_version: int | None
    target_version: int
    format: str  # "lora" | "full": which files the version dir holds (FILES_BY_FORMAT)
    steps: int
    records_seen: int
    heldout_alpha: float | None
    created_at: float
    drafter_kind: str | None = None  # DRAFTER_KINDS: what the trainer trained; None: hand-published
    draft_vocab_size: Any = _ANY  # N of the reduced draft vocabulary it was trained for, None = full, _ANY = unstated
    extra: Mapping[str, Any] = field(default_factory=dict)  # every other field (parent_heldout_alpha, ...)

    @classmethod
    def parse(cls, raw: Any, version: int) -> Manifest:
        """Check the fields of a loaded manifest.json; AdapterRejected(category="manifest") names what is wrong."""
        if not isinstance(raw, dict):
            raise AdapterRejected(f"{MANIFEST} is not a JSON object", version, category="manifest")
        raw = _upgraded(raw)
        missing = [f for f in MANIFEST_FIELDS if f not in raw]
        if missing:
            raise AdapterRejected(f"{MANIFEST} lacks field(s) {missing}", version, category="manifest")
        if raw["version"] != version:
            raise AdapterRejected(f"{MANIFEST} says version {raw['version']!r}, dir is {vname(version)}", version,
                                  category="manifest")
        if raw["format"] not in FILES_BY_FORMAT:
            raise AdapterRejected(f"unknown format {raw['format']!r}", version, category="manifest")
        if raw.get("drafter_kind") not in (None, *DRAFTER_KINDS):
            raise AdapterRejected(f"unknown drafter_kind {raw['drafter_kind']!r}", version, category="manifest")
        ints = ("target_version", "steps", "records_seen")
        bad = [f for f in ints if not is_count(raw[f])] + [f for f in ("parent_version",) if
                                                         raw[f] is not None and not is_count(raw[f])]
        bad += [f for f in ("heldout_alpha", "created_at") if raw[f] is not None and not _is_num(raw[f])]
        if raw.get("draft_vocab_size") is not None and not is_count(raw["draft_vocab_size"]):
            bad.append("draft_vocab_size")
        if bad:
            raise AdapterRejected(f"{MANIFEST} field(s) {bad} have the wrong type", version, category="manifest")
        known = {f.name for f in cls.__dataclass_fields__.values()} - {"extra"}
        return cls(**{k: raw[k] for k in known if k in raw and k != "created_at"},
                   created_at=float(raw["created_at"] or 0.0),
                   extra={k: v for k, v in raw.items() if k not in known})

    def as_dict(self) -> dict[str, Any]:
        """The manifest.json content."""
        out = {f: getattr(self, f) for f in MANIFEST_FIELDS}
        out.update(self.extra)
        out["drafter_kind"] = self.drafter_kind
        if self.draft_vocab_size is not _ANY:
            out["draft_vocab_size"] = self.draft_vocab_size
        return out

    def check_fits(self, drafter_kind: str, file_format: str | None = None,
                   draft_vocab_size: Any = _ANY) -> None:
        """Refuse (AdapterRejected category="architecture") a version made for another drafter kind, file format or
        draft vocabulary. A hand-published version (no drafter_kind) fits any drafter its files fit."""
        if self.drafter_kind is not None and self.drafter_kind != drafter_kind:
            raise AdapterRejected(f"published by a {self.drafter_kind!r} trainer, this drafter is {drafter_kind!r}",
                                  self.version, category="architecture")
        if file_format is not None and self.format != file_format:
            raise AdapterRejected(f"format is {self.format!r}, expected {file_format!r}", self.version,
                                  category="architecture")
        if (draft_vocab_size is not _ANY and self.draft_vocab_size is not _ANY
                and self.draft_vocab_size != draft_vocab_size):
            raise AdapterRejected(f"trained for a draft vocabulary of {self.draft_vocab_size or 'all'} ids, the "
                                  f"drafter drafts over {draft_vocab_size or 'all'}", self.version,
                                  category="architecture")


class DrafterRegistry(TrainerFacts, ServerFacts):
    """Publish, validate, load and garbage-collect drafter versions; the version facts are the ledger's
    (`dvi.registry.ledger`: LATEST the trainer's, SERVING / REFUSED a server's)."""

    def __init__(self, root: str | os.PathLike, keep_last: int = 5, replica: str = "") -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if replica and not SAFE_NAME.fullmatch(replica):
            raise ValueError(f"replica {replica!r}: 1-64 letters, digits, '_' or '-'")
        self.replica = replica
        self.root = Path(root)
        self.dir = self.root / "drafter"
        self.records_dir = self.dir / REPLICAS / replica if replica else self.dir
        self.records_dir.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last

    # -- reading state ----------------------------------------------------------------------
    def version_dir(self, version: int) -> Path:
        return self.dir / vname(version)

    def list_versions(self) -> list[int]:
        """All complete (renamed) versions, ascending."""
        out = []
        for p in self.dir.iterdir():
            m = VERSION_RE.match(p.name)
            if m and p.is_dir():
                out.append(int(m.group(1)))
        return sorted(out)

    def events(self) -> list[dict[str, Any]]:
        """The registry's history (publish, promote, rollback, refuse, pin, gc), the rotated part first."""
        out = []
        for name in ("events.1.jsonl", "events.jsonl"):
            try:
                lines = (self.dir / name).read_text().splitlines()
            except FileNotFoundError:
                continue
            for line in lines:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a torn last line from a kill mid-append
        return out

    def _check_confined(self, d: Path, version: int) -> None:
        """The version dir and its files must resolve inside the registry: a version dir (or a
        weights file) symlinked elsewhere would make the server load whatever it points at."""
        root = self.dir.resolve()
        if not d.resolve().is_relative_to(root) or d.resolve() == root:
            raise AdapterRejected("version directory is a symlink to outside the registry", version, category="symlink")
        for p in d.iterdir():
            if not p.resolve().is_relative_to(d.resolve()):
                raise AdapterRejected(f"{p.name} is a symlink to outside the version directory", version,
                                      category="symlink")

    def manifest(self, version: int) -> Manifest:
        """The parsed manifest of `version` (AdapterRejected when it is missing or malformed)."""
        try:
            raw = json.loads((self.version_dir(version) / MANIFEST).read_text())
        except FileNotFoundError:
            raise AdapterRejected(f"{MANIFEST} missing", version, category="manifest") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterRejected(f"{MANIFEST} does not parse: {e}", version, category="manifest") from None
        return Manifest.parse(raw, version)

    def published_at(self, version: int) -> float | None:
        """When `version` was published: its manifest's `created_at`, else its dir's mtime (None: neither)."""
        try:
            return self.manifest(version).created_at or None
        except AdapterRejected:
            pass
        try:
            return self.version_dir(version).stat().st_mtime
        except OSError:
            return None

    def _event(self, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        path = self.dir / "events.jsonl"
        try:
            if path.stat().st_size > EVENTS_MAX_BYTES:
                os.replace(path, self.dir / "events.1.jsonl")  # bounded: one rotated generation
        except FileNotFoundError:
            pass
        append_jsonl(path, fields)

    # -- publishing -------------------------------------------------------------------------
    def _publish(self, write_files: Any, manifest: Mapping[str, Any], file_format: str, set_latest: bool) -> int:
        """Build a version dir under a temp name via `write_files(tmpdir)`, then rename it in."""
        tmp = self.dir / f"{TMP_PREFIX}{os.getpid()}-{time.time_ns()}"
        tmp.mkdir()
        try:
            write_files(tmp)
            weights, config = FILES_BY_FORMAT[file_format]
            for fname in (weights, config):
                if not (tmp / fname).is_file():
                    raise ValueError(f"a {file_format} drafter version needs {fname}")
            parent = self.latest()
            version = (max(self.list_versions(), default=0)) + 1
            while True:
                man = {
                    "version": version,
                    "parent_version": parent,
                    "target_version": 0,
                    "format": file_format,
                    "steps": 0,
                    "records_seen": 0,
                    "heldout_alpha": None,
                    **dict(manifest),
                }
                man["version"], man["format"] = version, file_format
                man.setdefault("created_at", time.time())
                (tmp / MANIFEST).write_text(json.dumps(man, indent=1, sort_keys=True))
                fsync_tree(tmp)
                dest = self.version_dir(version)
                if dest.exists():  # another publisher won the number
                    version += 1
                    continue
                try:
                    os.rename(tmp, dest)
                except OSError:
                    version += 1
                    continue
                break
            fsync_path(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._event(event="publish", version=version, parent_version=parent, format=file_format)
        if set_latest:
            self._set_latest(version)
        self.gc()
        return version

    def publish_drafter(self, codec: DrafterCodec, drafter: Any, manifest: Mapping[str, Any] | None = None,
                        set_latest: bool = True) -> int:
        """Publish `drafter` in its format (`dvi.registry.codec`): the codec writes the files, the registry the
        manifest, the rename and LATEST."""
        man = {"drafter_kind": codec.kind, **dict(manifest or {})}
        return self._publish(lambda tmp: codec.save(drafter, tmp), man, codec.format, set_latest)

    # -- validation and loading -------------------------------------------------------------
    def open_version(self, version: int, expected: Expected | None = None, drafter_kind: str | None = None,
                     file_format: str | None = None, draft_vocab_size: Any = _ANY
                     ) -> tuple[dict[str, torch.Tensor], Manifest]:
        """THE check of a version, for the server and the trainer alike: files confined to the registry,
        manifest parsed (`Manifest.parse`), fits the loading drafter (`Manifest.check_fits`, when
        `drafter_kind` is given), config parses, weights load, names/shapes/dtypes as `expected`, finite.
        Returns (state_dict, Manifest); anything wrong raises AdapterRejected(reason)."""
        d = self.version_dir(version)
        if not d.is_dir():
            raise AdapterRejected("version directory does not exist (yet)", version, category="missing", transient=True)
        self._check_confined(d, version)
        man = self.manifest(version)
        if drafter_kind is not None:
            man.check_fits(drafter_kind, file_format, draft_vocab_size)
        weights, config = FILES_BY_FORMAT[man.format]
        for fname in (weights, config):
            if not (d / fname).is_file():
                raise AdapterRejected(f"{fname} missing", version, category="files")
        try:
            json.loads((d / config).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise AdapterRejected(f"{config} does not parse: {e}", version, category="files") from None
        try:
            sd = load_file(str(d / weights))
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise AdapterRejected(f"{weights} does not load: {e}", version, category="load") from None
        if not sd:
            raise AdapterRejected(f"{weights} holds no tensors", version, category="load")
        if expected is not None:
            check_state_dict(sd, expected, version)
        for name, t in sd.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise AdapterRejected(f"tensor {name} has non-finite values", version, category="nonfinite")
        return sd, man

    # -- moving LATEST ----------------------------------------------------------------------
    def promote(self, version: int, expected: Expected | None = None) -> None:
        """The trainer's: point LATEST at an existing valid version (e.g. one published with set_latest=False)."""
        self.open_version(version, expected)
        prev = self.latest()
        self._set_latest(version)
        self._event(event="promote", version=version, previous=prev)

    def gc(self) -> list[int]:
        """Delete versions beyond the newest `keep_last`, never LATEST, pinned or served ones."""
        versions = self.list_versions()
        keep = set(versions[-self.keep_last :])
        for serving in self.served_everywhere().values():  # what any replica serves, would roll back to or pins
            keep |= {serving.version, serving.good, serving.pinned}
        cur = self.latest()
        if cur is not None:
            keep.add(cur)
        removed = []
        for v in versions:
            if v in keep:
                continue
            # Rename first so a reader never sees a half-deleted version dir.
            d = self.version_dir(v)
            trash = self.dir / f"{TMP_PREFIX}gc-{vname(v)}-{os.getpid()}"
            try:
                os.rename(d, trash)
            except FileNotFoundError:
                continue
            _remove_tree(trash)
            removed.append(v)
        # Temp dirs left by crashed publishers (a killed one's at once: its pid is gone; any other after
        # an hour); temp symlinks at once (a publisher never makes one, and rmtree refuses them).
        now = time.time()
        for p in self.dir.glob(f"{TMP_PREFIX}*"):
            try:
                if p.is_symlink() or _publisher_dead(p.name) or (p.is_dir() and now - p.stat().st_mtime > 3600):
                    _remove_tree(p)
            except FileNotFoundError:
                pass
        if removed:
            self._event(event="gc", removed=removed)
        return removed

