"""EAGLE-3's training-time test for an `EagleModel`: the head unrolled on its own predictions, in parallel.

Serving drafts K tokens a step: draft 1 reads true target features; draft k > 1 reads the head's own output
of the previous draft and attends to the true context plus the earlier drafts of its chain. Training only on
true features (or on a second pass where *every* position reads predicted features, context included) teaches
a different function than the one served, and acceptance decays with depth.

`unroll` computes, for every position j of a window at once, the chain that started k steps earlier, for
k = 0..steps-1: step k's query at j reads token x_j (the draft there, when the chain survived) and the head's
step k-1 output at j-1, and attends to the true pass's keys 0..j-k plus its own chain's keys (step m at
position j-k+m). One step costs about one teacher-forced pass of the head, so `steps` passes train every
chain position of every window (arXiv 2503.01840, "training-time test").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dvi.drafters.eagle import EagleModel, features_from_hidden

__all__ = ["EagleObjective", "unroll", "ttt_loss", "chain_predictions"]


@dataclass(frozen=True)
class EagleObjective:
    """What the head is trained on beside the KL.

    `ttt_steps` > 0: EAGLE-3's training-time test (`trainers.builds.eagle_ttt`): every window is unrolled that many
    draft steps, each chain reading the head's own outputs and attending to its own earlier drafts exactly as
    served; the KL is taken at a `sample` share of each step's positions (the LM head is most of the cost).
    `ttt_steps` = 0, the first recipe: one teacher-forced pass and, when `chained`, a second pass in which every
    input reads the head's predicted feature. `feature_weight` x smooth-L1 onto the target's next final normed
    state (EAGLE-1's regression; heads on fused layers have no such target and skip it)."""

    feature_weight: float = 1.0
    chained: bool = True
    ttt_steps: int = 0
    sample: float = 1.0


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [..., T, D] moved s positions later along T (out[j] = x[j - s]; zeros for j < s)."""
    if s == 0:
        return x
    return F.pad(x[..., :-s, :], (0, 0, s, 0))


def _band_mask(t: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive [T, T] mask: query j sees the true pass's columns 0..j-k."""
    i = torch.arange(t, device=device)
    allowed = i.view(1, t) <= (i.view(t, 1) - k)
    return torch.zeros((), dtype=dtype, device=device).where(allowed, torch.finfo(dtype).min)


def _layer(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           cache: list[tuple[torch.Tensor, torch.Tensor]], k: int) -> torch.Tensor:
    """One decoder layer (HF Llama-family module, its own weights) at unroll step k over x [B, T, H]; appends
    this step's keys / values to `cache` (one entry per step so far)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    b, t, _ = x.shape
    d = int(attn.head_dim)
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(b, t, -1, d)
    key = attn.k_proj(h).view(b, t, -1, d)
    v = attn.v_proj(h).view(b, t, -1, d)
    if getattr(attn, "q_norm", None) is not None:  # qwen3
        q, key = attn.q_norm(q), attn.k_norm(key)
    q, key, v = q.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
    q, key = apply_rotary_pos_emb(q, key, cos, sin)
    rep = q.shape[1] // key.shape[1]
    key, v = key.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    cache.append((key, v))
    k0, v0 = cache[0]
    scores = q @ k0.transpose(-1, -2) * attn.scaling + _band_mask(t, k, q.dtype, q.device)  # [B, heads, T, T]
    chain = [(q * _shift(km, k - m)).sum(-1, keepdim=True) * attn.scaling for m, (km, _) in enumerate(cache[1:], 1)]
    p = torch.softmax(torch.cat([scores, *chain], -1).float(), -1).to(q.dtype)
    o = p[..., :t] @ v0
    for m, (_, vm) in enumerate(cache[1:], 1):
        o = o + p[..., t + m - 1: t + m] * _shift(vm, k - m)
    x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def unroll(model: EagleModel, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ids [B, T] tokens, feats [B, T, feature_dim] the true input features (F_j: the target's at j - 1). Returns
    per step k < `steps` the head's normed output [B, T, H] (what its LM head multiplies); at position j it is
    draft k + 1 of the chain that read true features up to position j - k (rows j < k are padding)."""
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device).expand(b, t)
    e = model.embed_tokens(ids)
    cos, sin = model.rotary_emb(e, pos)
    caches: list[list] = [[] for _ in model.layers]
    g = model.feature_input(feats, e.dtype)  # [B, T, H]
    outs = []
    for k in range(steps):
        x = model.fc(torch.cat([e, g], -1))
        for layer, cache in zip(model.layers, caches, strict=True):
            x = _layer(layer, x, cos, sin, cache, k)
        f = model.norm(x)
        outs.append(f)
        own = x if model.fuse is not None else f  # what the next draft reads (EagleModel.forward's `features`)
        g = _shift(own, 1)
    return outs


def ttt_loss(model: EagleModel, ids: torch.Tensor, feats: torch.Tensor, final: torch.Tensor, head: torch.Tensor,
             objective: EagleObjective, generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[float]]:
    """Mean over `objective.ttt_steps` unroll steps of KL(target || head) over the draft vocabulary rows `head`
    [n, H], at positions j >= k (an `objective.sample` share of them, drawn afresh per step: the LM head is most of a
    step's cost), plus `objective.feature_weight` x smooth-L1 of the head's normed output onto the target's final
    normed state `final` [B, T, H] (first recipe). Returns (loss, per-step KL)."""
    from trainers.builds.subset_distill import subset_kl

    steps, sample, feature_weight = objective.ttt_steps, objective.sample, objective.feature_weight
    outs = unroll(model, ids, feats, steps)
    b, t = ids.shape
    total, per_step = 0.0, []
    for k, f in enumerate(outs):
        n = t - k
        take = torch.arange(k, t, device=ids.device)
        if sample < 1.0:
            m = max(1, int(n * sample))
            take = take[torch.randperm(n, generator=generator)[:m].to(ids.device)]
        s_logits = F.linear(f[:, take].float(), head)
        with torch.no_grad():
            t_logits = F.linear(final[:, take].float(), head)
        kl = subset_kl(s_logits, t_logits)
        loss = kl
        if feature_weight:
            loss = loss + feature_weight * F.smooth_l1_loss(f[:, k:].float(), final[:, k:].float())
        total = total + loss
        per_step.append(float(kl.detach()))
    return total / len(outs), per_step


@torch.inference_mode()
def chain_predictions(model: EagleModel, ids: torch.Tensor, hidden: torch.Tensor, head: torch.Tensor,
                      vocab_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Drafted token ids [steps, B, T] (argmax over the draft vocabulary `vocab_ids`, rows `head`): entry [k, b, j] is
    draft k + 1 of the chain whose true context ends at position j - k, `hidden` [B, T, feature_dim] the target's
    features of each position (shifted into inputs here)."""
    outs = unroll(model, ids, features_from_hidden(hidden.float()), steps)
    # the head runs in its own dtype (bf16 where the build picks it); argmax over fp32 logits like the served head's
    return torch.stack([vocab_ids[F.linear(f.float(), head.float()).argmax(-1)] for f in outs])
