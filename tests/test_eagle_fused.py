"""A fused eagle head (EAGLE-3: the target's low / middle / high layers) in the engine: lossless, the verify hands
over the layers it reads (`LeanModel.feature_layers` follows the served head, swaps included), records log the
head's H-wide projection of them, and drafts equal the teacher-forced head on those logged features."""

from __future__ import annotations

import torch
from test_eagle import assert_drafts_are_the_teacher_forced_head, noisy_eagle, run
from test_eagle_ttt import noisy
from test_engine import NEW, PROMPTS, assert_greedy_equal, reference, tiny

from dvi.drafters.eagle import EagleDrafter
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine

torch.set_num_threads(1)

LAYERS = (0, 2)


def fused(target, seed: int = 1) -> EagleDrafter:
    return noisy(EagleDrafter(target, feature_layers=LAYERS), scale=0.3, seed=seed)


def projected(target, d: EagleDrafter, tokens: list[int]) -> torch.Tensor:
    """The head's projection of the target's residual streams after LAYERS on tokens[:-1] (HF forward)."""
    with torch.no_grad():
        hs = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        return d.project_features(torch.cat([hs[i + 1] for i in LAYERS], -1))[0]


def test_fused_head_is_lossless_and_logs_its_projection():
    target = tiny("llama", seed=0, layers=3)
    d = fused(target)
    got = run(SpeculativeEngine(target, proposer_for(target, d), num_draft_tokens=3), PROMPTS)
    for p, r in zip(PROMPTS, got, strict=True):
        assert_greedy_equal(target, p, r.token_ids, reference(target, p, NEW))
        assert r.hidden.shape == (len(p) + NEW - 1, 64)
        torch.testing.assert_close(r.hidden.float(), projected(target, d, p + r.token_ids), atol=3e-3, rtol=3e-3)
    assert sum(r.num_drafted for r in got) > 0


def test_fused_drafts_equal_the_teacher_forced_head_on_logged_features():
    target = tiny("llama", seed=0, layers=3)
    d = fused(target)
    assert_drafts_are_the_teacher_forced_head(target, d)


def test_swaps_between_feature_kinds_recompute_features():
    """first-recipe head -> fused head -> first-recipe head mid-flight: lossless, and each swap points the verify
    at the layers the served head reads."""
    target = tiny("llama", seed=0, layers=3)
    refs = [reference(target, p, NEW) for p in PROMPTS[:3]]
    seen = []

    def midflight(eng, step):
        if step == 2:
            eng.set_drafter(fused(target, seed=4), version=2)
        if step == 5:
            eng.set_drafter(noisy_eagle(target, seed=9), version=3)
        seen.append(eng._target.lean.feature_layers)

    eng = SpeculativeEngine(target, proposer_for(target, noisy_eagle(target)), num_draft_tokens=3)
    got = run(eng, PROMPTS[:3], midflight=midflight)
    for p, r, ref in zip(PROMPTS[:3], got, refs, strict=True):
        assert_greedy_equal(target, p, r.token_ids, ref)
        assert r.hidden.shape == (len(p) + NEW - 1, 64)
    assert seen[0] is None and LAYERS in seen and seen[-1] is None
