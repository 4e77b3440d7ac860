"""The field's workload on the engine behind `dvi serve`, in one process: each kind against speculation off without the
HTTP front, the client or a server's start.

Why beside `serve_field.py`: through servers this 2-core box's spread between fresh servers (off itself 412-507 tok/s
at C = 16 an hour apart, and each server's start-up probes and calibration its own) is larger than what a kind moves
at 8-16 rows. Here each round builds every arm's engine afresh as a server does (`serving.engine_build.serving_engine`,
then `ready_to_serve`: adaptive K calibrated for every batch bucket, the KV cache allocated), warms it with C requests,
then sends serve_field's unseen prompts (pip source cuts and chat instructions, alternating), C in flight and a new one
as each finishes, greedy, --max-tokens each, stopped at the end-of-turn token (`--ignore-eos`: run to --max-tokens, as
serve_field's servers do); arms in ABBA order over --rounds, weights shared, one thread. Output tokens / seconds per
arm pooled over rounds, with what each arm drafted (the server's `drft%` and `alpha`) and its tokens per step; every
kind's answers checked against speculation off's.

    .venv/bin/python benchmarks/field_engine.py --dtype fp32 --concurrency 8,16 [--rounds 2] [--ignore-eos] [--json ...]

Prints a table ending with the goals (each kind >= 1.0x speculation off at each C, in process; 0 answers differing) and
writes JSON. It does not replace serve_field's goals (what a user gets through the server): it says whether a miss
there is the engine's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, cpu_name, goal, print_goals  # noqa: E402

KINDS = ("separate", "suffix", "hybrid")


def workload_parser(description: str, arms: str, concurrency: str, json_path: str) -> argparse.ArgumentParser:
    """The options of the field workload on the engine (this benchmark's and `benchmarks/huge_pages.py`'s)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--arms", default=arms, help="off and any of " + ", ".join(KINDS))
    p.add_argument("--concurrency", default=concurrency)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="extra config override for every engine (key=value)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every answer runs to --max-tokens, past the end-of-turn token (as serve_field's servers do)")
    p.add_argument("--json", default=json_path)
    return p


def parse_workload(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parsed, with `arm_list` and `levels` split out."""
    a = p.parse_args(argv)
    a.arm_list = [x for x in a.arms.split(",") if x]
    a.levels = [int(c) for c in a.concurrency.split(",") if c]
    return a


def workload_stops(args: argparse.Namespace, pair) -> tuple[int, ...]:
    """The token ids that end an answer: the pair's end-of-turn / eos ids, none with --ignore-eos."""
    if args.ignore_eos:
        return ()
    return tuple(int(s) for s in (getattr(pair, "stop_ids", None) or [pair.tokenizer.eos_token_id]))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = workload_parser(__doc__.splitlines()[0], "off,separate,suffix,hybrid", "8,16", "bench_results/field_engine.json")
    a = parse_workload(p, argv)
    if a.arm_list[:1] != ["off"] or any(x not in KINDS for x in a.arm_list[1:]):
        p.error(f"--arms: off first, then any of {', '.join(KINDS)}; got {a.arms!r}")
    return a


class Run(NamedTuple):
    """One arm's pass over the prompts at one level: what it emitted, in what time, and what it drafted to get there
    (drafted and accepted tokens over every answer, engine steps): the server's `drft%` and `alpha` columns."""

    tokens: int
    seconds: float
    answers: list[list[int]]
    drafted: int
    accepted: int
    steps: int


def run_workload(engine, prompts: list[list[int]], concurrency: int, max_tokens: int, stops: tuple[int, ...],
                 tag: str) -> Run:
    """`prompts` through `engine`, `concurrency` in flight (a new one as each finishes), greedy; answers in prompt
    order."""
    from dvi.engine.speculative import Request, SamplingParams

    queue, inflight, answers, tokens, drafted, accepted, steps = list(enumerate(prompts)), 0, {}, 0, 0, 0, 0
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and inflight < concurrency:
            i, p = queue.pop(0)
            engine.add_request(Request(f"{tag}-{i}", list(p), SamplingParams(max_tokens, 0.0, 0, 1.0, None, stops)))
            inflight += 1
        steps += 1
        for o in engine.step():
            tokens += len(o.new_token_ids)
            if o.finished:
                inflight -= 1
                answers[int(o.request_id.rsplit("-", 1)[1])] = list(o.result.token_ids)
                drafted, accepted = drafted + o.result.num_drafted, accepted + o.result.num_accepted
    return Run(tokens, time.perf_counter() - t0, [answers[i] for i in range(len(prompts))], drafted, accepted, steps)


def pooled(runs: list[tuple[int, float]]) -> float:
    """Output tokens per second over every round ((tokens, seconds) or `Run`s)."""
    return sum(r[0] for r in runs) / sum(r[1] for r in runs)


def figures(results: dict[str, dict[int, list[Run]]], differ: dict[str, int]) -> list[dict]:
    """One row per arm and level: pooled tok/s, its ratio to off's and each round's, drafted tokens per 100 output
    tokens and their acceptance, output tokens per engine step."""
    rows = []
    for c in sorted({c for lv in results.values() for c in lv}):
        off = results["off"][c]
        for arm, lv in results.items():
            rs = lv[c]
            tokens, drafted, accepted = (sum(getattr(r, f) for r in rs) for f in ("tokens", "drafted", "accepted"))
            rows.append({"arm": arm, "concurrency": c, "tok_s": pooled(rs), "x_off": pooled(rs) / pooled(off),
                         "x_off_rounds": [(r.tokens / r.seconds) / (o.tokens / o.seconds)
                                          for r, o in zip(rs, off, strict=True)],
                         "drafted_per_100": 100 * drafted / tokens, "alpha": accepted / drafted if drafted else None,
                         "tokens_per_step": tokens / sum(r.steps for r in rs),
                         "differ_from_off": differ.get(arm, 0) if arm != "off" else None})
    return rows


def goals(rows: list[dict], dtype: str, differ: dict[str, int]) -> list[dict]:
    out = [goal(f"dvi {r['arm']} vs dvi off in process, output tok/s, C={r['concurrency']} ({dtype})", r["x_off"], 1.0)
           for r in rows if r["arm"] != "off"]
    out.append(goal(f"answers whose greedy text differs from speculation off's ({dtype}, every kind, C and round)",
                    float(sum(differ.values())), 0.0, higher_is_better=False))
    return out


def engine_factory(args: argparse.Namespace):
    """A factory of fresh engines per arm over one loaded pair, each made ready as a server makes its own, and the
    pair."""
    from benchmarks.serve_field import DVI_ARMS
    from dvi.config import load_config
    from dvi.models.loading import load_pair_from_config
    from serving.engine_build import ready_to_serve, serving_engine

    base = [f"models.preset={args.preset}", f"models.dtype={'bfloat16' if args.dtype == 'bf16' else 'float32'}",
            "serve.max_batch_size=16", *args.set]
    pair = load_pair_from_config(load_config(None, base + DVI_ARMS["separate"]).models)

    def make(arm: str):
        cfg = load_config(None, base + DVI_ARMS[arm])
        engine = serving_engine(cfg, pair)
        ready_to_serve(engine, cfg)
        return engine

    return make, pair


def forget_history(engine) -> None:
    """Empty a history kind's index of finished answers (`SuffixCache.clear`): the warm-up's answers are the measured
    prompts' own, which a server's warm-up (another prompt) never gives it."""
    proposer = engine.proposer
    for cache in (getattr(proposer, "cache", None), getattr(getattr(proposer, "suffix", None), "cache", None)):
        if cache is not None:
            cache.clear()


def measure(args: argparse.Namespace) -> tuple[dict, dict[str, int]]:
    """Every arm's runs per level ({arm: {C: [Run per round]}}) and its answers differing from off's."""
    import torch

    from benchmarks.serve_field import build_prompts
    from dvi.memory import freeze_long_lived

    torch.set_num_threads(1)
    make, pair = engine_factory(args)
    freeze_long_lived()  # as `dvi serve` does once started: the imports and the pair, never walked again
    tok = pair.tokenizer
    prompts = [tok(p["prompt"])["input_ids"] for p in build_prompts(tok, args.prompts, args.seed)]
    stops = workload_stops(args, pair)
    results = {a: {c: [] for c in args.levels} for a in args.arm_list}
    answers: dict[tuple[str, int, int], list[list[int]]] = {}
    for r in range(args.rounds):
        for arm in args.arm_list if r % 2 == 0 else args.arm_list[::-1]:
            for c in args.levels:  # a fresh engine per level, as serve_field starts a history kind's server
                engine = make(arm)
                run_workload(engine, prompts[:c], c, args.max_tokens, stops, "warm")
                forget_history(engine)
                run = run_workload(engine, prompts, c, args.max_tokens, stops, "run")
                answers[arm, r, c] = run.answers
                results[arm][c].append(run)
                print(f"round {r} C={c:2d} {arm:9s} {run.tokens / run.seconds:7.1f} tok/s ({run.tokens} tokens, "
                      f"{run.seconds:.2f} s, {run.steps} steps, drafted {run.drafted}, accepted {run.accepted})",
                      flush=True)
                del engine
                gc.collect()
    differ = {a: sum(x != y for (arm, r, c), xs in answers.items() if arm == a
                     for x, y in zip(xs, answers["off", r, c], strict=True)) for a in args.arm_list[1:]}
    return results, differ


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    results, differ = measure(args)
    cpu = cpu_name()
    rows = figures(results, differ)
    print(f"\nin process, {args.prompts} prompts x {args.max_tokens} tokens, greedy, {args.dtype}, one thread, {cpu}")
    print(f"{'arm':9s} {'C':>3s} {'tok/s':>7s} {'x off':>6s} {'drft%':>6s} {'alpha':>6s} {'tok/step':>8s}  rounds")
    for r in rows:
        alpha = "-" if r["alpha"] is None else f"{r['alpha']:.2f}"
        print(f"{r['arm']:9s} {r['concurrency']:3d} {r['tok_s']:7.1f} {r['x_off']:6.3f} {r['drafted_per_100']:6.1f} "
              f"{alpha:>6s} {r['tokens_per_step']:8.2f}  " + " ".join(f"{x:.3f}" for x in r["x_off_rounds"]))
    gs = goals(rows, args.dtype, differ)
    print_goals(gs)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(clean_json({"benchmark": "field_engine", "settings": vars(args) | {"cpu": cpu},
                                                      "rows": rows, "differ_from_off": differ, "goals": gs,
                                                      "wall_s": time.time() - t0}), indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
