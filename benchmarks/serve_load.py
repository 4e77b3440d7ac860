"""Closed-loop load on the dvi server over loopback: speculation (adaptive K) vs none.

For each arm real `dvi serve` processes are started (--instances of them, default 2, in ABBA start order after
--decoys throwaway servers, default 1, closed once they are up; each
its own process, one torch thread, trainer off, feedback logging on), and for each concurrency level C in
--concurrency, C clients each send a streamed greedy completion, wait for it to finish, and send the next (closed
loop), until --requests (default max(24, 2C)) have finished. Prompts are held-out code prompts from
`dvi.data.prompt_stream`, sent as token ids so both arms see identical inputs.

Figures per (arm, C): generated tokens/s, p50/p99 request latency and time to first token (client-side: first
content chunk), α (accepted / drafted, from the responses' `dvi` field), and errors (non-200, or an error chunk in
the stream). Each level is measured --rounds times per arm in ABBA order, round r on each arm's server r mod
--instances, and the figures pool the rounds (this 2-core machine's speed drifts by +-15% over tens of seconds, more
than the effects measured at high concurrency; and a server started first measured 5-8% slower steps than one started
second, whichever arm it ran). Goals: 0 errors at every level; speculation at its defaults >= 1.0x the
no-speculation throughput at every level (issue 61: never slower than off). The dtype and the drafter kind of both
arms: `--set models.dtype=float32`, `--set models.drafter_kind=hybrid`.

Every request asks for --max-tokens by default, so without speculation the rows that start together finish together
and the next wave joins together (lockstep); speculation's rows drift apart, and dvi's batched attention costs every
row the longest row's columns (`benchmarks/attention_spread.py` times that). `--min-tokens N` spreads the requests'
lengths over N..max as mixed traffic does, for both arms.

    .venv/bin/python benchmarks/serve_load.py --preset smollm2 [--json bench_results/serve_load.json]

Writes JSON (settings, raw figures, `goals`), prints a table ending with the goals, exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal
from dvi.decode.results import acceptance_rate

ARMS = {"spec": ["speculation.adaptive=true"],
        "nospec": ["speculation.adaptive=false", "speculation.num_draft_tokens=0"],
        "chain": ["speculation.adaptive=true", "speculation.tree_width=0"],
        "control0": ["speculation.adaptive=true", "trainer.adapter_key=domain", "serve.control_share=0"],
        "control25": ["speculation.adaptive=true", "trainer.adapter_key=domain", "serve.control_share=0.25"]}
"""`spec` the server's defaults (adaptive K, draft trees where they pay); `chain` the same without trees;
`control0` / `control25` a traffic group per domain with no control group / a quarter of each group's requests in
the control arm (issue 59): with the trainer off no adapter is ever promoted, so both arms draft with the base and
what differs is the control group's own machinery (arm draws, per-arm pools, per-request bookkeeping)."""


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


async def _one(client, prompt: list[int], max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft = None
    out = {"ok": False, "tokens": 0, "drafted": 0, "accepted": 0}
    try:
        async with client.stream("POST", "/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "metadata": {"domain": "code"}}) as r:
            if r.status_code != 200:
                await r.aread()
                out["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    out["error"] = ev["error"]["message"]
                    return out
                if ttft is None and ev["choices"][0].get("text"):
                    ttft = time.perf_counter() - t0
                if "usage" in ev:
                    out["tokens"] = ev["usage"]["completion_tokens"]
                    out["drafted"] = ev["dvi"]["drafted"]
                    out["accepted"] = ev["dvi"]["accepted"]
                    out["ok"] = True
    except Exception as exc:  # noqa: BLE001 - every failure is an error figure
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["latency"] = time.perf_counter() - t0
    out["ttft"] = ttft if ttft is not None else out["latency"]
    return out


async def _engine_counters(client) -> tuple[float, float]:
    """(seconds the server's engine spent in steps, steps) since it started, from its /metrics."""
    from dvi.metrics import names as M

    vals = {M.ENGINE_BUSY_SECONDS: 0.0, M.ENGINE_STEPS: 0.0}
    for line in (await client.get("/metrics")).text.splitlines():
        name, _, value = line.partition(" ")
        if name in vals:
            vals[name] = float(value)
    return vals[M.ENGINE_BUSY_SECONDS], vals[M.ENGINE_STEPS]


def _budget(i: int, lo: int, hi: int) -> int:
    """Request i's max_tokens: `hi` (lo 0: a fixed length), or spread over lo..hi by a fixed stride (the same for
    every arm)."""
    return hi if lo <= 0 or lo >= hi else lo + (i * 7919) % (hi - lo + 1)


async def _level(url: str, prompts: list[list[int]], concurrency: int, n_requests: int, max_tokens: int,
                 warmup: int, min_tokens: int = 0) -> tuple[list[dict], float, float, float]:
    """One closed-loop run: every request's outcome, the wall time of the measured part, and the engine's busy
    seconds and steps in it (its busy share says whether the arm was compute-bound: a share under 1 is time the
    engine waited on the HTTP side)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for i in range(warmup):
            await _one(client, prompts[i % len(prompts)], max_tokens)
        counter = iter(range(n_requests))
        results: list[dict] = []

        async def worker() -> None:
            for i in counter:
                results.append(await _one(client, prompts[i % len(prompts)], _budget(i, min_tokens, max_tokens)))

        busy0, steps0 = await _engine_counters(client)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        busy1, steps1 = await _engine_counters(client)
    return results, wall, busy1 - busy0, steps1 - steps0


def _summarize(concurrency: int, runs: list[tuple[list[dict], float, float, float]]) -> dict:
    """Figures of one (arm, level) pooled over its rounds: throughput = all tokens / all wall time."""
    results = [r for rs, *_ in runs for r in rs]
    wall = sum(w for _, w, *_ in runs)
    busy, steps = sum(r[2] for r in runs), sum(r[3] for r in runs)
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok]
    errors = [r.get("error") for r in results if not r["ok"]]
    return {
        "concurrency": concurrency, "requests": len(results), "rounds": len(runs), "wall_s": wall,
        "tokens": tokens,
        "throughput_tok_s": tokens / wall if wall > 0 else float("nan"),
        "round_throughputs_tok_s": [sum(r["tokens"] for r in rs if r["ok"]) / w if w > 0 else float("nan")
                                    for rs, w, *_ in runs],
        # the engine's side: busy share of the wall time, steps, tokens per step and milliseconds per step
        "engine_busy_share": busy / wall if wall > 0 else float("nan"), "engine_steps": steps,
        "tokens_per_step": tokens / steps if steps else float("nan"),
        "ms_per_step": 1e3 * busy / steps if steps else float("nan"),
        "requests_per_s": len(ok) / wall if wall > 0 else float("nan"),
        "latency_p50_s": _pct(lat, 0.5), "latency_p99_s": _pct(lat, 0.99),
        "latency_mean_s": statistics.fmean(lat) if lat else float("nan"),
        "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
        "alpha": acceptance_rate(sum(r["accepted"] for r in ok), drafted),
        "drafted": drafted, "accepted": sum(r["accepted"] for r in ok),
        "errors": len(errors), "error_samples": errors[:3],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--json", type=Path, default=Path("bench_results/serve_load.json"))
    ap.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(24, 2C))")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=0,
                    help="spread each request's max_tokens over min..max (default: every request max-tokens long)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measurements per arm and level, in ABBA order; figures pool all rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--instances", type=int, default=2,
                    help="servers per arm, started in ABBA order; round r measures server r mod instances")
    ap.add_argument("--decoys", type=int, default=1,
                    help="throwaway servers started before the measured ones and closed once those are up: a "
                         "server started first measured slower steps than the ones after it, whichever arm it ran")
    ap.add_argument("--arms", default="spec,nospec", help=f"comma-separated, of {sorted(ARMS)}")
    ap.add_argument("--set", action="append", default=[], help="extra config override for both servers (key=value), "
                    "e.g. models.device=cuda")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.instances < 1:
        ap.error("--instances must be >= 1")
    if args.decoys < 0:
        ap.error("--decoys must be >= 0")
    return args


def _prompts(args: argparse.Namespace) -> list:
    """64 held-out code prompts of the (built) preset's tokenizer."""
    from dvi.config import load_config
    from dvi.data import prompt_stream
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_tokenizer
    from serving.loading import ensure_pair

    ensure_pair(load_config(None, [f"models.preset={args.preset}"]))
    tok = load_tokenizer(embedded_paths(args.preset).tokenizer)
    stream = prompt_stream("code", tok, split="heldout", prompt_tokens=(32, 96), seed=args.seed)
    return [next(stream) for _ in range(64)]


def _start_servers(stack: contextlib.ExitStack, arms: dict, base: list[str], work: Path, instances: int,
                   decoys: int = 1) -> dict:
    """`instances` servers per arm, each in its own run dir, closed when `stack` closes; started in ABBA order (arm
    A's first, B's first, B's second, A's second), after `decoys` throwaway servers that are closed once the measured
    ones are up. On a 2-core Intel AMX machine the server started first measured 5-8% slower steps than the ones
    started after it, whichever arm it ran (and, in one process, the engine built first), so without a decoy ABBA
    still handed that server to arm A."""
    from serving.server_process import ServerProcess

    def start(into: contextlib.ExitStack, overrides: list[str], run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        return into.enter_context(ServerProcess(
            base + overrides + [f"run_dir={run_dir}", f"feedback.dir={run_dir / 'feedback'}",
                                f"registry.dir={run_dir / 'registry'}"], run_dir / "server.log", cwd=ROOT))

    with contextlib.ExitStack() as decoy_stack:
        for i in range(decoys):
            print(f"[decoy] starting throwaway server {i + 1} of {decoys} ...", flush=True)
            start(decoy_stack, ARMS["nospec"], work / f"decoy-{i}")
        servers: dict[str, list] = {arm: [] for arm in arms}
        for i in range(instances):
            for arm in (list(arms) if i % 2 == 0 else list(arms)[::-1]):
                print(f"[{arm}] starting server {i + 1} of {instances} ...", flush=True)
                servers[arm].append(start(stack, arms[arm], work / (arm if instances == 1 else f"{arm}-{i}")))
    return servers


def _measure_level(servers: dict, c: int, args: argparse.Namespace, prompts: list) -> dict[str, dict]:
    """Every arm at concurrency `c`, `--rounds` times, pooled into one figure per arm (printed)."""
    n = args.requests or max(24, 2 * c)
    runs: dict[str, list] = {arm: [] for arm in servers}
    for r in range(args.rounds):
        # ABBA: the arm measured first alternates, so a drift in machine speed within a level
        # hits both arms alike.
        # Round r measures each arm's server r mod --instances.
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for arm in order:
            url = servers[arm][r % len(servers[arm])].url
            runs[arm].append(asyncio.run(_level(url, prompts, c, n, args.max_tokens, args.warmup, args.min_tokens)))
    figs = {}
    for arm in servers:
        fig = figs[arm] = _summarize(c, runs[arm])
        a = fig["alpha"]
        print(f"[{arm}] C={c:>3}: {fig['throughput_tok_s']:7.1f} tok/s  p50 {fig['latency_p50_s']:.3f}s "
              f"p99 {fig['latency_p99_s']:.3f}s  ttft p50 {fig['ttft_p50_s']:.3f}s  "
              f"α {'-' if a is None else f'{a:.3f}'}  busy {fig['engine_busy_share']:.2f}  "
              f"{fig['tokens_per_step']:.2f} tok/step {fig['ms_per_step']:.1f} ms/step  errors {fig['errors']}  rounds "
              f"{', '.join(f'{x:.0f}' for x in fig['round_throughputs_tok_s'])}", flush=True)
    return figs


def _goals(figures: dict[str, list[dict]], levels: list[int]) -> list[dict]:
    def tput(arm: str, c: int) -> float:
        for f in figures.get(arm, []):
            if f["concurrency"] == c:
                return f["throughput_tok_s"]
        return float("nan")

    goals = [goal("errors at every level", float(sum(f["errors"] for fs in figures.values() for f in fs)), 0.0,
                   higher_is_better=False)]
    if "nospec" in figures:  # issue 61: speculation at its defaults is never slower than off, at any concurrency
        goals += [goal(f"speculation throughput ratio at concurrency {c}", tput("spec", c) / tput("nospec", c), 1.0)
                  for c in levels]
    if "control0" in figures and "control25" in figures:  # issue 59: the control group costs its share of the gain only
        goals += [goal(f"control group at share 0.25 vs 0, no adapter (A/A), throughput ratio at concurrency {c}",
                       tput("control25", c) / tput("control0", c), 0.97) for c in levels]
    if "spec" in figures and "control0" in figures:
        goals += [goal(f"groups with control share 0 vs no groups, throughput ratio at concurrency {c}",
                       tput("control0", c) / tput("spec", c), 0.97) for c in levels]
    if "chain" in figures:
        goals += [goal(f"trees vs chains throughput at concurrency {c}", tput("spec", c) / tput("chain", c), 1.0)
                  for c in levels]
    return goals


def _print_table(figures: dict[str, list[dict]], goals: list[dict]) -> None:
    header = f"{'arm':<7} {'C':>3} {'req':>4} {'tok/s':>8} {'p50 s':>7} {'p99 s':>7} {'ttft50':>7} {'ttft99':>7} " \
             f"{'alpha':>6} {'busy':>5} {'tok/st':>6} {'ms/st':>6} {'err':>4}"
    print("\n" + header + "\n" + "-" * len(header))
    for arm, fs in figures.items():
        for f in fs:
            a = "-" if f["alpha"] is None else f"{f['alpha']:.3f}"
            print(f"{arm:<7} {f['concurrency']:>3} {f['requests']:>4} {f['throughput_tok_s']:>8.1f} "
                  f"{f['latency_p50_s']:>7.3f} {f['latency_p99_s']:>7.3f} {f['ttft_p50_s']:>7.3f} "
                  f"{f['ttft_p99_s']:>7.3f} {a:>6} {f['engine_busy_share']:>5.2f} {f['tokens_per_step']:>6.2f} "
                  f"{f['ms_per_step']:>6.1f} {f['errors']:>4}")
    print("\ngoals:")
    for g in goals:
        print(f"  [{'met' if g['met'] else 'MISSED'}] {g['name']}: {g['value']:.3f} "
              f"({'>=' if g['higher_is_better'] else '<='} {g['target']})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    arms = {a: ARMS[a] for a in args.arms.split(",") if a}
    prompts = _prompts(args)
    work = Path(tempfile.mkdtemp(prefix="dvi-serve-load-"))
    base = [f"models.preset={args.preset}", f"run_dir={work}", "serve.trainer=off", "wandb.mode=disabled",
            f"serve.max_batch_size={args.max_batch_size}", "serve.queue_limit=1024",
            f"serve.max_tokens_limit={max(args.max_tokens, 64)}", *args.set]
    figures: dict[str, list[dict]] = {arm: [] for arm in arms}
    t_start = time.time()
    # The servers run side by side (each one thread, idle while another is measured) and the arms
    # alternate level by level, so a change in the machine's other load hits both arms alike.
    with contextlib.ExitStack() as stack:
        servers = _start_servers(stack, arms, base, work, args.instances, args.decoys)
        for c in levels:
            for arm, fig in _measure_level(servers, c, args, prompts).items():
                figures[arm].append(fig)
    goals = _goals(figures, levels)
    _print_table(figures, goals)
    out = {
        "benchmark": "serve_load",
        "settings": {"preset": args.preset, "concurrency": levels, "requests": args.requests,
                     "max_tokens": args.max_tokens, "min_tokens": args.min_tokens,
                     "max_batch_size": args.max_batch_size, "warmup": args.warmup,
                     "rounds": args.rounds, "instances": args.instances, "decoys": args.decoys,
                     "arms": arms, "prompts": "held-out code (dvi.data.prompt_stream, 32-96 tokens)",
                     "greedy": True, "trainer": "off", "feedback_logging": True,
                     "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                 "platform": platform.platform()}},
        "figures": figures,
        "goals": goals,
        "wall_s": time.time() - t_start,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(clean_json(out), indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
