"""Does a drafter adapter per tenant beat one shared drafter, and can a tenant's garbage hurt the others (issue 40)?

Three tenants send traffic concurrently through `dvi serve` with its supervised trainer: code (completions of
held-out stdlib cuts), sql (chat requests for SQLite queries) and chat (held-out chat instructions), each its own
`metadata.domain`, each until it has sent `--tokens` completion tokens. Arms, one server each, in turn,
all training with the demo's lane settings (`demo.scenario.LANE_WARMUP`: idle replay, a quarter held out):

- shared: `trainer.adapter_key: none` (one drafter learns from all three; its gate judges every group);
- adapters: `trainer.adapter_key: domain` (one adapter per tenant);
- adapters + garbage (`--garbage`): the same with a fourth tenant sending random token ids as `--garbage-share` of
  all requests.

Then, per tenant, the responses of every arm's last third, pooled (the same tokens for every arm), are replayed
(teacher-forced, `dvi.feedback.shadow.record_scores`) through what serves that tenant at the end of each arm (its
adapter's live version, or the shared drafter's) and through the frozen v0 drafter: α̂ per tenant and arm.

    PYTHONPATH=. .venv/bin/python benchmarks/groups.py [--tokens 20000] [--garbage] [--json bench_results/groups.json]
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

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402

TENANTS = ("code", "sql", "chat")


def tenant_requests(name: str, tok, seed: int):
    """Endless (endpoint, body) of one tenant."""
    from dvi import data

    if name == "code":
        stream = ({"prompt": p} for p in data.prompt_stream("code", tok, seed=seed))
    elif name == "sql":
        stream = ({"messages": m} for m in data.sql_instructions("heldout", seed=seed))
    elif name == "chat":
        stream = ({"messages": m} for m in data.chat_instructions("heldout", seed=seed))
    else:  # garbage: random token ids
        rng = random.Random(seed)
        stream = ({"prompt": [rng.randrange(200, 40000) for _ in range(rng.randint(16, 64))]} for _ in itertools.count())
    for body in stream:
        yield ("/v1/chat/completions" if "messages" in body else "/v1/completions"), body


async def traffic(url: str, tok, tokens: int, max_tokens: int, garbage_share: float, seed: int) -> dict:
    """The tenants' requests, 4 in flight, until every real tenant has `tokens` completion tokens; request ids per
    tenant."""
    import httpx

    names = list(TENANTS) + (["garbage"] if garbage_share > 0 else [])
    streams = {n: tenant_requests(n, tok, seed + i) for i, n in enumerate(names)}
    got = dict.fromkeys(names, 0)
    ids: dict[str, list[str]] = {n: [] for n in names}
    errors = [0]
    rng = random.Random(seed)

    def pick() -> str | None:
        if all(got[n] >= tokens for n in TENANTS):
            return None
        if garbage_share > 0 and rng.random() < garbage_share:
            return "garbage"
        return min(TENANTS, key=lambda n: got[n])

    async def worker(client: httpx.AsyncClient) -> None:
        while (name := pick()) is not None:
            endpoint, body = next(streams[name])
            r = await client.post(endpoint, json={**body, "max_tokens": max_tokens, "temperature": 0.0,
                                                  "metadata": {"domain": name}})
            if r.status_code != 200:
                errors[0] += 1
                continue
            out = r.json()
            got[name] += out["usage"]["completion_tokens"]
            ids[name].append(out["dvi"]["request_id"])
            done = sum(min(got[n], tokens) for n in TENANTS)
            print(f"\r  {done}/{tokens * len(TENANTS)} tokens " + " ".join(f"{n} {got[n]}" for n in names),
                  end="", flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(4)))
    print()
    return {"ids": ids, "tokens": got, "errors": errors[0]}


def run_arm(cfg, name: str, key: str, run_dir: Path, a) -> dict:
    import httpx
    import yaml

    from demo.scenario import LANE_WARMUP
    from dvi.config import dump_config
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_tokenizer
    from serving.server_process import ServerProcess

    data = dump_config(cfg)
    data.update(run_dir=str(run_dir))
    data["feedback"]["dir"], data["registry"]["dir"] = str(run_dir / "feedback"), str(run_dir / "registry")
    data["trainer"].update(adapter_key=key, publish_every_steps=5, **LANE_WARMUP)  # the demo's, in both arms
    data["serve"].update(trainer="supervised", admin_token="groups-bench", domains=[*TENANTS, "garbage"])
    data["wandb"]["mode"] = "disabled"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    tok = load_tokenizer(embedded_paths(cfg.models.preset).tokenizer)
    t0 = time.perf_counter()
    print(f"arm {name} (trainer.adapter_key {key}) ...")
    with ServerProcess(["--config", str(path)], run_dir / "server.log") as srv:
        out = asyncio.run(traffic(srv.url, tok, a.tokens, a.max_tokens, a.garbage_share if "garbage" in name else 0,
                                  a.seed))
        out["health"] = httpx.get(srv.url + "/health", headers={"Authorization": "Bearer groups-bench"},
                                  timeout=30).json()
    out["wall_s"] = time.perf_counter() - t0
    return out


def eval_records(runs: dict[str, tuple[Path, dict]]) -> dict[str, list]:
    """Per tenant, the records every arm is judged on: each arm's responses of the run's last third, pooled (the
    same tokens for every arm's drafter)."""
    from demo.replay import read_records

    out: dict[str, list] = {t: [] for t in TENANTS}
    for run_dir, arm in runs.values():
        records = read_records(run_dir / "feedback")
        for t in TENANTS:
            ids = arm["ids"][t][len(arm["ids"][t]) * 2 // 3:]
            out[t] += [records[i] for i in ids if i in records and len(records[i].token_ids)]
    return out


def replay(cfg, run_dir: Path, arm: dict, key: str, recs: dict[str, list]) -> dict[str, dict]:
    """Per tenant: α̂ of what serves it at the end of this arm, and of v0, on the pooled records `recs`."""
    from demo.replay import _pooled, drafter_scorers

    scorer = drafter_scorers(cfg, run_dir / "registry")
    health = arm["health"]
    groups = (health.get("adapters") or {}).get("groups") or {}
    res = {}
    for t in TENANTS:
        served = (0, t, groups[t]["live_version"]) if key != "none" and t in groups else (health["drafter_version"], "", 0)
        fn_served, fn_frozen = scorer(served), scorer(0)
        a_served = _pooled(fn_served(recs[t]).values())[0] if fn_served else None
        a_frozen = _pooled(fn_frozen(recs[t]).values())[0] if fn_frozen else None
        res[t] = {"served": list(served), "records": len(recs[t]), "alpha": a_served, "alpha_frozen": a_frozen}
    return res


def main(argv=None) -> int:
    from dvi.config import load_config

    ap = argparse.ArgumentParser(prog="groups", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--tokens", type=int, default=20000, help="completion tokens per tenant")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--garbage", action="store_true", help="also the adapters arm with a garbage tenant")
    ap.add_argument("--garbage-share", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("groups-%Y%m%d-%H%M%S"))
    ap.add_argument("--replay-only", action="store_true", help="replay the arms already run under --out")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    cfg = load_config(None, [f"models.preset={a.preset}"])
    arms = [("shared", "none"), ("adapters", "domain")] + ([("adapters + garbage", "domain")] if a.garbage else [])
    runs = {}
    for name, key in arms:
        run_dir = a.out.resolve() / name.replace(" + ", "_")
        if not a.replay_only:
            (run_dir / "arm.json").parent.mkdir(parents=True, exist_ok=True)
            (run_dir / "arm.json").write_text(json.dumps(run_arm(cfg, name, key, run_dir, a)))
        runs[name] = (run_dir, json.loads((run_dir / "arm.json").read_text()))
    recs = eval_records(runs)
    results = {name: {"replay": replay(cfg, run_dir, arm, key, recs), "tokens": arm["tokens"],
                      "errors": arm["errors"], "wall_s": arm["wall_s"]}
               for (name, key), (run_dir, arm) in zip(arms, runs.values(), strict=True)}
    print(f"\n{'tenant':<8}" + "".join(f"{n + ' α̂':>24}" for n in results) + f"{'frozen v0 α̂':>14}")
    for t in TENANTS:
        row = [results[n]["replay"][t]["alpha"] for n in results]
        frozen = results["shared"]["replay"][t]["alpha_frozen"]
        print(f"{t:<8}" + "".join(f"{'-' if x is None else f'{x:.3f}':>24}" for x in row)
              + f"{'-' if frozen is None else f'{frozen:.3f}':>14}")
    goals = []
    for t in TENANTS:
        ad, sh = results["adapters"]["replay"][t]["alpha"], results["shared"]["replay"][t]["alpha"]
        goals.append(goal(f"{t}: α̂ with its adapter - α̂ shared drafter", None if ad is None or sh is None else ad - sh,
                          0.05))
        if a.garbage:
            g = results["adapters + garbage"]["replay"][t]["alpha"]
            goals.append(goal(f"{t}: |α̂ with a garbage tenant - without|",
                              None if g is None or ad is None else abs(g - ad), 0.01, False))
    goals.append(goal("errors", float(sum(r["errors"] for r in results.values())), 0, False))
    print_goals(goals)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json({"args": {k: str(v) for k, v in vars(a).items()}, "arms": results,
                                                 "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
