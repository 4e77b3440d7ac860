"""The long soak (`benchmarks/soak.py --minutes N`): one `dvi serve` with its supervised trainer on the real pair for
N minutes of drifting traffic, with what a long-lived job meets: target updates, clients that cut or abandon their
requests, trainer kills. Issue 60 §2.

* Traffic (`benchmarks/_soak_traffic.py`): code, chat and sql requests, the mix and the concurrency changing every
  `--drift-minutes` (code-heavy, chat-heavy, sql-heavy at `--concurrencies` in turn); plain, streamed, cut and
  abandoned requests (`--stream-share`, `--cut-share`, `--abandon-share`).
* Every `--target-update-minutes`: `POST /admin/target`, alternately the pair's target with noise of
  `--target-noise` x each tensor's mean magnitude (a fine-tune's worth of change: α and greedy text may move) and the
  pair's own target (a new version of the same weights). Every `--kill-minutes`: SIGKILL to the trainer process;
  the supervisor restarts it (the check waits for a fresh heartbeat).
* Every `--sample-seconds` (`benchmarks/_soak_sampler.py`): memory, fds and threads of the server, its trainer and
  vLLM's processes; disk by part; latency and TTFT percentiles, α per group, outcomes over the interval; promotions,
  rollbacks, queue depth. A progress line per sample and a partial JSON beside the final one.
* At the end (`benchmarks/_soak_checks.py`): the feedback log against the answered requests (exact), 0 5xx, disk
  within the configured bounds, the second vs the last quarter (memory, fds, threads, p99 latency), α per group
  not falling inside a segment without a drift, target update or rollback; JSON with `goals` and a PNG.

`--engine vllm` runs the same behind vLLM (`serve.engine=vllm`, from `.venv-vllm`); where that venv is not
built it says why and writes a JSON that says it was skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from benchmarks._common import built_pair, clean_json, print_goals, write_json
from benchmarks._drift_server import Server, pair_overrides
from benchmarks._soak_checks import long_goals, plot_long
from benchmarks._soak_sampler import Sampler, scrape
from benchmarks._soak_traffic import DOMAINS, Shares, Traffic, domain_streams, event_times, schedule

ROOT = Path(__file__).resolve().parent.parent


def add_long_args(ap: argparse.ArgumentParser) -> None:
    """The long soak's flags (`--minutes` selects it)."""
    g = ap.add_argument_group("long soak (--minutes): one online server under drifting traffic and faults")
    g.add_argument("--minutes", type=float, default=None, help="run the long soak for this many minutes of traffic")
    g.add_argument("--engine", choices=("dvi", "vllm"), default="dvi", help="serve.engine")
    g.add_argument("--drift-minutes", type=float, default=10.0, help="a phase: the traffic mix and concurrency change")
    g.add_argument("--concurrencies", type=_ints, default=(1, 4, 8), help="per phase, in turn (e.g. 1,4,8)")
    g.add_argument("--target-update-minutes", type=float, default=15.0, help="POST /admin/target every this often")
    g.add_argument("--target-noise", type=float, default=0.02,
                   help="the updated target: noise of this x each tensor's mean |w| (0: the same weights)")
    g.add_argument("--kill-minutes", type=float, default=20.0, help="SIGKILL the trainer every this often (0: never)")
    g.add_argument("--kill-recover-s", type=float, default=300.0, help="the trainer must be back within this")
    g.add_argument("--sample-seconds", type=float, default=60.0)
    g.add_argument("--poll-seconds", type=float, default=5.0, help="queue depth and the feedback log, between samples")
    g.add_argument("--stream-share", type=float, default=0.3)
    g.add_argument("--cut-share", type=float, default=0.05, help="streams closed after 1-4 content chunks")
    g.add_argument("--abandon-share", type=float, default=0.05, help="requests closed before any content")
    g.add_argument("--retention-mb", type=float, default=32.0,
                   help="feedback.retention_bytes, small enough to bind in an hour (0: the config's)")
    g.add_argument("--log-max-kb", type=int, default=1024, help="files.log_max_bytes: small enough to rotate")
    g.add_argument("--alpha-margin", type=float, default=0.05, help="a fall of α per group tolerated in a segment")


def _ints(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return out


# -- set-up ---------------------------------------------------------------------------------------------
def vllm_unavailable(args: argparse.Namespace) -> str | None:
    """Why the vLLM arm cannot run here (None: it can)."""
    if os.environ.get("DVI_VLLM_PYTHON") or any(o.startswith("serve.vllm.python=") for o in args.overrides):
        return None
    venv = ROOT / ".venv-vllm"
    if (venv / ".dvi-installed").is_file():
        return None
    reason = Path(str(venv) + ".unavailable")
    if reason.is_file():
        return f"vLLM's venv is unavailable: {reason.read_text().strip()}"
    return f"vLLM's venv is not built at {venv} (make vllm-venv)"


def target_weights(pair_dir: Path, out_dir: Path, noise: float, seed: int) -> list[Path]:
    """The weights target updates alternate between: [the target with noise, the target itself] (the target
    alone when `noise` is 0)."""
    import torch
    from safetensors.torch import save_file

    from dvi.models.embedded import EmbeddedPaths
    from dvi.models.loading import load_state_dict

    orig = Path(EmbeddedPaths.at(pair_dir).target)
    if noise <= 0:
        return [orig]
    out_dir.mkdir(parents=True, exist_ok=True)
    sd = load_state_dict(orig)
    g = torch.Generator().manual_seed(seed)
    for k, v in sd.items():
        if v.is_floating_point():
            x = v.float()
            sd[k] = (x + torch.randn(x.shape, generator=g) * noise * x.abs().mean()).to(v.dtype).contiguous()
    path = out_dir / "target_noisy.safetensors"
    save_file(sd, str(path))
    return [path, orig]


def long_overrides(args: argparse.Namespace, pair_dir: Path, weights: list[Path]) -> list[str]:
    """The server's config for the soak: the pair, the supervised trainer, the engine, the admin paths, bounds."""
    allowed = sorted({str(w.parent if w.is_file() else w) for w in weights})
    out = [*pair_overrides(pair_dir, args.preset, args.kind, None), "serve.trainer=supervised",
           f"serve.engine={args.engine}", f"serve.allowed_dirs=[{','.join(allowed)}]",
           f"files.log_max_bytes={max(4096, args.log_max_kb * 1024)}"]
    if args.retention_mb > 0:
        out.append(f"feedback.retention_bytes={int(args.retention_mb * 2**20)}")
    if args.engine == "vllm":
        out.append("serve.vllm.max_model_len=1024")
    return out


# -- faults --------------------------------------------------------------------------------------------
async def _sleep_until(deadline: float, stop: asyncio.Event) -> bool:
    """Sleep until `deadline` (monotonic); True when `stop` came first."""
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, deadline - time.monotonic()))
        return True
    except TimeoutError:
        return False


async def target_updates(admin: Any, times: list[float], weights: list[Path], t_start: float, events: list[dict],
                         stop: asyncio.Event) -> None:
    """`POST /admin/target` at each time, the weights in turn; each one an event with its status and seconds."""
    for i, t in enumerate(times):
        if await _sleep_until(t_start + t, stop):
            return
        t1 = time.monotonic()
        try:
            r = await admin.post("/admin/target", json={"path": str(weights[i % len(weights)])}, timeout=900)
            status, body = r.status_code, (r.json() if r.status_code == 200 else r.text[:300])
        except Exception as e:  # noqa: BLE001 - a refused update is a finding, not a crash of the soak
            status, body = None, f"{type(e).__name__}: {e}"
        events.append({"kind": "target_update", "t": t1 - t_start, "status": status, "response": body,
                       "weights": weights[i % len(weights)].name, "seconds": time.monotonic() - t1})
        print(f"  target update {i + 1} ({weights[i % len(weights)].name}): {status} in "
              f"{time.monotonic() - t1:.1f}s", flush=True)


async def _trainer_back(admin: Any, read_status: Any, old_pid: int, since: float, limit_s: float) -> float | None:
    """Seconds until the supervisor runs a new trainer that has written a heartbeat since `since` (its status
    file, `read_status`); None when not within `limit_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        pid = ((await admin.get("/admin/status")).json().get("trainer") or {}).get("pid")
        st = await asyncio.to_thread(read_status)
        if pid not in (None, old_pid) and st.get("pid") == pid and st.get("heartbeat", 0) > since:
            return time.monotonic() - t0
        await asyncio.sleep(1.0)
    return None


async def trainer_kills(admin: Any, read_status: Any, times: list[float], t_start: float, events: list[dict],
                        stop: asyncio.Event, recover_s: float) -> None:
    """SIGKILL the trainer at each time; the event records how long until a new trainer beat."""
    for t in times:
        if await _sleep_until(t_start + t, stop):
            return
        pid = ((await admin.get("/admin/status")).json().get("trainer") or {}).get("pid")
        ev: dict[str, Any] = {"kind": "trainer_kill", "t": time.monotonic() - t_start, "pid": pid}
        events.append(ev)
        if not pid:
            ev["recovered_s"] = None
            print("  trainer kill: no trainer process to kill", flush=True)
            continue
        with_time = time.time()
        os.kill(pid, signal.SIGKILL)
        ev["recovered_s"] = await _trainer_back(admin, read_status, pid, with_time, recover_s)
        print(f"  trainer kill (pid {pid}): back in {ev['recovered_s']}", flush=True)


# -- the run ---------------------------------------------------------------------------------------------
async def _settle(admin: Any, limit_s: float = 120.0) -> None:
    """Until the engine runs and queues nothing and the feedback writer holds nothing (cancelled requests reaped)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        st = (await admin.get("/admin/status")).json()
        if st["engine"]["running"] == 0 and st["engine"]["queue"] == 0 and st["feedback"]["pending"] == 0:
            return
        await asyncio.sleep(0.5)


def _partial(args: argparse.Namespace, sampler: Sampler, events: list[dict], minutes: float) -> Any:
    """A sample's callback: its progress line, and the samples so far beside the final JSON."""
    from benchmarks._soak_sampler import progress_line

    path = args.json.with_suffix(".partial.json")

    def on_sample(s: dict) -> None:
        print(progress_line(s, minutes), flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(clean_json({"samples": sampler.samples, "events": events}), default=str))

    return on_sample


async def _faults(admin: Any, srv: Server, args: argparse.Namespace, weights: list[Path], t_start: float,
                  events: list[dict], stop: asyncio.Event) -> list[asyncio.Task]:
    return [asyncio.create_task(target_updates(admin, event_times(args.minutes, args.target_update_minutes), weights,
                                               t_start, events, stop)),
            asyncio.create_task(trainer_kills(admin, srv.trainer, event_times(args.minutes, args.kill_minutes),
                                              t_start, events, stop, args.kill_recover_s))]


async def drive(srv: Server, args: argparse.Namespace, phases: list, tok: Any, weights: list[Path]) -> dict:
    """The traffic, the sampler and the faults against a started server; everything the checks read."""
    import httpx

    rows: list[dict] = []
    events: list[dict] = [{"kind": "drift", "t": p.start_s, "shape": p.shape} for p in phases[1:]]
    traffic = Traffic(domain_streams(tok, args.prompt_tokens, args.seed),
                      Shares(args.stream_share, args.cut_share, args.abandon_share), args.max_tokens, args.seed, rows)
    stop, faults_stop = asyncio.Event(), asyncio.Event()
    t_start, t0_wall = time.monotonic(), time.time()
    sampler = Sampler(srv, rows, phases, t_start, args.sample_seconds, min(args.poll_seconds, args.sample_seconds),
                      DOMAINS, None)
    sampler.on_sample = _partial(args, sampler, events, args.minutes)
    headers = {"Authorization": f"Bearer {srv.token}"}
    async with httpx.AsyncClient(base_url=srv.url, timeout=120, headers=headers) as admin:
        sampling = asyncio.create_task(sampler.run(admin, stop))
        faults = await _faults(admin, srv, args, weights, t_start, events, faults_stop)
        await traffic.run(srv.url, phases, t_start, asyncio.Event())
        traffic_s = time.monotonic() - t_start
        faults_stop.set()
        await asyncio.gather(*faults)
        await _settle(admin)
        stop.set()
        await sampling
        server_total = scrape((await admin.get("/metrics")).text)["finished"]
        status = (await admin.get("/admin/status")).json()
    events += [{"kind": "rollback" if e["kind"] == "rolled_back" else e["kind"], "t": e["at"] - t0_wall,
                "version": e["version"], "reason": e.get("reason")}
               for e in sampler.swap_events.values() if e["kind"] in ("promoted", "rolled_back")]
    return {"rows": rows, "samples": sampler.samples, "events": sorted(events, key=lambda e: e["t"]),
            "t0_wall": t0_wall, "total_s": phases[-1].end_s, "traffic_s": traffic_s, "server_total": server_total,
            "status": status, "tally": sampler.tally, "unhealthy_polls": sampler.unhealthy_polls,
            "phases": phases, "domains": DOMAINS}


def _feedback_facts(run: dict) -> dict:
    fb = run["status"].get("feedback") or {}
    tally = run["tally"]
    return {"gaps": tally.gaps(), "unreadable": len(tally.unreadable), "unreadable_shards": tally.unreadable,
            "shards_read": len(tally.shards), "dropped": fb.get("dropped", 0), "write_errors": fb.get("write_errors", 0),
            "deleted_shards": fb.get("deleted_shards", 0), "log_errors": fb.get("errors", 0),
            # shards retention deleted before the trainer read them (counted, allowed: invariant 4)
            "trainer_shards_lost": (run.get("trainer_status") or {}).get("dvi_trainer_feedback_shards_lost")}


def serve_soak(args: argparse.Namespace, pair_dir: Path, tok: Any, work: Path) -> tuple[dict, Any]:
    """Start the server, drive the soak, stop the server (drained: every record flushed), read the log's rest."""
    weights = target_weights(pair_dir, work / "weights", args.target_noise, args.seed)
    phases = schedule(args.minutes, args.drift_minutes, args.concurrencies)
    with Server(args, work / "run", long_overrides(args, pair_dir, weights)) as srv:
        t0 = time.monotonic()
        srv.wait_trainer(("idle", "running"), 600)
        print(f"  server and trainer up ({time.monotonic() - t0:.0f}s after the server); {len(phases)} phases: "
              f"{', '.join(p.shape for p in phases)}", flush=True)
        run = asyncio.run(drive(srv, args, phases, tok, weights))
        run["trainer_status"] = srv.trainer()
    run["tally"].poll()  # what the drain flushed
    run["records"] = run["tally"].records
    run["feedback"] = _feedback_facts(run)
    return run, srv.cfg


def _skip(args: argparse.Namespace, why: str) -> int:
    print(f"[soak {args.engine}] skipped: {why}", flush=True)
    write_json(args.json, {"benchmark": "soak_long", "engine": args.engine, "skipped": why, "goals": []})
    return 0


def _title(args: argparse.Namespace) -> str:
    return (f"dvi soak ({args.preset}, {args.kind}, engine {args.engine}): {args.minutes:g} min, drift every "
            f"{args.drift_minutes:g} min (concurrency {','.join(map(str, args.concurrencies))}), target update every "
            f"{args.target_update_minutes:g} min, trainer kill every {args.kill_minutes:g} min")


def run_long(args: argparse.Namespace) -> int:
    """The long soak end to end: JSON (settings, phases, samples, events, summary, goals), the requests as JSON
    lines beside it, and a PNG of the series."""
    if args.json == Path("bench_results/soak.json"):  # the arms' default: not theirs to overwrite
        args.json = Path(f"bench_results/soak_long{'_vllm' if args.engine == 'vllm' else ''}.json")
    if args.engine == "vllm" and (why := vllm_unavailable(args)):
        return _skip(args, why)
    args.concurrency = max(args.concurrencies)  # the server's batch: the busiest phase's clients
    pair_dir, tok = built_pair(args.preset, args.pair_dir)
    work = args.json.parent / f"{args.json.stem}_work"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    print(f"[soak {args.engine}] {_title(args)}", flush=True)
    run, cfg = serve_soak(args, pair_dir, tok, work)
    summary, goals = long_goals(run, cfg, args)
    png, rows_path = args.json.with_suffix(".png"), args.json.with_suffix(".requests.jsonl")
    plot_long(png, run["samples"], run["events"], DOMAINS, _title(args))
    rows_path.parent.mkdir(parents=True, exist_ok=True)
    rows_path.write_text("".join(json.dumps(clean_json(r)) + "\n" for r in run["rows"]))
    out = {"benchmark": "soak_long", "engine": args.engine,
           "settings": {**vars(args), "pair_dir": str(pair_dir), "run_dir": str(work / "run")},
           "phases": [{"index": p.index, "start_s": p.start_s, "end_s": p.end_s, "shape": p.shape, "mix": p.mix,
                       "concurrency": p.concurrency} for p in run["phases"]],
           "samples": run["samples"], "events": run["events"], "feedback": run["feedback"],
           "trainer_status": run["trainer_status"], "final_status": run["status"], "summary": summary,
           "goals": goals, "png": str(png), "requests": str(rows_path), "wall_s": time.perf_counter() - t0}
    write_json(args.json, json.loads(json.dumps(out, default=str)))
    print_goals(goals)
    print(f"wrote {args.json}, {png} and {rows_path} ({out['wall_s']:.0f}s)")
    return 0
