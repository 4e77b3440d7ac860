"""RL rollout benchmark: one RL run, three ways (plain sampling, dvi + frozen drafter, dvi + online drafter).

Each arm is the same `trainers.rl` run (same seed, prompts, reward, optimiser, steps): sample
`n` completions per prompt, reward them, take a GRPO-style policy-gradient step on the target,
push the new weights into the rollout engine. The arms differ only in how rollouts are made:

* `plain`  - the target samples alone (the engine with speculation off: K = 0, same code path);
* `frozen` - dvi speculative sampling with the bootstrap drafter, never updated;
* `online` - dvi speculative sampling, the drafter trained between RL steps on the feedback
  records of the current policy (`trainers.online.OnlineTrainer` driven in process: the online
  trainer's loss, replay and stale-version handling, without a second process competing for cores).

The arms advance in lockstep (step i of every arm before step i+1 of any), so machine-load drift
hits all three alike. Sampling is lossless in every arm, so the arms sample the same
distributions; their random streams differ, so their trajectories differ by sampling noise only.

    .venv/bin/python benchmarks/rl.py --preset tiny --steps 40 [--json bench_results/rl.json]

Writes JSON (settings, per-step figures, per-arm totals, `goals`) and a PNG beside it, prints a
table ending with the goals, and exits 0 whether or not they are met.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal

ARMS = ("plain", "frozen", "online")


def _plot(path: Path, logs: dict[str, list], alpha_from: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = {"plain": "tab:gray", "frozen": "tab:blue", "online": "tab:green"}
    for arm in ("frozen", "online"):
        if arm in logs:
            axes[0].plot([r.step for r in logs[arm]], [r.alpha for r in logs[arm]], label=f"dvi, {arm} drafter",
                         color=colors[arm])
    axes[0].axvline(alpha_from, color="k", ls=":", lw=1)
    axes[0].set(title="acceptance rate α per RL step", xlabel="RL step", ylabel="α", ylim=(0, 1))
    for arm, rs in logs.items():
        axes[1].plot([r.step for r in rs], [r.rollout_s for r in rs], label=arm, color=colors[arm])
    axes[1].set(title="rollout time per RL step", xlabel="RL step", ylabel="seconds")
    for arm, rs in logs.items():
        axes[2].plot([r.step for r in rs], [r.reward for r in rs], label=arm, color=colors[arm])
    axes[2].set(title="mean reward (the policy moves)", xlabel="RL step", ylabel="reward")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ceiling(runs: dict, arm: str, batch: int, alpha_from: int) -> dict:
    """Speedup the measured costs allow at this arm's measured tokens/step (DESIGN.md, "closeness to the limit").

    predicted = E[tokens/step] * c_plain / (K * c_draft + c_verify(K)), with the engines' own cost
    models (median step timings at this batch size); also the tokens/step that 1.3x would need.
    """
    run = runs[arm]
    k = run.cfg.num_draft_tokens
    costs = run.engine.costs
    plain_costs = runs["plain"].engine.costs if "plain" in runs else costs
    c_d, c_v, c_p = costs.draft_cost(batch), costs.verify_cost(batch, k), plain_costs.verify_cost(batch, 0)
    late = [r for r in run.logs if r.step >= alpha_from] or run.logs
    steps = sum(r.num_steps for r in late)
    tps = 1.0 + sum(r.num_accepted for r in late) / steps if steps else float("nan")
    out = {"k": k, "batch": batch, "draft_s": c_d, "verify_s": c_v, "plain_step_s": c_p,
           "tokens_per_step_late": tps, "adaptive": run.cfg.adaptive}
    if None not in (c_d, c_v, c_p) and not run.cfg.adaptive:
        step_cost = k * c_d + c_v
        out["predicted_speedup_late"] = tps * c_p / step_cost
        out["tokens_per_step_needed_for_1.3x"] = 1.3 * step_cost / c_p
        out["max_speedup_at_alpha_1"] = (k + 1) * c_p / step_cost
    return out


def _plain_reference(run, prompts_per_step: int, n: int, max_new_tokens: int, seed: int) -> dict:
    """HF `generate(do_sample=True)` vs the plain arm's engine on one batch: is the baseline fair?"""
    import torch

    from dvi.data import prompt_stream

    tok = run.tokenizer
    prompts = []
    stream = prompt_stream("code", tok, split="heldout", prompt_tokens=run.cfg.prompt_tokens, seed=seed + 999)
    for _ in range(prompts_per_step):
        prompts.extend([next(stream)] * n)
    model = run.engine.target
    t0 = time.perf_counter()
    run.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    engine_s = time.perf_counter() - t0
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=pad,
                       eos_token_id=None)
    hf_s = time.perf_counter() - t0
    return {"sequences": len(prompts), "max_new_tokens": max_new_tokens, "plain_engine_s": engine_s,
            "hf_generate_s": hf_s, "hf_over_engine": hf_s / engine_s if engine_s > 0 else float("nan")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # tiny until the RL loop moves to the real target (issue 19): full fine-tuning of SmolLM2 on this CPU
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pair-dir", default=None, help="a built pair (default: the preset's cache dir; built if absent)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of plain,frozen,online")
    ap.add_argument("--reward", default="upper")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=None, help="policy learning rate (default: RLConfig's)")
    ap.add_argument("--num-draft-tokens", type=int, default=2,
                    help="fixed K (2 measured fastest for the small pair at T=1 on CPU)")
    ap.add_argument("--adaptive", action="store_true", help="let the engine choose K per step")
    ap.add_argument("--drafter-lr", type=float, default=None)
    ap.add_argument("--drafter-mode", default=None, choices=["lora", "full"])
    ap.add_argument("--drafter-batch-size", type=int, default=None)
    ap.add_argument("--drafter-replay-steps", type=int, default=None,
                    help="extra replay-only online-trainer steps per RL step")
    ap.add_argument("--alpha-from", type=int, default=20, help="goal α is measured from this step on")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="bench_results/rl.json")
    ap.add_argument("--png", default=None, help="default: the JSON path with .png")
    a = ap.parse_args(argv)

    import torch

    from dvi.embedded import embedded_dir, is_built
    from trainers.rl import RLConfig, RLRun, logs_to_jsonable

    torch.set_num_threads(a.threads)
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"--arms: unknown arm(s) {bad}; choose from {list(ARMS)}")
    root = Path(a.pair_dir) if a.pair_dir else embedded_dir(a.preset)
    if not is_built(root):
        from trainers.bootstrap import bootstrap

        print(f"building the {a.preset} pair into {root} ...", flush=True)
        root = bootstrap(a.preset, out=root.parent if a.pair_dir is None else root)
    alpha_from = min(a.alpha_from, a.steps // 2)

    overrides = {k: v for k, v in {"lr": a.lr, "drafter_lr": a.drafter_lr, "drafter_mode": a.drafter_mode,
                                   "drafter_batch_size": a.drafter_batch_size,
                                   "drafter_replay_steps": a.drafter_replay_steps}.items() if v is not None}
    runs: dict[str, RLRun] = {}
    for arm in arms:
        cfg = RLConfig(arm=arm, preset=a.preset, pair_dir=str(root), steps=a.steps, prompts_per_step=a.prompts_per_step,
                       n=a.n, max_new_tokens=a.max_new_tokens, temperature=a.temperature, reward=a.reward,
                       num_draft_tokens=a.num_draft_tokens, adaptive=a.adaptive, seed=a.seed, threads=a.threads,
                       **overrides)
        runs[arm] = RLRun(cfg, log=None)

    t_start = time.perf_counter()
    hdr = " ".join(f"{arm + ' rew':>10} {arm + ' α':>9} {arm + ' s':>9}" for arm in arms)
    print(f"{'step':>4} {hdr}", flush=True)
    for i in range(a.steps):
        cells = []
        for arm in arms:
            r = runs[arm].step(i)
            cells.append(f"{r.reward:>10.3f} {r.alpha if r.num_drafted else float('nan'):>9.3f} {r.rollout_s:>9.2f}")
        print(f"{i:>4} " + " ".join(cells), flush=True)
    wall = time.perf_counter() - t_start

    summaries = {arm: runs[arm].summary(alpha_from=alpha_from) for arm in arms}
    ceilings = {arm: _ceiling(runs, arm, a.prompts_per_step * a.n, alpha_from) for arm in arms if arm != "plain"}
    reference = _plain_reference(runs[arms[0]], a.prompts_per_step, a.n, a.max_new_tokens, a.seed)

    goals = []
    if "online" in summaries and "frozen" in summaries:
        gap = summaries["online"]["alpha_late"] - summaries["frozen"]["alpha_late"]
        goals.append(goal(f"online α minus frozen α, steps >= {alpha_from}", gap, 0.1))
    if "online" in summaries and "plain" in summaries:
        speed = summaries["plain"]["rollout_s_total"] / summaries["online"]["rollout_s_total"]
        goals.append(goal("plain / online total rollout time (speedup)", speed, 1.3))

    out = {
        "benchmark": "rl",
        "settings": {**vars(a), "alpha_from_effective": alpha_from, "pair_dir": str(root),
                     "rl_config": {arm: asdict(runs[arm].cfg) for arm in arms},
                     "machine": {"python": platform.python_version(), "torch": torch.__version__,
                                 "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}},
        "wall_s": wall,
        "arms": summaries,
        "steps": {arm: logs_to_jsonable(runs[arm].logs) for arm in arms},
        "plain_reference": reference,
        "speedup_ceiling": ceilings,
        "goals": goals,
    }
    json_path = Path(a.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(clean_json(out), indent=2))
    png_path = Path(a.png) if a.png else json_path.with_suffix(".png")
    try:
        _plot(png_path, {arm: runs[arm].logs for arm in arms}, alpha_from,
              f"RL rollouts, {a.preset} pair, {a.steps} steps, reward={a.reward}")
    except Exception as e:  # a plotting failure must not lose the JSON
        print(f"PNG not written: {e}", file=sys.stderr)
        png_path = None

    print()
    print(f"{'arm':<8} {'rollout s':>10} {'tok/s':>8} {'α all':>7} {'α late':>7} {'reward 0-4':>10} "
          f"{'reward last5':>12} {'update s':>9} {'drafter s':>9}")
    for arm, s in summaries.items():
        tps = s["tokens_total"] / s["rollout_s_total"] if s["rollout_s_total"] else float("nan")
        print(f"{arm:<8} {s['rollout_s_total']:>10.1f} {tps:>8.1f} {s['alpha_mean']:>7.3f} {s['alpha_late']:>7.3f} "
              f"{s['reward_first5']:>10.3f} {s['reward_last5']:>12.3f} {s['update_s_total']:>9.1f} "
              f"{s['drafter_s_total']:>9.1f}")
    for arm, c in ceilings.items():
        if "predicted_speedup_late" in c:
            print(f"{arm}: K={c['k']}, costs at batch {c['batch']}: draft {1e3 * c['draft_s']:.1f} ms, verify "
                  f"{1e3 * c['verify_s']:.1f} ms, plain step {1e3 * c['plain_step_s']:.1f} ms; tokens/step "
                  f"{c['tokens_per_step_late']:.2f} -> predicted {c['predicted_speedup_late']:.2f}x (1.3x needs "
                  f"{c['tokens_per_step_needed_for_1.3x']:.2f}; all {c['k']} accepted would give "
                  f"{c['max_speedup_at_alpha_1']:.2f}x)")
    print(f"plain-arm reference: HF generate takes {reference['hf_over_engine']:.2f}x the plain engine's time "
          f"on one {reference['sequences']}-sequence batch")
    print("\ngoals:")
    for g in goals:
        print(f"  [{'met' if g['met'] else 'NOT met'}] {g['name']}: {g['value']:.3f} (target "
              f"{'>=' if g['higher_is_better'] else '<='} {g['target']})")
    print(f"\nJSON: {json_path}" + (f"\nPNG:  {png_path}" if png_path else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
