"""GRPO-style rollouts through `dvi serve`, as an RL client reaches them over HTTP (issue 61 §3): speculation's
kinds against speculation off on sampled group traffic.

Each step is one `/v1/completions` request in OpenAI's batch form: --prompts-per-step task prompts (trainers.rl_tasks'
seeded arithmetic word problems, chat-templated, as token ids) x --n samples each (`n`), temperature 1, at most
--max-tokens each, ended by the end-of-turn token (a GRPO group's rollouts). Every arm's server is up at once (trainer
off, its own run dir; an idle server costs nothing), warmed with one step of other prompts, then every step goes to
each arm in a rotating order with the same prompts and seed (the same draws wherever a step drafts nothing), --gap-s
apart: an RL step's policy update comes between its rollouts, and so the work a server does after a request (its
feedback flush, the drafter thread's replays) lands there, not in another arm's measured step. The policy does not
move (benchmarks/rl.py measures the loop with its weight pushes, in process); this is what the
server's pricing makes of the rollouts' batches and temperature.

Per arm: output tokens over client seconds pooled over steps, the ratio to speculation off with a 95% paired
bootstrap interval over steps (`benchmarks.rl.ratio_interval`), α and the share of drafting steps from the responses'
`dvi` blocks. Goals: every kind >= 1.0x off; no request failed.

    .venv/bin/python benchmarks/serve_rollouts.py [--dtype bf16] [--arms off,separate,suffix,hybrid] [--steps 16]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import cpu_name, goal, print_goals, write_json  # noqa: E402

ARMS = ("off", "separate", "suffix", "hybrid")
"""Speculation off, and each kind at its defaults (adaptive K, draft trees where they pay): `serve_field`'s dvi arms."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--arms", default=",".join(ARMS), help=f"off first, then any of {', '.join(ARMS[1:])}")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts-per-step", type=int, default=3)
    p.add_argument("--n", type=int, default=4, help="samples a prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gap-s", type=float, default=1.0, help="pause after every request (0: back to back)")
    p.add_argument("--set", action="append", default=[], help="extra dvi config override (key=value), every arm")
    p.add_argument("--json", default="bench_results/serve_rollouts.json")
    a = p.parse_args(argv)
    a.arm_list = [x for x in a.arms.split(",") if x]
    if not a.arm_list or a.arm_list[0] != "off" or any(x not in ARMS for x in a.arm_list):
        p.error(f"--arms: off first, then any of {', '.join(ARMS[1:])}")
    return a


def step_prompts(tok, a: argparse.Namespace) -> list[list[list[int]]]:
    """Per step (one warm-up step first) its prompts' token ids."""
    from trainers.rl_tasks import task_prompts

    stream = (ids for ids, _ in task_prompts("arith", tok, a.seed))
    return [list(itertools.islice(stream, a.prompts_per_step)) for _ in range(a.steps + 1)]


def server(arm: str, a: argparse.Namespace, run: Path):
    """The arm's `dvi serve` as serve_field starts it (trainer off, its own run dir), room for a step's choices."""
    from benchmarks.serve_field import start_server

    opts = SimpleNamespace(preset=a.preset, dtype=a.dtype, threads=1, max_tokens=a.max_tokens,
                           set=[f"serve.max_choices={max(64, a.prompts_per_step * a.n)}", *a.set])
    return start_server(arm, opts, {}, run)


def rollout(client, url: str, prompts: list[list[int]], a: argparse.Namespace, seed: int) -> dict:
    """One step's request; its seconds, tokens and drafting counts (None: it failed)."""
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json={"prompt": prompts, "n": a.n, "max_tokens": a.max_tokens,
                                                   "temperature": a.temperature, "seed": seed})
    s = time.perf_counter() - t0
    if r.status_code != 200:
        print(f"  request failed: HTTP {r.status_code} {r.text[:200]}", flush=True)
        return {"rollout_s": s, "tokens": 0, "failed": True}
    body = r.json()
    return {"rollout_s": s, "tokens": body["usage"]["completion_tokens"], "failed": False,
            "drafted": body["dvi"]["drafted"], "accepted": body["dvi"]["accepted"],
            "steps": body["dvi"]["steps"]}


def summarize(logs: dict[str, list[dict]]) -> dict[str, dict]:
    from benchmarks.rl import ratio_interval

    def as_steps(rows: list[dict]) -> dict[int, list]:
        return {0: [SimpleNamespace(**r) for r in rows]}

    out = {}
    for arm, rows in logs.items():
        ok = [r for r in rows if not r["failed"]]
        tok, sec = sum(r["tokens"] for r in ok), sum(r["rollout_s"] for r in ok)
        drafted, accepted = sum(r.get("drafted", 0) for r in ok), sum(r.get("accepted", 0) for r in ok)
        out[arm] = {"tokens": tok, "seconds": sec, "tok_s": tok / sec if sec else None,
                    "failed": len(rows) - len(ok), "drafted": drafted,
                    "alpha": accepted / drafted if drafted else None}
    off = out["off"]["tok_s"]
    for arm, s in out.items():
        s["x_off"] = s["tok_s"] / off if off and s["tok_s"] else None
        s["x_off_interval"] = None if arm == "off" else ratio_interval(as_steps(logs["off"]), as_steps(logs[arm]))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    import httpx

    from benchmarks._common import built_pair

    pair_dir, tok = built_pair(a.preset, None)
    steps = step_prompts(tok, a)
    work = Path(tempfile.mkdtemp(prefix="dvi-serve-rollouts-"))
    print(f"serve_rollouts: {a.steps} steps x {a.prompts_per_step} prompts x n={a.n}, T={a.temperature}, "
          f"{a.max_tokens} tokens at most, dvi {a.dtype}, {cpu_name()}; work dir {work}", flush=True)
    logs: dict[str, list[dict]] = {arm: [] for arm in a.arm_list}
    with contextlib.ExitStack() as stack, httpx.Client(timeout=600) as client:
        urls = {}
        for arm in a.arm_list:
            urls[arm] = stack.enter_context(server(arm, a, work / arm)).url
            rollout(client, urls[arm], steps[0], a, seed=10**6)  # warm-up: first-call costs, the batch grown
            print(f"[{arm}] up on {urls[arm]}", flush=True)
        for i in range(a.steps):
            order = a.arm_list[i % len(a.arm_list):] + a.arm_list[:i % len(a.arm_list)]
            for arm in order:
                logs[arm].append(rollout(client, urls[arm], steps[i + 1], a, seed=a.seed * 1000 + i))
                time.sleep(a.gap_s)
            print(f"step {i:>3} " + " ".join(f"{arm} {logs[arm][-1]['tokens']:>4} tok {logs[arm][-1]['rollout_s']:6.2f} s"
                                            for arm in a.arm_list), flush=True)
    res = summarize(logs)
    print(f"\n{'arm':10} {'tok/s':>8} {'x off':>7} {'95% interval':>16} {'alpha':>6} {'drafted':>8} failed")
    for arm, s in res.items():
        iv = s["x_off_interval"]
        print(f"{arm:10} {s['tok_s'] or 0:8.1f} {s['x_off'] or 0:7.3f} "
              f"{'' if iv is None else f'[{iv[0]:.3f}, {iv[1]:.3f}]':>16} "
              f"{'' if s['alpha'] is None else format(s['alpha'], '.3f'):>6} {s['drafted']:>8} {s['failed']}")
    goals = [goal(f"dvi {arm} vs dvi off, rollout output tok/s ({a.dtype}, n={a.n}, T={a.temperature})",
                  res[arm]["x_off"], 1.0) for arm in a.arm_list[1:]]
    goals.append(goal("rollout requests failed", float(sum(s["failed"] for s in res.values())), 0.0,
                      higher_is_better=False))
    print_goals(goals)
    write_json(a.json, {"benchmark": "serve_rollouts", "cpu": cpu_name(), "settings": vars(a),
                        "arms": res, "steps": logs, "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
