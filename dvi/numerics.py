"""Width-invariant attention: a (K+1)-token verify whose rounding equals K+1 one-token steps.

In bf16 the target's logits at a position depend on how many positions one forward scores: SDPA's CPU
kernels round differently for a 1-token query over L columns (packed GQA, no mask) than for row j of a
(K+1)-token query over L + K + 1 columns with the tail masked. One bf16 ulp of difference in one layer's
attention output is amplified by the 30 layers of SmolLM2-135M to up to ~1 logit, so greedy text with
speculation parted from greedy text without it (measured: benchmarks/greedy_agreement.py). The linear
layers, norms, RoPE and the LM head are row-independent (bit-equal for 1 and K+1 rows, checked there).

So a multi-token forward over a non-empty, hole-free cache computes attention one query row at a time,
each row exactly as the 1-token step at that position would: the same SDPA call on the columns before
it and no mask. Everything else stays batched. Only attention, the cheap part at these contexts, is
looped. Masked (holed, padded, windowed) batches keep the one masked call: their column layout already
differs from the plain decode's, so no slicing could make them bit-equal.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from dvi.kv import mask_kind

ROWWISE_KWARG = "dvi_rowwise"
"""Keyword the lean forward passes down through the decoder layers to ask for row-by-row attention."""


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention, or (when `dvi_rowwise` is passed) one SDPA call per query row."""
    q, kv = query.shape[2], key.shape[2]
    if not kwargs.pop(ROWWISE_KWARG, False) or q == 1 or kv == q:  # a step, or a prefill over an empty cache
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = []
    for j in range(q):
        end = kv - q + j + 1  # the columns a 1-token step at this position would have cached
        out, _ = sdpa_attention_forward(module, query[:, :, j : j + 1], key[:, :, :end], value[:, :, :end], None,
                                        **kwargs)
        outs.append(out)  # [B, 1, H, D]
    return torch.cat(outs, 1), None


def install() -> None:
    """Route "sdpa" through `_sdpa` (idempotent). Without the keyword it is HF's function unchanged."""
    if AttentionInterface._global_mapping.get("sdpa") is not _sdpa:
        AttentionInterface.register("sdpa", _sdpa)


def rowwise_ok(attention_mask, config) -> bool:
    """True when a multi-token forward may attend row by row: full attention only (no sliding window) and
    no masked column before the last query (no holes, no padding), i.e. the plain step would pass no mask."""
    if attention_mask is None or isinstance(attention_mask, dict) or mask_kind(config)[0] != "full":
        return False
    return bool((attention_mask[:, :, -1] == 0).all())


@torch.inference_mode()
def plain_greedy(target, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The target's own greedy decoding as the engine serves it without speculation (prefill, then 1-token
    steps through the same forward): n tokens and each step's logits [V] (fp32), the reference that
    `dvi.sampling.first_divergence` judges another decode against."""
    from dvi.drafters import model_forward
    from dvi.kv import prefill

    fn = model_forward(target)
    p0 = next(target.parameters())
    kv = prefill(target.config, fn, [prompt[:-1]], p0.device, p0.dtype)
    last, out, steps = prompt[-1], [], []
    for _ in range(n):
        logits = kv.forward(fn, torch.tensor([[last]], device=p0.device))[0, -1].float()
        steps.append(logits)
        last = int(logits.argmax())
        out.append(last)
    return out, steps
