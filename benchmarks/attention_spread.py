"""What a plain batched step costs when its rows' contexts differ: dvi's batched attention vs the rows' own lengths.

dvi's batched verify runs one SDPA call per layer over the longest row's columns (the shorter rows masked), so a
batch whose rows drifted apart (speculation's rows advance 1..K+1 tokens a step; mixed traffic's rows start and end
at different times) pays every row the longest row's context. vLLM's paged attention reads each row's own blocks.

For each batch size B and mean context L, three arms of B rows on the serving engine's target runner, each timed as
one-token steps (the verify of speculation off) at fixed lengths, arms interleaved step by step:

- `lockstep`: every row at L (what a closed-loop benchmark with one output length gives speculation off);
- `spread`: rows evenly spread over L/2..3L/2 (the same mean, so the same useful work);
- `longest`: every row at 3L/2 (what padding to the longest row costs).

Goal (issue 61, "a batched step as lean as vLLM's"): `spread` costs at most 1.02x `lockstep` at every (B, L): a
batch pays its rows' own contexts.

    .venv/bin/python benchmarks/attention_spread.py [--preset smollm2] [--json bench_results/attention_spread.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import cpu_name, goal, print_goals, write_json


def _lengths(arm: str, b: int, mean: int) -> list[int]:
    if arm == "lockstep":
        return [mean] * b
    if arm == "longest":
        return [mean * 3 // 2] * b
    return [mean // 2 + (mean * i) // max(1, b - 1) for i in range(b)]  # spread: mean/2 .. 3 mean/2


def _engine(cfg, pair, lengths: list[int]):
    """The serving engine (speculation off) with one row per length admitted, its target cache filled."""
    import torch

    from dvi.decode.request import Request, SamplingParams
    from serving.engine_build import serving_engine

    g = torch.Generator().manual_seed(0)
    e = serving_engine(cfg, pair)
    vocab = int(pair.target.get_output_embeddings().weight.shape[0])
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        e.add_request(Request(f"r{i}", ids, SamplingParams(8, 0.0, 0, 1.0, None, ())))
    e.step()  # admits (prefill) and takes one step: the timed steps below are plain one-token steps
    return e


def measure(cfg, pair, b: int, mean: int, steps: int) -> dict[str, float]:
    """Median seconds of a one-token step per arm, arms interleaved, every step at the same lengths."""
    import torch

    arms = {a: _engine(cfg, pair, _lengths(a, b, mean)) for a in ("lockstep", "spread", "longest")}
    ids = torch.zeros(b, 1, dtype=torch.long)
    times: dict[str, list[float]] = {a: [] for a in arms}
    with torch.inference_mode():
        for i in range(steps + 3):
            for a, e in (arms.items() if i % 2 == 0 else reversed(list(arms.items()))):
                t0 = time.perf_counter()
                e._target.forward(ids, False)  # nothing kept (`keep` advances a row): the same columns every step
                dt = time.perf_counter() - t0
                if i >= 3:
                    times[a].append(dt)
    return {a: statistics.median(ts) for a, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--contexts", default="128,512", help="mean contexts (tokens)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", type=Path, default=Path("bench_results/attention_spread.json"))
    args = ap.parse_args(argv)
    import torch

    from dvi.config import load_config
    from serving.loading import ensure_pair, load_serving_pair

    cfg = load_config(None, [f"models.preset={args.preset}", "serve.trainer=off", "wandb.mode=disabled",
                             "speculation.adaptive=false", "speculation.num_draft_tokens=0"])
    torch.set_num_threads(cfg.serve.num_threads)
    ensure_pair(cfg)
    pair = load_serving_pair(cfg)
    rows, goals = [], []
    print(f"{'B':>3} {'L':>5} {'lockstep ms':>12} {'spread ms':>10} {'longest ms':>11} {'spread/lock':>12}")
    for b in (int(x) for x in args.batches.split(",")):
        for mean in (int(x) for x in args.contexts.split(",")):
            t = measure(cfg, pair, b, mean, args.steps)
            ratio = t["spread"] / t["lockstep"]
            rows.append({"batch": b, "mean_context": mean, **{f"{a}_ms": 1e3 * s for a, s in t.items()},
                         "spread_over_lockstep": ratio, "longest_over_lockstep": t["longest"] / t["lockstep"]})
            print(f"{b:>3} {mean:>5} {1e3 * t['lockstep']:>12.2f} {1e3 * t['spread']:>10.2f} "
                  f"{1e3 * t['longest']:>11.2f} {ratio:>12.3f}", flush=True)
            goals.append(goal(f"spread-context step / lockstep step, B={b}, L={mean}", ratio, 1.02,
                              higher_is_better=False))
    print_goals(goals)
    write_json(args.json, {"benchmark": "attention_spread", "cpu": cpu_name(), "dtype": str(pair.target.dtype),
                           "settings": vars(args) | {"json": str(args.json)}, "rows": rows, "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
