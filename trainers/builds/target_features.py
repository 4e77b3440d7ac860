"""The target's states on training and evaluation text, computed once by the lean forward (`dvi.decode.lean`):
per position the residual stream after chosen layers (what a fused-feature eagle head reads) and the final
normed hidden state (what the target's LM head multiplies: the teacher's logits over any draft vocabulary are
one small matmul away, and a first-recipe head reads it). Stored fp16 (bf16 matmuls are emulated, hence slow,
on CPUs without native bf16; fp16 is only storage here), one tensor per kind.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

__all__ = ["TargetStates", "target_states"]


@dataclass
class TargetStates:
    """Per window (row) and position: `layers` [N, T, len * H] (the residual stream after each of
    `feature_layers`, concatenated; None when none were asked), `final` [N, T, H] the final normed hidden
    state, `top` [N, T] the target's greedy token (argmax over the full vocabulary) after each position."""

    feature_layers: tuple[int, ...]
    layers: torch.Tensor | None
    final: torch.Tensor
    top: torch.Tensor


@torch.inference_mode()
def target_states(target, windows: list[list[int]] | torch.Tensor, feature_layers: tuple[int, ...] = (),
                  progress: bool = False, desc: str = "target states") -> TargetStates:
    """`TargetStates` of `target` (an HF Llama-family causal LM) on each window (token ids; equal lengths, or
    ragged lists right-padded with zeros in the output). One window per forward (a prefill of an empty cache)."""
    from dvi.decode.attention import Attention
    from dvi.decode.lean import LeanModel

    lean = LeanModel(target)
    taps = tuple(sorted(set(feature_layers)))
    last = int(target.config.num_hidden_layers) - 1
    lean.feature_layers = tuple(sorted(set(taps) | {last}))  # the last layer's residual gives the final state
    rows = [w.tolist() if isinstance(w, torch.Tensor) else list(w) for w in windows]
    n, t, h = len(rows), max(map(len, rows)), lean.hidden
    layers = torch.zeros(n, t, len(taps) * h, dtype=torch.float16) if taps else None
    final = torch.zeros(n, t, h, dtype=torch.float16)
    top = torch.zeros(n, t, dtype=torch.long)
    cache = lean.new_cache(1, max(16, t))
    zero = torch.zeros(1, dtype=torch.long)
    for i in tqdm(range(n), desc=desc, disable=not progress, leave=False,
                  mininterval=0.5 if sys.stderr.isatty() else 30.0):
        ids = torch.tensor([rows[i]], dtype=torch.long)
        m = ids.shape[1]
        cache.truncate([0])
        logits, feats = lean.forward(cache, ids, zero, Attention(m, causal=m > 1), features=True)
        chunks = feats[0].view(m, len(lean.feature_layers), h)  # [m, taps + last, H], in layer order
        f = F.rms_norm(chunks[:, -1], (h,), lean.norm, lean.eps)
        final[i, :m] = f.to(torch.float16)
        top[i, :m] = logits[0].argmax(-1)
        if taps:
            keep = [lean.feature_layers.index(j) for j in taps]
            layers[i, :m] = chunks[:, keep].reshape(m, -1).to(torch.float16)
    return TargetStates(taps, layers, final, top)
