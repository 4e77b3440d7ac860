"""One codec per drafter format: how a version's files are written, read back with validation, and what trained
weights they hold. The trainer (`trainers.online.trainables`), the registry (`DrafterRegistry.publish_drafter`), the swapper
and the demo replay (`load_drafter_version`, `load_group_version`, `scoring_module`) all go through these, so a format is written in one place and read in one.

| codec | drafter (`kind`, the config's `models.drafter_kind` names) | files (manifest `format`) |
|---|---|---|
| `LORA` | `separate`: an HF causal LM under a peft LoRA | `adapter_model.safetensors` + peft's `adapter_config.json` ("lora") |
| `FULL` | `separate`: an HF causal LM, every weight | `model.safetensors` + `config.json` ("full") |
| `SharedTargetCodec` | `early_exit` / `eagle` on the target's weights | `SharedTargetDrafter.save`'s own weights + `adapter_config.json` with `dvi_kind` ("lora") |

Every read first passes the registry's one file-level check (`DrafterRegistry.open_version`: confinement,
manifest, fit, parse, finite); what is here checks what only a drafter can: names and shapes of the weights it
holds, its architecture, finiteness once built.
"""

from __future__ import annotations

import copy
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dvi.drafters.adapters import LoraFactors
from dvi.drafters.learned import ADAPTER_CONFIG, Drafter, SharedTargetDrafter
from dvi.drafters.vocab import apply_draft_vocab, find_subset_head
from dvi.registry.base import AdapterRejected, check_state_dict

FULL_WEIGHTS = "model.safetensors"
FULL_CONFIG = "config.json"
MAX_CONFIG_BYTES = 1 << 20
# config keys that fix a drafter's architecture and size; a `full` version must match the live one
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "head_dim", "tie_word_embeddings")


class VersionSource(Protocol):
    """What a codec reads versions from (`DrafterRegistry`)."""

    def open_version(self, version: int, expected: Any = None, drafter_kind: str | None = None,
                     file_format: str | None = None, draft_vocab_size: Any = ...) -> tuple[dict, Any]: ...

    def version_dir(self, version: int) -> Path: ...


def _cpu_clone(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # clone() breaks storage sharing (tied weights), which safetensors refuses to save
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def _shapes(sd: Mapping[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], None]]:
    return {k: (tuple(v.shape), None) for k, v in sd.items()}


def _check_finite(named: Any, version: int) -> None:
    for name, p in named:
        if not bool(torch.isfinite(p).all()):
            raise AdapterRejected(f"parameter {name} is not finite after loading", version, category="nonfinite")


def scoring_module(drafter: Any) -> nn.Module:
    """The HF-style module whose `.logits` are a drafter's (what a shadow check scores)."""
    return drafter.model if isinstance(drafter, Drafter) else drafter


class DrafterCodec(ABC):
    """One format: `state` / `load_state` (the trained weights, keyed as published), `save` (a version dir's
    files), `read_state` (a version's weights, validated against a like drafter) and `build` (a servable drafter
    from a validated version)."""

    kind = "separate"  # the drafter kind (`models.drafter_kind`'s names): the manifest's drafter_kind
    format = "lora"  # which files a version dir holds: the manifest's format (`FILES_BY_FORMAT`)

    @abstractmethod
    def state(self, drafter: Any) -> dict[str, torch.Tensor]:
        """The trained weights, as CPU copies keyed as published."""

    @abstractmethod
    def load_state(self, drafter: Any, sd: Mapping[str, torch.Tensor]) -> None:
        """Put `state()`-shaped weights into `drafter` (checkpoint resume, the served version's weights)."""

    @abstractmethod
    def save(self, drafter: Any, path: Path) -> None:
        """Write the version files of `drafter` into dir `path` (the registry adds the manifest)."""

    def read_state(self, source: VersionSource, version: int, like: Any) -> dict[str, torch.Tensor]:
        """A published version's weights as a `state(like)`-shaped dict in `like`'s dtypes; tensors `like` does not
        train are ignored, any it trains must be there with its shape (AdapterRejected otherwise)."""
        sd, _ = source.open_version(version, drafter_kind=self.kind, file_format=self.format)
        own = self.state(like)
        need = {k: spec for k, spec in _shapes(own).items() if k in sd or not self._optional(k)}
        check_state_dict({k: v for k, v in sd.items() if k in need}, need, version)
        return {k: sd[k].to(own[k].dtype) for k in own if k in sd}

    def _optional(self, name: str) -> bool:
        """A trained tensor a version may leave out (a full version's tied lm_head)."""
        return False

    @abstractmethod
    def build(self, source: VersionSource, version: int, base: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        """A servable drafter of `version` (its weights `sd`, opened and checked by the registry) built from the live
        `base` (AdapterRejected if it does not fit)."""


class LoraCodec(DrafterCodec):
    """A peft LoRA (`adapter_name`) of a separate drafter, written by peft's own `save_pretrained` (the dir also
    loads with `PeftModel.from_pretrained`); served merged into a pristine copy of the base (`merge_and_unload`),
    so it costs exactly what the base drafter costs."""

    def __init__(self, adapter_name: str = "default") -> None:
        self.adapter_name = adapter_name

    def state(self, drafter: Any) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return _cpu_clone(get_peft_model_state_dict(drafter, adapter_name=self.adapter_name))

    def load_state(self, drafter: Any, sd: Mapping[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        dev = next(drafter.parameters()).device
        res = set_peft_model_state_dict(drafter, {k: v.to(dev) for k, v in sd.items()}, adapter_name=self.adapter_name)
        bad = list(getattr(res, "unexpected_keys", []) or [])
        if bad:
            raise ValueError(f"LoRA state has tensors this adapter lacks: {bad[:3]}")

    def save(self, drafter: Any, path: Path) -> None:
        name = self.adapter_name
        if name not in drafter.peft_config:
            raise ValueError(f"peft model has no adapter {name!r}")
        drafter.save_pretrained(str(path), selected_adapters=[name], safe_serialization=True)
        if name != "default":  # peft puts a named adapter in its own subdir
            for f in (path / name).iterdir():
                f.rename(path / f.name)
            (path / name).rmdir()
        (path / "README.md").unlink(missing_ok=True)  # peft's model card: a version dir holds weights and config

    def build(self, source: VersionSource, version: int, base: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        from peft import PeftModel, get_peft_model_state_dict

        try:
            d = source.version_dir(version)
            pm = PeftModel.from_pretrained(copy.deepcopy(base, _shared_untargeted(base, d)), str(d), is_trainable=False)
            check_state_dict(sd, _shapes(get_peft_model_state_dict(pm)), version)
            return pm.merge_and_unload()
        except AdapterRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
            raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, category="load") from None


def _shared_untargeted(base: nn.Module, version_dir: Path) -> dict[int, Any]:
    """A deepcopy memo that keeps every parameter of a module the adapter does not target shared with the base, not
    copied: a merge writes only the adapted projections, and the rest (the embedding table, the LM head, the norms)
    is most of a drafter's memory, held once per kept version and per traffic group's adapter version. Only the
    embeddings are shared when the targets are a pattern; nothing when the adapter targets embeddings or head."""
    try:
        targets = json.loads((version_dir / ADAPTER_CONFIG).read_text()).get("target_modules") or []
    except (OSError, ValueError, AttributeError):
        return {}
    if not isinstance(targets, str) and {"embed_tokens", "lm_head"} & set(targets):
        return {}
    if isinstance(targets, str):  # a regex over module names: share what no pattern can adapt
        return {id(m.weight): m.weight for m in base.modules() if isinstance(m, nn.Embedding)}
    adapted = {name for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in set(targets)}
    return {id(p): p for name, p in base.named_parameters()
            if name.rpartition(".")[0] not in adapted}


class FullCodec(DrafterCodec):
    """Every weight of a separate drafter (full distillation): `model.safetensors` + `config.json`."""

    format = "full"

    def state(self, drafter: Any) -> dict[str, torch.Tensor]:
        return _cpu_clone(drafter.state_dict())

    def _optional(self, name: str) -> bool:
        return name.endswith("lm_head.weight")

    def load_state(self, drafter: Any, sd: Mapping[str, torch.Tensor]) -> None:
        res = drafter.load_state_dict(dict(sd), strict=False)
        missing = [k for k in res.missing_keys if not self._optional(k)]
        if missing or res.unexpected_keys:
            raise ValueError(f"full state does not fit: missing {missing[:3]}, unexpected {res.unexpected_keys[:3]}")
        if hasattr(drafter, "tie_weights"):
            drafter.tie_weights()

    def save(self, drafter: Any, path: Path) -> None:
        write_full(path, drafter.state_dict(), drafter.config)

    def build(self, source: VersionSource, version: int, base: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        from transformers import AutoConfig, AutoModelForCausalLM

        d = source.version_dir(version)
        try:
            check_full_config(d, version, base)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(d)))
            expected = _shapes(model.state_dict())
            tied = {k for k in expected if k not in sd and self._optional(k)}
            check_state_dict(sd, {k: v for k, v in expected.items() if k not in tied}, version)
            model.load_state_dict(dict(sd), strict=not tied)
            if tied:
                model.tie_weights()
        except AdapterRejected:
            raise
        except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
            raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, category="load") from None
        head = find_subset_head(base)
        if head is not None and find_subset_head(model) is None:  # the same draft vocabulary as the live drafter
            apply_draft_vocab(model, head.token_ids.cpu())
        return model


def write_full(path: Path, state_dict: Mapping[str, torch.Tensor], config: Any) -> None:
    """The full format's files: `model.safetensors` and the config (an HF config, or a plain dict)."""
    from safetensors.torch import save_file

    save_file(_cpu_clone(state_dict), str(path / FULL_WEIGHTS), metadata={"format": "pt"})
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(str(path))
    else:
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        (path / FULL_CONFIG).write_text(json.dumps(cfg, indent=1, sort_keys=True))


class SharedTargetCodec(DrafterCodec):
    """An early-exit or eagle drafter: its own weights over the target's (`trainable_state_dict`) and the config
    that rebuilds it on a target (`adapter_config.json` with its `dvi_kind`); never merged (that would write into
    the target)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def state(self, drafter: Any) -> dict[str, torch.Tensor]:
        return _cpu_clone(drafter.trainable_state_dict())

    def load_state(self, drafter: Any, sd: Mapping[str, torch.Tensor]) -> None:
        drafter.load_trainable_state_dict(dict(sd))

    def save(self, drafter: Any, path: Path) -> None:
        drafter.save(path)  # the format's one writer is the drafter's own

    def build(self, source: VersionSource, version: int, base: Any, sd: Mapping[str, torch.Tensor]) -> Any:
        d = source.version_dir(version)
        try:
            cfg = json.loads((d / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise AdapterRejected(f"{ADAPTER_CONFIG} does not load: {exc}", version, category="files") from None
        if not isinstance(cfg, dict) or cfg.get("dvi_kind") != self.kind:
            raise AdapterRejected(f"not an {self.kind} drafter (adapter_config.json lacks dvi_kind {self.kind!r})",
                                  version, category="architecture")
        check_state_dict(sd, _shapes(base.trainable_state_dict()), version)
        head = find_subset_head(base.model)
        try:
            return type(base).load(base.target_ref, d, vocab_ids=head.token_ids.cpu() if head is not None else None)
        except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
            raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, category="load") from None


LORA = LoraCodec()
FULL = FullCodec()


def check_full_config(d: Path, version: int, base: nn.Module) -> None:
    """Compare a `full` version's config.json with the live drafter's before anything is built:
    instantiating a config first costs seconds (and memory) for a huge one, and a drafter of
    another architecture would otherwise be promoted."""
    path = d / FULL_CONFIG
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"config.json is {path.stat().st_size} bytes (> {MAX_CONFIG_BYTES})", version,
                              category="architecture")
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise AdapterRejected("config.json is not a JSON object", version, category="architecture")
    live = base.config.to_dict()
    for key in ARCH_KEYS:
        if key in live and cfg.get(key, live[key]) != live[key]:
            raise AdapterRejected(f"config.json {key}={cfg.get(key)!r}, the live drafter has {live[key]!r}",
                                  version, category="architecture")


def _open_for(source: VersionSource, version: int, base: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """`open_version` for the live drafter `base`: its kind ("separate" for a LoRA/full drafter) and draft
    vocabulary."""
    head = find_subset_head(scoring_module(base))
    kind = base.kind if isinstance(base, SharedTargetDrafter) else "separate"
    return source.open_version(version, drafter_kind=kind, draft_vocab_size=None if head is None else head.num_ids)


def load_drafter_version(source: VersionSource, version: int, base: Any) -> tuple[Any, Any]:
    """(servable drafter, Manifest) of `version` on the live drafter `base`: base + merged LoRA, a full model, or
    an early-exit / eagle drafter on base's target; on base's device and dtype, finite. AdapterRejected otherwise."""
    sd, man = _open_for(source, version, base)
    if isinstance(base, SharedTargetDrafter):
        model = SharedTargetCodec(base.kind).build(source, version, base, sd)
        _check_finite(model.trainable_state_dict().items(), version)
        return model, man
    return _servable((LORA if man.format == "lora" else FULL).build(source, version, base, sd), base, version), man


def load_group_version(source: VersionSource, version: int, base: Any, sizes: Mapping[str, int],
                       num_layers: int) -> tuple[Any, LoraFactors]:
    """A traffic group's version (issue 40), from one read: the merged drafter its gates score and the
    `LoraFactors` its rows are served with (`sizes`: the base drafter's projection rows). AdapterRejected when it
    is not a LoRA adapter of `base` or does not fit it."""
    sd, man = _open_for(source, version, base)
    if man.format != "lora" or isinstance(base, SharedTargetDrafter):
        raise AdapterRejected(f"a group's version must be a LoRA adapter, this one is {man.format!r}", version,
                              category="architecture")
    model = _servable(LORA.build(source, version, base, sd), base, version)
    try:
        conf = json.loads((source.version_dir(version) / ADAPTER_CONFIG).read_text())
        r, alpha = int(conf["r"]), float(conf["lora_alpha"])
        scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
        return model, LoraFactors.from_peft(sd, scale, sizes, num_layers)
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise AdapterRejected(f"adapter does not fit the drafter: {exc}", version, category="shape") from None


def _servable(model: Any, base: Any, version: int) -> Any:
    """A built drafter checked against `base` (its vocabulary rows), on base's device and dtype, finite."""
    rows, base_rows = (m.get_output_embeddings().weight.shape[0] for m in (model, base))
    if rows != base_rows:
        raise AdapterRejected(f"vocabulary has {rows} rows, the live drafter {base_rows}", version, category="shape")
    ref = next(base.parameters())
    model = model.to(device=ref.device, dtype=ref.dtype).eval()
    _check_finite(model.named_parameters(), version)
    return model
