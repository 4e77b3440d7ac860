"""The drafter a vLLM child serves, as dvi keeps it: its tensors in memory and on disk, one safetensors shard per
decoder layer plus one for the rest (embeddings, final norm, head), behind a `model.safetensors.index.json` vLLM
loads at every (re)start.

A swap is a diff: the new version's tensors are compared with the served ones in memory (no file is read), only
the decoder layers that changed go to vLLM, whole (vLLM fuses q/k/v and gate/up, and a fused weight loaded from
some of its parts is broken), and only their shards are rewritten. A LoRA version changes the decoder's
projections and leaves the embeddings and the head, most of a small drafter's bytes, as they were.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dvi.registry.base import AdapterRejected, check_state_dict

from .vllm_process import owned_tensors, write_tensors

INDEX_FILE = "model.safetensors.index.json"
REST = "rest"


def shard_of(name: str) -> str:
    """The shard a checkpoint tensor lives in: "layer-3" for `model.layers.3.*`, REST for the others."""
    parts = name.split(".")
    return f"layer-{parts[2]}" if len(parts) > 3 and parts[1] == "layers" else REST


def shard_file(shard: str) -> str:
    return f"drafter-{shard}.safetensors"


class ServedDrafter:
    """What vLLM serves (module docstring). Owned by the engine thread."""

    def __init__(self, drafter_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.dir = Path(drafter_dir)
        self.tensors = owned_tensors(tensors)
        # the served version's own tensors, with their in-place version counters: a later version sharing one
        # (a LoRA version's merge shares the startup drafter's embeddings and head) needs no byte comparison.
        # Kept alive, so their storage is never reused by another tensor at the same address
        self._sources = _sources(tensors)
        self._candidate: dict[str, tuple[torch.Tensor, int]] = {}

    @classmethod
    def of_model(cls, drafter_dir: Path, model: Any) -> ServedDrafter:
        return cls(drafter_dir, model.state_dict())

    def write_all(self) -> None:
        """Every shard and the index (at export, before vLLM first starts)."""
        for old in self.dir.glob("*.safetensors"):
            old.unlink()
        self._write({shard_of(k) for k in self.tensors})
        index = {"metadata": {}, "weight_map": {k: shard_file(shard_of(k)) for k in sorted(self.tensors)}}
        (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=1))

    def diff(self, new: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        """The tensors of `new` vLLM must load to serve it: the whole shards where any tensor changed, as owned
        copies, checked (names and shapes equal to the served ones, finite) before vLLM sees them. Empty when `new`
        equals what is served (an identity LoRA)."""
        check_state_dict(new, self.tensors, version)  # the registry's check: names, shapes and dtypes
        changed = {shard_of(name) for name, t in new.items()
                   if not self._same_source(name, t) and not _same(t, self.tensors[name])}
        self._candidate = _sources(new)
        out = owned_tensors({k: v for k, v in new.items() if shard_of(k) in changed})
        for name, t in out.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise AdapterRejected(f"tensor {name} holds non-finite values", version, category="nonfinite")
        return out

    def commit(self, loaded: dict[str, torch.Tensor]) -> None:
        """`loaded` (a `diff`) is now what vLLM serves: kept, and its shards rewritten so a restarted vLLM serves it
        too."""
        self.tensors.update(loaded)
        self._sources, self._candidate = self._candidate, {}
        self._write({shard_of(k) for k in loaded})

    def _same_source(self, name: str, t: torch.Tensor) -> bool:
        """`t` is the served version's own tensor (the same storage, offset, shape and strides), not written in place
        since (autograd's version counter, which a tensor and its `detach()`ed views share)."""
        old, version = self._sources.get(name, (None, -1))
        return (old is not None and t.device == old.device and t.dtype == old.dtype and t.shape == old.shape
                and t.stride() == old.stride() and t.storage_offset() == old.storage_offset()
                and t.untyped_storage().data_ptr() == old.untyped_storage().data_ptr() and t._version == version)

    def _write(self, shards: set[str]) -> None:
        for shard in shards:
            write_tensors({k: v for k, v in self.tensors.items() if shard_of(k) == shard}, self.dir / shard_file(shard))


def _sources(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {k: (v, v._version) for k, v in tensors.items()}


def _same(new: torch.Tensor, served: torch.Tensor) -> bool:
    return bool(torch.equal(new.detach().to("cpu"), served))
