"""dvi in front of vLLM (issue 41): what dvi costs over vLLM alone, and what promotions under load cost.

One `dvi serve` with `serve.engine: vllm` (trainer off) and the vLLM it starts; every arm hits that same vLLM, arms
interleaved round by round so a busy spell on the machine hits each alike:

- `vllm`: vLLM's own /v1/completions, the prompt as text, as a client of vLLM alone sends it;
- `vllm+feedback`: the same plus what dvi asks of vLLM (streamed, token ids, the top-`feedback.top_k` log-probs,
  per-step counts): the part of dvi's cost that is vLLM computing the feedback;
- `dvi`: dvi's /v1/completions (dvi tokenizes, streams from vLLM, detokenizes, logs the feedback record).

tokens/s = completion tokens over the wall time of the arm's batch at concurrency C (greedy: every arm generates
the same text). Then swaps under load: C=8, --swap-requests requests with a promotion (an admin pin, alternating
two published versions whose LoRA is tiny, so the drafts stay the same and only the swap costs) every
--swap-every seconds, against the same load without swaps: failed requests, p50 / p99 latency, seconds per swap.

    .venv/bin/python benchmarks/vllm_front.py [--rounds 2] [--swap-requests 200] [--json ...]

Prints a table ending with the goals, writes JSON with a `goals` list.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals
from benchmarks._prompts import pip_code_prompts
from benchmarks.serve_speed import CHAT

ADMIN = "bench-admin"


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dvi bench vllm_front", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--concurrency", default="4,16")
    p.add_argument("--requests", type=int, default=16, help="per arm, round and concurrency")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--swap-requests", type=int, default=200)
    p.add_argument("--swap-every", type=float, default=20.0)
    p.add_argument("--only", choices=["all", "throughput", "swaps"], default="all")
    p.add_argument("--set", nargs="*", default=[], help="more dvi config overrides")
    p.add_argument("--json", default="bench_results/vllm_front.json")
    return p.parse_args(argv)


async def _batch(url: str, bodies: list[dict], c: int) -> list[dict]:
    """`bodies` at concurrency `c`: per request (status, completion tokens, latency s)."""
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        async def one(body: dict) -> dict:
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await client.post("/v1/completions", json=body)
                    ok = r.status_code == 200
                    toks = r.json()["usage"]["completion_tokens"] if ok else 0
                except httpx.HTTPError:
                    ok, toks = False, 0
                return {"ok": ok, "tokens": toks, "latency_s": time.perf_counter() - t0}
        return list(await asyncio.gather(*(one(b) for b in bodies)))


def run_batch(url: str, bodies: list[dict], c: int) -> dict:
    t0 = time.perf_counter()
    rs = asyncio.run(_batch(url, bodies, c))
    wall = time.perf_counter() - t0
    lat = sorted(r["latency_s"] for r in rs)
    return {"requests": len(rs), "failed": sum(not r["ok"] for r in rs), "tokens": sum(r["tokens"] for r in rs),
            "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in rs) / wall,
            "p50_s": lat[len(lat) // 2], "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}


def arm_bodies(arm: str, prompts: list[str], n: int, top_k: int, name: str) -> list[dict]:
    base = {"max_tokens": n, "temperature": 0}
    if arm == "dvi":
        return [{**base, "prompt": p} for p in prompts]
    extra = ({"return_token_ids": True, "return_tokens_as_token_ids": True, "logprobs": top_k}
             if arm == "vllm+feedback" else {})
    return [{**base, "model": name, "prompt": p, **extra} for p in prompts]


def publish_near_identity_versions(registry_dir: Path, preset: str) -> list[int]:
    """Two versions whose LoRA is tiny (1e-4 noise in A and B): the drafts stay as they were, the weights differ, so
    every swap loads the changed layer into vLLM."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from dvi.models.loading import load_embedded_pair
    from dvi.registry.codec import LORA
    from dvi.registry.store import DrafterRegistry

    pair = load_embedded_pair(preset, device="cpu", dtype="float32")
    reg = DrafterRegistry(registry_dir)
    out = []
    for _ in range(2):
        pm = get_peft_model(copy.deepcopy(pair.drafter), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape) * 1e-2)  # B·A ~ 1e-4 x 2: far below the weights' own scale
        out.append(reg.publish_drafter(LORA, pm, {"target_version": 0, "steps": 1, "records_seen": 0,
                                                 "heldout_alpha": None}, set_latest=False))
    return out


class Promoter(threading.Thread):
    """Pins the versions in turn every `every` seconds until stopped; records each pin's time and result."""

    def __init__(self, url: str, versions: list[int], every: float) -> None:
        super().__init__(daemon=True)
        self.url, self.versions, self.every = url, versions, every
        self.stop = threading.Event()
        self.pins: list[dict] = []

    def run(self) -> None:
        i = 0
        while not self.stop.wait(self.every):
            v = self.versions[i % len(self.versions)]
            t0 = time.perf_counter()
            r = httpx.post(self.url + "/admin/drafter/pin", json={"version": v},
                           headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300)
            self.pins.append({"version": v, "status": r.status_code, "seconds": time.perf_counter() - t0})
            i += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    from dvi.models.loading import load_embedded_pair
    from serving.server_process import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="dvi-vllm-front-"))
    tok = load_embedded_pair(args.preset, device="cpu", dtype="float32").tokenizer
    code = [tok.decode(ids) for ids in pip_code_prompts(tok, 16, 0)]
    prompts = [p for pair in zip(code, CHAT, strict=False) for p in pair]
    versions = publish_near_identity_versions(work / "registry", args.preset)
    cfg = [f"models.preset={args.preset}", "serve.engine=vllm", "serve.trainer=off", "wandb.mode=disabled",
           f"run_dir={work}", f"feedback.dir={work / 'feedback'}", f"registry.dir={work / 'registry'}",
           f"serve.admin_token={ADMIN}", "serve.max_batch_size=16", *args.set]
    t_start = time.time()
    with ServerProcess(cfg, work / "server.log", cwd=ROOT) as server:
        health = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        vllm_url, top_k = health["engine"]["url"], int(health["engine"].get("feedback_top_k", 32))
        urls = {"vllm": vllm_url, "vllm+feedback": vllm_url, "dvi": server.url}
        arms = list(urls)
        results: dict[str, dict[str, list[dict]]] = {}
        for c in [int(x) for x in args.concurrency.split(",")] if args.only != "swaps" else []:
            n = max(args.requests, c)
            for rnd in range(args.rounds):
                for arm in arms[rnd % len(arms):] + arms[:rnd % len(arms)]:  # a rotating order
                    batch = [prompts[(rnd * n + i) % len(prompts)] for i in range(n)]
                    r = run_batch(urls[arm], arm_bodies(arm, batch, args.max_tokens, top_k, "dvi"), c)
                    results.setdefault(f"C={c}", {}).setdefault(arm, []).append(r)
                    print(f"C={c} round {rnd} {arm:14s} {r['tokens_per_s']:7.1f} tok/s  failed {r['failed']}", flush=True)
        swaps = {}
        bodies = [{"prompt": prompts[i % len(prompts)], "max_tokens": args.max_tokens, "temperature": 0}
                  for i in range(args.swap_requests)]
        for arm in ("steady", "swaps") if args.only != "throughput" else ():
            promoter = Promoter(server.url, versions, args.swap_every) if arm == "swaps" else None
            if promoter is not None:
                promoter.start()
            swaps[arm] = run_batch(server.url, bodies, 8)
            if promoter is not None:
                promoter.stop.set()
                promoter.join()
                swaps[arm]["pins"] = promoter.pins
            print(f"swaps arm {arm}: {swaps[arm]['tokens_per_s']:.1f} tok/s p99 {swaps[arm]['p99_s']:.2f}s "
                  f"failed {swaps[arm]['failed']}", flush=True)
        health = httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return report(args, results, swaps, health, time.time() - t_start)


def _mean(rs: list[dict], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def report(args, results: dict, swaps: dict, health: dict, wall: float) -> int:
    from trainers.builds.shipped_drafter import cpu_model

    print(f"\n{'C':>5} {'arm':14s} {'tok/s':>8} {'vs vllm':>8} {'p99 s':>7} {'failed':>6}")
    goals = []
    for c, arms in results.items():
        base = _mean(arms["vllm"], "tokens_per_s")
        for arm, rs in arms.items():
            print(f"{c:>5} {arm:14s} {_mean(rs, 'tokens_per_s'):8.1f} {_mean(rs, 'tokens_per_s') / base:8.3f} "
                  f"{max(r['p99_s'] for r in rs):7.2f} {sum(r['failed'] for r in rs):6d}")
        goals.append(goal(f"dvi in front vs vLLM alone, tokens/s at {c}", _mean(arms["dvi"], "tokens_per_s") / base,
                          0.95))
    engine = health.get("engine", {})
    if swaps:
        pins = swaps["swaps"].get("pins", [])
        goals += [
            goal("failed requests during swaps (C=8)", float(swaps["swaps"]["failed"]), 0.0, higher_is_better=False),
            goal("p99 latency during swaps / without", swaps["swaps"]["p99_s"] / swaps["steady"]["p99_s"], 1.5,
                 higher_is_better=False),
            goal("seconds per swap (pin answered)", max((p["seconds"] for p in pins), default=None), 1.0,
                 higher_is_better=False),
        ]
        inside = engine.get("swap_s") or []
        goals.append(goal("seconds per swap inside the engine (write + vLLM load)", max(inside, default=None), 1.0,
                          higher_is_better=False))
        print(f"swaps: {len(pins)} pins ({sorted({p['status'] for p in pins})}), answered in "
              f"{[round(p['seconds'], 2) for p in pins]} s; inside the engine {inside} s")
    print_goals(goals)
    out = clean_json({"benchmark": "vllm_front", "cpu": cpu_model(), "python": platform.python_version(),
                      "settings": vars(args), "results": results, "swaps": swaps, "engine": engine,
                      "goals": goals, "wall_s": wall})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
