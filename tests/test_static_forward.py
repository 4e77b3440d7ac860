"""The static-shape forward that CUDA graphs capture (`dvi.decode.graphs.StaticForward`), run eagerly on the CPU:
bucketed rows, widths and columns, padding rows in free slots and padding positions past a row's length give
what the eager lean target computes, step after step, as rows join, keep drafts and leave."""

from __future__ import annotations

import torch
from tiny_models import tiny_llama

from dvi.decode.graphs import StaticForward, buckets_up_to
from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget


def test_buckets_end_at_the_limit():
    assert buckets_up_to(16, (1, 2, 4, 8, 16, 32)) == (1, 2, 4, 8, 16)
    assert buckets_up_to(6, (1, 2, 3, 5, 9)) == (1, 2, 3, 5, 6)


@torch.inference_mode()
def test_static_shapes_compute_what_the_eager_forward_does():
    target = tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2)
    lean = LeanModel(target)
    static = LeanTarget(lean=lean, graphs=StaticForward(lean, max_batch=4, max_width=5, max_context=300))
    eager = LeanTarget(lean=lean)
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 30, 2)]
    for run in (static, eager):
        run.admit(contexts, False)
    for step, (q, kept) in enumerate([(1, [1, 1, 1]), (5, [2, 5, 1]), (3, [3, 1, 2]), (2, [1, 2, 2])]):
        ids = torch.randint(0, 128, (3, q), generator=g)
        a, b = static.forward(ids, False), eager.forward(ids, False)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
        static.keep(q, kept)
        eager.keep(q, kept)
    for run in (static, eager):  # a row leaves, one joins
        run.select_rows([0, 2])
        run.admit([contexts[1][:11]], False)
    ids = torch.randint(0, 128, (3, 4), generator=g)
    torch.testing.assert_close(static.forward(ids, False), eager.forward(ids, False), rtol=1e-5, atol=1e-5)
    assert static.cache.frozen and static.cache is static.graphs.cache


@torch.inference_mode()
def test_engine_admits_no_more_rows_than_a_fixed_cache_holds():
    """A captured graphs' cache holds max_batch rows: more prompts than that join as rows leave, with the text of
    an engine whose cache grows (the first GPU check sent a 17th row into 16 slots)."""
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine

    kw = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    target, drafter = tiny_llama(0, **kw), tiny_llama(1, **kw)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 7, 4, 8, 6, 10, 2)]
    grown = SpeculativeEngine(target, proposer_for(target, drafter),
                              num_draft_tokens=2).generate(prompts, max_new_tokens=6)
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=2)
    lean = LeanModel(target)
    eng._target = LeanTarget(lean=lean, graphs=StaticForward(lean, max_batch=4, max_width=3, max_context=300))
    fixed = eng.generate(prompts, max_new_tokens=6)
    assert eng._target.max_rows == 4
    assert [r.token_ids for r in fixed] == [r.token_ids for r in grown]


@torch.inference_mode()
def test_rope_tables_never_regrow_inside_a_capture():
    """The rope tables are sized before capture; a context bucket past the model's max positions (positions are
    clamped there) must not rebuild them during a forward (on CUDA: a host copy inside a capture, and graphs left
    reading freed tables; the first GPU check failed 14 of 18 CUDA tests on it)."""
    target = tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64)
    lean = LeanModel(target)
    static = LeanTarget(lean=lean, graphs=StaticForward(lean, max_batch=2, max_width=3, max_context=300))
    tables = (lean.cos, lean.sin)
    static.admit([list(range(1, 9))], False)
    for _ in range(3):
        static.forward(torch.tensor([[5, 6, 7]]), False)
        static.keep(3, [3])
    assert lean.cos is tables[0] and lean.sin is tables[1]


@torch.inference_mode()
def test_a_big_head_scores_the_same_blockwise_or_whole_and_its_path_is_measured():
    """A CPU head of >= 4 blocks: `head_block_rows` is measured at its first multi-row use (a probed row count or
    never), and a multi-row forward's logits are the same through either path, so the choice changes only the time."""
    from dvi.decode.lean import HEAD_BLOCK

    target = tiny_llama(0, vocab_size=4 * HEAD_BLOCK, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2)
    lean = LeanModel(target)
    assert lean.head_blocks is not None and len(lean.head_blocks) == 4
    f = torch.randn(5, 64)
    lean._logits(f)  # the first multi-row head measures the paths
    assert not lean._head_unmeasured and lean.head_block_rows in (None, 2, 3, 5, 9, 17)
    outs = []
    for rows in (None, 2):
        lean.head_block_rows = rows
        outs.append(lean._logits(f))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
    from dvi.decode.invariance import _key  # the greedy verdict is per head path: its cache must not mix them

    blockwise_key = _key(lean)  # head_block_rows is 2 here
    lean.head_block_rows = None
    assert _key(lean) != blockwise_key


@torch.inference_mode()
def test_a_ragged_verify_scores_only_real_positions_and_computes_what_the_full_one_does():
    """`lens` (row i drafted lens[i] of q - 1 tokens): the runner scores only each row's real positions (vLLM's
    flattened batch); they match the full-width verify's, padding comes back as zeros, and the caches agree on
    every kept entry, so the next step scores alike."""
    target = tiny_llama(0, vocab_size=128, hidden_size=96, num_hidden_layers=2, num_attention_heads=6,
                        num_key_value_heads=2)
    lean = LeanModel(target)
    full, ragged = LeanTarget(lean=lean), LeanTarget(lean=lean)
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 40, 3, 17)]
    for run in (full, ragged):
        run.admit(contexts, False)
    assert ragged.ragged_rows([4, 4, 4, 4], 5) is None  # nothing to skip
    for step, (q, lens, kept) in enumerate([(5, [4, 0, 2, 1], [3, 1, 3, 2]), (3, [0, 2, 0, 1], [1, 3, 1, 1]),
                                            (1, [0, 0, 0, 0], [1, 1, 1, 1])]):
        ids = torch.randint(0, 128, (4, q), generator=g)
        a, b = full.forward(ids, False), ragged.forward(ids, False, lens=lens)
        for i, n in enumerate(lens):
            torch.testing.assert_close(b[i, : n + 1], a[i, : n + 1], rtol=1e-5, atol=1e-5)
            assert torch.equal(b[i, : n + 1].argmax(-1), a[i, : n + 1].argmax(-1)), (step, i)
        for run in (full, ragged):
            run.keep(q, kept)
    ids = torch.randint(0, 128, (4, 2), generator=g)
    torch.testing.assert_close(ragged.forward(ids, False), full.forward(ids, False), rtol=1e-5, atol=1e-5)
