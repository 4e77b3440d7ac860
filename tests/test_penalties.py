"""Penalties and logit_bias stay lossless (issue 27 §3).

presence/frequency/repetition penalties and logit_bias transform the target's distribution; the
engine verifies drafts against the transformed target, where the penalties at draft position j
count the tokens emitted before and the drafts d_1..d_{j-1}. Proven against a reference that
applies the transform step by step with the target alone (written out here, not the engine's
function): greedy equality, and a chi-square test of the first two tokens at T > 0.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from test_engine import perturbed, tiny
from test_sampling import tiny_lm

from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import InvalidParam, Request, SamplingParams, SpeculativeEngine

torch.set_num_threads(1)


def ref_transform(logits: torch.Tensor, prompt: list[int], out: list[int], p: SamplingParams) -> torch.Tensor:
    """The transform of one position's logits [V], by the definition (OpenAI / vLLM semantics)."""
    x = logits.double().clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(out):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return x


def ref_greedy(target, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            lg = target(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(ref_transform(lg, prompt, out, p).argmax()))
    return out


def run(eng: SpeculativeEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    for i, (pr, sp) in enumerate(zip(prompts, params, strict=True)):
        eng.add_request(Request(f"r{i}", pr, sp))
    done = {}
    while len(done) < len(prompts):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.result
    return [done[f"r{i}"] for i in range(len(prompts))]


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [3, 4, 5, 6, 3, 4, 5, 6], [42]]
NEW = 20


def _params(i: int, greedy_top: list[int]) -> SamplingParams:
    """Row-specific transforms (row 3: none), the logit_bias aimed at tokens greedy decoding emits."""
    kinds = [
        dict(presence_penalty=1.5, frequency_penalty=0.7),
        dict(repetition_penalty=1.8, logit_bias={greedy_top[0]: -4.0, greedy_top[1]: 2.5}),
        dict(frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={greedy_top[2]: 3.0}),
        dict(),
    ]
    return SamplingParams(NEW, **kinds[i])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_greedy_with_penalties_equals_the_reference(k):
    target = tiny("llama", seed=0)
    drafter = perturbed(target)  # agrees often: drafts reach deep positions, where within-step counts matter
    plain = [ref_greedy(target, pr, NEW, SamplingParams(NEW)) for pr in PROMPTS]
    top = [t for r in plain for t in r]
    params = [_params(i, top) for i in range(len(PROMPTS))]
    refs = [ref_greedy(target, pr, NEW, sp) for pr, sp in zip(PROMPTS, params, strict=True)]
    assert sum(a != b for a, b in zip(plain[:3], refs[:3], strict=True)) == 3, "the transforms must change the text"
    res = run(SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=k), PROMPTS, params)
    assert sum(r.num_accepted for r in res) > 0 or k == 0
    for pr, r, ref in zip(PROMPTS, res, refs, strict=True):
        assert r.token_ids == ref, (pr, r.token_ids, ref)


def test_params_are_validated_naming_the_field():
    eng = SpeculativeEngine(tiny("llama", seed=0), None, num_draft_tokens=0)
    bad = [("presence_penalty", dict(presence_penalty=2.5)), ("frequency_penalty", dict(frequency_penalty=float("nan"))),
           ("repetition_penalty", dict(repetition_penalty=0.0)), ("logit_bias", dict(logit_bias={10**6: 1.0})),
           ("logit_bias", dict(logit_bias={3: 101.0})), ("logit_bias", dict(logit_bias={-1: 1.0}))]
    for name, kw in bad:
        with pytest.raises(InvalidParam) as e:
            eng.add_request(Request("x", [1, 2], SamplingParams(4, **kw)))
        assert e.value.param == name, (name, kw)


CHI_PARAMS = SamplingParams(3, temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.5,
                            logit_bias={0: 1.5, 5: -2.0})
CHI_PROMPT = [1, 2, 3]


def exact_two_token_law(target, p: SamplingParams) -> dict:
    def dist(out):
        with torch.no_grad():
            lg = target(torch.tensor([CHI_PROMPT + out])).logits[0, -1]
        return torch.softmax(ref_transform(lg, CHI_PROMPT, out, p) / p.temperature, -1)

    p1 = dist([])
    return {(a, b): float(p1[a]) * float(dist([a])[b]) for a in range(p1.numel()) for b in range(p1.numel())}


def test_sampling_with_penalties_follows_the_transformed_target():
    target, drafter = tiny_lm(0), tiny_lm(1)
    n = 3000
    params = [SamplingParams(**{**CHI_PARAMS.__dict__, "seed": 100 + i}) for i in range(n)]
    res = run(SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=2), [CHI_PROMPT] * n, params)
    exact = exact_two_token_law(target, CHI_PARAMS)
    counts: dict[tuple, int] = {}
    for r in res:
        counts[tuple(r.token_ids[:2])] = counts.get(tuple(r.token_ids[:2]), 0) + 1
    big = [key for key, pr in exact.items() if pr * n >= 5]
    obs = [counts.get(key, 0) for key in big] + [n - sum(counts.get(key, 0) for key in big)]
    exp = [exact[key] * n for key in big] + [n - sum(exact[key] * n for key in big)]
    exp = [e * sum(obs) / sum(exp) for e in exp]
    alpha = sum(r.num_accepted for r in res) / max(1, sum(r.num_drafted for r in res))
    assert 0.1 < alpha < 0.95, alpha
    assert chisquare(obs, exp).pvalue > 1e-3
    # the test can fail: the same samples against the untransformed target's law
    plain = exact_two_token_law(target, SamplingParams(3, temperature=1.0))
    exp_plain = [plain[key] * n for key in big] + [n - sum(plain[key] * n for key in big)]
    exp_plain = [e * sum(obs) / sum(exp_plain) for e in exp_plain]
    assert chisquare(obs, exp_plain).pvalue < 1e-4
