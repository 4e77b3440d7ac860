"""Publish-to-verdict latency on an idle server (issue 36 §8): how long a published drafter version waits for the
server's first verdict on it, promoted or refused.

Each run starts a fresh `dvi serve` (trainer off, the config's registry poll and watch idle times), sends
`--requests` completions, then leaves the server idle and publishes `--versions` LoRA versions one after the
other (identity ones, which pass, and every third a much worse one, which is refused), each after a random pause
of up to `--max-pause` seconds after the previous verdict (so publishes fall anywhere in the poll cycle). A
version published while the previous one's rollback watch runs is the case that waited forever before: the watch
needs `serve.rollback_window` requests an idle server never gets. The latency is the swap event's
`publish_to_verdict_s` (manifest `created_at` to the event), the figure `dvi_drafter_publish_to_verdict_seconds`
shows on /metrics.

Goal: p99 <= 5 s, and every version gets a verdict within `--timeout` seconds.

    python benchmarks/verdict_latency.py [--preset tiny] [--runs 8] [--json bench_results/verdict_latency.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal, print_goals

PROMPTS = ["def main(argv):\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self", "for i in range("]


def _events(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "swap_events.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def _verdict(run_dir: Path, version: int, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = [e for e in _events(run_dir) if e["version"] == version and e["kind"] in ("promoted", "refused")]
        if hit:
            return hit[0]
        time.sleep(0.05)
    return None


def _lora(drafter: Any, scale: float, seed: int) -> Any:
    """A LoRA on a copy of the drafter: scale 0 drafts exactly as it (B = 0), 2.0 much worse."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(drafter), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if scale and "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return pm


def one_run(args: argparse.Namespace, pair_dir: Path, run_dir: Path, rng: random.Random) -> list[dict]:
    """One server: traffic, then `args.versions` publishes on the idle server; one row per version."""
    import httpx
    import yaml

    from dvi.config import dump_config, load_config
    from dvi.models.loading import load_causal_lm
    from dvi.registry.codec import LORA
    from dvi.registry.store import DrafterRegistry
    from serving.server_process import ServerProcess

    cfg = load_config(args.config, [
        f"models.target={pair_dir / 'target'}", f"models.drafter={pair_dir / 'drafter'}",
        f"models.tokenizer={pair_dir / 'tokenizer'}", f"run_dir={run_dir}", f"feedback.dir={run_dir / 'feedback'}",
        f"registry.dir={run_dir / 'registry'}", "serve.trainer=off", "wandb.mode=disabled",
        "trainer.heldout_fraction=0.5", "trainer.shadow_min_positions=16", *args.overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    base = load_causal_lm(pair_dir / "drafter", "cpu", "float32")
    rows = []
    with ServerProcess(["--config", str(path)], run_dir / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        for i in range(args.requests):
            c.post("/v1/completions", json={"prompt": PROMPTS[i % 4] + " " * (i % 7), "max_tokens": 16})
        reg = DrafterRegistry(cfg.registry.dir)
        for k in range(args.versions):
            time.sleep(rng.uniform(0, args.max_pause))
            bad = k % 3 == 2
            v = reg.publish_drafter(LORA, _lora(base, 2.0 if bad else 0.0, k),
                                         {"target_version": 0, "steps": 1, "records_seen": 0, "heldout_alpha": None})
            ev = _verdict(run_dir, v, args.timeout)
            seconds = None if ev is None else ev.get("publish_to_verdict_s")
            if ev is not None and seconds is None:  # a server from before the field: from the manifest's time
                seconds = ev["at"] - reg.manifest(v).created_at
            rows.append({"version": v, "published_bad": bad, "verdict": ev["kind"] if ev else None,
                         "seconds": seconds})
            print(f"  v{v}: {rows[-1]['verdict']} after {rows[-1]['seconds']} s", flush=True)
    return rows


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(rows: list[dict], timeout: float) -> dict[str, Any]:
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    missing = sum(r["verdict"] is None for r in rows)
    dist = {f"p{int(q * 100)}": _quantile(secs, q) for q in (0.5, 0.9, 0.99)}
    dist.update(min=min(secs, default=None), max=max(secs, default=None), n=len(rows), without_verdict=missing)
    wrong = sum(r["verdict"] is not None and (r["verdict"] == "refused") != r["published_bad"] for r in rows)
    goals = [goal("publish-to-verdict p99 (s)", dist["p99"] if not missing else None, 5.0, higher_is_better=False),
             goal(f"versions without a verdict within {timeout:g} s", float(missing), 0.0, higher_is_better=False),
             goal("verdicts other than expected (good promoted, bad refused)", float(wrong), 0.0,
                  higher_is_better=False)]
    return {"distribution": dist, "goals": goals}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pair-dir", type=Path, default=None)
    ap.add_argument("--config", default=None)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-pause", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    args = ap.parse_args(argv)
    pair_dir, _ = built_pair(args.preset, args.pair_dir)
    rng = random.Random(args.seed)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="dvi-verdict-"))
    try:
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}", flush=True)
            rows += [{**r, "run": run} for r in one_run(args, pair_dir, work / f"run{run}", rng)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out = {"rows": rows, **summarize(rows, args.timeout), "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(out["distribution"]))
    print_goals(out["goals"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(clean_json(out), indent=1))
    return 0 if all(g["met"] for g in out["goals"]) else 1


if __name__ == "__main__":
    sys.exit(main())
