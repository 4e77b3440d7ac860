"""Losslessness on CUDA: the CPU suite's greedy and chi-square checks, run with the models on the GPU.

Skipped where no CUDA device is present (CI); run on a GPU machine with `pytest tests/test_cuda.py`.
fp32 must match the target's own greedy decoding up to float-noise ties (TF32 off, as in torch's
default for matmuls); bf16 is checked with a tie tolerance of a few bf16 ulps of the top logit,
since a K+1-token verify and a 1-token decode round differently there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_engine import FAMILIES, NEW, PROMPTS, assert_greedy_equal, perturbed, reference, tiny
from test_sampling import N_SAMPLES, engine_pvalue, tiny_lm

from dvi.drafters.factory import proposer_for
from dvi.drafters.learned import EarlyExitDrafter
from dvi.engine.speculative import SpeculativeEngine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
BF16_ULPS = 4  # tie tolerance in bf16 ulps of the top logit (bf16 has 8 mantissa bits: ulp = 2^-7 * |x|)


@pytest.fixture(autouse=True)
def _strict_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _greedy_case(target, drafter, ks=(1, 3, 5), adaptive=False, tie_eps=None) -> float | None:
    """Greedy equality at batch 1 and in a ragged batch; returns α pooled over the batched requests (None when
    nothing was drafted: adaptive K may keep speculation off for a whole request, where its costs say so)."""
    refs = [reference(target, p, NEW) for p in PROMPTS]
    drafted = accepted = 0
    for k in ks:
        eng = SpeculativeEngine(target, proposer_for(target, drafter),
                                num_draft_tokens=k, adaptive=adaptive, max_draft_tokens=max(ks))
        assert eng.device.type == "cuda"
        for p, ref in zip(PROMPTS, refs, strict=True):  # batch 1
            r = eng.generate([p], NEW)[0]
            assert_greedy_equal(target, p, r.token_ids, ref, **({"tie_eps": tie_eps} if tie_eps else {}))
        for p, ref, r in zip(PROMPTS, refs, eng.generate(PROMPTS, NEW), strict=True):  # ragged batch
            assert_greedy_equal(target, p, r.token_ids, ref, **({"tie_eps": tie_eps} if tie_eps else {}))
            drafted, accepted = drafted + r.num_drafted, accepted + r.num_accepted
    return accepted / drafted if drafted else None


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_fp32_cuda(fam):
    target = tiny(fam, seed=0).to(CUDA)
    alpha = _greedy_case(target, perturbed(target))
    assert 0.3 < alpha < 1.0, alpha  # acceptance exercised both ways


def test_adaptive_engine_fp32_cuda():
    """Adaptive K may draft nothing for a request (on CUDA a tiny drafter costs about what the tiny target does,
    so its calibrated costs can keep speculation off): greedy equality is what must hold either way."""
    target = tiny("llama", seed=0).to(CUDA)
    _greedy_case(target, perturbed(target), ks=(3,), adaptive=True)


@pytest.mark.parametrize("fam", ["llama", "qwen3"])
def test_greedy_bf16_cuda(fam):
    target = tiny(fam, seed=0).to(CUDA, torch.bfloat16)
    drafter = perturbed(target)
    with torch.no_grad():
        top = max(float(target(torch.tensor([p], device=CUDA)).logits.float().abs().max()) for p in PROMPTS)
    _greedy_case(target, drafter, ks=(1, 4), tie_eps=BF16_ULPS * top * 2**-7)


def test_early_exit_drafter_cuda():
    target = tiny("llama", seed=0, layers=3).to(CUDA)
    ee = EarlyExitDrafter(target, num_layers=1, lora_rank=4)
    with torch.no_grad():
        for p in ee.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    _greedy_case(target, ee, ks=(1, 3))


@pytest.mark.parametrize("fam", ["llama", "qwen3", "mistral"])
def test_eagle_drafter_cuda(fam):
    from test_eagle import noisy_eagle

    target = tiny(fam, seed=0).to(CUDA)
    _greedy_case(target, noisy_eagle(target), ks=(1, 3, 5))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 1.0), (1.0, 0, 0.8)])
def test_sampling_matches_target_cuda(temperature, top_k, top_p):
    """Engine on the GPU, exact law from the same weights on the CPU: the chi-square test of test_sampling."""
    target, drafter = tiny_lm(0), tiny_lm(1)
    cpu_target = copy.deepcopy(target)
    pv, alpha = engine_pvalue(
        target.to(CUDA), drafter.to(CUDA), N_SAMPLES, temperature, top_k, top_p, seed=11, reference=cpu_target
    )
    assert 0.1 < alpha < 0.95
    assert pv > 1e-3, pv


def test_graphed_forward_matches_eager_cuda():
    """Each captured bucket replays what the eager lean forward computes on the same cache contents."""
    from dvi.decode.graphs import GraphedForward
    from dvi.decode.lean import LeanModel
    from dvi.decode.lean_target import LeanTarget

    target = tiny("llama", seed=0).to(CUDA)
    lean = LeanModel(target)
    graphed = LeanTarget(lean=lean, graphs=GraphedForward(lean, 4, 5, 128, progress=False))
    eager = LeanTarget(lean=lean)
    contexts = [p[:-1] for p in PROMPTS[:3]]
    with torch.inference_mode():
        graphed.admit(contexts, False)
        eager.admit(contexts, False)
        for q in (1, 2, 5):
            ids = torch.randint(0, target.config.vocab_size, (3, q), device=CUDA)
            a, b = graphed.forward(ids, False), eager._eager(ids, False)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            graphed.keep(q, [1, q, 0])
            eager.keep(q, [1, q, 0])


def test_one_host_sync_per_graphed_step_cuda():
    """A plain step of the graphed engine synchronises with the host once (the step's one transfer)."""
    import warnings

    target = tiny("llama", seed=0).to(CUDA)
    eng = SpeculativeEngine(target, None, num_draft_tokens=0, adaptive=False)
    from dvi.engine.speculative import Request, SamplingParams

    eng.add_request(Request("r", PROMPTS[0], SamplingParams(max_new_tokens=8)))
    eng.step()  # admission (prefill) and the first step
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
