"""dvi's decode attention kernel (`dvi/decode/attention_kernel.c`, switched on with `serve.cpu_rows_kernel`): each
query over exactly its row's visible columns, as SDPA computes it up to float rounding, rounding alike alone or beside
other queries, so a batch row on the kernels decodes as it does alone (both dtypes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_llama

from dvi.decode import attention_kernel
from dvi.decode.attention_kernel import KernelPlan, prefix_plan
from dvi.decode.lean import LeanModel
from dvi.engine.speculative import EngineOptions, SpeculativeEngine

KERNEL = attention_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"attention kernel unavailable: "
                                                        f"{attention_kernel.unavailable_reason()}")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# every build this CPU runs (AVX-512's 16 lanes where it has them, AVX2's): each must hold what the one serving holds
BUILDS = [pytest.param(k, id=name) for k, name in zip(attention_kernel.builds(), (
    ("avx512", "avx2") if len(attention_kernel.builds()) == 2 else ("avx2",)), strict=False)]


def _cache(dtype, rows=4, kvh=3, d=64, capacity=320, seed=0):
    """A slot cache layer's layout [rows, capacity, 2, kv_heads, d] and its key / value views as the lean forward
    hands them over ([rows, kv_heads, columns, d], strided)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(rows, capacity, 2, kvh, d, generator=g).to(dtype)
    return kv.select(2, 0).transpose(1, 2), kv.select(2, 1).transpose(1, 2)


def _reference(q, keys, values, rows, visible, scale):
    out = []
    g = q.shape[1] // keys.shape[1]
    for i in range(q.shape[0]):
        r, n = int(rows[i]), int(visible[i])
        k = keys[r, :, :n].double().repeat_interleave(g, 0)
        v = values[r, :, :n].double().repeat_interleave(g, 0)
        out.append(F.scaled_dot_product_attention(q[i].double().unsqueeze(1), k, v, scale=scale).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kvh", "d"), [(9, 3, 64), (4, 4, 16), (8, 2, 32), (6, 1, 24), (40, 2, 136),
                                                 (10, 2, 80), (4, 1, 128)])
def test_the_kernel_computes_what_sdpa_does(kernel, dtype, heads, kvh, d):
    keys, values = _cache(dtype, kvh=kvh, d=d)
    g = torch.Generator().manual_seed(heads * d)
    qkv = torch.randn(8, heads + 2 * kvh, d, generator=g).to(dtype)  # q strided as the forward's qkv rows are
    q = qkv[:, :heads]
    rows = torch.tensor([0, 1, 1, 2, 3, 3, 3, 0])
    visible = torch.tensor([1, 7, 8, 9, 255, 256, 257, 320])  # both sides of the kernel's blocks of 8 keys
    got = kernel.attend(q, keys, values, prefix_plan(rows, visible), d ** -0.5)
    assert got.shape == (8, heads * d) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
    torch.testing.assert_close(got.double(), _reference(q, keys, values, rows, visible, d ** -0.5), rtol=tol, atol=tol)


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_query_rounds_alike_alone_and_beside_others(kernel, dtype):
    keys, values = _cache(dtype)
    q = torch.randn(12, 9, 64).to(dtype)
    rows, visible = torch.arange(12) % 4, torch.arange(12) * 25 + 3
    together = kernel.attend(q, keys, values, prefix_plan(rows, visible), 0.125)
    for i in range(12):
        alone = kernel.attend(q[i : i + 1], keys, values, prefix_plan(rows[i : i + 1], visible[i : i + 1]),
                              0.125)
        assert torch.equal(alone, together[i : i + 1]), i


@pytest.mark.parametrize("kernel", BUILDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tree_node_attends_its_ancestors_as_the_step_at_its_position_does(kernel, dtype):
    """A node's columns: its row's cache, then its ancestors' and its own (not its siblings'), in depth order; the
    same arithmetic as a query whose prefix holds those keys in place, bit for bit (then the accepted path, moved
    into place, is what the next step reads)."""
    keys, values = _cache(dtype, rows=1)
    q = torch.randn(3, 9, 64).to(dtype)
    start = 37
    # a tree over columns 37..: root 37, children 38 and 39, 39's child 40; node 40's path is 37, 39, 40
    plan = KernelPlan(torch.zeros(3, dtype=torch.long), torch.full((3,), start), start + 4,
                      torch.tensor([[37, 38, 0], [37, 39, 0], [37, 39, 40]]), torch.tensor([2, 2, 3]))
    got = kernel.attend(q, keys, values, plan, 0.125)
    moved_k, moved_v = keys.clone(), values.clone()  # the path 37, 39, 40 at 37, 38, 39, as after acceptance
    moved_k[:, :, 38:40], moved_v[:, :, 38:40] = keys[:, :, [39, 40]], values[:, :, [39, 40]]
    step = kernel.attend(q[2:], moved_k, moved_v, prefix_plan(torch.zeros(1, dtype=torch.long),
                                                              torch.tensor([start + 3])), 0.125)
    assert torch.equal(got[2:], step)
    first = kernel.attend(q[:1], keys, values, prefix_plan(torch.zeros(1, dtype=torch.long),
                                                           torch.tensor([start + 2])), 0.125)
    assert torch.equal(got[:1], first)  # node 38 sees its chain's columns
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    ref = _reference(q[1:2], torch.cat([keys[:, :, :38], keys[:, :, 39:40]], 2),
                     torch.cat([values[:, :, :38], values[:, :, 39:40]], 2), torch.zeros(1), torch.tensor([39]), 0.125)
    torch.testing.assert_close(got[1:2].double(), ref, rtol=tol, atol=tol)


def test_shapes_it_does_not_attend_are_named():
    assert KERNEL.supports(torch.float16, 4, 4, 16) == "torch.float16 caches"
    assert "head_dim 12" in KERNEL.supports(torch.float32, 4, 4, 12)
    assert KERNEL.supports(torch.bfloat16, 9, 3, 64) is None
    lean = LeanModel(tiny_llama(0, hidden_size=24, num_attention_heads=2))  # head_dim 12
    lean.use_rows_kernel(4)
    assert lean.attn_kernel is None  # torch's SDPA attends that model


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_a_batch_on_the_kernels_decodes_each_row_as_it_decodes_alone(dtype):
    """Matmul rows and attention queries each computed alone: a batch row's greedy text is its lone decode token for
    token, with speculation on (history drafts, ragged verifies) and off, in fp32 and in bf16 (where torch's kernels
    part rows at near-ties)."""
    target = tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2).to(dtype)
    opts = EngineOptions(cpu_rows_kernel=True)
    off = SpeculativeEngine(target, None, options=opts)
    assert off._target.lean.attn_kernel is not None
    assert_batch_decodes_alone(target, off, opts, seed=7)


def assert_batch_decodes_alone(target, off: SpeculativeEngine, opts: EngineOptions, seed: int) -> None:
    """Four repetitive prompts (vocab 128) decoded together, with history drafts (ragged verifies) and without, equal
    each prompt decoded alone by `off`, token for token."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    g = torch.Generator().manual_seed(seed)
    prompts = [(torch.randint(0, 128, (9 + i,), generator=g).tolist() * 3)[: 20 + 3 * i] for i in range(4)]
    alone = [off.generate([p], 20)[0].token_ids for p in prompts]
    prop = make_proposer("suffix", None, 128, "cpu", settings=SuffixConfig(max_draft_tokens=4))
    spec = SpeculativeEngine(target, prop, num_draft_tokens=4, max_draft_tokens=4, options=opts)
    spec.generate(prompts, 20)  # history to draft from
    outs = spec.generate(prompts, 20)
    assert sum(o.num_drafted for o in outs) > 0
    assert [o.token_ids for o in outs] == alone
    assert [o.token_ids for o in off.generate(prompts, 20)] == alone


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_a_batch_verify_scores_each_row_as_it_scores_alone(dtype):
    """Bit for bit, at the logits: rows of different lengths verified together equal each verified alone (torch's
    kernels part them: SDPA over a padded, masked batch and MKL's GEMM round a row with what is beside it)."""
    from dvi.decode.target import CpuMatmuls, target_runner

    target = tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2).to(dtype)
    g = torch.Generator().manual_seed(7)
    contexts = [torch.randint(0, 128, (30 + 17 * i,), generator=g).tolist() for i in range(4)]
    ids = torch.randint(0, 128, (4, 3), generator=g)

    def logits(rows: list[int]) -> torch.Tensor:
        run = target_runner(target, cpu=CpuMatmuls(rows_kernel=True))
        run.admit([contexts[r] for r in rows], False)
        return run.forward(ids[rows], False)

    together = logits([0, 1, 2, 3])
    for i in range(4):
        assert torch.equal(together[i], logits([i])[0]), i


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_draft_trees_on_the_kernels_decode_as_speculation_off_does(dtype, monkeypatch):
    """A learned drafter's trees (K 4, 3 siblings a depth) verified on the kernels, one request at a time and batched:
    token for token the text of speculation off on the kernels, with accepted paths through siblings."""
    from test_engine import perturbed
    from test_trees import TreeSpy

    import dvi.engine.speculative
    from dvi.drafters.factory import proposer_for
    from dvi.drafters.learned import SeparateDrafter

    spy = TreeSpy()
    monkeypatch.setattr(dvi.engine.speculative, "accept_tree", spy.wrap(dvi.engine.speculative.accept_tree))
    target = tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2).to(dtype)
    drafter = SeparateDrafter(perturbed(target, 0.3))
    opts = EngineOptions(cpu_rows_kernel=True, tree_width=3)
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=4, options=opts)
    off = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel=True))
    assert eng._target.trees and eng._target.lean.attn_kernel is not None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (12 + 5 * i,), generator=g).tolist() for i in range(4)]
    alone = [off.generate([p], 24)[0].token_ids for p in prompts]
    assert [eng.generate([p], 24)[0].token_ids for p in prompts] == alone
    assert [o.token_ids for o in eng.generate(prompts, 24)] == alone
    assert spy.steps > 0 and spy.off_spine > 0, vars(spy)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 0.9)])
def test_tree_sampling_on_the_kernels_follows_the_target(dtype, temperature, top_p, monkeypatch):
    """Sampled drafts with point-mass siblings verified on the kernels (tree nodes through `TreeAttention.plan`):
    the first two tokens follow the target's warped law (chi-square), and siblings were accepted."""
    from test_sampling import tiny_lm
    from test_trees import TreeSpy, tree_pvalue

    import dvi.engine.speculative

    spy = TreeSpy()
    monkeypatch.setattr(dvi.engine.speculative, "accept_tree", spy.wrap(dvi.engine.speculative.accept_tree))
    pv, alpha = tree_pvalue(tiny_lm(0).to(dtype), tiny_lm(1).to(dtype), 3000, temperature, top_p, 3,
                            rows_kernel=True)
    assert 0.1 < alpha < 0.95, alpha
    assert pv > 1e-3, pv
    assert spy.steps > 0 and spy.off_spine > 60, vars(spy)
