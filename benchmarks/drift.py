"""Drift benchmark on the real `dvi serve` path: α over code -> sql (or chat) -> code traffic, per drafter kind.

For each drafter kind (`separate`, `eagle`) and arm, a real `dvi serve` process (scheduler, swapper
with its shadow check and rollback, supervisor; `serving.server_process.ServerProcess`) gets the same greedy
traffic over loopback HTTP, C clients at a time: held-out code prompts (`/v1/completions`, token
ids), then held-out requests of the drift domain (`/v1/chat/completions`; `--drift sql`, the default:
`dvi.data.sql_instructions`, SQLite queries, a domain the build never trained on; `--drift chat`:
`dvi.data.chat_instructions`, 30% of the build's text), then other held-out code prompts. α per request is read from each response's `dvi` block.

* ``online``: the server's supervised trainer trains the drafter from the feedback log under a
  machine-independent budget: at most one step per `trainer.feedback_tokens_per_step` feedback
  tokens (enforced by the trainer, reported in its status: steps, feedback tokens read); idle
  replay fills the budget, never more. Between phases the client waits until the trainer has read
  every record and the swapper has decided on LATEST, so phase boundaries do not depend on the
  machine's speed. Afterwards the throughput probe: the same code prompts in ABBA blocks with the
  trainer paused / running (`/admin/trainer/pause`, `/admin/trainer/resume`).
* ``frozen``: `serve.trainer=off`; the bootstrap drafter serves all three phases.
* ``ceiling``: the bootstrap drafter distilled offline on the drift domain's *training* text (the target's
  greedy replies to its training-split requests, `trainers.builds.pretrained_build.greedy_replies`) for 5x the
  online arm's trained tokens up to the end of its drift phase (`trainers.builds.subset_distill` for
  separate, `trainers.builds.eagle_build.distill_eagle` for eagle), then *served* by `dvi serve` (trainer
  off) on the same drift requests.

Goals per kind (issue 25 §1): the ceiling's drift α at least 0.08 above the frozen arm's (something to
recover); the online arm's rolling α closes 70% of that gap within 20,000 feedback tokens of the new
domain (the tokens it needed are reported, with trainer steps and seconds); online code α on return
within 0.02 of before the switch; the frozen arm's drift α does not rise (second half minus first <=
0.02: no gain from prompt choice); tokens/s with the trainer running >= 0.9x paused. Every arm's greedy
text must be identical (lossless). `--rescore JSON` recomputes the goals of a saved run.

    python benchmarks/drift.py --preset smollm2 [--kinds separate,eagle] [--json bench_results/drift.json]

Writes JSON (settings, per-request rows of every arm, swap events, trainer status, `goals`) and a
PNG beside it, prints a table ending with the goals, exits 0 whether or not they are met.
The server and its requests are in `benchmarks/_drift_server.py`, the ceiling's drafter in
`benchmarks/_drift_ceiling.py`, α, the goals, the figure and the table in `benchmarks/_drift_score.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal_line
from benchmarks._drift_ceiling import build_ceiling, drift_training_set
from benchmarks._drift_score import PHASES, alpha, kind_goals, plot, table
from benchmarks._drift_server import Server, pair_overrides, run_requests

DRIFTS = ("sql", "chat")  # sql: never in the build's text; chat: 30% of it
KINDS = ("separate", "eagle")


# -- traffic ----------------------------------------------------------------------------------------
def traffic(tok: Any, args: argparse.Namespace) -> dict[str, list]:
    """Per phase: code prompts (token ids) or the drift domain's chat messages (rendered <= --drift-prompt-tokens)."""
    from dvi.data import chat_instructions, prompt_stream, render_chat, sql_instructions

    def code(seed: int) -> list[list[int]]:
        s = prompt_stream("code", tok, split="heldout", prompt_tokens=(32, 96), seed=seed)
        return list(itertools.islice(s, args.code_requests))

    source = sql_instructions if args.drift == "sql" else chat_instructions
    chats = (m for m in source("heldout", seed=args.seed) if len(render_chat(tok, m)) <= args.drift_prompt_tokens)
    return {"code": code(args.seed), "drift": list(itertools.islice(chats, args.drift_requests)),
            "code_return": code(args.seed + 1), "probe": code(args.seed + 2)[: args.probe_prompts]}


# -- the arms ---------------------------------------------------------------------------------------
def run_arm(name: str, args: argparse.Namespace, work: Path, overrides: list[str], phases: dict[str, list],
            probe: list | None = None) -> dict:
    """Serve `phases` in order on a fresh server; the online arm settles between phases and ends with the probe."""
    online = name == "online"
    with Server(args, work / name, [f"serve.trainer={'supervised' if online else 'off'}", *overrides]) as srv:
        out: dict[str, Any] = {"rows": [], "phases": {}, "settle_s": {}}
        if online:
            out["trainer_start"] = srv.wait_trainer(("idle", "running"), 600)
        for phase, items in phases.items():
            rows, wall, step = [], 0.0, args.wave if online else len(items)
            for i in range(0, len(items), step):  # online: waves, each followed by the trainer's budget
                r, w = run_requests(srv.url, items[i: i + step], args, srv.snapshot if online else None, first=i)
                rows, wall = rows + r, wall + w
                if online:
                    out["settle_s"][f"{phase}@{i}"] = srv.settle(args.settle_s)
            out["rows"] += [{**r, "phase": phase} for r in rows]
            out["phases"][phase] = {"wall_s": wall, "end": srv.snapshot()}
            print(f"  {name}: {phase} α {alpha(rows):.3f} ({len(rows)} requests, {wall:.0f}s serving)", flush=True)
        if probe is not None:
            out["probe"] = throughput_probe(srv, probe, args)
        out["status"] = srv.admin("GET", "/admin/status")
        out["trainer_final"] = srv.trainer()
    return out


def throughput_probe(srv: Server, prompts: list, args: argparse.Namespace) -> dict:
    """Paused / running blocks of the same prompts in ABBA order; ratio = median over adjacent pairs."""
    blocks = []
    for p in range(args.probe_pairs):
        for mode in (("paused", "running") if p % 2 == 0 else ("running", "paused")):
            srv.admin("POST", "/admin/trainer/pause" if mode == "paused" else "/admin/trainer/resume")
            srv.wait_trainer(("paused",) if mode == "paused" else ("idle", "running"), 120)
            s0, c0 = srv.snapshot(), srv.admin("GET", "/health")["drafter"]["counts"]
            rows, wall = run_requests(srv.url, prompts, args)
            s1, c1 = srv.snapshot(), srv.admin("GET", "/health")["drafter"]["counts"]
            toks = sum(r.get("tokens", 0) for r in rows)
            blocks.append({"mode": mode, "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall,
                           "alpha": alpha(rows), "trainer_steps": (s1["trainer_step"] or 0) - (s0["trainer_step"] or 0),
                           "swap_decisions": sum(c1.values()) - sum(c0.values())})
    srv.admin("POST", "/admin/trainer/resume")
    ratios = []
    for a, b in zip(blocks[::2], blocks[1::2], strict=True):
        run, paused = (a, b) if a["mode"] == "running" else (b, a)
        ratios.append(run["tokens_per_s"] / paused["tokens_per_s"])

    def tps(mode: str) -> float:
        xs = [b for b in blocks if b["mode"] == mode]
        return sum(x["tokens"] for x in xs) / sum(x["seconds"] for x in xs)

    return {"blocks": blocks, "pair_ratios": ratios, "ratio": statistics.median(ratios),
            "tokens_per_s_paused": tps("paused"), "tokens_per_s_running": tps("running")}


# -- main ----------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=("tiny", "smollm2"), default="smollm2")
    ap.add_argument("--pair-dir", type=Path, default=None, help="a built pair (default: the preset's cache dir)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "drift.yaml"))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--code-requests", type=int, default=12, help="per code phase")
    ap.add_argument("--drift", choices=DRIFTS, default="sql", help="the domain traffic drifts to")
    ap.add_argument("--drift-requests", type=int, default=72)
    ap.add_argument("--drift-prompt-tokens", type=int, default=320)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--feedback-tokens-per-step", type=int, default=64, help="the online trainer's budget")
    ap.add_argument("--window", type=int, default=12, help="requests in the rolling α window")
    ap.add_argument("--wave", type=int, default=8, help="online arm: requests between waits for the trainer")
    ap.add_argument("--settle-s", type=float, default=180.0, help="max wait for the trainer after a wave")
    ap.add_argument("--probe-prompts", type=int, default=8)
    ap.add_argument("--probe-pairs", type=int, default=2)
    ap.add_argument("--ceiling-prompts", type=int, default=96, help="training-split drift requests whose replies the ceiling distils on")
    ap.add_argument("--ceiling-reply-tokens", type=int, default=128)
    ap.add_argument("--ceiling-seq-len", type=int, default=128)
    ap.add_argument("--ceiling-batch", type=int, default=8)
    ap.add_argument("--ceiling-lr", type=float, default=5e-4)
    ap.add_argument("--ceiling-multiple", type=float, default=5.0, help="x the online arm's trained tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("bench_results/drift.json"))
    ap.add_argument("--rescore", type=Path, default=None, help="recompute the goals of this saved run and exit")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for every server")
    return ap.parse_args(argv)


def save_partial(args: argparse.Namespace, kind: str, arms: dict) -> None:
    """The arms finished so far, beside the final JSON (an hour-long run that dies late keeps them)."""
    path = args.json.with_suffix(f".{kind}.partial.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json({"kind": kind, "arms": arms}), default=str))


def run_kind(kind: str, pair_dir: Path, args: argparse.Namespace, items: dict[str, list], work: Path,
             chat_set: dict) -> dict:
    base = pair_overrides(pair_dir, args.preset, kind, None)
    phases = {p: items[p] for p in PHASES}
    t0 = time.perf_counter()
    arms = {"online": run_arm("online", args, work, base, phases, probe=items["probe"])}
    save_partial(args, kind, arms)
    arms["frozen"] = run_arm("frozen", args, work, base, phases)
    save_partial(args, kind, arms)
    if "windows" not in chat_set:
        chat_set.update(drift_training_set(pair_dir, args))
    chat_end = arms["online"]["phases"]["drift"]["end"]
    tokens = int(args.ceiling_multiple * (chat_end.get("tokens_trained") or 0))
    ceiling_dir = work / "ceiling_drafter"
    tc = time.perf_counter()
    stats = build_ceiling(kind, pair_dir, chat_set, tokens, ceiling_dir, args)
    stats["build_s"] = time.perf_counter() - tc
    print(f"  ceiling: {stats['tokens']} token-passes ({stats['steps']} steps, {stats['build_s']:.0f}s), "
          f"loss {stats['first_loss']:.3f} -> {stats['final_loss']:.3f}", flush=True)
    arms["ceiling"] = run_arm("ceiling", args, work, pair_overrides(pair_dir, args.preset, kind, ceiling_dir),
                              {"drift": items["drift"]})
    arms["ceiling"]["training"] = stats
    summary, goals = kind_goals(kind, arms, args.window)
    return {"arms": arms, "summary": summary, "goals": goals, "wall_s": time.perf_counter() - t0}


def rescore(path: Path, w: int) -> int:
    """Recompute a saved run's goals (after a change of the goals, or of the window) and print them."""
    out = json.loads(path.read_text())
    out["goals"] = []
    for kind, res in out["kinds"].items():
        res["summary"], res["goals"] = kind_goals(kind, res["arms"], w)
        out["goals"] += res["goals"]
    path.write_text(json.dumps(clean_json(out), indent=1, default=str))
    for g in out["goals"]:
        print(goal_line(g))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rescore is not None:
        return rescore(args.rescore, args.window)
    pair_dir, tok = built_pair(args.preset, args.pair_dir)
    items = traffic(tok, args)
    work = args.json.parent / "drift_work"
    shutil.rmtree(work, ignore_errors=True)
    results, goals, chat_set = {}, [], {}
    t0 = time.perf_counter()
    for kind in [k for k in args.kinds.split(",") if k]:
        print(f"[{kind}] online, frozen, ceiling ...", flush=True)
        results[kind] = run_kind(kind, pair_dir, args, items, work / kind, chat_set)
        goals += results[kind]["goals"]
    png = args.json.with_suffix(".png")
    plot(png, results, args.window, f"dvi drift ({args.preset}): code -> {args.drift} -> code over `dvi serve`, greedy, "
         f"{args.concurrency} clients, budget 1 step / {args.feedback_tokens_per_step} feedback tokens")
    out = {"benchmark": "drift", "settings": {**vars(args), "pair_dir": str(pair_dir),
                                              "drift_training": {k: v for k, v in chat_set.items()
                                                                if k not in ("windows", "states")}},
           "kinds": results, "goals": goals, "wall_s": time.perf_counter() - t0, "png": str(png)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(clean_json(out), indent=1, default=str))
    print(table(results, goals))
    for kind, res in results.items():
        s = res["summary"]
        print(f"{kind}: ceiling α {s['ceiling_alpha']:.3f}; drift budget {s['drift_phase_budget']}; throughput "
              f"{s['throughput_ratio']:.3f}x; greedy text differs from the frozen arm's in {s['greedy_text_mismatches']} "
              f"requests (bf16 batch numerics, see text_mismatches)")
    print(f"wrote {args.json} and {png} ({out['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
