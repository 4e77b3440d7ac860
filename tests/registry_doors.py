"""The registry doors only tests use: publishing hand-made files (garbage a trainer never writes), a peft model's
adapter or a bare state dict, and loading a LoRA version into a live peft adapter in place. The production paths
are `DrafterRegistry.publish_drafter` (a format's codec writes the files) and
`dvi.registry.codec.load_drafter_version`."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dvi.registry.codec import FULL, LoraCodec
from dvi.registry.store import (
    FILES_BY_FORMAT,
    LORA_WEIGHTS,
    MANIFEST,
    AdapterRejected,
    DrafterRegistry,
    Manifest,
)


def publish_peft_adapter(reg: DrafterRegistry, peft_model: Any, manifest: Mapping[str, Any] | None = None,
                         adapter_name: str = "default", set_latest: bool = True) -> int:
    """One LoRA adapter of a peft model, through `LoraCodec` (the files a trainer's LoRA publish writes)."""
    if adapter_name not in peft_model.peft_config:
        raise ValueError(f"peft model has no adapter {adapter_name!r}")
    return reg.publish_drafter(LoraCodec(adapter_name), peft_model, manifest, set_latest)


class _Weights:
    """What `FULL`'s writer reads of a drafter: its state dict and config."""

    def __init__(self, state_dict: Mapping[str, Any], config: Any) -> None:
        self._sd, self.config = state_dict, config

    def state_dict(self) -> Mapping[str, Any]:
        return self._sd


def publish_full(reg: DrafterRegistry, state_dict: Mapping[str, Any], config: Any,
                 manifest: Mapping[str, Any] | None = None, set_latest: bool = True) -> int:
    """A whole small drafter from its weights, through `FULL` (a state dict no trainer made: any keys, any config)."""
    return reg.publish_drafter(FULL, _Weights(state_dict, config), manifest, set_latest)


def publish_files(reg: DrafterRegistry, files: Mapping[str, bytes | str | os.PathLike], manifest: Mapping[str, Any],
                  set_latest: bool = True) -> int:
    """Publish files given as bytes or paths (name -> content); the format comes from the file names."""
    file_format = manifest.get("format") or ("lora" if LORA_WEIGHTS in files else "full")
    if file_format not in FILES_BY_FORMAT:
        raise ValueError(f"manifest format must be 'lora' or 'full', got {file_format!r}")
    for name in files:
        if "/" in name or name in (MANIFEST, "") or name.startswith("."):
            raise ValueError(f"bad file name {name!r}")

    def write(tmp: Path) -> None:
        for name, content in files.items():
            if isinstance(content, bytes | bytearray):
                (tmp / name).write_bytes(content)
            else:
                shutil.copyfile(content, tmp / name)

    return reg._publish(write, manifest, file_format, set_latest)


def load_adapter_into(reg: DrafterRegistry, peft_model: Any, version: int | None = None,
                      adapter_name: str = "default") -> Manifest:
    """Validate `version` against the live adapter's names/shapes and load it in place.

    Float tensors are cast to the live adapter's dtype. Returns the manifest. If the model
    has no adapter `adapter_name` yet, it is created from the version dir with `load_adapter`.
    """
    if version is None:
        version = reg.latest()
        if version is None:
            raise AdapterRejected("registry has no LATEST version")
    if adapter_name not in peft_model.peft_config:
        _, man = reg.open_version(version, drafter_kind="separate", file_format="lora")
        peft_model.load_adapter(str(reg.version_dir(version)), adapter_name=adapter_name)
        return man
    codec = LoraCodec(adapter_name)
    live = codec.state(peft_model)
    sd, man = reg.open_version(version, {k: (tuple(v.shape), None) for k, v in live.items()},
                               drafter_kind="separate", file_format="lora")
    try:
        codec.load_state(peft_model, {k: v.to(dtype=live[k].dtype) for k, v in sd.items()})
    except ValueError as exc:
        raise AdapterRejected(f"peft did not place every tensor: {exc}", version) from None
    return man
