"""`make demo` / `dvi demo`: the main job, end to end, over loopback HTTP.

1. bootstrap the embedded pair if absent (`dvi bootstrap` in a subprocess: serving never imports
   trainers);
2. start `dvi serve` as a subprocess with its supervised online trainer (publish checks every
   `PUBLISH_EVERY_STEPS`), everything written under `runs/<id>/` (feedback, registry, trainer log,
   metrics.jsonl, the offline wandb run);
3. replay a drift scenario: code completions (held-out stdlib source, `dvi.data.prompt_stream`), then
   requests for SQLite queries through `/v1/chat/completions` (`dvi.data.sql_instructions`, a domain the
   build never trained on; prose completions for the test pair), then a target update through the admin
   endpoint (a slightly perturbed copy of the target, saved under `runs/<id>/targets/`, the only allowed
   dir) followed by more of the drift domain;
4. show live progress (requests, rolling α, drafter and target versions, trainer state);
5. once the server stopped (its feedback log flushed), replay each window's own responses through the drafter
   version that served them and through the frozen v0 drafter (`demo.replay`: the same tokens, so the
   gain over the frozen drafter is 0 until a promotion); print the α timeline with both and the gain, write
   `runs/<id>/timeline.json` and `runs/<id>/alpha.png`.

Ctrl-C stops the traffic, then the server (SIGTERM: graceful shutdown, which stops the trainer;
SIGKILL after a timeout, and the trainer dies with it through PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dvi.config import DviConfig, dump_config
from dvi.decode.results import acceptance_rate, mean_accepted_length
from dvi.fsutil import PRIVATE, atomic_write_text
from dvi.rundir import RunDir
from serving.drafter.diagnosis import WINDOW as WINDOW_RECORDS
from serving.server_process import ServerProcess

from .live_gain import DEMO_CONTROL_SHARE, alpha_moves, live_gain, print_live_gain, window_arms

DEFAULT_REQUESTS = {"tiny": 48, "smollm2": 96}
CONCURRENCY = 4
WINDOW = 16
LOG_WIDTH = 200  # columns of the α table when stdout is not a terminal (rich would use 80)
# The demo's trainer checks for a publish every 5 steps (the schema's default: 20) unless the config sets it. Replayed
# offline on a demo run's records, the sql-trained drafter passed the held-out check at step 45 with checks every 5
# steps, at step 60 with checks every 20. A check costs two shadow passes (~9% of the trainer's time here).
PUBLISH_EVERY_STEPS = 5
# With one drafter for every domain (no per-group adapters: vLLM serves one), the demo's trainer replays half of each
# batch (group by group, `trainers.online.trainer`) unless the config says: the domain whose traffic stopped keeps its
# share, so the gate does not refuse every sql-trained candidate for forgetting code. Through vLLM on a 2-core Zen3:
# 0 promotions at 0.25 with uniform replay (code -0.06..-0.14 on its held-out records), 5 at 0.5 group by group.
SHARED_REPLAY_RATIO = 0.5
# Every version is kept (a LoRA version: 0.65 MB) unless the config says: the replay scores each window with its own.
KEEP_VERSIONS = 64
# With one adapter per domain, a phase of 96 requests must hold a group's warm-up: its lane opens at 16 records and a
# quarter of them are held out (the first checks need 256 held-out positions of that group). At 32 and a tenth the sql
# adapter was first promoted at request ~200, a phase late. Between feedback shards (one per `feedback.flush_seconds`)
# the trainer replays the active groups' records instead of sleeping (without it a lane stepped once per shard), at
# most twice per record on top of its own pass: unbounded, the code lane took 60 steps on 20 records and overfit.
LANE_WARMUP = {"adapter_min_records": 16, "heldout_fraction": 0.25, "idle_replay_steps": 1, "idle_replay_epochs": 2.0}
TARGET_UPDATE = "target_v1.safetensors"  # the perturbed target the third phase serves, under `<run>/targets/`


def _perturbed_target(target_dir: Path, out: Path, scale: float = 0.05, seed: int = 0) -> Path:
    """A slightly different target: every 2-D weight + Gaussian noise of `scale` x its std.

    Stands in for one update of an RL trainer: same architecture, shifted distribution.
    """
    import torch
    from safetensors.torch import save_file

    from dvi.models.loading import load_state_dict

    sd = load_state_dict(target_dir)
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in sd.items():
        if v.is_floating_point() and v.ndim == 2 and "embed" not in k:
            v = v + torch.randn(v.shape, generator=g, dtype=v.dtype) * (scale * float(v.float().std()))
        new[k] = v.contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(new, str(out))
    return out


def window_rate(stats: list[dict[str, Any]]) -> tuple[int, float, float | None]:
    """(completion tokens, wall seconds, tokens/s) of a window's responses, as the client saw them: the wall time
    runs from its first request sent to its last response, so concurrent requests are not counted twice (the
    responses carry no server-side time). None without a timed response."""
    timed = [s for s in stats if "sent_s" in s]
    tokens = sum(s["completion_tokens"] for s in timed)
    wall = max((s["received_s"] for s in timed), default=0.0) - min((s["sent_s"] for s in timed), default=0.0)
    return tokens, wall, tokens / wall if wall > 0 else None


class Timeline:
    """Per-window α and tokens/s as the client sees them (from each response's `dvi` block and usage, and its
    send and answer times) and the request ids of the window's responses (the feedback records
    `demo.replay` replays)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.window = window
        self.rows: list[dict[str, Any]] = []
        self._buf: list[dict[str, Any]] = []
        self.recent: deque = deque(maxlen=32)
        self.responses: list[dict[str, Any]] = []  # every response's stats, for the live gain (`demo.live_gain`)
        self.done = 0
        self.errors = 0

    def add(self, phase: str, stats: dict[str, Any] | None, domain: str | None = None) -> None:
        self.done += 1
        if stats is None:
            self.errors += 1
            return
        stats = dict(stats, phase=phase, domain=domain)
        self.recent.append(stats)
        self.responses.append(stats)
        self._buf.append(stats)
        if len(self._buf) >= self.window:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        b, self._buf = self._buf, []
        accepted, drafted = sum(s["accepted"] for s in b), sum(s["drafted"] for s in b)
        tokens, wall, rate = window_rate(b)
        self.rows.append({
            "requests": self.done, "phase": b[-1]["phase"], "n": len(b),
            "alpha": acceptance_rate(accepted, drafted), "drafted": drafted,
            "mean_accepted_length": mean_accepted_length(accepted, sum(s["steps"] for s in b)),
            # accepted drafts that were a draft tree's siblings (the drafter's next candidates), not its chain's
            "sibling_accepted": sum(sum((s.get("accepted_by_rank") or [0])[1:]) for s in b),
            "completion_tokens": tokens, "wall_s": wall, "tok_s": rate,
            "drafter_version": b[-1]["drafter_version"], "target_version": b[-1]["target_version"],
            "adapter_version": b[-1].get("adapter_version", 0),
            "domain": b[-1].get("domain"), "request_ids": [s["request_id"] for s in b if s.get("request_id")],
            **window_arms(b),  # the control group's two arms, live
        })

    def rolling_alpha(self) -> float | None:
        return acceptance_rate(sum(s["accepted"] for s in self.recent), sum(s["drafted"] for s in self.recent))


@dataclass
class Phase:
    """One phase of the scenario: `n` requests of `domain` drawn from `prompts` (token-id lists for
    /v1/completions, or chat message lists for /v1/chat/completions)."""

    name: str
    domain: str
    prompts: Any
    n: int
    max_tokens: int

    def request(self) -> tuple[str, dict]:
        """(endpoint, body) of the next request."""
        item = next(self.prompts)
        chat = isinstance(item[0], dict)  # a list of chat messages, else prompt token ids
        body = {"messages" if chat else "prompt": item, "max_tokens": self.max_tokens, "temperature": 0.0,
                "metadata": {"domain": self.domain}}
        return ("/v1/chat/completions" if chat else "/v1/completions"), body


@dataclass
class Live:
    """What the phases update as they go: the timeline, the progress bar and the last /health."""

    timeline: Timeline
    progress: Any
    health: dict = field(default_factory=dict)
    task: Any = None
    shown: int = 0
    plain_every: int = 8  # output that is no terminal (CI, `| tee`): a line every this many requests instead of a bar

    def show(self, name: str) -> None:
        a, h = self.timeline.rolling_alpha(), self.health
        line = (f"{name:<18} α {'-' if a is None else f'{a:.3f}'}  drafter v{h.get('drafter_version')}  "
                f"adapters {h.get('adapters') or '-'}  "
                f"target v{h.get('target_version')}  trainer {h.get('trainer', '?')}  errors {self.timeline.errors}")
        self.progress.update(self.task, advance=1, description=line)
        self.shown += 1
        if not self.progress.console.is_terminal and self.shown % self.plain_every == 0:
            self.progress.console.print(f"{self.shown:4d} requests  {line}")


async def _poll_health(client: Any, live: Live, stop: asyncio.Event, admin_token: str) -> None:
    """The full /health (trainer state included) needs the admin token."""
    import httpx

    while not stop.is_set():
        try:
            h = (await client.get("/health", headers=_bearer(admin_token))).json()
            groups = (h.get("adapters") or {}).get("groups", {})
            live.health.update(drafter_version=h["drafter_version"], target_version=h["target_version"],
                               trainer=f"{h['trainer']['state']} (restarts {h['trainer']['restarts']})",
                               adapters=" ".join(f"{g} v{s['live_version']}" for g, s in groups.items()))
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), 1.0)
        except TimeoutError:
            pass


def _timed_stats(response: dict[str, Any], sent: float, received: float) -> dict[str, Any]:
    """A response's `dvi` block with what the window's tokens/s needs: its completion tokens and when the
    client sent it and got it back (`window_rate`)."""
    return dict(response["dvi"], completion_tokens=response["usage"]["completion_tokens"], sent_s=sent,
                received_s=received)


async def _phase(url: str, phase: Phase, live: Live, admin_token: str) -> None:
    """Send the phase's requests, CONCURRENCY at a time, while polling /health for the display."""
    import httpx

    it = iter(range(phase.n))
    unreachable = [0]

    async def worker(client: httpx.AsyncClient) -> None:
        for _ in it:
            endpoint, body = phase.request()
            try:
                sent = time.perf_counter()
                r = await client.post(endpoint, json=body)
                received = time.perf_counter()
                stats = _timed_stats(r.json(), sent, received) if r.status_code == 200 else None
                unreachable[0] = 0
            except httpx.TransportError:
                stats = None
                unreachable[0] += 1
                if unreachable[0] >= 3:  # the server is gone (e.g. Ctrl-C reached it first)
                    raise RuntimeError("the server stopped answering") from None
            live.timeline.add(phase.name, stats, phase.domain)
            live.show(phase.name)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_health(client, live, stop, admin_token))
        try:
            await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
        finally:
            stop.set()
            await poller


def _write_serve_config(cfg: DviConfig, run_dir: Path, targets: Path) -> tuple[Path, str]:
    """The demo server's config under `run_dir` (everything written there; `targets` the only allowed
    dir; a supervised trainer checking for a publish every `PUBLISH_EVERY_STEPS` unless the config says); returns
    (its path, the admin token it holds)."""
    data = dump_config(cfg)
    data["run_dir"] = str(run_dir)
    data["feedback"]["dir"] = str(run_dir / "feedback")
    data["registry"]["dir"] = str(run_dir / "registry")
    admin_token = secrets.token_hex(16)
    data["serve"].update(admin_token=admin_token, allowed_dirs=[str(targets)], api_key=None,
                         trainer="supervised" if cfg.serve.trainer == "off" else cfg.serve.trainer)
    if data["wandb"]["mode"] == "disabled":
        data["wandb"]["mode"] = "offline"
    data["trainer"]["adapter_key"] = demo_adapter_key(cfg)
    lanes = data["trainer"]["adapter_key"] != "none"
    unset = {"trainer": {"publish_every_steps": PUBLISH_EVERY_STEPS,
                         **(LANE_WARMUP if lanes else {"replay_ratio": SHARED_REPLAY_RATIO})},
             "registry": {"keep_last": KEEP_VERSIONS},
             # rows never exceed the demo's concurrency: adaptive K calibrates only the batch sizes it can meet
             "serve": {"max_batch_size": CONCURRENCY, **({"control_share": DEMO_CONTROL_SHARE} if lanes else {})}}
    for section, values in unset.items():
        data[section].update({k: v for k, v in values.items() if k not in getattr(cfg, section).model_fields_set})
    config_path = run_dir / "serve_config.yaml"
    atomic_write_text(config_path, yaml.safe_dump(data, sort_keys=False), mode=PRIVATE)  # holds the admin token
    return config_path, admin_token


def demo_adapter_key(cfg: DviConfig) -> str:
    """The demo's phases are traffic groups (issue 40): one adapter per domain, unless the config says otherwise
    (and "none" where the learned drafter cannot take adapters)."""
    if "adapter_key" in cfg.trainer.model_fields_set:
        return cfg.trainer.adapter_key
    lora_separate = cfg.models.learned_kind == "separate" and cfg.trainer.mode == "lora"
    return "domain" if lora_separate and cfg.serve.engine == "dvi" else "none"  # vLLM serves one drafter to all


def _phases(cfg: DviConfig, tok: Any, n: int) -> list[Phase]:
    """code, then the drift domain, then the drift domain again after the target update. The drift is sql
    (requests for SQLite queries, a domain the build never trained on) for a tokenizer with a chat template
    (the real pair), prose for the test pair. Each phase's prompts are a fresh seeded stream."""
    from dvi.data import prompt_stream, sql_instructions

    max_tokens = min(64, cfg.sampling.max_new_tokens)
    if getattr(tok, "chat_template", None):
        drift, drift_name = sql_instructions("heldout", seed=cfg.seed), "sql"
    else:
        drift, drift_name = prompt_stream("prose", tok, seed=cfg.seed), "prose"
    return [Phase("code", "code", prompt_stream("code", tok, seed=cfg.seed), n, max_tokens),
            Phase(drift_name, drift_name, drift, n, max_tokens),
            Phase(f"{drift_name} · new target", drift_name, drift, n, max_tokens)]


def fmt(x: float | None, digits: int = 3) -> str:
    """A number for the table ('-' for none)."""
    return "-" if x is None else f"{x:.{digits}f}"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _update_target(url: str, path: Path, admin_token: str) -> int:
    """POST /admin/target with the perturbed target; returns the new target version."""
    import httpx

    r = httpx.post(url + "/admin/target", json={"path": str(path), "version": 1},
                   headers=_bearer(admin_token), timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"target update failed: {r.status_code} {r.text}")
    return r.json()["target_version"]


def _run_scenario(cfg: DviConfig, rundir: RunDir, n: int, timeline: Timeline, console: Any) -> dict:
    """Start the server, run the phases (the target update before the third); the final /health."""
    import httpx
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dvi.models.loading import find_tokenizer_path, load_tokenizer
    from serving.loading import pair_paths

    targets = rundir.root / "targets"
    config_path, admin_token = _write_serve_config(cfg, rundir.root, targets)
    target_path, _, tok_path = pair_paths(cfg)
    tok = load_tokenizer(tok_path or find_tokenizer_path(target_path))
    console.print(f"starting server + trainer (logs: {rundir.root}/server.log, {rundir.trainer_log_path}) ...")
    with ServerProcess(["--config", str(config_path)], rundir.root / "server.log") as srv, Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console) as progress:
        live = Live(timeline, progress)
        for i, phase in enumerate(_phases(cfg, tok, n)):
            if i == 2:
                path = _perturbed_target(target_path, targets / TARGET_UPDATE, seed=cfg.seed)
                version = _update_target(srv.url, path, admin_token)
                progress.console.print(f"target updated through /admin/target -> version {version}")
            live.task = progress.add_task(phase.name, total=phase.n)
            asyncio.run(_phase(srv.url, phase, live, admin_token))
            timeline.flush()
        return httpx.get(srv.url + "/health", headers=_bearer(admin_token), timeout=30).json()


def _logged(rundir: RunDir, console: Any) -> dict:
    """The run's feedback records by request id (read once, for the replay and the greedy check); {} if unreadable."""
    from .replay import read_records

    try:
        return read_records(rundir.root / "feedback")
    except Exception as exc:  # noqa: BLE001 - the live table is still worth printing
        console.print(f"[red]cannot read the run's feedback log: {type(exc).__name__}: {exc}[/red]")
        return {}


def _replay(cfg: DviConfig, rundir: RunDir, timeline: Timeline, records: dict, console: Any) -> None:
    """Each window's responses replayed through the drafter that served them and the frozen one
    (`demo.replay`); a failure is shown, the table is still printed."""
    from .replay import drafter_scorers, replay_windows

    console.print("replaying each window's responses through the serving and the frozen drafter ...")
    try:
        replay_windows(timeline.rows, records, drafter_scorers(cfg, rundir.root / "registry"), demo_adapter_key(cfg))
    except Exception as exc:  # noqa: BLE001 - the live table is still worth printing
        console.print(f"[red]replay failed: {type(exc).__name__}: {exc}[/red]")


def _pair(row: dict, key: str, digits: int) -> str:
    """The learned / control arm's live mean of `key` in a window ('-' for an arm without requests)."""
    return f"{fmt(row.get('learned_' + key), digits)}/{fmt(row.get('control_' + key), digits)}"


def _gain(x: float | None) -> str:
    return "-" if x is None else f"{x:+.3f}"


def _report(console: Any, rundir: RunDir, timeline: Timeline, final: dict, k: int, greedy: dict | None = None) -> None:
    """The α timeline table, timeline.json, alpha.png and the run's counts; `k` the K the replayed lengths
    chain (`speculation.num_draft_tokens`)."""
    from rich.table import Table

    from .replay import LEGEND, plot_windows

    table = Table(title=f"α timeline (per window of requests; len served / len frozen at K = {k})", caption=LEGEND,
                  caption_justify="left")
    cols = ("requests", "phase", "α live", "drafted", "α̂ served", "α̂ frozen", "gain", "acc. len", "siblings",
            "len srv/frz", "tpp L/C", "dec tok/s L/C", "tok/s", "drafter", "adapter", "target")
    for col in cols:
        table.add_column(col, justify="left" if col == "phase" else "right")
    for row in timeline.rows:
        table.add_row(str(row["requests"]), row["phase"], fmt(row["alpha"]), str(row.get("drafted", "-")),
                      fmt(row.get("replay_alpha")), fmt(row.get("frozen_alpha")), _gain(row.get("gain")),
                      fmt(row["mean_accepted_length"], 2), str(row.get("sibling_accepted", "-")),
                      f"{fmt(row.get('replay_len'), 2)}/{fmt(row.get('frozen_len'), 2)}", _pair(row, "tpp", 2), _pair(row, "dtps", 1),
                      fmt(row.get("tok_s"), 1), f"v{row['drafter_version']}",
                      f"{row.get('domain')} v{row['adapter_version']}" if row.get("adapter_version") else "-",
                      f"v{row['target_version']}")
    console.print(table)
    moves = alpha_moves(final)
    console.print(f"why α moved (the server's diagnosis per window of {WINDOW_RECORDS} records, by lane): "
                  f"{len(moves)} moves named" + ("" if moves else " (none)"))
    for m in moves:
        console.print(f"  [{m['cause']}] {m['message']}")
    gains = live_gain(timeline.responses)
    share = ((final.get("control") or {}).get("share")) or 0.0
    if share:
        print_live_gain(console, gains, share)
    run_dir = rundir.root
    (run_dir / "timeline.json").write_text(json.dumps({"rows": timeline.rows, "errors": timeline.errors, "k": k,
                                                       "legend": LEGEND, "health": final, "greedy_check": greedy,
                                                       "live_gain": gains, "alpha_moves": moves}, indent=1))
    if timeline.rows:
        console.print(f"α plot: {plot_windows(timeline.rows, run_dir / 'alpha.png')}")
    counts = [(final.get("drafter") or {}).get("counts", {})]
    counts += [g.get("counts", {}) for g in ((final.get("adapters") or {}).get("groups") or {}).values()]
    total = {k: sum(c.get(k, 0) for c in counts) for k in ("promoted", "refused", "rolled_back")}
    groups = ", ".join(f"{g} v{s['live_version']}" for g, s in ((final.get("adapters") or {}).get("groups") or {}).items())
    console.print(f"requests {timeline.done}, errors {timeline.errors}; promotions {total['promoted']}, refusals "
                  f"{total['refused']}, rollbacks {total['rolled_back']} (shared drafter and group adapters"
                  f"{': ' + groups if groups else ''}); trainer restarts {(final.get('trainer') or {}).get('restarts', 0)}")
    wandb_dir = run_dir / "wandb"
    if wandb_dir.exists():
        console.print(f"offline wandb run: {wandb_dir} (`wandb sync {wandb_dir}/offline-run-*` to upload)")
    console.print(f"run dir: {run_dir}")


def run_demo(cfg: DviConfig, requests_per_phase: int | None = None) -> int:
    """The drift scenario against a real server + trainer; returns a process exit code."""
    import httpx
    from rich.console import Console

    from serving.loading import ensure_pair

    # A log file or pipe gets rich's 80 columns, which cut the table's gain column to "+0.0…": give it room.
    console = Console() if sys.stdout.isatty() else Console(width=LOG_WIDTH)
    n = requests_per_phase or DEFAULT_REQUESTS.get(cfg.models.preset, 64)
    rundir = RunDir((Path(cfg.run_dir).parent / time.strftime("demo-%Y%m%d-%H%M%S")).resolve())
    (rundir.root / "targets").mkdir(parents=True, exist_ok=True)
    console.rule(f"dvi demo · preset {cfg.models.preset} · {n} requests per phase · {rundir.root}")
    ensure_pair(cfg)
    timeline = Timeline()
    status, final = 0, {}
    try:
        final = _run_scenario(cfg, rundir, n, timeline, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping the server and its trainer ...[/yellow]")
        status = 130
    except (RuntimeError, httpx.HTTPError) as exc:
        console.print(f"[red]demo stopped: {exc}[/red]")
        status = 1
    timeline.flush()
    records = _logged(rundir, console)
    _replay(cfg, rundir, timeline, records, console)
    greedy = None
    if cfg.serve.engine == "vllm":  # dvi's own engine: its losslessness is the test suite's to prove
        from .greedy import report_greedy

        greedy = report_greedy(cfg, records, rundir.root / "targets" / TARGET_UPDATE, console,
                               contract=final.get("greedy_contract"), plain_root=rundir.root / "vllm-plain")
    _report(console, rundir, timeline, final, cfg.speculation.num_draft_tokens, greedy)
    return status or (1 if timeline.errors or (greedy or {}).get("failed") else 0)
