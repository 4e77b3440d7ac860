"""RL with dvi rollouts: TRL's GRPOTrainer through `rollout_func`, and the self-contained loop.

Real tiny pair, real SpeculativeEngine, real TRL; a few steps each so the suite stays fast.
"""

from __future__ import annotations

import itertools
import math
import os
import re

import pytest
import torch

from dvi.data import prompt_stream
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine
from dvi.models.loading import find_tokenizer_path, load_causal_lm, load_tokenizer
from dvi.rollout import policy_state_dict
from dvi.rollout_trl import SamplingOverrides, trl_rollout_func
from trainers.grpo import completion_logprobs, group_advantages
from trainers.rl import RLConfig, RLRun
from trainers.rl_tasks import ast_reward, upper_reward

torch.set_num_threads(1)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = policy_state_dict(a), policy_state_dict(b)
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_trl_grpo_steps_with_dvi_rollout_func(tiny_pair_dir, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    tok = load_tokenizer(find_tokenizer_path(tiny_pair_dir / "target"))
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_pair_dir / "target"), dtype=torch.float32)
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    served = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    engine = SpeculativeEngine(served, proposer_for(served, load_causal_lm(tiny_pair_dir / "drafter", device="cpu",
                                                                           dtype="float32")), num_draft_tokens=3)
    calls: list[tuple[int, int]] = []
    rollout_func = trl_rollout_func(  # seeded: unseeded samples can give a step equal rewards (no gradient)
        engine, sampling=SamplingOverrides(seed=0),
        on_rollouts=lambda rolls, stats, trainer: calls.append((len(rolls), int(trainer.state.global_step))))

    seen_fields: list[dict] = []

    def reward(prompts, completions, completion_ids, **kw):
        seen_fields.append({k: kw[k] for k in ("dvi_alpha", "dvi_target_version") if k in kw})
        return [upper_reward("", c) for c in completions]

    prompts = [tok.decode(p) for p in itertools.islice(prompt_stream("code", tok, prompt_tokens=(8, 16), seed=1), 16)]
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), use_cpu=True, max_steps=3, learning_rate=1e-3,
                      logging_steps=1, report_to="none", save_strategy="no", per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=8, seed=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=policy, reward_funcs=reward, args=args, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), rollout_func=rollout_func)
    trainer.train()

    assert trainer.state.global_step == 3
    # TRL passes the sampler's per-process slice (each prompt already repeated num_generations times);
    # dvi returns one completion per entry, and synced the policy before every generation.
    assert calls == [(4, 0), (4, 1), (4, 2)]
    assert rollout_func.num_syncs == 3
    assert [h["target_version"] for h in rollout_func.history] == [0, 1, 2]
    assert all(h["num_drafted"] > 0 for h in rollout_func.history)
    # Extra keys reach the reward functions, one value per completion.
    assert [f["dvi_target_version"] for f in seen_fields] == [[0] * 4, [1] * 4, [2] * 4]
    assert all(len(f["dvi_alpha"]) == 4 for f in seen_fields)
    # α reaches TRL's own logs (and so wandb/trackio) under the dvi metric name, per step.
    from dvi.metrics import ACCEPTANCE_RATE, TARGET_VERSION

    logged = [x for x in trainer.state.log_history if ACCEPTANCE_RATE in x]
    assert len(logged) == 3 and all(0 <= x[ACCEPTANCE_RATE] <= 1 for x in logged)
    assert [x[TARGET_VERSION] for x in logged] == [0, 1, 2]
    # GRPO really trained the policy, and the next generation would sample exactly it.
    assert any(not torch.equal(initial[k], v) for k, v in policy.state_dict().items())
    trainer.state.global_step += 1
    rollout_func(prompts[:2], trainer)
    assert _same_weights(policy, engine.target)
    assert engine.target_version == 4


def test_trl_example_grpo_with_lora_policy_on_tiny(tiny_pair_dir, tmp_path):
    """examples/trl_grpo.py end to end on the tiny pair: peft LoRA policy, arithmetic reward, dvi rollouts."""
    import argparse
    import importlib.util
    from pathlib import Path

    from peft import PeftModel

    path = Path(__file__).resolve().parent.parent / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("dvi_trl_grpo_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    # The tiny pair cannot do arithmetic (every reward 0, no gradient); upper-case share is dense.
    a = argparse.Namespace(preset="tiny", root=str(tiny_pair_dir.parent), steps=3, reward="upper", num_generations=2,
                           prompts_per_step=2, max_completion_length=8, num_draft_tokens=2, lr=1e-2, threads=1,
                           output_dir=str(tmp_path / "grpo"), seed=0)
    trainer, rollout_func = example.build(a)
    engine = rollout_func.rollouts.engine
    base = {k: v.clone() for k, v in engine.target.state_dict().items()}
    trainer.train()

    assert trainer.state.global_step == 3 and isinstance(trainer.model, PeftModel)
    assert [h["target_version"] for h in rollout_func.history] == [0, 1, 2]
    assert all(h["num_sequences"] == 4 and 0 <= h["speculated_share"] <= 1 for h in rollout_func.history)
    rewards = [x["reward"] for x in trainer.state.log_history if "reward" in x]
    assert len(rewards) == 3 and all(0 <= r <= 1 for r in rewards)
    # The next generation samples exactly the LoRA-merged policy; only adapted matrices moved.
    trainer.state.global_step += 1
    rollout_func(["user: Ann has 2 pens and buys 3 more.\nassistant:"], trainer)
    merged = policy_state_dict(trainer.model)
    target = engine.target.state_dict()
    assert engine.target_version == 4 and all(torch.equal(merged[k], target[k]) for k in merged)
    moved = {k for k in target if not torch.equal(target[k], base[k])}
    assert moved and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in moved)


def test_group_advantages_and_rewards():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2, 0.4])
    adv = group_advantages(r, 2, scale=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, -0.1, 0.1]))
    scaled = group_advantages(r, 2)
    assert scaled[0] > 0 > scaled[1] and scaled[2] == 0
    with pytest.raises(ValueError, match="groups of n=4"):
        group_advantages(r, 4)
    assert upper_reward("", "ABc d") == pytest.approx(0.5)
    assert upper_reward("", "123") == 0.0
    assert ast_reward("def f(x):\n", "    return x\n") == 1.0
    assert ast_reward("def f(x):\n", "    return (x\n") == 0.0
    assert ast_reward("def f(x):\n", "    if x:\n") == 1.0  # open block completed with `pass`
    assert ast_reward("if x:\n", "\n") == 0.0  # nothing written
    assert ast_reward("x = 1\n", "y = (") == 0.0  # no complete line


def test_completion_logprobs_batched_equals_per_row(tiny_pair_dir):
    model = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype="float32")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    comps = [[20, 21], [22, 23, 24, 25], [26]]
    with torch.no_grad():
        lp, mask = completion_logprobs(model, prompts, comps, temperature=0.8)
    assert mask.sum(1).tolist() == [2, 4, 1]
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + c])).logits[0]
        ref = torch.log_softmax(logits / 0.8, -1)[torch.arange(len(p) - 1, len(p) + len(c) - 1), torch.tensor(c)]
        torch.testing.assert_close(lp[i, : len(c)], ref, atol=1e-5, rtol=1e-5)


def test_rl_loop_online_arm_pushes_policy_and_trains_drafter(tiny_pair_dir):
    cfg = RLConfig(arm="online", preset="tiny", reward="short_lines", pair_dir=str(tiny_pair_dir), steps=3,
                   prompts_per_step=2, n=4, max_new_tokens=16, prompt_tokens=(8, 16), lr=1e-2, kl_every=2,
                   feedback_top_k=8, adaptive=False, num_draft_tokens=2, lora_top_layers=0)
    run = RLRun(cfg, log=None)
    assert type(run.policy).__name__ == "PeftModelForCausalLM"
    drafter0 = {k: v.clone() for k, v in run.drafter.state_dict().items()}
    logs = [run.step(i) for i in range(3)]
    assert [r.target_version for r in logs] == [0, 1, 2]  # rollouts of step i sampled policy version i
    assert [r.drafter_version for r in logs] == [0, 1, 2]
    assert run.engine.target_version == 3 and _same_weights(run.policy, run.engine.target)
    assert any(not torch.equal(drafter0[k], v) for k, v in run.drafter.state_dict().items())
    assert run.drafter_trainer.records_seen == 3 * 8 and run.drafter_trainer.current_target_version() == 3
    run.close()
    assert not math.isnan(logs[2].kl_to_init) and logs[2].kl_to_init > 0  # the target moved
    # The served target is the policy the gradient was taken on (same fp32 weights, merged LoRA).
    assert all(r.logprob_gap < 1e-3 for r in logs)
    assert all(0 <= r.alpha <= 1 and r.tokens > 0 and r.rollout_s > 0 for r in logs)
    # Fixed K = 2 drafts on every step but a row's last (K is capped by the tokens left).
    assert all(0.5 * r.tokens < r.speculated_tokens <= r.tokens for r in logs)
    s = run.summary()
    assert s["steps"] == 3 and s["rollout_s_total"] > 0 and 0.5 < s["speculated_share"] <= 1.0


def test_lora_merge_is_out_of_place_and_matches_peft_merge(tiny_pair_dir):
    from trainers.grpo import lora_policy

    policy = lora_policy(tiny_pair_dir / "target", "float32", 4, ("q_proj", "v_proj"), top_layers=1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    adapted = policy_state_dict(policy, adapted_only=True)
    full = policy_state_dict(policy)
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())  # policy untouched
    n_layers = policy.config.num_hidden_layers
    assert sorted(adapted) == [f"model.layers.{n_layers - 1}.self_attn.{m}.weight" for m in ("q_proj", "v_proj")]
    merged = policy.merge_and_unload().state_dict()
    assert full.keys() == merged.keys()
    for k, v in full.items():
        torch.testing.assert_close(v, merged[k], atol=1e-6, rtol=1e-6)
        if k in adapted:
            base = before[f"base_model.model.{k.removesuffix('.weight')}.base_layer.weight"]
            assert torch.equal(adapted[k], v) and not torch.equal(v, base)


def test_arith_task_prompts_and_reward(tiny_pair_dir):
    from trainers.rl_tasks import Problem, arith_reward, arithmetic_problems, task_prompts, trl_reward

    tok = load_tokenizer(find_tokenizer_path(tiny_pair_dir / "target"))
    a = list(itertools.islice(arithmetic_problems(3), 20))
    assert a == list(itertools.islice(arithmetic_problems(3), 20)) != list(itertools.islice(arithmetic_problems(4), 20))
    for p in a:  # the stated answer is what the text asks for
        nums = [int(x) for x in re.findall(r"\d+", p.text)]
        assert p.answer == (nums[0] + nums[1] if "buys" in p.text else nums[0] - nums[1])
    ids, prob = next(task_prompts("arith", tok, 3))
    assert prob == a[0] and prob.text in tok.decode(ids)
    p = Problem("x", 12)
    assert arith_reward(p, "5 + 7 = 12. Answer: 12") == 1.0
    assert arith_reward(p, "so 12 apples") == 0.75  # right, stated last, not in the asked format
    assert arith_reward(p, "12 ... Answer: 13") == 0.5  # format, and 12 was mentioned, but the answer is wrong
    assert arith_reward(p, "Answer: 11") == 0.25
    assert arith_reward(p, "no idea") == 0.0
    trl = trl_reward("arith")  # TRL's reward signature: the dataset's `answer` column as a keyword
    assert trl(["q"] * 2, [[{"role": "assistant", "content": "Answer: 12"}], "no"], answer=[12, 3]) == [1.0, 0.0]


def test_rl_loop_plain_arm_has_no_drafter(tiny_pair_dir, tmp_path):
    from dvi.feedback import FeedbackReader

    cfg = RLConfig(arm="plain", preset="tiny", reward="upper", pair_dir=str(tiny_pair_dir), steps=2,
                   prompts_per_step=2, n=2, max_new_tokens=6, prompt_tokens=(8, 16), kl_every=0, feedback_dir=str(tmp_path / "fb"))
    run = RLRun(cfg, log=None)
    logs = run.run()
    assert run.engine.drafter is None and all(r.drafter_s == 0 and r.speculated_tokens == 0 for r in logs)
    reader = FeedbackReader(tmp_path / "fb")
    versions = sorted({r.target_version for r in reader.iter_records(reader.poll())})
    assert versions == [0, 1]



@pytest.mark.parametrize("arm", ["suffix", "hybrid"])
def test_rl_loop_suffix_arms_draft_from_earlier_rollouts(tiny_pair_dir, arm):
    """The suffix arms share one index over the run's rollouts: later steps draft from earlier samples and
    siblings (`suffix_global`), whose weight decays with the policy version; the policy is pushed as usual."""
    cfg = RLConfig(arm=arm, preset="tiny", reward="upper", pair_dir=str(tiny_pair_dir), steps=3, prompts_per_step=2,
                   n=4, max_new_tokens=16, prompt_tokens=(8, 16), kl_every=0, adaptive=False, num_draft_tokens=2)
    run = RLRun(cfg, log=None)
    logs = run.run()
    assert run.engine.target_version == 3 and run.engine.proposer.name == arm
    assert (run.engine.drafter is None) == (arm == "suffix")
    assert run.engine.proposer.stats()["hits_global"] > 0 and all(r.tokens > 0 for r in logs)
    sp = getattr(run.engine.proposer, "suffix", run.engine.proposer)
    assert sp.version == 3 and min(sp._versions.values()) < 3  # older samples kept, down-weighted


def test_a_finite_dataset_comes_back_every_epoch_in_a_new_order():
    """`dataset_size`: RL runs iterate epochs over their prompts (a prompt's earlier rollouts are then drafts)."""
    from trainers.rl import epochs

    it = epochs(iter(range(100)), 5, seed=0)
    first, second, third = (list(itertools.islice(it, 5)) for _ in range(3))
    assert sorted(first) == sorted(second) == sorted(third) == [0, 1, 2, 3, 4]
    assert len({tuple(first), tuple(second), tuple(third)}) > 1  # reshuffled
    with pytest.raises(ValueError, match="dataset_size"):
        RLConfig(dataset_size=2, prompts_per_step=3)
    with pytest.raises(ValueError, match="only 3 problems"):
        next(epochs(iter(range(3)), 5, seed=0))


def test_an_arm_that_follows_samples_the_leaders_policy(tiny_pair_dir):
    """`RLRun.learn(i, rolled, leader)` (benchmarks/rl.py --shared-policy): the follower learns nothing itself and serves the
    leader's updated policy, so both sample the same policy on the same prompts each step."""
    common = dict(preset="tiny", reward="short_lines", pair_dir=str(tiny_pair_dir), steps=2, prompts_per_step=2, n=4,
                  max_new_tokens=16, prompt_tokens=(8, 16), kl_every=0, lr=1e-2, lora_top_layers=0)
    leader, follower = RLRun(RLConfig(arm="plain", **common), log=None), RLRun(RLConfig(arm="suffix", **common),
                                                                                log=None)
    own = {k: v.clone() for k, v in follower.policy.state_dict().items()}
    for i in range(2):  # the benchmark's order: both roll out, then the leader learns, then the follower follows
        rolled = follower.roll(i), leader.roll(i)
        leader.learn(i, rolled[1])
        log = follower.learn(i, rolled[0], leader)
        assert log.update_s == 0.0 and log.target_version == i
    assert follower.engine.target_version == 2 and _same_weights(leader.policy, follower.engine.target)
    assert not _same_weights(follower.policy, follower.engine.target)  # its own policy never moved
    assert all(torch.equal(own[k], v) for k, v in follower.policy.state_dict().items())
    leader.close()
    follower.close()


def test_another_sample_seed_draws_other_rollouts_of_the_same_prompts(tiny_pair_dir):
    """`RLConfig.sample_seed` (benchmarks/rl.py --aa's second plain arm): the same prompts in the same order, other
    draws; without it the run seed decides both."""
    common = dict(arm="plain", preset="tiny", reward="short_lines", pair_dir=str(tiny_pair_dir), steps=1,
                  prompts_per_step=2, n=4, max_new_tokens=16, prompt_tokens=(8, 16), kl_every=0, lora_top_layers=0)
    runs = [RLRun(RLConfig(**common), log=None), RLRun(RLConfig(**common), log=None),
            RLRun(RLConfig(**common, sample_seed=7919), log=None)]
    rolled = [run._rollouts(0) for run in runs]
    prompts = [[r.prompt_ids for r in rolls] for _, rolls in rolled]
    draws = [[r.completion_ids for r in rolls] for _, rolls in rolled]
    assert prompts[0] == prompts[1] == prompts[2]
    assert draws[0] == draws[1] and draws[2] != draws[0]
    for run in runs:
        run.close()
