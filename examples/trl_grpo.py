"""TRL's GRPOTrainer with dvi generating the rollouts (speculative, lossless, weights kept in sync).

The switch is three lines on top of an ordinary GRPO script:

    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), adaptive=True)
    rollout_func = trl_rollout_func(engine)                                         # dvi.rollout_trl
    trainer = GRPOTrainer(..., rollout_func=rollout_func)

Here on the real pair (SmolLM2-135M-Instruct + its 1-layer drafter over a 16k draft vocabulary, served in
the preset's dtype), a LoRA policy (``peft_config``) and seeded arithmetic word problems with an exact
integer answer (`trainers.rl_tasks`). Before each generation the rollout function copies the policy's
LoRA-merged weights into the dvi target (whenever `trainer.state.global_step` moved), so dvi always
samples the policy being trained; it returns `prompt_ids`, `completion_ids` and the target's per-token
`logprobs` as TRL's `rollout_func` contract requires, plus `dvi_alpha` per completion.

    .venv/bin/python examples/trl_grpo.py --steps 4
    .venv/bin/python examples/trl_grpo.py --preset tiny --steps 4      # the self-trained test pair

The embedded pair must be built (`dvi bootstrap --preset smollm2`).
"""

from __future__ import annotations

import argparse
import os
import tempfile

from dvi.decode.results import fmt_rate

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--root", default=None, help="the models root holding <preset>/ (default: the dvi cache)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reward", default="arith", choices=["arith", "upper", "short_lines"],
                    help="arith: exact answers to the word problems (trainers.rl_tasks); the others score text only")
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="seeds the data order and every rollout (step i: seed + i)")
    ap.add_argument("--output-dir", default=None)
    a = ap.parse_args(argv)
    trainer, rollout_func = build(a)
    trainer.train()
    report(trainer, rollout_func)
    return 0


def build(a: argparse.Namespace) -> tuple:
    """(GRPOTrainer, dvi rollout function) for the parsed arguments; nothing trained yet."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from dvi.data import render_chat
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_embedded_pair
    from dvi.rollout_trl import SamplingOverrides, trl_rollout_func
    from trainers.rl_tasks import arith_dataset, trl_reward

    torch.set_num_threads(a.threads)
    pair = load_embedded_pair(a.preset, root=a.root, device="cpu")
    tokenizer = pair.tokenizer
    # dvi's copy of the target + the drafter; adaptive K speculates where it pays (the batch's tail).
    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter),
                               num_draft_tokens=a.num_draft_tokens, max_draft_tokens=max(4, a.num_draft_tokens),
                               adaptive=True)
    rollout_func = trl_rollout_func(engine, sampling=SamplingOverrides(seed=a.seed))  # reproducible rollouts
    # The policy TRL trains: the same weights (float32 for the optimiser) + a LoRA adapter.
    policy = AutoModelForCausalLM.from_pretrained(str(embedded_paths(a.preset, a.root).target), dtype=torch.float32)
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])

    data = arith_dataset(64, seed=0)
    if not getattr(tokenizer, "chat_template", None):  # the self-trained pair: plain-text prompts
        data["prompt"] = [tokenizer.decode(render_chat(tokenizer, m)) for m in data["prompt"]]
    output_dir = a.output_dir or tempfile.mkdtemp(prefix="dvi-grpo-")  # nothing is saved there (save_strategy no)
    args = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True, max_steps=a.steps, learning_rate=a.lr, logging_steps=1, report_to="none",
        save_strategy="no", per_device_train_batch_size=a.num_generations * a.prompts_per_step,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length,
        temperature=1.0, seed=a.seed, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=trl_reward(a.reward), args=args, peft_config=lora,
                          train_dataset=Dataset.from_dict(data), processing_class=tokenizer,
                          rollout_func=rollout_func)
    return trainer, rollout_func


def report(trainer, rollout_func) -> None:
    """Per generation batch: policy version, rows, tokens, α, tokens/s; then the reward's first and last step."""
    print(f"\n{'step':>4} {'target_v':>8} {'seqs':>5} {'tokens':>6} {'alpha':>6} {'spec':>5} {'tok/s':>7}")
    for h in rollout_func.history:
        print(f"{h['global_step']:>4} {h['target_version']:>8} {h['num_sequences']:>5} {h['num_tokens']:>6} "
              f"{fmt_rate(h['alpha']):>6} {fmt_rate(h['speculated_share'], 2):>5} {fmt_rate(h['tokens_per_s'], 1):>7}")
    rewards = [x["reward"] for x in trainer.state.log_history if "reward" in x]
    if rewards:
        print(f"reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
    print(f"weight syncs into the dvi target: {rollout_func.num_syncs}")


if __name__ == "__main__":
    raise SystemExit(main())
