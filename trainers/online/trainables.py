"""The drafter as the trainer sees it: three kinds (LoRA, full, early-exit) behind one interface.

Its own module so the trainer is written once against `Trainable` (parameters, forward module,
state snapshot/restore, publish) and a new drafter kind is one class here, not branches there.
`load_drafter_for_training` loads the drafter the config names, as the server does.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dvi.config import DviConfig
from dvi.registry.store import DrafterRegistry, check_state_dict

if TYPE_CHECKING:
    from dvi.drafters.learned import Drafter


class Trainable(ABC):
    """What the trainer needs from a drafter kind: params, forward, snapshot/restore, publish."""

    kind = "base"
    publish_kind = "lora"

    def __init__(self, module: nn.Module) -> None:
        self.module = module  # the nn.Module that is trained (accelerate prepares it)

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def forward_module(self) -> nn.Module:
        return self.module

    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The trained weights, keyed as they are published."""

    @abstractmethod
    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Restore weights from `state()` (checkpoint resume, rollback to a published version)."""

    @abstractmethod
    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        """Write the current weights to the registry; returns the new version."""

    def load_version(self, registry: DrafterRegistry, version: int) -> dict[str, torch.Tensor]:
        """A published version's weights as a `state()`-shaped dict (checked by `DrafterRegistry.open_version`)."""
        sd, _ = registry.open_version(version, drafter_kind=self.kind, publish_kind=self.publish_kind)
        own = self.state()
        # a full version may leave out a tied lm_head; tensors this drafter does not train are ignored
        need = {k: (tuple(v.shape), None) for k, v in own.items()
                if not (self.kind == "full" and k.endswith("lm_head.weight") and k not in sd)}
        check_state_dict({k: v for k, v in sd.items() if k in need}, need, version)
        return {k: sd[k].to(own[k].dtype) for k in own if k in sd}


def _clone(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


class _LoraTrainable(Trainable):
    kind = "lora"
    publish_kind = "lora"

    def state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return _clone(get_peft_model_state_dict(self.module))

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        dev = next(self.module.parameters()).device
        res = set_peft_model_state_dict(self.module, {k: v.to(dev) for k, v in sd.items()})
        bad = list(getattr(res, "unexpected_keys", []) or [])
        if bad:
            raise ValueError(f"LoRA state has tensors this adapter lacks: {bad[:3]}")

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        return registry.publish_peft_adapter(self.module, manifest)


class _FullTrainable(Trainable):
    kind = "full"
    publish_kind = "full"

    def state(self) -> dict[str, torch.Tensor]:
        return _clone(self.module.state_dict())

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        res = self.module.load_state_dict(dict(sd), strict=False)
        missing = [k for k in res.missing_keys if not k.endswith("lm_head.weight")]
        if missing or res.unexpected_keys:
            raise ValueError(f"full state does not fit: missing {missing[:3]}, unexpected {res.unexpected_keys[:3]}")
        if hasattr(self.module, "tie_weights"):
            self.module.tie_weights()

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        return registry.publish_full(self.module.state_dict(), self.module.config, manifest)


class _SharedTargetTrainable(Trainable):
    """A drafter on the target's own weights, which stay frozen: the early-exit drafter's LoRA + exit
    head, or an eagle head's fc + layer + norm (published as `publish_kind` "lora": a small file set)."""

    publish_kind = "lora"

    def __init__(self, drafter: Any) -> None:
        super().__init__(drafter.model)
        self.drafter = drafter
        self.kind = drafter.kind

    def parameters(self) -> list[nn.Parameter]:
        return list(self.drafter.trainable_parameters())

    def state(self) -> dict[str, torch.Tensor]:
        return _clone(self.drafter.trainable_state_dict())

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        self.drafter.load_trainable_state_dict(dict(sd))

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        from safetensors.torch import save

        from dvi.drafters.learned import ADAPTER_CONFIG, ADAPTER_WEIGHTS

        blob = save(self.state(), metadata={"format": "pt"})
        cfg = json.dumps(self.drafter.config_dict(), indent=2)
        return registry.publish({ADAPTER_WEIGHTS: blob, ADAPTER_CONFIG: cfg.encode()}, {**manifest, "kind": "lora"})


def make_trainable(drafter: nn.Module | Drafter, mode: str, cfg: DviConfig) -> Trainable:
    from dvi.drafters.learned import EarlyExitDrafter, SharedTargetDrafter

    t = cfg.trainer
    if isinstance(drafter, SharedTargetDrafter):
        if mode == "full" and isinstance(drafter, EarlyExitDrafter):
            raise ValueError("trainer.mode 'full' trains a separate drafter; the early-exit drafter trains LoRA + head")
        for p in drafter.target_ref.parameters():
            p.requires_grad_(False)
        for p in drafter.trainable_parameters():
            p.requires_grad_(True)
        return _SharedTargetTrainable(drafter)
    if mode == "full":
        if hasattr(drafter, "peft_config"):
            raise ValueError("trainer.mode 'full' needs a plain HF model, got a peft model")
        for p in drafter.parameters():
            p.requires_grad_(True)
        return _FullTrainable(drafter)
    if not hasattr(drafter, "peft_config"):
        from peft import LoraConfig, get_peft_model

        names = {n.rsplit(".", 1)[-1] for n, m in drafter.named_modules() if isinstance(m, nn.Linear)}
        targets = [x for x in t.lora_targets if x in names]
        if not targets:
            raise ValueError(f"trainer.lora_targets {t.lora_targets} match no Linear module of the drafter "
                             f"(it has {sorted(names)})")
        lcfg = LoraConfig(r=t.lora_rank, lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout,
                          target_modules=targets, bias="none")
        drafter = get_peft_model(drafter, lcfg)
    return _LoraTrainable(drafter)



def load_drafter_for_training(cfg: DviConfig, accelerator: Any = None) -> tuple[Any, int]:
    """The drafter to train, as the config describes it: (model, EarlyExitDrafter or EagleDrafter, pad id)."""
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import find_tokenizer_path, load_causal_lm, load_tokenizer

    m = cfg.models
    device = accelerator.device if accelerator is not None else m.device
    # fp32 master weights for training on any device; bf16 autocast is accelerate's business.
    dtype = "float32"
    if m.target is not None:
        target_path, drafter_path = Path(m.target), (Path(m.drafter) if m.drafter else None)
        tok_path = Path(m.tokenizer) if m.tokenizer else find_tokenizer_path(target_path)
    else:
        p = embedded_paths(m.preset)
        target_path, drafter_path = p.target, (Path(m.drafter) if m.drafter else p.drafter)
        tok_path = Path(m.tokenizer) if m.tokenizer else p.tokenizer
    try:
        tok = load_tokenizer(tok_path)
        pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else 0)
    except Exception:  # noqa: BLE001 - padding is masked anyway; any valid id will do
        pad_id = 0
    if m.learned_kind is None:
        raise ValueError("models.drafter_kind is suffix: there is no learned drafter to train")
    if m.learned_kind in ("early_exit", "eagle"):
        from dvi.models.loading import load_shared_target_drafter

        target = load_causal_lm(target_path, device, dtype)
        return load_shared_target_drafter(target, target_path, cfg), pad_id  # the server builds the same one
    if drafter_path is None:
        raise ValueError("models.drafter is not set and there is no embedded drafter: nothing to train")
    from dvi.drafters.vocab import apply_draft_vocab, load_draft_vocab
    from dvi.models.loading import draft_vocab_size_for

    drafter = load_causal_lm(drafter_path, device, dtype)
    rows = int(drafter.get_output_embeddings().weight.shape[0])
    ids = load_draft_vocab(m.draft_vocab or drafter_path, draft_vocab_size_for(m), rows)  # as `dvi.models.loading.load_pair`
    return (apply_draft_vocab(drafter, ids) if ids is not None else drafter), pad_id

