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

from dvi.decode.engine import SpeculativeEngine
from dvi.drafters.learned import EarlyExitDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
BF16_ULPS = 4  # tie tolerance in bf16 ulps of the top logit (bf16 has 8 mantissa bits: ulp = 2^-7 * |x|)


@pytest.fixture(autouse=True)
def _strict_fp32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _greedy_case(target, drafter, ks=(1, 3, 5), adaptive=False, tie_eps=None) -> float:
    refs = [reference(target, p, NEW) for p in PROMPTS]
    alphas = []
    for k in ks:
        eng = SpeculativeEngine(target, drafter, num_draft_tokens=k, adaptive=adaptive, max_draft_tokens=max(ks))
        assert eng.device.type == "cuda"
        for p, ref in zip(PROMPTS, refs, strict=True):  # batch 1
            r = eng.generate([p], NEW)[0]
            assert_greedy_equal(target, p, r.token_ids, ref, **({"tie_eps": tie_eps} if tie_eps else {}))
        for p, ref, r in zip(PROMPTS, refs, eng.generate(PROMPTS, NEW), strict=True):  # ragged batch
            assert_greedy_equal(target, p, r.token_ids, ref, **({"tie_eps": tie_eps} if tie_eps else {}))
            alphas.append(r.alpha)
    return sum(alphas) / len(alphas)


@pytest.mark.parametrize("fam", FAMILIES)
def test_greedy_fp32_cuda(fam):
    target = tiny(fam, seed=0).to(CUDA)
    alpha = _greedy_case(target, perturbed(target))
    assert 0.3 < alpha < 1.0, alpha  # acceptance exercised both ways


def test_adaptive_engine_fp32_cuda():
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
