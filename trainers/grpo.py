"""GRPO's pieces, independent of any loop: group-relative advantages, the per-token log-probs of sampled
completions under the policy, the on-policy loss, the LoRA policy (peft) and how far the served target is
from it. `trainers.rl` runs them against dvi's rollout engine; TRL users get the same through
`dvi.rollout_trl.trl_rollout_func`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dvi.rollout import Rollout

__all__ = ["group_advantages", "completion_logprobs", "policy_gradient_loss", "lora_policy", "logprob_gap"]


def group_advantages(rewards: torch.Tensor, n: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: reward minus its group's mean (optionally / group std); groups of `n` rows."""
    if rewards.numel() % n:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of n={n}")
    g = rewards.view(-1, n)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale and n > 1:
        adv = adv / (g.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)


def _pad_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompts left-padded and completions right-padded, so every completion starts at the same column.

    Returns ids, attention mask, position ids (counting real tokens only) and a [B, C] mask of the
    completion columns that hold real tokens.
    """
    width_p = max(len(p) for p in prompts)
    width_c = max(len(c) for c in completions)
    ids = torch.full((len(prompts), width_p + width_c), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        lo, hi = width_p - len(p), width_p + len(c)
        ids[i, lo:hi] = torch.tensor(list(p) + list(c), dtype=torch.long)
        attn[i, lo:hi] = 1
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), attn.to(device), pos.to(device), attn[:, width_p:].bool().to(device)


def completion_logprobs(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log_softmax(logits / T)`` of each completion token under `model`, one padded batch.

    Returns ``(logps, mask)`` of shape (B, max completion length); gradients flow unless the
    caller disables them. Explicit position ids make each row exactly a plain forward pass over its
    prompt + completion; the LM head runs on the completion columns only (the prompt's logits would
    be a fifth of a 135M model's forward, and their log-softmax over 49k ids more still).
    """
    dev = next(model.parameters()).device
    width_c = max(len(c) for c in completions)
    if width_c == 0:
        z = torch.zeros((len(completions), 1), device=dev)
        return z, z.bool()
    ids, attn, pos, mask = _pad_batch(prompts, completions, pad_id, dev)
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=1, use_cache=False,
                output_hidden_states=True)
    hidden = out.hidden_states[-1][:, -width_c - 1: -1]  # [B, C, H], after the final norm
    # The head on a flat [B*C, H] matrix: on CPU a bf16 linear over a sliced 3-D input takes a
    # copy-heavy batched path ~10x slower than this one matmul.
    head = model.get_output_embeddings()
    logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), head.weight, head.bias)
    logits = logits.view(len(completions), width_c, -1).float()  # [B, C, V]
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1).gather(-1, ids[:, -width_c:, None]).squeeze(-1)
    return logp * mask, mask


def policy_gradient_loss(logps: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """On-policy GRPO loss (ratio = 1, so no clipping): -A * log p, averaged over all tokens."""
    m = mask.float()
    return -(advantages[:, None] * logps * m).sum() / m.sum().clamp_min(1.0)


def lora_policy(path: str | Path, dtype: str, rank: int, targets: Sequence[str], top_layers: int = 0) -> Any:
    """The trainable policy: the target's weights (frozen) + a peft LoRA adapter, in train mode.

    LoRA keeps a GRPO step affordable on CPU and makes the weight push small: only the adapted
    matrices change (`policy_state_dict(..., adapted_only=True)`).
    """
    from peft import LoraConfig, get_peft_model

    from dvi.models.loading import load_causal_lm

    base = load_causal_lm(path, device="cpu", dtype=dtype)
    n = int(base.config.num_hidden_layers)
    layers = list(range(n - top_layers, n)) if 0 < top_layers < n else None
    cfg = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(targets),
                     layers_to_transform=layers)
    return get_peft_model(base, cfg).train()


def logprob_gap(logps: torch.Tensor, mask: torch.Tensor, rolls: Sequence[Rollout]) -> float:
    """Mean |log p_policy - log p_rollout| over the sampled tokens: how far the served (merged, serving
    dtype) target is from the policy the gradient was taken on (0 = exactly on-policy)."""
    gaps = []
    for i, r in enumerate(rolls):
        n = len(r.logprobs)
        if n:
            served = torch.tensor(r.logprobs, dtype=logps.dtype)
            gaps.append((logps[i, :n].detach().cpu() - served).abs()[mask[i, :n].cpu()])
    return float(torch.cat(gaps).mean()) if gaps else float("nan")
