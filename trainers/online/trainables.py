"""The drafter as the trainer sees it: every kind (LoRA, full, early exit, eagle) behind one `Trainable`.

Its own module so the trainer is written once against `Trainable` (parameters, forward module, and through its
format's codec, `dvi.registry.codec`: state snapshot/restore, publish, a published version's weights); a new
drafter format is a codec, not branches here. `load_drafter_for_training` loads the drafter the config names, as
the server does.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dvi.config import DviConfig
from dvi.registry.codec import FULL, LORA, DrafterCodec, LoraCodec, SharedTargetCodec
from dvi.registry.store import DrafterRegistry

if TYPE_CHECKING:
    from dvi.drafters.learned import Drafter


class Trainable:
    """What the trainer needs from a drafter kind: the parameters it optimises and the module it runs; weights in
    and out (state, resume, publish, a published version's weights) are its format's codec's
    (`dvi.registry.codec`), the same the registry, the swapper and the demo replay use."""

    def __init__(self, module: nn.Module, codec: DrafterCodec, drafter: Any = None, adapter: str | None = None) -> None:
        self.module = module  # the nn.Module that is trained (accelerate prepares it)
        self.codec = codec
        self.drafter = drafter if drafter is not None else module  # what the codec reads and writes
        self.kind = codec.kind  # `models.drafter_kind`'s learned names
        self.format = codec.format  # which files it publishes (lora | full)
        self.adapter = adapter  # one of several named LoRA adapters on a shared peft model (a traffic group's)

    def activate(self) -> None:
        """Make this trainable's adapter the peft model's active one (before a forward that trains or scores it)."""
        if self.adapter is not None and self.module.active_adapter != self.adapter:
            self.module.set_adapter(self.adapter)

    def parameters(self) -> list[nn.Parameter]:
        if isinstance(self.codec, SharedTargetCodec):
            return list(self.drafter.trainable_parameters())
        if self.adapter is not None:
            return [p for n, p in self.module.named_parameters() if f".{self.adapter}." in n]
        return [p for p in self.module.parameters() if p.requires_grad]

    def state(self) -> dict[str, torch.Tensor]:
        """The trained weights, keyed as they are published."""
        return self.codec.state(self.drafter)

    def load_state(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Restore weights from `state()` (checkpoint resume, the served version's weights)."""
        self.codec.load_state(self.drafter, sd)

    def publish(self, registry: DrafterRegistry, manifest: dict) -> int:
        """Write the current weights to the registry; returns the new version."""
        return registry.publish_drafter(self.codec, self.drafter, manifest)

    def load_version(self, registry: DrafterRegistry, version: int) -> dict[str, torch.Tensor]:
        """A published version's weights as a `state()`-shaped dict (checked by `DrafterRegistry.open_version`)."""
        return self.codec.read_state(registry, version, self.drafter)


def group_trainable(peft_model: nn.Module, adapter: str) -> Trainable:
    """A traffic group's adapter `adapter` on the shared peft model (added, like its default adapter, on first use;
    a fresh LoRA's B is zero, so it starts as the base drafter)."""
    if not hasattr(peft_model, "peft_config"):
        raise ValueError("a group adapter needs the shared drafter wrapped in peft (trainer.mode lora)")
    if adapter not in peft_model.peft_config:
        peft_model.add_adapter(adapter, copy.deepcopy(peft_model.peft_config["default"]))
    peft_model.set_adapter(adapter)
    return Trainable(peft_model, LoraCodec(adapter), adapter=adapter)


def make_trainable(drafter: nn.Module | Drafter, mode: str, cfg: DviConfig, adapter: str | None = None) -> Trainable:
    from dvi.drafters.learned import EarlyExitDrafter, SharedTargetDrafter

    if adapter is not None:
        return group_trainable(drafter, adapter)
    t = cfg.trainer
    if isinstance(drafter, SharedTargetDrafter):
        if mode == "full" and isinstance(drafter, EarlyExitDrafter):
            raise ValueError("trainer.mode 'full' trains a separate drafter; the early-exit drafter trains LoRA + head")
        for p in drafter.target_ref.parameters():
            p.requires_grad_(False)
        for p in drafter.trainable_parameters():
            p.requires_grad_(True)
        return Trainable(drafter.model, SharedTargetCodec(drafter.kind), drafter)
    if mode == "full":
        if hasattr(drafter, "peft_config"):
            raise ValueError("trainer.mode 'full' needs a plain HF model, got a peft model")
        for p in drafter.parameters():
            p.requires_grad_(True)
        return Trainable(drafter, FULL)
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
    return Trainable(drafter, LORA)



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

