"""The embedded pair's drafter as dvi ships it: built once, stored in the repository, installed in seconds.

A new user should not pay the drafter's distillation (half an hour to an hour of a 2-core CPU) before the first
request. The separate drafter of a pretrained preset is a layer-skip Llama whose embeddings are the target's
(frozen in the build) and whose LM head only ever trained the draft-vocabulary rows (the rest are zero). So what
ships is what the target cannot give back: the decoder layers, the final norm and the LM head's draft-vocabulary
rows with their ids, in bf16 (`drafter.safetensors`), the draft vocabulary's priority order, and a manifest (`manifest.json`):
the GGUF's sha256 and the recipe's fingerprint it was built for, the command, commit and device that built it,
tokens trained, agreement per domain and draft-vocabulary size, and the digest of the full drafter it
reconstructs. `dvi bootstrap` converts the target from the wheel, checks the manifest against it and installs
the drafter (`install`); a mismatch builds from scratch and says why. `export` writes a built pair's drafter in
this form (`trainers.builds.ship_judge` refuses one that does not beat the shipped one).
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from dvi.drafters.vocab import DRAFT_VOCAB_FILE, save_draft_vocab
from dvi.fsutil import atomic_write_text
from dvi.models.embedded import EmbeddedPaths, PretrainedPreset
from dvi.models.pretrained import sha256_file

SHIPPED_ROOT = Path(__file__).resolve().parent / "shipped"
WEIGHTS = "drafter.safetensors"
MANIFEST = "manifest.json"
CURVE_PNG = "learning_curve.png"  # what the build leaves beside its manifest (trainers.builds.pretrained_build.CURVE_PNG)
HEAD_ROWS = "lm_head.rows"  # the LM head's trained (non-zero) rows
HEAD_IDS = "lm_head.ids"  # their token ids
FORMAT = 1


def shipped_dir(preset: str, root: Path | None = None) -> Path:
    return (root or SHIPPED_ROOT) / preset


@dataclass(frozen=True)
class Shipped:
    """A shipped drafter found for a preset: its dir and manifest."""

    path: Path
    manifest: dict

    @property
    def gguf_sha256(self) -> str:
        return self.manifest["gguf_sha256"]


def find(p: PretrainedPreset, root: Path | None = None) -> tuple[Shipped | None, str]:
    """The shipped drafter of `p` when there is one built by `p`'s current recipe, else None and why not."""
    return read(p, shipped_dir(p.name, root))


def read(p: PretrainedPreset, d: Path) -> tuple[Shipped | None, str]:
    """The shipped drafter in directory `d` when it was built by `p`'s current recipe for its wheel, else None and
    why not."""
    d = Path(d)
    try:
        m = json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return None, f"no shipped drafter for preset {p.name!r} (looked in {d})"
    except (OSError, ValueError) as e:
        return None, f"the shipped drafter's manifest {d / MANIFEST} is unreadable ({e})"
    if m.get("format") != FORMAT:
        return None, f"the shipped drafter at {d} has format {m.get('format')!r}, this dvi reads {FORMAT}"
    if m.get("fingerprint") != p.fingerprint():
        return None, (f"the shipped drafter was built by another recipe of preset {p.name!r} (fingerprint "
                      f"{m.get('fingerprint')}, the preset's is {p.fingerprint()})")
    if m.get("wheel_sha256") != p.sha256:
        return None, f"the shipped drafter was built for another wheel (sha256 {m.get('wheel_sha256')}, preset {p.sha256})"
    return Shipped(d, m), ""


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state dict's names, dtypes, shapes and bytes (sorted by name): the identity of a drafter's
    weights, whatever file holds them."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _shippable(drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors the target cannot rebuild: all but the embeddings, with the LM head cut to the rows
    the build trained (the others are zero) and their ids."""
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    head = drafter.lm_head.weight.detach()
    ids = head.ne(0).any(-1).nonzero().flatten()
    state[HEAD_ROWS] = head[ids].to(torch.bfloat16).contiguous()
    state[HEAD_IDS] = ids.to(torch.int64).contiguous()
    return state


def export(built: Path, p: PretrainedPreset, command: str, root: Path | None = None, commit: str | None = None) -> Path:
    """Write the separate drafter of the pair built at `built` as the shipped drafter of `p` (under `root`, default
    the package's), replacing any (`trainers.builds.ship_judge.ship_if_stronger` first checks it is stronger). `commit`:
    the code that built it (default: this checkout's HEAD)."""
    from safetensors.torch import save_file

    from dvi.models.embedded import read_manifest
    from dvi.models.loading import load_causal_lm

    paths = EmbeddedPaths.at(built)
    bm = read_manifest(built)
    if not bm or bm.get("fingerprint") != p.fingerprint():
        raise ValueError(f"{built} is not a pair built by preset {p.name!r}'s current recipe")
    drafter = load_causal_lm(paths.drafter, "cpu", "bfloat16")
    stored = _stored_order(paths.drafter)
    init = bm["drafter"].get("init")  # a refinement of a shipped drafter: its tokens count too
    manifest = {
        "format": FORMAT, "preset": p.name, "fingerprint": p.fingerprint(), "wheel_sha256": p.sha256,
        "gguf_sha256": bm["source"]["conversion"]["gguf_sha256"], "seed": bm["seed"],
        "command": command, "commit": commit or _commit(),
        "built_on": bm.get("built_on") or {"device": "cpu", "cpu": cpu_model(), "threads": bm.get("threads")},
        "created_at": bm["created_at"], "exported_at": time.time(),
        "tokens_trained": bm["drafter"]["train_tokens"] + int((init or {}).get("tokens_trained") or 0),
        "refined_from": init, "draft_vocab": int(stored.numel()),
        "serve_draft_vocab": p.serve_draft_vocab, "agreement": bm["agreement"],
        "drafter_digest": state_digest({k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()}),
        "build_manifest": {k: v for k, v in bm.items() if k not in ("source",)},
    }
    d = shipped_dir(p.name, root)
    d.mkdir(parents=True, exist_ok=True)
    tensors = _shippable(drafter)
    save_file(tensors, str(d / WEIGHTS), metadata={"format": str(FORMAT), "preset": p.name})
    save_draft_vocab(d, stored, int(drafter.config.vocab_size))
    names = [WEIGHTS, DRAFT_VOCAB_FILE]
    curve = Path(built) / CURVE_PNG
    if curve.is_file():  # the build's learning curve, for a reader deciding whether more tokens would pay
        shutil.copyfile(curve, d / CURVE_PNG)
        names.append(CURVE_PNG)
    manifest["files"] = {name: sha256_file(d / name) for name in names}
    manifest["bytes"] = sum((d / f).stat().st_size for f in manifest["files"])
    atomic_write_text(d / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return d


def install(shipped: Shipped, drafter, paths: EmbeddedPaths) -> dict:
    """Load the shipped weights into `drafter` (`load_into`) and save it to `paths.drafter`. Returns the manifest
    entries the pair records."""
    load_into(shipped, drafter)
    drafter.save_pretrained(str(paths.drafter))
    save_draft_vocab(paths.drafter, _stored_order(shipped.path), int(drafter.config.vocab_size))
    return {"shipped": {"path": str(shipped.path), "commit": shipped.manifest["commit"],
                        "built_on": shipped.manifest["built_on"], "command": shipped.manifest["command"],
                        "files": shipped.manifest["files"]}}


def load_into(shipped: Shipped, drafter):
    """The shipped weights loaded into `drafter` (the preset's drafter made from the converted target, bf16: it
    brings the target's embeddings), exactly as built (checked by digest); returns it."""
    from safetensors.torch import load_file

    for name, want in shipped.manifest["files"].items():
        got = sha256_file(shipped.path / name)
        if got != want:
            raise ValueError(f"shipped drafter file {shipped.path / name} has sha256 {got}, its manifest says {want}: "
                             "the checkout is damaged (git checkout -- the file) or the manifest is stale")
    tensors = load_file(str(shipped.path / WEIGHTS))
    rows, ids = tensors.pop(HEAD_ROWS), tensors.pop(HEAD_IDS)
    with torch.no_grad():
        head = torch.zeros_like(drafter.lm_head.weight)
        head[ids] = rows.to(head.dtype)
        drafter.lm_head.weight.copy_(head)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    expected_missing = {"model.embed_tokens.weight", "lm_head.weight"}
    if set(missing) - expected_missing or unexpected:
        raise ValueError(f"shipped drafter {shipped.path / WEIGHTS} does not fit the preset's drafter: "
                         f"missing {sorted(set(missing) - expected_missing)}, unexpected {sorted(unexpected)}")
    digest = state_digest(drafter.state_dict())
    if digest != shipped.manifest["drafter_digest"]:
        raise ValueError(f"the drafter rebuilt from {shipped.path} differs from the one that was built and measured "
                         f"(digest {digest[:16]} vs {shipped.manifest['drafter_digest'][:16]}): the target converted "
                         "here has other embeddings than the build's")
    return drafter


def _stored_order(d: Path) -> torch.Tensor:
    """The stored draft vocabulary in its priority order (`load_draft_vocab` sorts it)."""
    from safetensors.torch import load_file

    return load_file(str(Path(d) / DRAFT_VOCAB_FILE))["token_ids"]



def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (+ uncommitted changes)" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    """The CPU's model name (what every number measured on a CPU is quoted beside)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
