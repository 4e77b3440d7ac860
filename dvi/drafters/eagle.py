"""EAGLE-style drafter: a one-layer head that reads the target's own hidden states.

Per input position j the head sees the embedding of token x_j fused with the target's feature of the
position before, F_j = f_{j-1} (f = the target's final *normed* hidden state, the vector its LM head
multiplies; F_0 = 0), runs one decoder layer of the target's architecture and a norm, and predicts
f_j; logits are the target's own LM head on that prediction, over the reduced draft vocabulary.
The embedding and the head are the target's modules (no copy); fc, the layer and the norm are trained.

How the engine drives it (`dvi.engine.speculative`): the verify pass returns the target's features of the K + 1
positions it scored, so the first draft of the next step feeds every accepted token with its true
feature; later drafts feed the head its own predicted feature (EAGLE's autoregression on features).
Drafted entries are always dropped from the head's cache after verification and re-fed with true
features, which is what the trainer sees too: training and serving agree on every input.

The feedback record stores f_0..f_{L-2} (fp16) for a sequence of L tokens (`features_from_hidden`
shifts them into F); the online trainer never runs the target.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from dvi.decode.forward import FAST_TYPES
from dvi.decode.kv import mask_layout
from dvi.drafters.learned import SharedTargetDrafter
from dvi.drafters.vocab import apply_draft_vocab

__all__ = ["EagleModel", "EagleDrafter", "EagleOutput", "features_from_hidden", "causal_mask"]


class EagleOutput:
    """What `EagleModel.forward` returns: logits [B, T, V (or N in subset mode)] and features [B, T, H]; `regress`:
    whether those features are predictions of the target's next final normed state (first recipe: a trainer may
    regress them onto it) or the head's own hidden state (fused heads: nothing to regress onto)."""

    __slots__ = ("logits", "features", "regress")

    def __init__(self, logits: torch.Tensor, features: torch.Tensor, regress: bool = True):
        self.logits, self.features, self.regress = logits, features, regress


def features_from_hidden(hidden: torch.Tensor) -> torch.Tensor:
    """The head's input features F [..., L-1, H] from the target's features f_0..f_{L-2} [..., L-1, H]:
    F_0 = 0, F_j = f_{j-1} (input j sees the feature of the position before it)."""
    zero = hidden.new_zeros((*hidden.shape[:-2], 1, hidden.shape[-1]))
    return torch.cat([zero, hidden[..., :-1, :]], -2)


def causal_mask(attention_mask: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """Additive [B, 1, T, T] causal mask from a [B, T] padding mask (padded queries see themselves)."""
    t = attention_mask.shape[1]
    i = torch.arange(t, device=attention_mask.device)
    allowed = (i.view(1, t, 1) >= i.view(1, 1, t)) & attention_mask.bool().unsqueeze(1)  # [B, T, T]
    if window:
        allowed &= (i.view(1, t, 1) - i.view(1, 1, t)) < window
    allowed |= torch.eye(t, dtype=torch.bool, device=attention_mask.device)
    zero = torch.zeros((), dtype=dtype, device=attention_mask.device)
    neg = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=attention_mask.device)
    return torch.where(allowed, zero, neg).unsqueeze(1)


class EagleModel(nn.Module):
    """fc(cat(embed(x_j), F_j)) -> `num_layers` decoder layers -> norm -> the target's LM head.

    `embed_tokens`, `rotary_emb` and `lm_head` are the target's own modules; `fc`, the layers and `norm`
    are this head's. The layers start as copies of the target's first ones and fc as [I | 0], so the
    untrained head is the target exiting early on the embeddings; training teaches it to use F.

    Two kinds of feature (`feature_layers`):
    - None (the first recipe): F_j is the target's final normed hidden state f_{j-1}; the head predicts f_j
      (its own `features` output, normed) and later drafts of a step read that prediction.
    - a tuple of >= 2 target layers (EAGLE-3's low / middle / high): a true F_j is the residual stream after
      each listed layer at position j-1, concatenated [len * H]; each H-chunk is RMS-normalised (the layers'
      scales differ by orders of magnitude) and `fuse` projects the lot to H. Later drafts read the head's own
      last hidden state (pre-norm, H wide) instead, as EAGLE-3 does; no regression target, so the head's
      `features` output is that hidden state. A feature's width says which it is (len * H: the target's).
    """

    def __init__(self, target: nn.Module, feature_layers: tuple[int, ...] | None = None, num_layers: int = 1,
                 intermediate_size: int | None = None):
        super().__init__()
        tcfg = target.config
        if getattr(tcfg, "model_type", None) not in FAST_TYPES:
            raise ValueError(f"eagle drafters support {sorted(FAST_TYPES)} targets, got {tcfg.model_type!r}")
        n_target = int(tcfg.num_hidden_layers)
        if feature_layers is not None:
            feature_layers = tuple(int(i) for i in feature_layers)
            if len(feature_layers) < 2 or not all(0 <= i < n_target for i in feature_layers):
                raise ValueError(f"feature_layers must list >= 2 target layers in [0, {n_target}), got {feature_layers}")
        if not 1 <= num_layers <= n_target:
            raise ValueError(f"num_layers must be in [1, {n_target}], got {num_layers}")
        cfg = copy.deepcopy(tcfg)
        cfg.num_hidden_layers = int(num_layers)
        if intermediate_size:
            cfg.intermediate_size = int(intermediate_size)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = list(cfg.layer_types)[:num_layers]
        self.config = cfg
        self.feature_layers = feature_layers
        base = target.model
        p0 = base.embed_tokens.weight
        hidden = int(cfg.hidden_size)
        self.feature_dim = hidden * (len(feature_layers) if feature_layers else 1)
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.lm_head = target.get_output_embeddings()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False, device=p0.device, dtype=p0.dtype)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden].copy_(torch.eye(hidden))
        self.fuse = (nn.Linear(self.feature_dim, hidden, bias=False, device=p0.device, dtype=p0.dtype)
                     if feature_layers else None)
        layers = [_layer_copy(base.layers[i], cfg, i) for i in range(num_layers)]
        self.layer = layers[0]
        self.extra = nn.ModuleList(layers[1:]) if num_layers > 1 else None
        self.norm = copy.deepcopy(base.norm)
        layout, window = mask_layout(cfg)
        self.window = window if layout != "full" else None  # for the masks it builds itself (training)

    @property
    def layers(self) -> list[nn.Module]:
        return [self.layer, *(self.extra or [])]

    def own_modules(self) -> dict[str, nn.Module]:
        """The trained parts (what a version publishes)."""
        own = {"fc": self.fc, "layer": self.layer, "norm": self.norm}
        if self.extra is not None:
            own["extra"] = self.extra
        if self.fuse is not None:
            own["fuse"] = self.fuse
        return own

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, head: nn.Module) -> None:
        self.lm_head = head

    def feature_input(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """F [..., H] as the fc reads it: the target's fused layers projected by `fuse` (width len * H), else as is
        (the final normed feature, or the head's own hidden state)."""
        features = features.to(dtype)
        if self.fuse is None or features.shape[-1] != self.feature_dim:
            return features
        h = self.fc.in_features // 2
        chunks = features.unflatten(-1, (-1, h))  # [..., len, H]
        normed = torch.nn.functional.rms_norm(chunks, (h,), eps=float(self.config.rms_norm_eps))
        return self.fuse(normed.flatten(-2))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, attention_mask=None,
                position_ids: torch.Tensor | None = None, past_key_values=None, logits_to_keep: int = 0,
                use_cache: bool = False, with_logits: bool = True) -> EagleOutput:
        """input_ids [B, T], features F [B, T, H or feature_dim]; attention_mask: a 4-D additive mask (the
        engine's) or a [B, T] padding mask (training, no cache). Returns logits of the last `logits_to_keep`
        positions (all when 0) and the features later drafts read of those positions (`with_logits=False`:
        features only, for a trainer that applies its own head slice)."""
        e = self.embed_tokens(input_ids)  # [B, T, H]
        h = self.fc(torch.cat([e, self.feature_input(features, e.dtype)], -1))  # [B, T, H]
        if position_ids is None:
            ref = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
            position_ids = ((ref.long().cumsum(-1) - 1).clamp_min(0) if ref is not None
                            else torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids))
        if attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = causal_mask(attention_mask, h.dtype, self.window)
        elif attention_mask is None and past_key_values is None and input_ids.shape[1] > 1:
            attention_mask = causal_mask(torch.ones_like(input_ids), h.dtype, self.window)
        pe = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            h = layer(h, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=past_key_values, use_cache=use_cache, position_embeddings=pe)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        f = self.norm(h)  # [B, T', H]: what the head multiplies (the predicted target feature, first recipe)
        fused = self.fuse is not None
        return EagleOutput(self.lm_head(f) if with_logits else None, h if fused else f, regress=not fused)


def _layer_copy(src: nn.Module, cfg, idx: int) -> nn.Module:
    """A decoder layer of `cfg` (the head's: maybe a wider FFN) that computes target layer `src`: extra FFN units
    keep their down-projection at zero. Indexed `idx` in the head's own cache."""
    layer = copy.deepcopy(src)
    mlp = layer.mlp
    inter = int(cfg.intermediate_size)
    if mlp.gate_proj.out_features != inter:
        hidden, old = mlp.gate_proj.in_features, mlp.gate_proj.out_features
        p = mlp.gate_proj.weight
        with torch.no_grad():
            for name in ("gate_proj", "up_proj"):
                new = nn.Linear(hidden, inter, bias=False, device=p.device, dtype=p.dtype)
                new.weight[:old].copy_(getattr(mlp, name).weight)
                setattr(mlp, name, new)
            down = nn.Linear(inter, hidden, bias=False, device=p.device, dtype=p.dtype)
            down.weight.zero_()
            down.weight[:, :old].copy_(mlp.down_proj.weight)
            mlp.down_proj = down
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = inter
    layer.self_attn.layer_idx = idx
    return layer


class EagleDrafter(SharedTargetDrafter):
    """The engine's view of an `EagleModel`: called with the features of its inputs, returns (logits, features)."""

    kind = "eagle"
    needs_features = True

    def __init__(self, target: nn.Module, vocab_ids: torch.Tensor | None = None,
                 feature_layers: tuple[int, ...] | None = None, num_layers: int = 1,
                 intermediate_size: int | None = None):
        self.target_ref = target
        self.model = EagleModel(target, feature_layers, num_layers, intermediate_size)
        if vocab_ids is not None:  # a row slice of the target's head (shared Parameter, cached slice)
            apply_draft_vocab(self.model, vocab_ids)
        self.model.eval()
        self.config = self.model.config
        self.vocab_size = int(target.get_input_embeddings().weight.shape[0])

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        """The target layers whose residual streams the head reads (`LeanModel.feature_layers`), or None for the
        target's final normed hidden state."""
        return self.model.feature_layers

    @property
    def feature_dim(self) -> int:
        """Width of one position's target feature, as the verify pass returns it and records log it."""
        return self.model.feature_dim

    @torch.no_grad()
    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., feature_dim] as the head's input [..., H]: a fused head's `fuse` applied
        (per-chunk RMS norm, one matmul), the final normed state as is. A proposer stores, and a feedback record
        logs, this projection: 2 H bytes a position (fp16) whatever the number of fused layers. The online trainer
        then trains everything but `fuse`, which only the offline build moves (logged features stay valid)."""
        return self.model.feature_input(features, self.dtype)

    def _fn(self, *args, **kwargs):
        raise TypeError("an eagle drafter needs features: call it through `with_features`")

    @property
    def explicit_mask(self) -> bool:
        return True

    def with_features(self, features: torch.Tensor):
        """The engine's model callable for one forward whose inputs have features [B, M, H]."""

        def fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep=0):
            out = self.model(input_ids, features, attention_mask, position_ids, past_key_values, logits_to_keep,
                             use_cache=True)
            return out.logits, out.features

        fn.explicit_mask = True
        return fn

    # ---------------------------------------------------------------- trainable parts
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.model.own_modules().values() for p in m.parameters()]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v for name, m in self.model.own_modules().items() for k, v in m.state_dict().items()}

    def load_trainable_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for name, m in self.model.own_modules().items():
            own = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
            m.load_state_dict(own, strict=True)
        extra = [k for k in sd if k.split(".", 1)[0] not in self.model.own_modules()]
        if extra:
            raise ValueError(f"eagle state has tensors this head lacks: {extra[:3]}")

    def config_dict(self) -> dict:
        m = self.model
        return {"dvi_kind": "eagle", "feature": "layers" if m.feature_layers else "final_normed",
                "feature_layers": list(m.feature_layers) if m.feature_layers else None,
                "num_layers": len(m.layers), "intermediate_size": int(self.config.intermediate_size),
                "base_model_type": getattr(self.config, "model_type", None),
                "hidden_size": int(self.config.hidden_size)}

    @classmethod
    def load(cls, target: nn.Module, path: str | Path, vocab_ids: torch.Tensor | None = None) -> EagleDrafter:
        """Rebuild from `save()` output on top of `target` (shares its embedding and head)."""
        path = Path(path)
        cfg = cls.saved_config(path)
        if int(cfg.get("hidden_size", target.config.hidden_size)) != int(target.config.hidden_size):
            raise ValueError(f"{path} was trained for hidden size {cfg['hidden_size']}, "
                             f"the target has {target.config.hidden_size}")
        layers = cfg.get("feature_layers")
        d = cls(target, vocab_ids=vocab_ids, feature_layers=tuple(layers) if layers else None,
                num_layers=int(cfg.get("num_layers", 1)), intermediate_size=cfg.get("intermediate_size"))
        d.load_trainable_state_dict({k: v.to(d.dtype) for k, v in cls.saved_weights(path, target).items()})
        return d
