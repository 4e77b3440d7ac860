"""The packed weights on transparent huge pages against 4 KiB pages (`dvi.decode.huge_pages`), in one process.

Two measures, arms interleaved (ABBA over --rounds), one thread:

1. the rows kernel alone: every layer's four matmuls of the target at 1, 4, 8, 12, 16 and 32 rows (best of --reps),
   its weights packed on each kind of page; at few rows a step streams the weights, so this is their streaming rate;
2. serve_field's workload on the engine behind `dvi serve` (`benchmarks/field_engine.py`: fresh engines made ready as a
   server's, C in flight, unseen prompts, greedy), speculation off and any kinds in --arms, each on both kinds of
   page; answers checked equal.

    .venv/bin/python benchmarks/huge_pages.py --dtype bf16 --concurrency 1,8,16 [--arms off] [--rounds 2]

Prints tables ending with the goals (huge pages >= 1.0x 4 KiB pages in output tok/s at each C; the same answers) and
writes JSON. Where the OS gives no huge pages (THP mode "never", not Linux) it says so and measures nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, cpu_name, goal, print_goals  # noqa: E402
from benchmarks.field_engine import (  # noqa: E402
    KINDS,
    forget_history,
    parse_workload,
    pooled,
    run_workload,
    workload_parser,
    workload_stops,
)

PAGES = ("huge", "4k")
KERNEL_ROWS = (1, 4, 8, 12, 16, 32)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = workload_parser(__doc__.splitlines()[0], "off", "1,8,16", "bench_results/huge_pages.json")
    p.add_argument("--reps", type=int, default=5, help="kernel timings a row count and round (best kept)")
    a = parse_workload(p, argv)
    if not a.arm_list or any(x not in ("off", *KINDS) for x in a.arm_list):
        p.error(f"--arms: any of off, {', '.join(KINDS)}; got {a.arms!r}")
    return a


def kernel_times(lean, dtype, rows: int, reps: int) -> float:
    """Best seconds of every layer's four matmuls at `rows` rows."""
    import torch

    x, xi = torch.randn(rows, lean.hidden, dtype=dtype), torch.randn(rows, int(lean.layers[0].down.shape[1]), dtype=dtype)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for lw in lean.layers:
            lean.linear(x, lw.qkv), lean.linear(x, lw.o), lean.linear(x, lw.gate_up), lean.linear(xi, lw.down)
        best = min(best, time.perf_counter() - t)
    return best


def measure_kernel(args, pair) -> dict[str, dict[int, list[float]]]:
    """{pages: {rows: [best seconds per round]}}: the target's weights packed afresh on each kind of page a round."""
    import torch

    from dvi.decode import huge_pages
    from dvi.decode.lean import LeanModel

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    out: dict[str, dict[int, list[float]]] = {p: {r: [] for r in KERNEL_ROWS} for p in PAGES}
    with torch.inference_mode():
        for rnd in range(args.rounds):
            for pages in PAGES if rnd % 2 == 0 else PAGES[::-1]:
                huge_pages.enable(pages == "huge")
                lean = LeanModel(pair.target)
                if not lean.use_rows_kernel(max(KERNEL_ROWS)):
                    return {}
                for r in KERNEL_ROWS:
                    out[pages][r].append(kernel_times(lean, dtype, r, args.reps))
                del lean
                gc.collect()
    huge_pages.enable(True)
    return out


def measure_engine(args, make, pair) -> tuple[dict, int]:
    """{(arm, pages): {C: [(tokens, seconds) per round]}} and the answers differing from the first arm's."""
    from benchmarks.serve_field import build_prompts
    from dvi.decode import huge_pages

    tok = pair.tokenizer
    prompts = [tok(p["prompt"])["input_ids"] for p in build_prompts(tok, args.prompts, args.seed)]
    stops = workload_stops(args, pair)
    arms = [(a, p) for a in args.arm_list for p in PAGES]
    results: dict = {a: {c: [] for c in args.levels} for a in arms}
    answers, differ = {}, 0
    for rnd in range(args.rounds):
        for arm, pages in arms if rnd % 2 == 0 else arms[::-1]:
            for c in args.levels:
                huge_pages.enable(pages == "huge")
                engine = make(arm)
                run_workload(engine, prompts[:c], c, args.max_tokens, stops, "warm")
                forget_history(engine)
                run = run_workload(engine, prompts, c, args.max_tokens, stops, "run")
                results[arm, pages][c].append((run.tokens, run.seconds))
                first = answers.setdefault((rnd, c), run.answers)
                differ += sum(x != y for x, y in zip(run.answers, first, strict=True))
                print(f"round {rnd} C={c:2d} {arm:9s} {pages:4s} pages {run.tokens / run.seconds:7.1f} tok/s", flush=True)
                del engine
                gc.collect()
    huge_pages.enable(True)
    return results, differ


def figures(kernel: dict, engine: dict, arms: list[str], levels: list[int]) -> tuple[list[dict], list[dict]]:
    """Kernel rows (each page kind's best time over rounds, 4k / huge) and engine rows (tok/s pooled over rounds,
    huge / 4k, and each round's)."""
    kernel_rows = [{"rows": r, "huge_ms": min(kernel["huge"][r]) * 1e3, "4k_ms": min(kernel["4k"][r]) * 1e3,
                    "x_4k": min(kernel["4k"][r]) / min(kernel["huge"][r])} for r in kernel.get("huge", {})]
    rows = []
    for arm in arms:
        for c in levels:
            h, k = engine[arm, "huge"][c], engine[arm, "4k"][c]
            rows.append({"arm": arm, "concurrency": c, "huge_tok_s": pooled(h), "4k_tok_s": pooled(k),
                         "x_4k": pooled(h) / pooled(k),
                         "x_4k_rounds": [(th / sh) / (tk / sk) for (th, sh), (tk, sk) in zip(h, k, strict=True)]})
    return kernel_rows, rows


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.field_engine import engine_factory
    from dvi.decode import huge_pages

    args = parse_args(argv)
    t0, cpu = time.time(), cpu_name()
    mode = huge_pages.thp_mode()
    if mode not in ("madvise", "always"):
        print(f"transparent huge pages: {mode or 'none on this OS'}; the weights stay on 4 KiB pages: nothing to compare")
        return 0
    torch.set_num_threads(1)
    make, pair = engine_factory(args)
    kernel = measure_kernel(args, pair)
    engine, differ = measure_engine(args, make, pair)
    print(f"\n{args.dtype}, one thread, {cpu}, THP mode {mode}")
    kernel_rows, rows = figures(kernel, engine, args.arm_list, args.levels)
    if kernel_rows:
        print("rows kernel, every layer's matmuls (ms, best a round; huge / 4k pages):")
        for r in kernel_rows:
            print(f"  {r['rows']:3d} rows  {r['huge_ms']:7.2f} / {r['4k_ms']:7.2f} ms  {r['x_4k']:5.3f}x")
    print(f"engine, {args.prompts} prompts x {args.max_tokens} tokens, greedy:\n{'arm':9s} {'C':>3s} {'huge':>7s} "
          f"{'4k':>7s} {'x 4k':>6s}  rounds")
    for r in rows:
        print(f"{r['arm']:9s} {r['concurrency']:3d} {r['huge_tok_s']:7.1f} {r['4k_tok_s']:7.1f} {r['x_4k']:6.3f}  "
              + " ".join(f"{x:.3f}" for x in r["x_4k_rounds"]))
    gs = [goal(f"dvi {r['arm']}, packed weights on huge pages vs 4 KiB pages, output tok/s, C={r['concurrency']} "
               f"({args.dtype})", r["x_4k"], 1.0) for r in rows]
    gs.append(goal(f"answers differing between the arms ({args.dtype})", float(differ), 0.0, higher_is_better=False))
    print_goals(gs)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(clean_json({"benchmark": "huge_pages", "settings": vars(args) | {"cpu": cpu,
                                                      "thp_mode": mode}, "kernel": kernel_rows, "rows": rows,
                                                      "goals": gs, "wall_s": time.time() - t0}), indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
