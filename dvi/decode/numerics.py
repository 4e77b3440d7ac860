"""Width-invariant attention: a (K+1)-token verify whose rounding equals K+1 one-token steps.

In bf16 the target's logits at a position depend on how many positions one forward scores: SDPA's CPU
kernels round differently for a 1-token query over L columns (packed GQA, no mask) than for row j of a
(K+1)-token query over L + K + 1 columns with the tail masked. One bf16 ulp of difference in one layer's
attention output is amplified by the 30 layers of SmolLM2-135M to up to ~1 logit, so greedy text with
speculation parted from greedy text without it (measured then on the real pair: 5 of 10 prompts). The linear
layers, norms, RoPE and the LM head are row-independent (bit-equal for 1 to 32 rows on this CPU's bf16
GEMM; from 33 rows the kernel changes).

So a multi-token forward over a non-empty, hole-free cache computes attention one query row at a time
("prefix"), each row exactly as the 1-token step at that position would: the same SDPA call on the
columns before it and no mask. Everything else stays batched; only attention, the cheap part at these
contexts, is looped. That makes one request at a time bit-exact in any dtype.

Batches with holes or left padding have another column layout than a lone request's decode, so the
default keeps their one masked call (divergences there are near-ties: `dvi.decode.sampling.tie_bound`). The
exact mode (`models.exact_greedy`, `set_exact_greedy`) also attends those row by row on each row's own
valid columns ("gather") and prefills rows one by one: every row is then computed as its lone plain
decode (while a forward scores at most 32 rows x positions), at B x (K+1) SDPA calls per layer.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa
from transformers.modeling_utils import AttentionInterface

from dvi.decode.kv import mask_layout

ROWWISE_KWARG = "dvi_rowwise"
"""Keyword the lean forward passes down through the decoder layers to ask for row-by-row attention."""


def _sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention, or (`dvi_rowwise` = "prefix" / "gather") one SDPA call per query row."""
    mode = kwargs.pop(ROWWISE_KWARG, None)
    q, kv = query.shape[2], key.shape[2]
    if mode is None or (mode == "prefix" and (q == 1 or kv == q)):  # a step, or a prefill over an empty cache
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if mode == "prefix" and use_gqa_in_sdpa(None, key, value) and not kwargs.get("dropout"):
        return _prefix_rows(module, query, key, value, kwargs.get("scaling")), None
    outs = []
    for j in range(q):
        if mode == "prefix":  # every row: the kv - q + j + 1 columns a 1-token step here would have cached
            end = kv - q + j + 1
            outs.append(sdpa_attention_forward(module, query[:, :, j : j + 1], key[:, :, :end], value[:, :, :end],
                                               None, **kwargs)[0])
        else:  # "gather": each row alone over the columns its mask allows
            outs.append(torch.cat([_one(module, query, key, value, attention_mask, b, j, **kwargs)
                                   for b in range(query.shape[0])], 0))
    return torch.cat(outs, 1), None  # [B, q, H, D]


def _prefix_rows(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling) -> torch.Tensor:
    """Row j of query [B, H, q, D] over the kv - q + j + 1 columns of key/value [B, Hkv, kv, D] that a 1-token
    step at its position would have cached: [B, q, H, D]. The SDPA call is the one HF's `sdpa_attention_forward`
    makes for an unmasked 1-token query (GQA inside the kernel, the module's scale; the caller checks that HF
    would take that path), made directly: its
    per-call bookkeeping, 30 layers x (K + 1) times a verify, cost ~0.5 ms per verified token here."""
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    q, kv = query.shape[2], key.shape[2]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kw = {"enable_gqa": True} if gqa else {}
    outs = [sdpa(query[:, :, j : j + 1], key[:, :, : kv - q + j + 1], value[:, :, : kv - q + j + 1],
                 scale=scaling, **kw) for j in range(q)]  # each [B, H, 1, D]
    return torch.cat(outs, 2).transpose(1, 2).contiguous()


def _one(module, query, key, value, attention_mask, b: int, j: int, **kwargs) -> torch.Tensor:
    """Attention of row b's query j alone over the key columns its mask allows, unmasked: [1, 1, H, D]."""
    idx = (attention_mask[b, 0, j] == 0).nonzero().squeeze(1)
    return sdpa_attention_forward(module, query[b : b + 1, :, j : j + 1], key[b : b + 1, :, idx],
                                  value[b : b + 1, :, idx], None, **kwargs)[0]


def install() -> None:
    """Route "sdpa" through `_sdpa` (idempotent). Without the keyword it is HF's function unchanged."""
    if AttentionInterface._global_mapping.get("sdpa") is not _sdpa:
        AttentionInterface.register("sdpa", _sdpa)


def rowwise_mode(attention_mask, config, q: int, exact: bool) -> str | None:
    """How a forward of q new positions attends (`_sdpa`): "prefix" for a multi-token query over a hole-free
    cache (the plain step would pass no mask), "gather" in the exact mode when columns are masked (holes,
    padding), None (one SDPA call) otherwise and always for windowed or hybrid attention."""
    if attention_mask is None or isinstance(attention_mask, dict) or mask_layout(config)[0] != "full":
        return None
    if bool((attention_mask[:, :, -1] == 0).all()):
        return "prefix" if q > 1 else None
    return "gather" if exact else None


EXACT_ATTR = "dvi_exact_greedy"


def set_exact_greedy(model, on: bool = True):
    """Mark a target for the exact mode (read when the engine builds its forward); returns `model`."""
    setattr(model, EXACT_ATTR, bool(on))
    return model


def is_exact_greedy(model) -> bool:
    return bool(getattr(model, EXACT_ATTR, False))


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none): which kernels it runs natively."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
