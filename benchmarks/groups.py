"""Does a drafter adapter per tenant beat one shared drafter, and can a tenant's garbage hurt the others (issue 40)?

Three tenants send traffic concurrently through `dvi serve` with its supervised trainer: code (completions of
held-out stdlib cuts), sql (chat requests for SQLite queries) and chat (held-out chat instructions), each its own
`metadata.domain`, each until it has sent `--tokens` completion tokens. Arms, one server each, in turn,
all training with the demo's lane settings (`demo.scenario.LANE_WARMUP`: idle replay, a quarter held out):

- shared: `trainer.adapter_key: none` (one drafter learns from all three; its gate judges every group);
- adapters: `trainer.adapter_key: domain` (one adapter per tenant);
- adapters + garbage (`--garbage`): the same with a fourth tenant sending random token ids as `--garbage-share` of
  all requests (each answered with at most `--garbage-max-tokens`);
- adapters again (`--control`): the run-to-run spread of α̂ with nothing changed, the yardstick for the garbage arm;
- frozen (`--frozen`): the trainer off, the v0 drafter at the same K policy: live tokens per step to compare with.

Then, per tenant, what serves that tenant at the end of each arm (its adapter's live version, or the shared
drafter's) and the frozen v0 drafter are scored (teacher-forced, `dvi.feedback.shadow.record_scores`) on:

- unseen prompts (the goal): `--eval-prompts` distinct prompts per tenant drawn from the tenant's own generator with
  another seed and never sent by any arm's traffic (the traffic skips them), answered once by a server with the
  trainer off (the "eval" step, run before the arms). The sql and chat generators repeat prompts (239 distinct of
  357 sql requests in a 20k run), so the arms' own responses would score what a drafter memorised;
- traffic: the responses of every arm's last third, pooled (the same tokens for every arm; repeats included).

Live tokens per step per tenant and arm: completion tokens over engine steps of the arm's last third (the responses'
`dvi` blocks).

The garbage arm runs several times longer than the others (nine requests in ten are garbage), and a lane that is
still learning gains from that time alone: more idle replay, and versions published late get their verdict. To
compare what the garbage does rather than what the time does, `--budget N` makes training a function of each
group's own feedback (`trainer.feedback_tokens_per_step`, per lane) and `--settle-s` waits, after the traffic, for
the trainer to stop and for every latest version's verdict before the arm's drafters are read.

    PYTHONPATH=. .venv/bin/python benchmarks/groups.py [--tokens 20000] [--garbage] [--control] [--frozen]
        [--budget 128 --settle-s 300] [--arms adapters,...] [--json bench_results/groups.json]
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


EVAL_SEED = 1000  # the unseen prompts' generator seed offset


def tenant_requests(name: str, tok, seed: int, skip: frozenset[str] = frozenset()):
    """Endless (endpoint, body) of one tenant, without the bodies whose `body_key` is in `skip`."""
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
        if body_key(body) not in skip:
            yield ("/v1/chat/completions" if "messages" in body else "/v1/completions"), body


def body_key(body: dict) -> str:
    return json.dumps(body, sort_keys=True)


def eval_prompts(tok, n: int, seed: int) -> dict[str, list[tuple[str, dict]]]:
    """Per tenant, `n` distinct (endpoint, body) from its generator at another seed: the unseen prompts."""
    out = {}
    for i, t in enumerate(TENANTS):
        got: dict[str, tuple[str, dict]] = {}
        for endpoint, body in tenant_requests(t, tok, seed + EVAL_SEED + i):
            got.setdefault(body_key(body), (endpoint, body))
            if len(got) == n:
                break
        out[t] = list(got.values())
    return out


async def traffic(url: str, tok, tokens: int, max_tokens: int, garbage: tuple[float, int], seed: int,
                  skip: frozenset[str]) -> dict:
    """The tenants' requests, 4 in flight, until every real tenant has `tokens` completion tokens; per tenant and
    request: its id, completion tokens and engine steps. `garbage`: (share of all requests, their max tokens);
    `skip`: the unseen prompts' keys, never sent."""
    import httpx

    garbage_share, garbage_tokens = garbage
    names = list(TENANTS) + (["garbage"] if garbage_share > 0 else [])
    streams = {n: tenant_requests(n, tok, seed + i, skip) for i, n in enumerate(names)}
    got = dict.fromkeys(names, 0)
    ids: dict[str, list[str]] = {n: [] for n in names}
    lens: dict[str, list[tuple[int, int]]] = {n: [] for n in names}  # (completion tokens, engine steps)
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
            cap = garbage_tokens if name == "garbage" else max_tokens
            r = await client.post(endpoint, json={**body, "max_tokens": cap, "temperature": 0.0,
                                                  "metadata": {"domain": name}})
            if r.status_code != 200:
                errors[0] += 1
                continue
            out = r.json()
            got[name] += out["usage"]["completion_tokens"]
            ids[name].append(out["dvi"]["request_id"])
            lens[name].append((out["usage"]["completion_tokens"], out["dvi"]["steps"]))
            done = sum(min(got[n], tokens) for n in TENANTS)
            print(f"\r  {done}/{tokens * len(TENANTS)} tokens " + " ".join(f"{n} {got[n]}" for n in names),
                  end="", flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(4)))
    print()
    return {"ids": ids, "lens": lens, "tokens": got, "errors": errors[0]}


async def answer_once(url: str, prompts: dict[str, list[tuple[str, dict]]], max_tokens: int) -> dict:
    """Each unseen prompt sent once, 4 in flight: {"ids": {tenant: request ids}, "errors": n}."""
    import httpx

    todo = [(t, e, b) for t, items in prompts.items() for e, b in items]
    ids: dict[str, list[str]] = {t: [] for t in prompts}
    errors = [0]

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            t, endpoint, body = todo.pop()
            r = await client.post(endpoint, json={**body, "max_tokens": max_tokens, "temperature": 0.0,
                                                  "metadata": {"domain": t}})
            if r.status_code != 200:
                errors[0] += 1
                continue
            ids[t].append(r.json()["dvi"]["request_id"])
            print(f"\r  unseen prompts answered: {sum(map(len, ids.values()))}", end="", flush=True)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(4)))
    print()
    return {"ids": ids, "errors": errors[0]}


def live_tokens_per_step(arm: dict, tenant: str) -> float | None:
    """Completion tokens over engine steps of the tenant's last third of requests in this arm."""
    lens = arm.get("lens", {}).get(tenant) or []
    last = lens[len(lens) * 2 // 3:]
    steps = sum(s for _, s in last)
    return sum(t for t, _ in last) / steps if steps else None


def unjudged(info: dict) -> bool:
    """A swapper's /health entry has a published version newer than what serves that has no verdict yet."""
    latest, live = info.get("latest"), info.get("live_version") or 0
    if latest is None or latest <= live:
        return False
    judged = {e["version"] for e in info.get("events") or [] if e["kind"] in ("promoted", "refused", "rolled_back")}
    return latest not in judged and str(latest) not in (info.get("refused") or {})


def health(url: str) -> dict:
    """The server's /health as the admin sees it."""
    import httpx

    return httpx.get(url + "/health", headers={"Authorization": "Bearer groups-bench"}, timeout=30).json()


def settle(url: str, run_dir: Path, limit_s: float, poll_s: float = 10.0) -> dict:
    """After the traffic: wait (at most `limit_s`) until the trainer's steps stop moving for three polls and every
    swapper has judged its latest version, so arms that ran for different times are compared at the same point:
    what their feedback trained and judged, not how long the trainer had. Returns the /health it ended on."""
    def steps() -> int:
        try:
            status = json.loads((run_dir / "trainer" / "status.json").read_text())
        except (OSError, ValueError):
            return -1
        groups = (status.get("adapters") or {}).get("groups") or {}
        return status.get("dvi_trainer_step", 0) + sum(g["step"] for g in groups.values())

    t0, seen = time.monotonic(), []
    while True:
        h = health(url)
        seen.append(steps())
        swappers = [h["drafter"], *((h.get("adapters") or {}).get("groups") or {}).values()]
        if (len(seen) >= 3 and len(set(seen[-3:])) == 1 and not any(unjudged(s) for s in swappers)) \
                or time.monotonic() - t0 > limit_s:
            h["settle_s"] = time.monotonic() - t0
            return h
        time.sleep(poll_s)


def run_arm(cfg, name: str, key: str, run_dir: Path, a) -> dict:
    """One arm's server and traffic; the "eval" step instead answers the unseen prompts once, trainer off."""
    import yaml

    from demo.scenario import LANE_WARMUP
    from dvi.config import dump_config
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_tokenizer
    from serving.server_process import ServerProcess

    data = dump_config(cfg)
    data.update(run_dir=str(run_dir))
    data["feedback"]["dir"], data["registry"]["dir"] = str(run_dir / "feedback"), str(run_dir / "registry")
    data["trainer"].update(adapter_key=key, publish_every_steps=5, feedback_tokens_per_step=a.budget,
                           **LANE_WARMUP)  # the demo's, in both arms
    trainer = "off" if name in ("frozen", "eval") else "supervised"
    data["serve"].update(trainer=trainer, admin_token="groups-bench", domains=[*TENANTS, "garbage"])
    data["wandb"]["mode"] = "disabled"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    tok = load_tokenizer(embedded_paths(cfg.models.preset).tokenizer)
    unseen = eval_prompts(tok, a.eval_prompts, a.seed)
    t0 = time.perf_counter()
    print(f"arm {name} (trainer.adapter_key {key}) ...")
    with ServerProcess(["--config", str(path)], run_dir / "server.log") as srv:
        if name == "eval":
            out = asyncio.run(answer_once(srv.url, unseen, a.max_tokens))
        else:
            garbage = (a.garbage_share if "garbage" in name else 0.0, a.garbage_max_tokens or a.max_tokens)
            skip = frozenset(body_key(b) for items in unseen.values() for _, b in items)
            out = asyncio.run(traffic(srv.url, tok, a.tokens, a.max_tokens, garbage, a.seed, skip))
        settled = a.settle_s > 0 and trainer != "off"
        out["health"] = settle(srv.url, run_dir, a.settle_s) if settled else health(srv.url)
    out["wall_s"] = time.perf_counter() - t0
    return out


def traffic_records(runs: dict[str, tuple[Path, dict]], logs: dict[str, dict]) -> dict[str, list]:
    """Per tenant, each arm's responses of the run's last third, pooled (the same tokens for every arm's drafter);
    `logs`: each arm's feedback records by request id."""
    out: dict[str, list] = {t: [] for t in TENANTS}
    for name, (_, arm) in runs.items():
        records = logs[name]
        for t in TENANTS:
            ids = arm["ids"][t][len(arm["ids"][t]) * 2 // 3:]
            out[t] += [records[i] for i in ids if i in records and len(records[i].token_ids)]
    return out


def unseen_records(records: dict, arm: dict, logs: dict[str, dict]) -> dict[str, list]:
    """Per tenant, the eval step's responses (`records`) to the unseen prompts, less any prompt an arm's traffic did
    send (none since the traffic skips them; arms run before that skip existed may have)."""
    sent = {tuple(r.prompt_ids) for log in logs.values() for r in log.values()}
    out = {t: [records[i] for i in arm["ids"][t] if i in records and len(records[i].token_ids)] for t in TENANTS}
    return {t: [r for r in recs if tuple(r.prompt_ids) not in sent] for t, recs in out.items()}


def replay(scorer, arm: dict, key: str, recs: dict[str, list]) -> dict[str, dict]:
    """Per tenant: α̂ of what serves it at the end of this arm, and of v0, on the records `recs`."""
    from demo.replay import _pooled

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
    ap.add_argument("--garbage-max-tokens", type=int, default=None, help="a garbage request's max tokens")
    ap.add_argument("--control", action="store_true", help="also a second adapters arm (run-to-run spread)")
    ap.add_argument("--frozen", action="store_true", help="also an arm with the trainer off (live tokens per step)")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms to run (the rest are read)")
    ap.add_argument("--budget", type=int, default=0,
                    help="trainer.feedback_tokens_per_step in every arm: training a function of the feedback, not of "
                         "an arm's wall time (0: as much as time allows)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="after the traffic, wait up to this long for the trainer to stop and every latest version "
                         "to be judged (0: do not wait)")
    ap.add_argument("--eval-prompts", type=int, default=64, help="unseen prompts per tenant (the goal's α̂)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("groups-%Y%m%d-%H%M%S"))
    ap.add_argument("--replay-only", action="store_true", help="replay the arms already run under --out")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    cfg = load_config(None, [f"models.preset={a.preset}"])
    arms = [("shared", "none"), ("adapters", "domain")] + ([("adapters + garbage", "domain")] if a.garbage else []) \
        + ([("adapters again", "domain")] if a.control else []) + ([("frozen", "none")] if a.frozen else [])
    run_now = None if a.arms is None else set(a.arms.split(","))
    runs = {}
    for name, key in [("eval", "none"), *arms]:  # the unseen prompts' answers first: reused while under --out
        run_dir = a.out.resolve() / name.replace(" + ", "_").replace(" ", "_")
        fresh = run_now is None or name in run_now or (name == "eval" and not (run_dir / "arm.json").exists())
        if not a.replay_only and fresh:
            (run_dir / "arm.json").parent.mkdir(parents=True, exist_ok=True)
            (run_dir / "arm.json").write_text(json.dumps(run_arm(cfg, name, key, run_dir, a)))
        if (run_dir / "arm.json").exists():
            runs[name] = (run_dir, json.loads((run_dir / "arm.json").read_text()))
        else:
            print(f"arm {name}: not run under {a.out} (left out)")
    from demo.replay import drafter_scorers, read_records

    keys = dict(arms)
    eval_dir, eval_arm = runs.pop("eval")
    logs = {name: read_records(run_dir / "feedback") for name, (run_dir, _) in runs.items()}  # each read once
    unseen = unseen_records(read_records(eval_dir / "feedback"), eval_arm, logs)
    seen = traffic_records(runs, logs)
    results = {}
    for name, (run_dir, arm) in runs.items():
        scorer = drafter_scorers(cfg, run_dir / "registry")
        results[name] = {"replay": replay(scorer, arm, keys[name], unseen),
                         "replay_traffic": replay(scorer, arm, keys[name], seen), "tokens": arm["tokens"],
                         "errors": arm["errors"], "wall_s": arm["wall_s"],
                         "live_tokens_per_step": {t: live_tokens_per_step(arm, t) for t in TENANTS}}
    print_table(results)
    return finish(a, results)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def print_table(results: dict) -> None:
    """α̂ per tenant and arm on the unseen prompts and on the pooled traffic, the frozen v0's, and live tokens per
    step."""
    for field, title in (("replay", "unseen prompts (the goal)"), ("replay_traffic", "traffic, last thirds pooled")):
        frozen = next(iter(results.values()))[field]
        print(f"\nα̂ on {title}\n{'tenant':<8}" + "".join(f"{n:>22}" for n in results) + f"{'frozen v0':>12}{'records':>9}")
        for t in TENANTS:
            print(f"{t:<8}" + "".join(f"{_fmt(results[n][field][t]['alpha']):>22}" for n in results)
                  + f"{_fmt(frozen[t]['alpha_frozen']):>12}{frozen[t]['records']:>9}")
    print(f"\nlive tokens per step, last third\n{'tenant':<8}" + "".join(f"{n:>22}" for n in results))
    for t in TENANTS:
        print(f"{t:<8}" + "".join(f"{_fmt(results[n]['live_tokens_per_step'][t]):>22}" for n in results))


def finish(a, results: dict) -> int:
    """The goals of the arms that ran; the JSON."""
    def alpha(arm: str, t: str) -> float | None:
        return results[arm]["replay"][t]["alpha"] if arm in results else None

    def diff(x: float | None, y: float | None, absolute: bool = False) -> float | None:
        return None if x is None or y is None else (abs(x - y) if absolute else x - y)

    goals = []
    for t in TENANTS:
        if "shared" in results and "adapters" in results:
            goals.append(goal(f"{t}: α̂ with its adapter - α̂ shared drafter (unseen prompts)", diff(alpha("adapters", t),
                                                                               alpha("shared", t)), 0.05))
        if "adapters + garbage" in results:
            goals.append(goal(f"{t}: |α̂ with a garbage tenant - without|",
                              diff(alpha("adapters + garbage", t), alpha("adapters", t), True), 0.01, False))
        if "adapters again" in results:  # no goal of its own: the spread the garbage arm's difference stands beside
            print(f"{t}: |α̂ adapters again - adapters| (run-to-run spread) "
                  f"{_fmt(diff(alpha('adapters again', t), alpha('adapters', t), True))}")
    if "frozen" in results and "adapters" in results:
        live, frozen = (results[n]["live_tokens_per_step"]["sql"] for n in ("adapters", "frozen"))
        goals.append(goal("sql: live tokens per step, adapter / frozen drafter", None if not live or not frozen
                          else live / frozen, 1.1))
    goals.append(goal("errors", float(sum(r["errors"] for r in results.values())), 0, False))
    print_goals(goals)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json({"args": {k: str(v) for k, v in vars(a).items()}, "arms": results,
                                                 "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
