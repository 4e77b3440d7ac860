"""Offline α estimates: a drafter equal to the target scores 1, a different one scores less."""

import torch
from tiny_models import tiny_llama
from transformers import LlamaForCausalLM

from dvi.feedback import FeedbackRecord
from dvi.feedback.shadow import hf_logits_fn, shadow_alpha

torch.set_num_threads(1)


def _llama(seed: int) -> LlamaForCausalLM:
    return tiny_llama(seed, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                      initializer_range=0.3)


def _records(target: LlamaForCausalLM, temperature: float) -> list[FeedbackRecord]:
    recs = []
    gen = torch.Generator().manual_seed(0)
    for i in range(4):
        prompt = torch.randint(0, 64, (5 + i,), generator=gen).tolist()
        ids = list(prompt)
        topk_ids, topk_lp = [], []
        with torch.no_grad():
            for _ in range(8):
                logits = target(torch.tensor([ids])).logits[0, -1]
                lp = torch.log_softmax(logits, -1)
                vals, idx = lp.topk(64)
                topk_ids.append(idx.tolist())
                topk_lp.append(vals.tolist())
                if temperature == 0:
                    nxt = int(logits.argmax())
                else:
                    nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
                ids.append(nxt)
        tokens = ids[len(prompt):]
        recs.append(FeedbackRecord(request_id=f"r{i}", domain="default", target_version=0, drafter_version=0,
                                   started_at=0.0, finished_at=0.0, temperature=temperature, prompt_ids=prompt,
                                   token_ids=tokens, drafted_ids=[-1] * len(tokens), accepted=[False] * len(tokens),
                                   topk_ids=topk_ids, topk_logprobs=topk_lp))
    return recs


def test_identical_drafter_scores_one_greedy_and_sampled() -> None:
    target = _llama(0)
    for temperature in (0.0, 1.0):
        est = shadow_alpha(hf_logits_fn(target), _records(target, temperature))
        assert est.records == 4 and est.positions == 32
        assert abs(est.alpha - 1.0) < 1e-4, (temperature, est)


def test_different_drafter_scores_less() -> None:
    target, other = _llama(0), _llama(1)
    for temperature in (0.0, 1.0):
        est = shadow_alpha(hf_logits_fn(other), _records(target, temperature))
        assert 0.0 <= est.alpha < 0.9, (temperature, est)


def test_scoring_computes_only_the_generated_positions_logits() -> None:
    """A shadow check asks for the generated positions' logits only (`keep`): the same rows as the full forward's
    tail, without the prompt's full-vocabulary rows (most of a check's memory on the real pair)."""
    model = _llama(0)
    fn = hf_logits_fn(model)
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, kept = fn(ids), fn(ids, keep=6)
    assert full.shape[1] == 20 and kept.shape[1] == 6
    torch.testing.assert_close(kept, full[:, -6:])


def test_nan_shadow_alpha_never_passes():
    """Issue 17 item 5: `not (nan < x)` is True; a NaN or inf candidate estimate must not pass."""
    from dvi.feedback.shadow import shadow_passes

    assert not shadow_passes(float("nan"), 0.5, 0.01) and not shadow_passes(float("inf"), 0.5, 0.01)
    assert shadow_passes(0.495, 0.5, 0.01) and not shadow_passes(0.48, 0.5, 0.01)
    assert shadow_passes(0.3, float("nan"), 0.01)  # no live estimate to compare with
