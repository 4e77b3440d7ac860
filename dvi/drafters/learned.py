"""Drafter kinds behind one small interface (in the spirit of HF's candidate generators).

A drafter is a callable `(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep) -> logits`
with a `config` (for masks / context limits) and `vocab_size` (how many token ids it can embed). The engine
owns the caches; drafters stay stateless so they can be hot-swapped between steps.

* `SeparateDrafter`: any HF causal LM (optionally a peft `PeftModel`, LoRA applied).
* `EarlyExitDrafter`: self-speculative; the target's first k layers + LoRA + a small exit head, reusing the
  target's Parameter objects (no second copy). LoRA is injected into the drafter's OWN module objects
  (which hold the shared Parameters), so the target's modules, forward and state_dict are untouched and
  verification stays lossless by construction.

Any kind may draft over a reduced vocabulary (`vocab_ids`, see `dvi.drafters.vocab`): its output embedding becomes
a `SubsetHead` (N rows computed, -inf elsewhere), so the engine sees full-vocab logits with q = 0 outside.
A future `eagle` kind does the same with `apply_draft_vocab` on the head it owns.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dvi.decode.forward import model_forward
from dvi.drafters.vocab import apply_draft_vocab, find_subset_head

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_norm")


def _num_embeddings(model: nn.Module) -> int:
    emb = model.get_input_embeddings()
    return int(emb.num_embeddings if hasattr(emb, "num_embeddings") else emb.weight.shape[0])


class Drafter:
    """Interface: a stateless draft model callable; the engine keeps its KV cache.

    A kind sets `model` (the nn.Module whose parameters it runs) and `_fn` (its forward, from
    `model_forward`), plus `config` and `vocab_size`; calling, devices and parameters follow from those.
    """

    config = None
    vocab_size: int = 0
    kind: str = "base"
    model: nn.Module
    _fn: Callable[..., torch.Tensor]

    def __call__(self, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep=0) -> torch.Tensor:
        return self._fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep)

    @property
    def explicit_mask(self) -> bool:
        return getattr(self._fn, "explicit_mask", False)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def parameters(self):
        return self.model.parameters()

    def shares_weights_with_target(self) -> bool:
        """True when the drafter reads the target's parameters (its cache must be rebuilt on target updates)."""
        return False

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Sorted target ids the drafter predicts over ([N]), None for the full vocabulary."""
        head = find_subset_head(self.model)
        return None if head is None else head.token_ids


class SeparateDrafter(Drafter):
    """A separate small HF causal LM (PreTrainedModel or peft PeftModel with LoRA) with the target's tokenizer.

    `vocab_ids` reduces its head in place (`dvi.drafters.vocab.apply_draft_vocab`); a model loaded by
    `dvi.models.loading.load_pair` from a dir with `draft_vocab.safetensors` already has it.
    """

    kind = "separate"

    def __init__(self, model: nn.Module, vocab_ids: torch.Tensor | None = None):
        if vocab_ids is not None:
            apply_draft_vocab(model, vocab_ids)
        self.model = model
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._fn = model_forward(base, width_invariant=False)
        self.config = base.config
        self.vocab_size = _num_embeddings(base)


class ExitHead(nn.Module):
    """Own final norm + zero-initialised low-rank residual projection (starts as a plain early exit)."""

    def __init__(self, norm: nn.Module, hidden_size: int, rank: int):
        super().__init__()
        p = next(norm.parameters())
        self.norm = norm
        self.down = nn.Linear(hidden_size, rank, bias=False, device=p.device, dtype=p.dtype)
        self.up = nn.Linear(rank, hidden_size, bias=False, device=p.device, dtype=p.dtype)
        nn.init.zeros_(self.up.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.up(self.down(x)))


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, is_buffer: bool) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if is_buffer:
        mod._buffers[attr] = value
    else:
        mod._parameters[attr] = value


def _shallow_copy(target: nn.Module, num_layers: int, exit_rank: int) -> tuple[nn.Module, ExitHead]:
    """A `num_layers`-layer model of the target's class whose Parameters and buffers ARE the target's,
    except its final norm, replaced by a fresh `ExitHead` (returned too)."""
    cfg = copy.deepcopy(target.config)
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:num_layers]
    cfg.num_hidden_layers = num_layers
    with torch.device("meta"):
        shallow = type(target)(cfg)
    base_name = shallow.base_model_prefix
    t_base, s_base = getattr(target, base_name), getattr(shallow, base_name)
    norm_name = next((n for n in _FINAL_NORM_NAMES if hasattr(t_base, n)), None)
    if norm_name is None:
        raise ValueError(f"cannot find the final norm of {type(target).__name__}")
    hidden = int(cfg.hidden_size)
    head = ExitHead(copy.deepcopy(getattr(t_base, norm_name)), hidden, exit_rank)
    setattr(s_base, norm_name, head)
    head_prefix = f"{base_name}.{norm_name}."
    # Share every other Parameter / buffer object with the target (no copies).
    t_params = dict(target.named_parameters(remove_duplicate=False))
    for name, _ in list(shallow.named_parameters(remove_duplicate=False)):
        if name.startswith(head_prefix):
            continue
        if name not in t_params:
            raise ValueError(f"early-exit drafter: target has no parameter {name!r}")
        _set_tensor(shallow, name, t_params[name], is_buffer=False)
    t_bufs = dict(target.named_buffers(remove_duplicate=False))
    for name, _ in list(shallow.named_buffers(remove_duplicate=False)):
        if name.startswith(head_prefix):
            continue
        if name in t_bufs:
            _set_tensor(shallow, name, t_bufs[name], is_buffer=True)
    for name, t in list(shallow.named_parameters()) + list(shallow.named_buffers()):
        if t.is_meta:
            raise ValueError(f"early-exit drafter: {name} was not shared from the target")
    return shallow, head


class SharedTargetDrafter(Drafter, ABC):
    """A drafter that runs on the target's own Parameters plus a few trained weights of its own (early exit,
    eagle): saved as those weights (`adapter_model.safetensors`) + `adapter_config.json` with its `dvi_kind`,
    rebuilt on a target by `load`. A kind supplies the two abstract methods; `save` does the rest."""

    def shares_weights_with_target(self) -> bool:
        return True

    @abstractmethod
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The kind's own trained weights (never the target's shared ones), as `save` writes them."""

    @abstractmethod
    def config_dict(self) -> dict:
        """What `load` needs to rebuild the kind on a target, with `dvi_kind` set."""

    def save(self, path: str | Path) -> Path:
        """Write `adapter_model.safetensors` (the trained weights) and `adapter_config.json` into dir `path`."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().contiguous().cpu() for k, v in self.trainable_state_dict().items()}
        save_file(sd, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG).write_text(json.dumps(self.config_dict(), indent=2))
        return path

    @classmethod
    def saved_config(cls, path: Path) -> dict:
        """The `adapter_config.json` of a `save()` dir, refused unless it is this kind's."""
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        if cfg.get("dvi_kind") != cls.kind:
            raise ValueError(f"{path} is not an {cls.kind} drafter (dvi_kind={cfg.get('dvi_kind')!r})")
        return cfg

    @staticmethod
    def saved_weights(path: Path, target: nn.Module) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(str(path / ADAPTER_WEIGHTS), device=str(next(target.parameters()).device))


class EarlyExitDrafter(SharedTargetDrafter):
    """Self-speculative drafter: the target's first `num_layers` layers + LoRA + `ExitHead` + the target's lm_head."""

    kind = "early_exit"

    def __init__(
        self,
        target: nn.Module,
        num_layers: int,
        lora_rank: int = 8,
        lora_alpha: int | None = None,
        target_modules: list[str] | None = None,
        exit_rank: int = 16,
        vocab_ids: torch.Tensor | None = None,
    ):
        n_target = int(target.config.num_hidden_layers)
        if not 1 <= num_layers <= n_target:
            raise ValueError(f"num_layers must be in [1, {n_target}], got {num_layers}")
        if lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0, got {lora_rank}")
        self.num_layers, self.lora_rank, self.exit_rank = int(num_layers), int(lora_rank), int(exit_rank)
        self.lora_alpha = int(lora_alpha if lora_alpha is not None else 2 * max(lora_rank, 1))
        self.target_ref = target
        shallow, head = _shallow_copy(target, num_layers, exit_rank)
        shallow.eval()
        if vocab_ids is not None:  # a row slice of the target's lm_head (shared Parameter, cached slice)
            apply_draft_vocab(shallow, vocab_ids)
        self.shallow = shallow
        self.exit_head = head
        self.peft_model = None
        self.target_modules = target_modules
        fwd_model = shallow
        if lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            lcfg = LoraConfig(
                r=lora_rank, lora_alpha=self.lora_alpha, lora_dropout=0.0, target_modules=target_modules, bias="none"
            )
            self.peft_model = get_peft_model(shallow, lcfg)
            self.peft_model.eval()
            self.target_modules = sorted(self.peft_model.peft_config["default"].target_modules)
            fwd_model = self.peft_model.get_base_model()
        for p in head.parameters():
            p.requires_grad_(True)
        self.model = fwd_model
        self._fn = model_forward(fwd_model, width_invariant=False)
        self.config = shallow.config
        self.vocab_size = _num_embeddings(target)

    # ---------------------------------------------------------------- trainable parts
    def trainable_parameters(self) -> list[nn.Parameter]:
        """LoRA + exit head parameters (what the trainer optimises)."""
        ps = list(self.exit_head.parameters())
        if self.peft_model is not None:
            ps += [p for n, p in self.peft_model.named_parameters() if "lora_" in n]
        return ps

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {f"exit_head.{k}": v for k, v in self.exit_head.state_dict().items()}
        if self.peft_model is not None:
            from peft import get_peft_model_state_dict

            sd.update({f"lora.{k}": v for k, v in get_peft_model_state_dict(self.peft_model).items()})
        return sd

    def load_trainable_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        head = {k[len("exit_head.") :]: v for k, v in sd.items() if k.startswith("exit_head.")}
        self.exit_head.load_state_dict(head, strict=True)
        lora = {k[len("lora.") :]: v for k, v in sd.items() if k.startswith("lora.")}
        if self.peft_model is not None:
            from peft import set_peft_model_state_dict

            res = set_peft_model_state_dict(self.peft_model, lora)
            bad = [k for k in getattr(res, "unexpected_keys", []) if "lora_" in k]
            if bad:
                raise ValueError(f"unexpected LoRA keys: {bad[:3]}")
        elif lora:
            raise ValueError("state dict has LoRA weights but this drafter has lora_rank=0")

    def config_dict(self) -> dict:
        return {
            "dvi_kind": "early_exit",
            "num_layers": self.num_layers,
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "target_modules": self.target_modules,
            "exit_rank": self.exit_rank,
            "base_model_type": getattr(self.config, "model_type", None),
        }

    @classmethod
    def load(cls, target: nn.Module, path: str | Path, vocab_ids: torch.Tensor | None = None) -> EarlyExitDrafter:
        """Rebuild from `save()` output on top of `target` (shares its weights)."""
        path = Path(path)
        cfg = cls.saved_config(path)
        d = cls(
            target,
            num_layers=cfg["num_layers"],
            lora_rank=cfg["lora_rank"],
            lora_alpha=cfg.get("lora_alpha"),
            target_modules=cfg.get("target_modules"),
            exit_rank=cfg.get("exit_rank", 16),
            vocab_ids=vocab_ids,
        )
        d.load_trainable_state_dict(cls.saved_weights(path, target))
        return d


def as_drafter(obj) -> Drafter | None:
    """None -> None; a Drafter as is; any HF causal LM / PeftModel -> SeparateDrafter."""
    if obj is None or isinstance(obj, Drafter):
        return obj
    if isinstance(obj, nn.Module):
        return SeparateDrafter(obj)
    raise TypeError(f"drafter must be None, a Drafter or a causal LM module, got {type(obj).__name__}")
