"""Building a servable drafter from a registry version: `load_drafter_version(registry, version, base)`.

Its own module so the swapper (`serving.swap`) reads as policy. Every check of the version itself is
`DrafterRegistry.open_version` (manifest, kind, draft vocabulary, files, tensors); what is here is what
only a live drafter can check: its architecture, its module shapes, finiteness after loading.

LoRA versions are applied to a pristine copy of the base drafter and merged (`merge_and_unload`), so a
served LoRA drafter costs exactly what the base drafter costs. Early-exit and eagle versions are rebuilt
on the live target (shared Parameters, LoRA never merged: that would write into the target).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch

from dvi.drafters.learned import ADAPTER_CONFIG, Drafter, SharedTargetDrafter
from dvi.drafters.vocab import apply_draft_vocab, find_subset_head
from dvi.registry.store import AdapterRejected, DrafterRegistry, Manifest, check_state_dict

MAX_CONFIG_BYTES = 1 << 20
# config keys that fix a drafter's architecture and size; a `full` version must match the live one
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "head_dim", "tie_word_embeddings")


def check_full_config(d: Any, version: int, base: torch.nn.Module) -> None:
    """Compare a `full` version's config.json with the live drafter's before anything is built:
    instantiating a config first costs seconds (and memory) for a huge one, and a drafter of
    another architecture would otherwise be promoted."""
    path = d / "config.json"
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"config.json is {path.stat().st_size} bytes (> {MAX_CONFIG_BYTES})", version,
                              kind="architecture")
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise AdapterRejected("config.json is not a JSON object", version, kind="architecture")
    live = base.config.to_dict()
    for key in ARCH_KEYS:
        if key in live and cfg.get(key, live[key]) != live[key]:
            raise AdapterRejected(f"config.json {key}={cfg.get(key)!r}, the live drafter has {live[key]!r}",
                                  version, kind="architecture")


def _module(drafter: Any) -> torch.nn.Module:
    """The HF-style module whose `.logits` are the drafter's (for shadow checks)."""
    return drafter.model if isinstance(drafter, Drafter) else drafter


def _open(registry: DrafterRegistry, version: int, base: Any) -> tuple[dict[str, torch.Tensor], Manifest]:
    """`open_version` for the live drafter: its kind ("separate" for a LoRA/full drafter) and draft vocabulary."""
    head = find_subset_head(_module(base))
    kind = base.kind if isinstance(base, SharedTargetDrafter) else "separate"
    return registry.open_version(version, drafter_kind=kind, draft_vocab_size=None if head is None else head.num_ids)


def load_shared_target_version(registry: DrafterRegistry, version: int, base: Any) -> tuple[Any, Manifest]:
    """Validated drafter of `version` of the live drafter's kind (early_exit: LoRA + exit head, unmerged;
    eagle: fc + layer + norm), built on the live drafter's target."""
    kind = base.kind
    sd, man = _open(registry, version, base)
    d = registry.version_dir(version)
    try:
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterRejected(f"{ADAPTER_CONFIG} does not load: {exc}", version, kind="files") from None
    if not isinstance(cfg, dict) or cfg.get("dvi_kind") != kind:
        raise AdapterRejected(f"not an {kind} drafter (adapter_config.json lacks dvi_kind {kind!r})", version,
                              kind="architecture")
    live = base.trainable_state_dict()
    check_state_dict(sd, {k: (tuple(v.shape), None) for k, v in live.items()}, version)
    head = find_subset_head(base.model)
    try:
        drafter = type(base).load(base.target_ref, d, vocab_ids=head.token_ids.cpu() if head is not None else None)
    except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
        raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, kind="load") from None
    for name, p in drafter.trainable_state_dict().items():
        if not bool(torch.isfinite(p).all()):
            raise AdapterRejected(f"parameter {name} is not finite after loading", version, kind="nonfinite")
    return drafter, man


def load_drafter_version(registry: DrafterRegistry, version: int, base: Any) -> tuple[Any, Manifest]:
    """Validated drafter of `version`: base + merged LoRA, a full model, or an early-exit drafter.

    Raises AdapterRejected with the reason for anything that does not load or fit.
    """
    if isinstance(base, SharedTargetDrafter):
        return load_shared_target_version(registry, version, base)
    sd, man = _open(registry, version, base)
    d = registry.version_dir(version)
    ref = next(base.parameters())
    try:
        if man.kind == "lora":
            from peft import PeftModel, get_peft_model_state_dict

            pm = PeftModel.from_pretrained(copy.deepcopy(base), str(d), is_trainable=False)
            live = get_peft_model_state_dict(pm)
            check_state_dict(sd, {k: (tuple(v.shape), None) for k, v in live.items()}, version)
            model = pm.merge_and_unload()
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            check_full_config(d, version, base)
            config = AutoConfig.from_pretrained(str(d))
            model = AutoModelForCausalLM.from_config(config)
            expected = {k: (tuple(v.shape), None) for k, v in model.state_dict().items()}
            tied = {k for k in expected if k not in sd and k.endswith("lm_head.weight")}
            check_state_dict(sd, {k: v for k, v in expected.items() if k not in tied}, version)
            model.load_state_dict(sd, strict=not tied)
            if tied:
                model.tie_weights()
    except AdapterRejected:
        raise
    except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
        raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, kind="load") from None
    base_rows = base.get_output_embeddings().weight.shape[0]
    rows = model.get_output_embeddings().weight.shape[0]
    if rows != base_rows:
        raise AdapterRejected(f"vocabulary has {rows} rows, the live drafter {base_rows}", version, kind="shape")
    head = find_subset_head(base)
    if head is not None and find_subset_head(model) is None:  # a full version: same draft vocabulary as live
        apply_draft_vocab(model, head.token_ids.cpu())
    model = model.to(device=ref.device, dtype=ref.dtype).eval()
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise AdapterRejected(f"parameter {name} is not finite after loading", version, kind="nonfinite")
    return model, man
