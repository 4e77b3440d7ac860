"""Tiny random models for tests: one builder, so every test makes its small Llama the same way.

Not a test module (no `test_` prefix); tests import it by name, as pytest puts `tests/` on sys.path.
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(seed: int | None = 0, *, vocab_size: int = 64, hidden_size: int = 32, intermediate_size: int = 64,
               num_hidden_layers: int = 1, num_attention_heads: int = 2, num_key_value_heads: int = 2,
               **config: Any) -> Any:
    """A random `LlamaForCausalLM` in eval mode, its weights drawn after `torch.manual_seed(seed)`.

    `seed=None` keeps drawing from the current RNG stream (a second model after a first one).
    `config`: any other `LlamaConfig` field (max positions, initializer range, tied embeddings, ...).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                      num_key_value_heads=num_key_value_heads, **config)
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()
