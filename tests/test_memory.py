"""A long-serving process keeps its memory flat (issue 25): nothing per request stays behind in the engine, and
the server hands freed heap memory back to the OS (`serving.memory`)."""

from __future__ import annotations

import gc
import random

import pytest
import torch


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_engine_keeps_no_tensor_per_prompt_length(tiny_pair_dir):
    """Prompts of ever new lengths (each a new prefill / drafter catch-up width) leave no tensor behind: a mask
    helper once kept a [q, q] identity per width on the drafter's long-lived cache (a 4k prompt: 16 MiB)."""
    from dvi.decode.engine import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")
    engine = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=3)
    rng = random.Random(0)

    def serve(lengths: list[int]) -> None:
        for n in lengths:  # two rows of different lengths: a padded prefill, holes in the caches
            engine.generate([[rng.randrange(3, 60) for _ in range(n)], [rng.randrange(3, 60) for _ in range(n // 2)]],
                            max_new_tokens=6)

    serve([70, 80])  # warm-up: the engine's lasting state exists
    before = _live_tensors()
    serve(list(range(90, 150, 6)))
    assert _live_tensors() - before <= 2
