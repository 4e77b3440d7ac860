"""The engine's model callable (`model_forward`): how a target or a drafter runs HF's modules over a
`dvi.decode.kv.RaggedKV` (drafters, and targets `dvi.decode.lean` does not run).

Its own module below the engine and the drafter kinds, which both call it; the attention it asks for row by
row lives in `dvi.decode.numerics`.
"""

from __future__ import annotations

from torch import nn

from dvi.decode.numerics import ROWWISE_KWARG, is_exact_greedy, rowwise_mode
from dvi.decode.numerics import install as install_rowwise


def hf_forward(model: nn.Module):
    """Wrap an HF causal LM as the engine's model callable."""

    def fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep=0):
        return model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=True,
            logits_to_keep=logits_to_keep,
        ).logits

    return fn


FAST_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
"""Decoders `model_forward` runs layer by layer (and the only ones whose features an eagle head can read)."""


def _lean_ok(model: nn.Module) -> bool:
    """A Llama-family decoder with sdpa or eager attention and the parts `model_forward` calls directly."""
    cfg, base = model.config, getattr(model, "model", None)
    return (
        getattr(cfg, "model_type", None) in FAST_TYPES
        and getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", "eager")
        and base is not None
        and all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm"))
        and hasattr(model, "lm_head")
    )


def model_forward(model: nn.Module, with_features: bool = False, width_invariant: bool = True):
    """The engine's model callable: a lean direct path for Llama-family decoders, else `hf_forward`.

    HF's top-level forward costs ~0.5 ms of Python per call on CPU (output capturing, mask factory,
    ModelOutput), a quarter of a 1-layer drafter step. The lean path calls embed -> rotary -> decoder
    layers -> norm -> lm_head directly and always receives an explicit 4-D mask from `RaggedKV` (except a
    single hole-free query on full attention, where no mask is needed). Equality with HF `generate` is
    what tests/test_engine.py checks for these architectures.

    `with_features`: the callable returns (logits, f) with f [B, q, H] the final normed hidden state of
    every input position (what an `eagle` drafter reads); Llama-family decoders only.

    `width_invariant` (the target's forwards): a multi-token forward over a cached, hole-free prefix (a
    verify) attends row by row (`dvi.decode.numerics`), so its logits are bit-equal to one-token steps in any
    dtype; drafters pass False (their rounding decides nothing). A target marked by
    `dvi.decode.numerics.set_exact_greedy` also attends holed/padded batches row by row (the exact mode).
    """
    cfg = model.config
    base = getattr(model, "model", None)
    if not _lean_ok(model):
        if with_features:
            raise ValueError(f"target features (eagle drafters) need a {sorted(FAST_TYPES)} target with sdpa "
                             f"or eager attention, got {getattr(cfg, 'model_type', None)!r}")
        return hf_forward(model)
    embed, rotary, norm, head = base.embed_tokens, base.rotary_emb, base.norm, model.lm_head
    layers = list(base.layers[: cfg.num_hidden_layers])
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * len(layers))
    rowwise = width_invariant and getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
    exact = rowwise and is_exact_greedy(model)
    if rowwise:
        install_rowwise()

    def fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep=0):
        h = embed(input_ids)
        pe = rotary(h, position_ids)
        mode = rowwise_mode(attention_mask, cfg, input_ids.shape[1], exact) if rowwise else None
        extra = {ROWWISE_KWARG: mode} if mode else {}
        for layer, layer_type in zip(layers, types, strict=False):
            m = attention_mask[layer_type] if isinstance(attention_mask, dict) else attention_mask
            h = layer(
                h,
                attention_mask=m,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=True,
                position_embeddings=pe,
                **extra,
            )
        if with_features:
            f = norm(h)  # [B, q, H]
            return head(f[:, -logits_to_keep:] if logits_to_keep else f), f
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return head(norm(h))

    fn.explicit_mask = True
    fn.exact_rows = exact  # `dvi.decode.kv.prefill` then prefills rows one by one
    return fn
