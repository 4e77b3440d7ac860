"""TRL's GRPOTrainer with dvi generating the rollouts (speculative, lossless, weights kept in sync).

The switch is three lines on top of an ordinary GRPO script:

    engine = SpeculativeEngine(load_causal_lm(target_path), drafter=load_causal_lm(drafter_path))
    rollout_func = trl_rollout_func(engine)          # dvi.rollout
    trainer = GRPOTrainer(..., rollout_func=rollout_func)

Before each generation the rollout function copies the GRPO policy's current weights into the dvi
target (whenever `trainer.state.global_step` moved), so dvi always samples the policy being
trained; it returns `prompt_ids`, `completion_ids` and the target's per-token `logprobs` as TRL's
`rollout_func` contract requires, plus `dvi_alpha` per completion.

    .venv/bin/python examples/trl_grpo.py --preset tiny --steps 4
    .venv/bin/python examples/trl_grpo.py --preset tiny --steps 20

Builds the embedded pair first if it is not in the cache (tiny: ~30 s; small: ~20 min).
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def upper_case_reward(prompts: list, completions: list, **kwargs) -> list[float]:
    """Share of upper-case letters in each completion (a reward the policy learns in a few steps)."""
    out = []
    for c in completions:
        letters = [ch for ch in c if ch.isalpha()]
        out.append(sum(ch.isupper() for ch in letters) / len(letters) if letters else 0.0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pair-dir", default=None, help="a built pair dir (default: the preset's cache dir)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=2)
    ap.add_argument("--max-completion-length", type=int, default=24)
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--output-dir", default=None)
    a = ap.parse_args(argv)

    import itertools
    from pathlib import Path

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from dvi.data import prompt_stream
    from dvi.embedded import embedded_dir, is_built
    from dvi.engine import SpeculativeEngine
    from dvi.models import find_tokenizer_path, load_causal_lm, load_tokenizer
    from dvi.rollout import trl_rollout_func

    torch.set_num_threads(a.threads)
    root = Path(a.pair_dir) if a.pair_dir else embedded_dir(a.preset)
    if not is_built(root):
        from trainers.bootstrap import bootstrap

        root = bootstrap(a.preset, out=a.pair_dir)
    tokenizer = load_tokenizer(find_tokenizer_path(root / "target"))

    # The policy TRL trains, and dvi's own copy of the target + the drafter.
    policy = AutoModelForCausalLM.from_pretrained(str(root / "target"), dtype=torch.float32)
    engine = SpeculativeEngine(load_causal_lm(root / "target", device="cpu", dtype="float32"),
                               drafter=load_causal_lm(root / "drafter", device="cpu", dtype="float32"),
                               num_draft_tokens=a.num_draft_tokens)
    rollout_func = trl_rollout_func(engine)

    prompts = [tokenizer.decode(p) for p in itertools.islice(
        prompt_stream("code", tokenizer, split="heldout", prompt_tokens=(12, 32), seed=0), 64)]
    scratch = tempfile.TemporaryDirectory(prefix="dvi-grpo-") if a.output_dir is None else None
    args = GRPOConfig(
        output_dir=a.output_dir or scratch.name,
        use_cpu=True, max_steps=a.steps, learning_rate=a.lr, logging_steps=1, report_to="none",
        save_strategy="no", per_device_train_batch_size=a.num_generations * a.prompts_per_step,
        num_generations=a.num_generations, max_completion_length=a.max_completion_length,
        temperature=1.0, seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=policy, reward_funcs=upper_case_reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                          rollout_func=rollout_func)
    trainer.train()

    print(f"\n{'step':>4} {'target_v':>8} {'seqs':>5} {'tokens':>6} {'alpha':>6} {'tok/s':>7}")
    for h in rollout_func.history:
        print(f"{h['global_step']:>4} {h['target_version']:>8} {h['num_sequences']:>5} {h['num_tokens']:>6} "
              f"{h['alpha']:>6.3f} {h['tokens_per_s']:>7.1f}")
    rewards = [x["reward"] for x in trainer.state.log_history if "reward" in x]
    if rewards:
        print(f"reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
    print(f"weight syncs into the dvi target: {rollout_func.num_syncs}")
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
