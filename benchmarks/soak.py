"""Soak: long serving on a steady mixed workload, the online trainer on vs off, and the curve that shows learning.

Two arms, each a fresh `dvi serve` (`benchmarks._drift_server.Server`: scheduler, swapper with its shadow
check and rollback, supervisor) on the same pair and the same request sequence (one seeded draw over code
completions, chat and sql requests, `--mix`): ``online`` (`serve.trainer=supervised`) and ``frozen``
(`serve.trainer=off`).
An arm is sized in feedback tokens (completion tokens served, each one judged and logged), not seconds, so a
busy machine runs the same soak slower. After every wave of `--wave` requests the client records, per
domain, α over the wave; the served-token count; the swapper's promotion / rollback counts; and the
server's and trainer's resident memory (`/proc/<pid>`). Everything goes to the JSON, an offline wandb
run per arm (`<work>/<arm>/soak_wandb`, α per domain against feedback tokens) and a PNG: α per domain for
both arms against feedback tokens, promotions and rollbacks marked, memory below.

Goals (issue 25 §2): online α over the last fifth of the run >= frozen's + 0.05 on every domain; 0 errors;
server and trainer memory flat within 10% over the second half (max / min of the samples there). Whether
a promotion lowered held-out α is the publish chain's held-out judging: reported from the swapper's counts
here (rollbacks), not measured.

    python benchmarks/soak.py --preset smollm2 [--feedback-tokens 40000] [--json bench_results/soak.json]

With `--minutes N` it is the long soak instead (issue 60 §2, `benchmarks/_soak_long.py`): one online server for N
minutes of traffic that drifts every `--drift-minutes`, with target updates, cut and abandoned requests and trainer
kills, sampled every `--sample-seconds`, checked at the end (records = answered requests, 0 5xx, disk bounds, the
second vs the last quarter, α per group); `--engine vllm` behind vLLM.

    python benchmarks/soak.py --minutes 60 --json bench_results/soak_long.json
    python benchmarks/soak.py --minutes 30 --engine vllm --drift-minutes 5 --json bench_results/soak_long_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal
from benchmarks._drift_server import Server, _send, pair_overrides
from benchmarks._soak_long import add_long_args, run_long
from dvi import metrics as M
from dvi.decode.results import acceptance_rate

ARMS = ("online", "frozen")
DOMAINS = ("code", "chat", "sql")
# feedback tokens per arm by default; the real pair's is a guess at 30 minutes of this 2-core machine (~20 served
# tokens/s), not yet measured: size it from the first real run
DEFAULT_TOKENS = {"smollm2": 40_000, "tiny": 2_000}


def workload(tok: Any, args: argparse.Namespace) -> Any:
    """Endless (domain, item) pairs, drawn by `--mix` weights with `--seed`: the same sequence for every arm."""
    from dvi.data import chat_instructions, prompt_stream, render_chat, sql_instructions

    def fits(stream: Any) -> Any:
        return (m for m in stream if len(render_chat(tok, m)) <= args.prompt_tokens)

    streams = {"code": prompt_stream("code", tok, split="heldout", prompt_tokens=(32, 96), seed=args.seed),
               "chat": fits(chat_instructions("heldout", seed=args.seed)),
               "sql": fits(sql_instructions("heldout", seed=args.seed))}
    mix = dict(args.mix)
    rng = random.Random(f"soak/{args.seed}")
    doms = [d for d in DOMAINS if mix.get(d, 0) > 0]
    while True:
        d = rng.choices(doms, weights=[mix[d] for d in doms])[0]
        yield d, next(streams[d])


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a live process (None when it is gone or unknown)."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def _wave(url: str, chunk: list[tuple[str, list]], args: argparse.Namespace) -> list[dict]:
    import httpx

    queue = iter(chunk)
    rows: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def worker() -> None:
            for dom, item in queue:
                try:
                    r = await _send(client, item, args.max_tokens, dom)
                except httpx.HTTPError as e:
                    r = {"error": f"{type(e).__name__}: {e}"}
                rows.append({"domain": dom, **r})
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    return rows


def wave_record(rows: list[dict], tokens: int, health: dict, server_pid: int | None) -> dict:
    """One point of the curve: α per domain over the wave, counts, versions and memory after it."""
    alpha = {d: acceptance_rate(sum(r["accepted"] for r in rows if r["domain"] == d and "error" not in r),
                                sum(r["drafted"] for r in rows if r["domain"] == d and "error" not in r))
             for d in DOMAINS}
    counts = dict((health.get("drafter") or {}).get("counts") or {})
    trainer = health.get("trainer") or {}
    return {"feedback_tokens": tokens, "alpha": alpha, "requests": len(rows),
            "errors": sum("error" in r for r in rows),
            "accepted": {d: sum(r.get("accepted", 0) for r in rows if r["domain"] == d) for d in DOMAINS},
            "drafted": {d: sum(r.get("drafted", 0) for r in rows if r["domain"] == d) for d in DOMAINS},
            "promoted": counts.get("promoted", 0), "rolled_back": counts.get("rolled_back", 0),
            "drafter_version": health.get("drafter_version"), "time": time.time(),
            "server_rss": _server_rss(server_pid, health), "trainer_rss": rss_bytes(trainer.get("pid"))}


def _server_rss(server_pid: int | None, health: dict) -> int | None:
    """The server's resident bytes, with its engine's where that is a process of its own (`serve.engine_process`)."""
    engine_pid = (health.get("engine") or {}).get("pid")
    parts = [rss_bytes(server_pid)] + ([rss_bytes(engine_pid)] if engine_pid and engine_pid != server_pid else [])
    return None if any(p is None for p in parts) else sum(parts)


def run_arm(name: str, args: argparse.Namespace, work: Path, overrides: list[str], tok: Any) -> dict:
    """Serve the workload on a fresh server until `--feedback-tokens` completion tokens; one record per wave."""
    from dvi.metrics import MetricsLogger

    online = name == "online"
    waves: list[dict] = []
    with Server(args, work / name, [f"serve.trainer={'supervised' if online else 'off'}", *overrides]) as srv:
        if online:
            srv.wait_trainer(("idle", "running"), 600)
        logger = MetricsLogger(work / name / "soak_wandb", wandb_mode=args.wandb, project="dvi-soak",
                               name=f"soak-{name}", config={"arm": name, **{k: str(v) for k, v in vars(args).items()}})
        stream, tokens, t0 = workload(tok, args), 0, time.perf_counter()
        try:
            while tokens < args.feedback_tokens:
                rows = asyncio.run(_wave(srv.url, list(itertools.islice(stream, args.wave)), args))
                tokens += sum(r.get("tokens", 0) for r in rows)
                rec = wave_record(rows, tokens, srv.admin("GET", "/health"), srv.proc.proc.pid)
                waves.append(rec)
                for d, a in rec["alpha"].items():
                    if a is not None:
                        logger.log({M.ACCEPTANCE_RATE: a}, step=tokens, domain=d, drafter_version=rec["drafter_version"])
                logger.log({M.DRAFTER_PROMOTIONS: rec["promoted"], M.DRAFTER_ROLLBACKS: rec["rolled_back"],
                            M.SERVER_RSS_BYTES: rec["server_rss"], M.TRAINER_RSS_BYTES: rec["trainer_rss"]},
                           step=tokens)
                if rec["requests"] and rec["errors"] == rec["requests"]:
                    break  # the server is failing every request: stop rather than spin
        finally:
            logger.close()
        status = srv.admin("GET", "/admin/status")
    print(f"  {name}: {len(waves)} waves, {tokens} feedback tokens, {time.perf_counter() - t0:.0f}s", flush=True)
    return {"waves": waves, "status": status, "wall_s": time.perf_counter() - t0}


def tail_alpha(waves: list[dict], domain: str, share: float = 0.2) -> float | None:
    """α of `domain` pooled over the waves in the last `share` of the run's feedback tokens."""
    if not waves:
        return None
    cut = waves[-1]["feedback_tokens"] * (1 - share)
    tail = [w for w in waves if w["feedback_tokens"] > cut] or waves[-1:]
    return acceptance_rate(sum(w["accepted"][domain] for w in tail), sum(w["drafted"][domain] for w in tail))


def flatness(waves: list[dict], key: str) -> float | None:
    """max / min of the memory samples `key` over the second half of the run (1.0: flat)."""
    xs = [w[key] for w in waves[len(waves) // 2:] if w.get(key)]
    return max(xs) / min(xs) if xs else None


def soak_goals(arms: dict[str, dict], margin: float = 0.05) -> tuple[dict, list[dict]]:
    on, fr = arms["online"]["waves"], arms["frozen"]["waves"]
    summary: dict[str, Any] = {"online_tail": {d: tail_alpha(on, d) for d in DOMAINS},
                               "frozen_tail": {d: tail_alpha(fr, d) for d in DOMAINS},
                               "errors": sum(w["errors"] for a in arms.values() for w in a["waves"]),
                               "promotions": on[-1]["promoted"] if on else 0,
                               "rollbacks": on[-1]["rolled_back"] if on else 0,
                               "server_rss_ratio": flatness(on, "server_rss"), "trainer_rss_ratio": flatness(on, "trainer_rss")}
    goals = []
    for d in DOMAINS:
        o, f = summary["online_tail"][d], summary["frozen_tail"][d]
        if o is not None or f is not None:
            goals.append(goal(f"online α - frozen α on {d}, last fifth of the run", None if o is None or f is None
                              else o - f, margin))
    goals.append(goal("errors (both arms)", summary["errors"], 0, higher_is_better=False))
    goals.append(goal("server memory max/min, second half (online arm)", summary["server_rss_ratio"], 1.10, False))
    goals.append(goal("trainer memory max/min, second half (online arm)", summary["trainer_rss_ratio"], 1.10, False))
    return summary, goals


def plot(path: Path, arms: dict[str, dict], title: str, smooth: int) -> None:
    """α per domain against feedback tokens (online solid, frozen dashed; rolling over `smooth` waves), the
    online arm's promotions (green) and rollbacks (red) marked; memory below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, mem) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=(3, 1))
    colors = dict(zip(DOMAINS, ("tab:blue", "tab:orange", "tab:purple"), strict=True))
    for arm, style in (("online", "-"), ("frozen", "--")):
        waves = arms[arm]["waves"]
        for d in DOMAINS:
            xs, ys = [], []
            for i, w in enumerate(waves):
                win = waves[max(0, i - smooth + 1): i + 1]
                a = acceptance_rate(sum(x["accepted"][d] for x in win), sum(x["drafted"][d] for x in win))
                if a is not None:
                    xs.append(w["feedback_tokens"])
                    ys.append(a)
            if xs:
                ax.plot(xs, ys, style, color=colors[d], label=f"{d} ({arm})")
    on = arms["online"]["waves"]
    for prev, w in itertools.pairwise(on):
        for key, color in (("promoted", "tab:green"), ("rolled_back", "tab:red")):
            if w[key] > prev[key]:
                ax.axvline(w["feedback_tokens"], color=color, alpha=0.4, lw=1)
    for key, style in (("server_rss", "-"), ("trainer_rss", ":")):
        pts = [(w["feedback_tokens"], w[key] / 2**20) for w in on if w.get(key)]
        if pts:
            mem.plot(*zip(*pts, strict=True), style, color="k", label=f"{key.split('_')[0]} RSS (online)")
    ax.set_ylabel(f"α (rolling {smooth} waves)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    mem.set_xlabel("feedback tokens served")
    mem.set_ylabel("MiB")
    mem.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--pair-dir", type=Path, default=None, help="a built pair (default: the preset's cache dir)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "drift.yaml"))
    ap.add_argument("--kind", choices=("separate", "eagle"), default="separate")
    ap.add_argument("--feedback-tokens", type=int, default=None,
                    help=f"completion tokens per arm (default per preset: {DEFAULT_TOKENS}); raise it for longer runs")
    ap.add_argument("--mix", type=_mix, default=(("code", 1.0), ("chat", 1.0), ("sql", 1.0)),
                    help="domain weights, e.g. code:2,chat:1,sql:1")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--wave", type=int, default=12, help="requests per curve point")
    ap.add_argument("--smooth", type=int, default=4, help="waves in the PNG's rolling α")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=320, help="longest rendered chat / sql prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--feedback-tokens-per-step", type=int, default=64, help="the online trainer's budget")
    ap.add_argument("--wandb", choices=("offline", "disabled"), default="offline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("bench_results/soak.json"))
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every server")
    add_long_args(ap)
    args = ap.parse_args(argv)
    args.feedback_tokens = args.feedback_tokens or DEFAULT_TOKENS[args.preset]
    return args


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in text.split(","):
        d, _, w = part.partition(":")
        if d not in DOMAINS or not w:
            raise argparse.ArgumentTypeError(f"--mix: expected domain:weight with a domain of {DOMAINS}, got {part!r}")
        out.append((d, float(w)))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.minutes is not None:
        return run_long(args)
    pair_dir, tok = built_pair(args.preset, args.pair_dir)
    work = args.json.parent / "soak_work"
    base = pair_overrides(pair_dir, args.preset, args.kind, None)
    t0 = time.perf_counter()
    arms = {}
    for arm in [a for a in args.arms.split(",") if a]:
        print(f"[soak {args.kind}] {arm}: {args.feedback_tokens} feedback tokens ...", flush=True)
        arms[arm] = run_arm(arm, args, work, base, tok)
    summary, goals = soak_goals(arms) if set(ARMS) <= set(arms) else ({}, [])
    png = args.json.with_suffix(".png")
    plot(png, {a: arms.get(a, {"waves": []}) for a in ARMS},
         f"dvi soak ({args.preset}, {args.kind}): mix {dict(args.mix)}, greedy, {args.concurrency} clients, "
         f"1 step / {args.feedback_tokens_per_step} feedback tokens", args.smooth)
    out = {"benchmark": "soak", "settings": {**vars(args), "pair_dir": str(pair_dir)}, "arms": arms,
           "summary": summary, "goals": goals, "png": str(png), "wall_s": time.perf_counter() - t0}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(clean_json(out), indent=1, default=str))
    for g in goals:
        print(f"{'met ' if g['met'] else 'MISS'} {g['name']}: {g['value']} (target {g['target']})")
    print(f"wrote {args.json} and {png} ({out['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
