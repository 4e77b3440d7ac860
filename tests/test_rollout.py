"""dvi.rollout: speculative rollouts carry the target's exact log-probs, and target swaps take effect.

Real tiny pair, real SpeculativeEngine, plain HF forward passes / `generate` as the reference.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dvi.data import prompt_stream
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine, Versions
from dvi.models.loading import find_tokenizer_path, load_causal_lm, load_tokenizer
from dvi.rollout import Rollout, RolloutEngine, policy_state_dict
from dvi.rollout_trl import trl_rollout_func

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    tok = load_tokenizer(find_tokenizer_path(tiny_pair_dir / "target"))
    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    drafter = load_causal_lm(tiny_pair_dir / "drafter", device="cpu", dtype="float32")
    prompts = list(itertools.islice(prompt_stream("code", tok, prompt_tokens=(6, 20), seed=3), 3))
    return tok, target, drafter, prompts


def _plain_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each completion token, one unbatched forward pass."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return lp[pos, torch.tensor(completion)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_plain_forward(pair, temperature):
    tok, target, drafter, prompts = pair
    engine = RolloutEngine(SpeculativeEngine(target, proposer=proposer_for(target, drafter), num_draft_tokens=3))
    rolls = engine.generate_rollouts(prompts, n=2, max_new_tokens=12, temperature=temperature, seed=11)

    assert len(rolls) == len(prompts) * 2
    assert [(r.prompt_index, r.sample_index) for r in rolls] == [(i, s) for i in range(len(prompts)) for s in range(2)]
    stats = engine.last_stats
    assert stats is not None and stats.num_drafted > 0 and 0.0 <= stats.alpha <= 1.0
    for r in rolls:
        assert isinstance(r, Rollout)
        assert r.prompt_ids == prompts[r.prompt_index]
        assert 1 <= len(r.completion_ids) <= 12
        assert len(r.logprobs) == len(r.completion_ids)
        ref = _plain_logprobs(target, r.prompt_ids, r.completion_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, atol=2e-4, rtol=1e-4)


def test_same_seed_same_rollouts(pair):
    _, target, drafter, prompts = pair
    engine = RolloutEngine(SpeculativeEngine(target, proposer=proposer_for(target, drafter), num_draft_tokens=3))
    a = engine.generate_rollouts(prompts[:2], n=2, max_new_tokens=8, seed=5)
    b = engine.generate_rollouts(prompts[:2], n=2, max_new_tokens=8, seed=5)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]


def _perturbed(model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A genuinely different policy of the same architecture: every weight moved by seeded noise."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) * (v.std() if v.numel() > 1 else 1.0)
            for k, v in policy_state_dict(model).items()}


def _check_greedy_equal(model, prompt: list[int], got: list[int], want: list[int]) -> None:
    """Equal, or the first divergence sits where the model's top-2 logits tie (float noise)."""
    if got == want:
        return
    j = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + want[:j]])).logits[0, -1]
    top2 = logits.topk(2).values
    assert float(top2[0] - top2[1]) < 1e-4, f"greedy diverged at {j} with a clear top-1: {got} vs {want}"


def test_update_target_weights_then_greedy_equals_new_target(pair, tmp_path, tiny_pair_dir):
    tok, _, drafter, prompts = pair
    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    engine = RolloutEngine(SpeculativeEngine(target, proposer=proposer_for(target, drafter), num_draft_tokens=3))
    before = engine.generate_rollouts(prompts, max_new_tokens=16, temperature=0.0)

    # New weights as a state dict.
    new_model = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    new_model.load_state_dict(_perturbed(new_model, seed=1))
    assert engine.update_target_weights(policy_state_dict(new_model), version=7) == 7
    after = engine.generate_rollouts(prompts, max_new_tokens=16, temperature=0.0)
    assert all(r.target_version == 7 for r in after)
    assert [r.completion_ids for r in after] != [r.completion_ids for r in before], "the swap changed nothing"
    for p, r in zip(prompts, after, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            hf = new_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                    do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
        _check_greedy_equal(new_model, p, r.completion_ids, hf[0, len(p):].tolist())

    # New weights from a saved checkpoint path; version defaults to current + 1.
    other = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    other.load_state_dict(_perturbed(other, seed=2))
    other.save_pretrained(tmp_path / "policy")
    assert engine.update_target_weights(tmp_path / "policy") == 8
    again = engine.generate_rollouts(prompts[:1], max_new_tokens=16, temperature=0.0)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        hf = other.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                            do_sample=False, eos_token_id=None, pad_token_id=tok.pad_token_id)
    _check_greedy_equal(other, prompts[0], again[0].completion_ids, hf[0, len(prompts[0]):].tolist())
    assert again[0].target_version == 8


def test_feedback_records_carry_versions(pair, tmp_path):
    from dvi.feedback import FeedbackReader, FeedbackWriter

    _, target, drafter, prompts = pair
    writer = FeedbackWriter(tmp_path / "fb", shard_records=1000)
    engine = RolloutEngine(SpeculativeEngine(target, proposer=proposer_for(target, drafter),
                                             num_draft_tokens=3, feedback_top_k=4,
                                             versions=Versions(target=3, drafter=2)), feedback_writer=writer)
    engine.generate_rollouts(prompts[:2], n=2, max_new_tokens=6, seed=0)
    assert engine.flush_feedback() is not None
    reader = FeedbackReader(tmp_path / "fb")
    recs = list(reader.iter_records(reader.poll()))
    assert len(recs) == 4
    assert {(r.target_version, r.drafter_version, r.domain) for r in recs} == {(3, 2, "rl")}
    assert all(len(r.topk_ids) == len(r.token_ids) and len(r.topk_ids[0]) == 4 for r in recs)
    writer.close()


def test_bad_input_names_the_field(pair):
    _, target, drafter, prompts = pair
    engine = RolloutEngine(SpeculativeEngine(target, proposer=proposer_for(target, drafter)))
    with pytest.raises(ValueError, match="n must be"):
        engine.generate_rollouts(prompts, n=0)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.generate_rollouts([prompts[0], []])
    with pytest.raises(TypeError, match="prompts"):
        engine.generate_rollouts("def f():")
    assert callable(trl_rollout_func(engine))


def test_policy_state_dict_merges_a_peft_policy(tiny_pair_dir):
    """A LoRA-wrapped GRPO policy (TRL's peft_config path) lands in the dvi target as merged weights."""
    from peft import LoraConfig, get_peft_model

    base = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             modules_to_save=["lm_head"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    engine = RolloutEngine(SpeculativeEngine(target))
    sd = policy_state_dict(policy)
    assert set(sd) == set(target.state_dict())
    engine.update_target_weights(sd, version=1)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_a_new_target_version_keeps_the_drafters_acceptance_estimates(pair, tiny_pair_dir):
    """RL pushes a policy every step: the drafter did not change, so its measured acceptance carries over (reset to
    the optimistic prior, every rollout batch drafted its full batch once and restarted its probes); a new drafter
    still starts from the prior."""
    tok, _, drafter, prompts = pair
    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    eng = SpeculativeEngine(target, proposer=proposer_for(target, drafter), num_draft_tokens=3)
    engine = RolloutEngine(eng)
    engine.generate_rollouts(prompts, max_new_tokens=16, temperature=0.0)
    pools = {d: p.alpha for d, p in eng.acceptance._pools.items()}
    assert pools and all(a != eng.acceptance.prior for a in pools.values())  # measured, not the prior
    engine.update_target_weights(policy_state_dict(target), version=1)
    assert {d: p.alpha for d, p in eng.acceptance._pools.items()} == pools
    eng.set_drafter(drafter, 1)
    assert not eng.acceptance._pools  # a new drafter: back to the prior
