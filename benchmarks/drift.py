"""Drift benchmark: α over a code -> prose -> code traffic stream, online trainer vs frozen drafter.

The headline of dvi. One script, same pair, same prompts, greedy decoding (temperature 0, so
every arm emits exactly the target's greedy tokens, which the script checks, and α differences
are the drafters' alone):

* arm A, ``online``: the engine serves the stream in batches and logs feedback shards; the real
  trainer process (`python -m dvi.cli train --online`, 1 torch thread, pinned to its own core
  when the machine has two, niced by `trainer.nice`; the engine thread is not pinned) tails them, trains the drafter's LoRA and publishes shadow-checked
  versions; the serving loop polls the registry's LATEST between batches and hot-swaps it in
  (`serving.swap.load_drafter_version`: validated, LoRA merged into a copy of the base drafter).
* arm B, ``frozen``: the same stream with the bootstrap drafter, never updated, no trainer.
* arm C, ``ceiling``: the bootstrap drafter distilled offline on prose *training* text with the
  target as teacher (`trainers.offline.distill`, full-vocab KL, all weights) for as many seconds
  as arm A's trainer spent training up to the end of the prose phase; its α on the same prose
  prompts is the reference the online arm should approach.
* throughput probe: the frozen drafter serving a fixed prompt set in alternating blocks with a
  second trainer process busy (training on a backlog copied from arm A's log) or paused (its
  pause file), so "serving with the trainer running" vs "without it" differ in nothing else.

Goals (issue 4): after the switch the online arm's prose α reaches >= 90% of the ceiling's
(within the prose phase; requests and seconds to get there are reported), its α on code when
code returns is within 0.02 of its pre-switch code α, the frozen arm stays down (< 90% of the
ceiling), and serving throughput with the trainer running is >= 0.9x without it.

    .venv/bin/python benchmarks/drift.py --preset smollm2 --requests 48 [--json bench_results/drift.json]

Writes JSON (settings, per-request α of every arm, drafter versions, timings, `goals`) and a PNG
beside it, prints a table ending with the goals, and exits 0 whether or not they are met.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal

PHASES = (("code", "code"), ("prose", "prose"), ("code_return", "code"))


# -- small helpers --------------------------------------------------------------------------------
def _alpha(rows: list[dict]) -> float:
    """Token-weighted α = accepted / drafted over a list of per-request rows."""
    d = sum(r["drafted"] for r in rows)
    return sum(r["accepted"] for r in rows) / d if d else float("nan")


def _rolling(rows: list[dict], w: int) -> list[float]:
    return [_alpha(rows[max(0, i + 1 - w): i + 1]) for i in range(len(rows))]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _pin(pid: int, cpu: int | None) -> None:
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(pid, {cpu})
    except OSError:
        pass


class Progress:
    """One bar over every request of every arm (tqdm), with a phase label."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, disable=not enabled,
                        mininterval=0.5 if sys.stderr.isatty() else 15.0)

    def update(self, n: int, label: str, **post: Any) -> None:
        self.bar.set_description(label, refresh=False)
        if post:
            self.bar.set_postfix(post, refresh=False)
        self.bar.update(n)

    def write(self, msg: str) -> None:
        self.bar.write(msg)

    def close(self) -> None:
        self.bar.close()


# -- the trainer process ------------------------------------------------------------------------------
class TrainerProc:
    """`python -m dvi.cli train --online --config <work>/trainer.yaml` with its own core and one thread."""

    def __init__(self, cfg: Any, work: Path, cpu: int | None) -> None:
        import yaml

        from dvi.config import dump_config

        self.cfg = cfg
        self.work = work
        self.config_path = work / "trainer.yaml"
        self.config_path.write_text(yaml.safe_dump(dump_config(cfg), sort_keys=False))
        self.log_path = work / "trainer.log"
        self.status_path = Path(cfg.run_dir) / "trainer" / "status.json"
        self.pause_path = Path(cfg.run_dir) / "trainer.pause"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dvi.cli", "train", "--online", "--config", str(self.config_path)],
            cwd=ROOT, env=env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT,  # noqa: SIM115
        )
        _pin(self.proc.pid, cpu)

    def status(self) -> dict:
        try:
            return json.loads(self.status_path.read_text())
        except (OSError, ValueError):
            return {}

    def wait_state(self, states: tuple[str, ...], timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status()
            if st.get("state") in states:
                return st
            if self.proc.poll() is not None:
                raise RuntimeError(f"trainer exited ({self.proc.returncode}); see {self.log_path}")
            time.sleep(0.1)
        raise TimeoutError(f"trainer did not reach {states} in {timeout}s; see {self.log_path}")

    def pause(self, on: bool) -> None:
        if on:
            self.pause_path.write_text("")
        else:
            self.pause_path.unlink(missing_ok=True)

    def stop(self, timeout: float = 120.0) -> int | None:
        """SIGTERM (finish the round, commit, publish, exit 0); SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.pause(False)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def trainer_config(base_cfg: Any, paths: Any, run_dir: Path, overrides: list[str]) -> Any:
    """The arm-A trainer's config: the benchmark config with this work dir's paths."""
    from dvi.config import DviConfig, apply_overrides, dump_config

    data = dump_config(base_cfg)
    data["run_dir"] = str(run_dir)
    data["models"].update(target=str(paths.target), drafter=str(paths.drafter), tokenizer=str(paths.tokenizer),
                          device="cpu")
    data["feedback"]["dir"] = str(run_dir / "feedback")
    data["registry"]["dir"] = str(run_dir / "registry")
    data["trainer"]["num_threads"] = 1
    data = apply_overrides(data, overrides)
    return DviConfig.model_validate(data)


# -- serving one arm ----------------------------------------------------------------------------------
def serve_stream(engine: Any, phases: list[tuple[str, str, list[list[int]]]], batch: int, max_new_tokens: int,
                 arm: str, progress: Progress, writer: Any = None, registry: Any = None, base: Any = None,
                 t_zero: float | None = None, on_phase_end: Any = None) -> tuple[list[dict], list[dict]]:
    """Serve every phase's prompts in batches; between batches, hot-swap LATEST if a registry is given.

    Returns per-request rows (α, tokens, version, times) and swap events.
    """
    from dvi.feedback import FeedbackRecord

    rows: list[dict] = []
    swaps: list[dict] = []
    t0 = t_zero if t_zero is not None else time.perf_counter()
    idx = 0
    for phase, domain, prompts in phases:
        for i in range(0, len(prompts), batch):
            if registry is not None:
                _maybe_swap(engine, registry, base, swaps, idx, t0)
            chunk = prompts[i: i + batch]
            tb = time.perf_counter()
            results = engine.generate(chunk, max_new_tokens=max_new_tokens)
            te = time.perf_counter()
            for r in results:
                rows.append({
                    "i": idx, "phase": phase, "domain": domain, "alpha": r.alpha, "accepted": r.num_accepted,
                    "drafted": r.num_drafted, "steps": r.num_steps, "tokens": len(r.token_ids),
                    "drafter_version": r.drafter_version, "t_end": te - t0, "batch_s": te - tb, "wall": time.time(),
                    "token_ids": list(r.token_ids),
                })
                if writer is not None:
                    writer.write(FeedbackRecord.from_result(r, temperature=0.0, domain=domain))
                idx += 1
            if writer is not None:
                writer.flush()  # one shard per batch: the trainer sees traffic within a batch
            progress.update(len(chunk), f"{arm}:{phase}", alpha=f"{_alpha(rows[-len(chunk):]):.2f}",
                            v=engine.drafter_version)
        if on_phase_end is not None:
            on_phase_end(phase)
    return rows, swaps


def _maybe_swap(engine: Any, registry: Any, base: Any, swaps: list[dict], idx: int, t0: float) -> None:
    from dvi.registry import AdapterRejected
    from serving.swap import load_drafter_version

    latest = registry.latest()
    if latest is None or latest == engine.drafter_version or any(s["version"] == latest for s in swaps):
        return
    tl = time.perf_counter()
    try:
        model, man = load_drafter_version(registry, latest, base)
    except AdapterRejected as exc:
        swaps.append({"version": latest, "at_request": idx, "t": tl - t0, "refused": exc.reason})
        return
    engine.set_drafter(model, latest)
    swaps.append({"version": latest, "at_request": idx, "t": tl - t0, "load_s": time.perf_counter() - tl,
                  "heldout_alpha": man.get("heldout_alpha"), "parent_heldout_alpha": man.get("parent_heldout_alpha"),
                  "steps": man.get("steps"), "records_seen": man.get("records_seen")})


# -- arms -----------------------------------------------------------------------------------------------
def run_ceiling(pair: Any, seconds: float, batch_size: int, seq_len: int, lr: float, seed: int) -> tuple[Any, dict]:
    """The base drafter distilled on prose training text for `seconds` (target as teacher, full-vocab KL)."""
    import copy

    from dvi.data import load_texts
    from trainers.offline import distill, pack_docs, token_batches

    tok = pair.tokenizer
    texts = load_texts("prose", "train")
    ids = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
    stream = pack_docs(ids, tok.bos_token_id, tok.eos_token_id)
    student = copy.deepcopy(pair.drafter)
    stats = distill(student, pair.target, token_batches([stream], batch_size, seq_len, seed=seed), steps=0, lr=lr,
                    warmup=5, max_seconds=max(1.0, seconds), progress=False, desc="ceiling")
    student.eval()
    return student, {**stats, "budget_s": seconds, "batch_size": batch_size, "seq_len": seq_len, "lr": lr,
                     "train_tokens_available": int(stream.numel())}


def throughput_probe(engine: Any, prompts: list[list[int]], batch: int, max_new_tokens: int, proc: TrainerProc,
                     blocks: int, progress: Progress) -> dict:
    """Paused / running blocks over the same prompts in ABBA order; tokens/s, trainer CPU share.

    Other users' load drifts during the probe; ABBA order cancels a linear drift, and the ratio is
    the median over adjacent (paused, running) pairs, so one noisy block cannot decide it.
    """
    import statistics

    out: dict[str, list[dict]] = {"paused": [], "running": []}
    seq: list[dict] = []
    order = [m for p in range(blocks) for m in (("paused", "running") if p % 2 == 0 else ("running", "paused"))]
    for mode in order:
        proc.pause(mode == "paused")
        st0 = proc.wait_state(("paused",) if mode == "paused" else ("running", "idle"))
        c0 = _cpu_seconds(proc.proc.pid)
        t0 = time.perf_counter()
        toks = 0
        for i in range(0, len(prompts), batch):
            res = engine.generate(prompts[i: i + batch], max_new_tokens=max_new_tokens)
            toks += sum(len(r.token_ids) for r in res)
            progress.update(len(res), f"probe:{mode}")
        wall = time.perf_counter() - t0
        st1 = proc.status()
        busy = (_cpu_seconds(proc.proc.pid) - c0) / wall if wall else 0.0  # trainer CPU share of one core
        blk = {"mode": mode, "tokens": toks, "seconds": wall, "tokens_per_s": toks / wall, "trainer_busy": busy,
               "trainer_steps": int(st1.get("dvi_trainer_step", 0)) - int(st0.get("dvi_trainer_step", 0))}
        out[mode].append(blk)
        seq.append(blk)
    proc.pause(False)

    def tps(xs: list[dict]) -> float:
        return sum(x["tokens"] for x in xs) / sum(x["seconds"] for x in xs)

    pair_ratios = []
    for a, b in zip(seq[::2], seq[1::2], strict=True):
        run, paused = (a, b) if a["mode"] == "running" else (b, a)
        pair_ratios.append(run["tokens_per_s"] / paused["tokens_per_s"])
    return {"blocks": out, "order": [b["mode"] for b in seq], "pair_ratios": pair_ratios,
            "tokens_per_s_paused": tps(out["paused"]), "tokens_per_s_running": tps(out["running"]),
            "pooled_ratio": tps(out["running"]) / tps(out["paused"]),
            "ratio": statistics.median(pair_ratios),
            "trainer_busy_running": sum(x["trainer_busy"] * x["seconds"] for x in out["running"])
            / sum(x["seconds"] for x in out["running"])}


def _copy_backlog(src: Path, dst: Path, copies: int) -> int:
    """Copy arm A's shards `copies` times under fresh shard names (a backlog for the probe's trainer)."""
    dst.mkdir(parents=True, exist_ok=True)
    shards = sorted(p for p in src.glob("shard-*.parquet"))
    n = 0
    base = time.time_ns() - 10**12  # older than anything new, well outside the reader's grace window
    for _ in range(copies):
        for s in shards:
            n += 1
            shutil.copyfile(s, dst / f"shard-{base + n:020d}-{os.getpid()}-{n % 1_000_000:06d}.parquet")
    return n


# -- report ---------------------------------------------------------------------------------------------
def _plot(path: Path, online: list[dict], frozen: list[dict], ceiling_alpha: float, ceiling_span: tuple[int, int],
          swaps: list[dict], window: int, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 5))
    for rows, name, color in ((online, "online trainer (arm A)", "tab:green"), (frozen, "frozen drafter (arm B)",
                                                                               "tab:blue")):
        x = [r["i"] for r in rows]
        ax.scatter(x, [r["alpha"] for r in rows], s=6, color=color, alpha=0.25)
        ax.plot(x, _rolling(rows, window), color=color, lw=2, label=f"{name}, rolling {window}")
    lo, hi = ceiling_span
    if not math.isnan(ceiling_alpha):
        ax.hlines(ceiling_alpha, lo, hi, colors="tab:red", linestyles="--", label=f"offline ceiling α {ceiling_alpha:.3f}")
        ax.hlines(0.9 * ceiling_alpha, lo, hi, colors="tab:red", linestyles=":", lw=1, label="90% of ceiling")
    bounds = sorted({r["i"] for r in online if r["i"] > 0 and r["phase"] != online[r["i"] - 1]["phase"]})
    for b in bounds:
        ax.axvline(b - 0.5, color="k", lw=1)
    for s in swaps:
        if "refused" not in s:
            ax.axvline(s["at_request"] - 0.5, color="tab:green", lw=0.6, ls=":", alpha=0.6)
    phases = [(online[0]["phase"], 0)] + [(online[b]["phase"], b) for b in bounds]
    for name, start in phases:
        ax.text(start + 0.5, 0.96, name, transform=ax.get_xaxis_transform(), fontsize=9, va="top")
    ax.set(xlabel="request (serving order); dotted green = drafter version swapped in", ylabel="α (accepted / drafted)",
           ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table(summary: dict, goals: list[dict]) -> str:
    lines = []
    lines.append(f"{'arm':<10} {'phase':<12} {'requests':>8} {'α':>7} {'tok/s':>8}")
    for arm in ("online", "frozen"):
        for phase, s in summary[arm].items():
            lines.append(f"{arm:<10} {phase:<12} {s['requests']:>8} {s['alpha']:>7.3f} {s['tokens_per_s']:>8.1f}")
    c = summary["ceiling"]
    lines.append(f"{'ceiling':<10} {'prose':<12} {c['requests']:>8} {c['alpha']:>7.3f} {c['tokens_per_s']:>8.1f}")
    lines.append("")
    lines.append("goals:")
    for g in goals:
        op = ">=" if g["higher_is_better"] else "<="
        lines.append(f"  [{'MET ' if g['met'] else 'MISS'}] {g['name']}: {g['value']:.3f} (target {op} {g['target']})")
    return "\n".join(lines)


def _phase_summary(rows: list[dict]) -> dict:
    """α and tokens/s per phase; each row carries its batch's wall time, counted once per batch."""
    out = {}
    for phase, _ in PHASES:
        rs = [r for r in rows if r["phase"] == phase]
        if not rs:
            continue
        secs = sum({r["t_end"]: r["batch_s"] for r in rs}.values())
        toks = sum(r["tokens"] for r in rs)
        out[phase] = {"requests": len(rs), "alpha": _alpha(rs), "tokens": toks, "seconds": secs,
                      "tokens_per_s": toks / secs if secs else float("nan")}
    return out


# -- main -----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exits 0 even when it fails (the JSON then carries the error)."""
    ap = _parser()
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not crash CI
        import traceback

        traceback.print_exc()
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"benchmark": "drift", "error": f"{type(exc).__name__}: {exc}",
                                    "settings": clean_json(vars(args)), "goals": []}, indent=1))
        print(f"drift benchmark failed: {exc}; wrote {path}")
        return 0


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--pair-dir", default=None, help="a built pair (default: the preset's cache dir; built if absent)")
    ap.add_argument("--config", default=str(ROOT / "configs" / "drift.yaml"), help="trainer/engine settings")
    ap.add_argument("--requests", type=int, default=None, help="requests per phase (default: smollm2 64, tiny 16)")
    ap.add_argument("--batch", type=int, default=4, help="requests decoded together (greedy)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: smollm2 48, tiny 24")
    ap.add_argument("--window", type=int, default=None, help="rolling window (requests) for α (default N/4, >= 8)")
    ap.add_argument("--probe-prompts", type=int, default=8)
    ap.add_argument("--probe-blocks", type=int, default=4, help="paused/running block pairs in the throughput probe")
    ap.add_argument("--no-probe-equal-priority", dest="probe_equal_priority", action="store_false",
                    help="skip the second probe with the trainer at the engine's CPU priority (trainer.nice=0)")
    ap.add_argument("--ceiling-batch", type=int, default=8)
    ap.add_argument("--ceiling-seq-len", type=int, default=128)
    ap.add_argument("--ceiling-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=None, help="scratch dir (default: <json dir>/drift_work)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin engine / trainer to separate cores")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", default="bench_results/drift.json")
    ap.add_argument("--png", default=None, help="default: the JSON path with .png")
    ap.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides (e.g. trainer.mode=full)")
    return ap


def _run(args: argparse.Namespace) -> int:

    import torch

    torch.set_num_threads(1)
    from dvi.config import load_config
    from dvi.data import prompt_stream
    from dvi.embedded import EmbeddedPaths, embedded_dir, is_built
    from dvi.engine import SpeculativeEngine
    from dvi.feedback import FeedbackWriter
    from dvi.models import load_pair
    from dvi.registry import DrafterRegistry

    small = args.preset != "tiny"
    n = args.requests or (64 if small else 16)
    max_new = args.max_new_tokens or (48 if small else 24)
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    png_path = Path(args.png) if args.png else json_path.with_suffix(".png")
    work = Path(args.work_dir) if args.work_dir else json_path.parent / "drift_work"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    # The trainer gets a core of its own (pinned, and niced by trainer.nice); the engine is left free
    # to run on either core, so a busy trainer can only take a core the engine is not using.
    pin = not args.no_pin and len(cpus) >= 2
    engine_cpu, trainer_cpu = None, (cpus[-1] if pin else None)

    pair_dir = Path(args.pair_dir) if args.pair_dir else embedded_dir(args.preset)
    if not is_built(pair_dir):
        from trainers.bootstrap import bootstrap

        print(f"building the {args.preset} pair into {pair_dir} (once) ...", flush=True)
        bootstrap(args.preset, out=pair_dir, seed=0)
    elif not args.pair_dir and not is_built(pair_dir, args.preset):
        print(f"note: {pair_dir} was built by an older {args.preset} recipe; using it as is "
              f"(`dvi bootstrap --preset {args.preset} --force` rebuilds)", flush=True)
    paths = EmbeddedPaths.at(pair_dir)
    base_cfg = load_config(args.config, [f"models.preset={args.preset}", *args.overrides])
    pair = load_pair(paths.target, paths.drafter, paths.tokenizer, device="cpu")
    tok = pair.tokenizer
    k = base_cfg.speculation.num_draft_tokens
    top_k = base_cfg.feedback.top_k

    def prompts(domain: str, seed: int, count: int) -> list[list[int]]:
        s = prompt_stream(domain, tok, split="heldout", prompt_tokens=(32, 96) if small else (16, 48), seed=seed)
        bos = [tok.bos_token_id] if tok.bos_token_id is not None and not tok.chat_template else []
        return [bos + p for p in itertools.islice(s, count)]

    phase_prompts = [("code", "code", prompts("code", args.seed, n)),
                     ("prose", "prose", prompts("prose", args.seed, n)),
                     ("code_return", "code", prompts("code", args.seed + 1, n))]
    probe_prompts = prompts("code", args.seed + 2, args.probe_prompts)
    total = 3 * n * 2 + n + 2 * args.probe_blocks * args.probe_prompts * (2 if args.probe_equal_priority else 1)
    progress = Progress(total, enabled=not args.no_progress)
    timings: dict[str, float] = {}
    t_all = time.perf_counter()

    # ---- arm A: online trainer process
    run_a = work / "online"
    cfg_a = trainer_config(base_cfg, paths, run_a, [])
    trainer = TrainerProc(cfg_a, work, trainer_cpu)
    try:
        t0 = time.perf_counter()
        trainer.wait_state(("idle", "running"))
        timings["trainer_startup_s"] = time.perf_counter() - t0
        writer = FeedbackWriter(cfg_a.feedback.dir, shard_records=10**6, flush_seconds=3600.0)
        registry = DrafterRegistry(cfg_a.registry.dir)
        eng_a = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=k, feedback_top_k=top_k)
        trainer_cpu_s: dict[str, float] = {"start": _cpu_seconds(trainer.proc.pid)}
        t0 = time.perf_counter()
        online, swaps = serve_stream(eng_a, phase_prompts, args.batch, max_new, "online", progress, writer=writer,
                                     registry=registry, base=pair.drafter, t_zero=t0,
                                     on_phase_end=lambda ph: trainer_cpu_s.__setitem__(ph, _cpu_seconds(trainer.proc.pid)))
        timings["online_serve_s"] = time.perf_counter() - t0
        writer.close()
    except BaseException:
        trainer.stop(timeout=10)
        raise
    # when did the prose phase end (in trainer time)? the trainer's metrics rows carry wall clock
    t_prose_end_wall = max(r["wall"] for r in online if r["phase"] == "prose")
    rc = trainer.stop()
    trainer_rows = []
    mpath = run_a / "trainer" / "metrics.jsonl"
    if mpath.exists():
        trainer_rows = [json.loads(x) for x in mpath.read_text().splitlines() if x.strip()]
    train_s_rows = [r for r in trainer_rows if r.get("train_seconds") is not None]
    train_s_total = max((r["train_seconds"] for r in train_s_rows), default=0.0)
    train_s_prose_end = max((r["train_seconds"] for r in train_s_rows if r["time"] <= t_prose_end_wall), default=0.0)
    publishes = [r for r in trainer_rows if "published" in r]
    trainer_final = trainer.status()
    progress.write(f"online arm: {len(swaps)} swaps, trainer {trainer_final.get('dvi_trainer_step')} steps, "
                   f"{train_s_total:.0f}s training (exit {rc})")

    # ---- arm B: frozen drafter, no trainer
    eng_b = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=k, feedback_top_k=top_k)
    t0 = time.perf_counter()
    frozen, _ = serve_stream(eng_b, phase_prompts, args.batch, max_new, "frozen", progress, t_zero=t0)
    timings["frozen_serve_s"] = time.perf_counter() - t0

    # ---- arm C: offline ceiling, same wall time as arm A trained until the end of the prose phase
    progress.write(f"ceiling: distilling on prose training text for {train_s_prose_end:.0f}s ...")
    t0 = time.perf_counter()
    ceiling_model, ceiling_stats = run_ceiling(pair, train_s_prose_end, args.ceiling_batch, args.ceiling_seq_len,
                                               args.ceiling_lr, args.seed)
    timings["ceiling_train_s"] = time.perf_counter() - t0
    eng_c = SpeculativeEngine(pair.target, ceiling_model, num_draft_tokens=k, feedback_top_k=top_k)
    t0 = time.perf_counter()
    ceiling_rows, _ = serve_stream(eng_c, [phase_prompts[1]], args.batch, max_new, "ceiling", progress, t_zero=t0)
    timings["ceiling_serve_s"] = time.perf_counter() - t0
    for r in ceiling_rows:
        r["i"] += n  # align with the prose phase of the stream

    # ---- throughput probe: frozen drafter, a busy vs paused trainer process. Run twice: with the
    # configured trainer (trainer.nice as in arm A: the goal) and with trainer.nice=0 (a trainer that
    # competes at the engine's priority: the worst case, reported beside it).
    eng_p = SpeculativeEngine(pair.target, pair.drafter, num_draft_tokens=k, feedback_top_k=top_k)
    eng_p.generate(probe_prompts[:1], max_new_tokens=4)  # warm-up
    probes = {}
    variants = [("configured", [])] + ([("equal_priority", ["trainer.nice=0"])] if args.probe_equal_priority else [])
    for name, extra in variants:
        run_p = work / f"probe_{name}"
        copied = _copy_backlog(Path(cfg_a.feedback.dir), run_p / "feedback", copies=3)
        cfg_p = trainer_config(base_cfg, paths, run_p, ["trainer.publish_every_steps=1000000", *extra])
        probe_trainer = TrainerProc(cfg_p, run_p, trainer_cpu)
        try:
            probe_trainer.wait_state(("idle", "running"))
            probes[name] = throughput_probe(eng_p, probe_prompts, args.batch, max_new, probe_trainer,
                                            args.probe_blocks, progress)
            probes[name].update(backlog_shards=copied, trainer_nice=cfg_p.trainer.nice)
        finally:
            probe_trainer.stop()
    probe = probes["configured"]
    progress.close()
    timings["total_s"] = time.perf_counter() - t_all

    # ---- figures
    lossless = sum(a["token_ids"] != b["token_ids"] for a, b in zip(online, frozen, strict=True))
    lossless += sum(a["token_ids"] != b["token_ids"] for a, b in
                    zip([r for r in frozen if r["phase"] == "prose"], ceiling_rows, strict=True))
    ceiling_alpha = _alpha(ceiling_rows)
    w = args.window or max(8, n // 4)
    by = {arm: {p: [r for r in rows if r["phase"] == p] for p, _ in PHASES} for arm, rows in
          (("online", online), ("frozen", frozen))}
    on_prose = by["online"]["prose"]
    roll = _rolling(on_prose, w)
    reach = next((j for j, a in enumerate(roll) if j + 1 >= min(w, len(roll)) and a >= 0.9 * ceiling_alpha), None)
    t_switch = on_prose[0]["t_end"] - on_prose[0]["batch_s"]
    budget = {"window": w, "reached_at_request": None if reach is None else reach + 1,
              "reached_after_s": None if reach is None else on_prose[reach]["t_end"] - t_switch,
              "prose_requests": len(on_prose), "prose_phase_s": on_prose[-1]["t_end"] - t_switch}
    last_w = on_prose[-w:]
    online_end_ratio = _alpha(last_w) / ceiling_alpha
    code_pre = _alpha(by["online"]["code"][len(by["online"]["code"]) // 2:])
    code_ret_rows = by["online"]["code_return"][: max(w, len(by["online"]["code_return"]) // 2)]
    code_ret = _alpha(code_ret_rows)
    frozen_ratio = _alpha(by["frozen"]["prose"][-w:]) / ceiling_alpha
    # control: the same windows in the frozen arm (phase 3 prompts differ from phase 1's)
    frozen_code_shift = (_alpha(by["frozen"]["code_return"][: len(code_ret_rows)])
                         - _alpha(by["frozen"]["code"][len(by["frozen"]["code"]) // 2:]))
    summary = {"online": _phase_summary(online), "frozen": _phase_summary(frozen),
               "ceiling": {"requests": len(ceiling_rows), "alpha": ceiling_alpha,
                           "tokens_per_s": _phase_summary([{**r, "phase": "prose"} for r in ceiling_rows])
                           .get("prose", {}).get("tokens_per_s", float("nan"))}}
    goals = [
        goal(f"online prose α (last {w} of {len(on_prose)} prose requests) / ceiling α; reached 90% at request "
              f"{budget['reached_at_request']} after {budget['reached_after_s'] or float('nan'):.0f}s "
              f"(budget: {len(on_prose)} requests, {budget['prose_phase_s']:.0f}s)", online_end_ratio, 0.9),
        goal(f"online code α when code returns (first {len(code_ret_rows)} requests) minus pre-switch code α "
              f"(last {len(by['online']['code']) - len(by['online']['code']) // 2})", code_ret - code_pre, -0.02),
        goal(f"frozen prose α (last {w} prose requests) / ceiling α (stays down)", frozen_ratio, 0.9,
              higher_is_better=False),
        goal(f"serving tokens/s with the trainer running / paused (median of {len(probe['pair_ratios'])} ABBA pairs;"
              f" trainer used {probe['trainer_busy_running']:.0%} of a core while running)",
              probe["ratio"], 0.9),
    ]
    title = (f"dvi drift ({args.preset}): code -> prose -> code, {n} requests/phase, greedy, K={k}, batch {args.batch}, "
             f"trainer {base_cfg.trainer.mode}")
    _plot(png_path, online, frozen, ceiling_alpha, (n, 2 * n), swaps, w, title)
    result = {
        "benchmark": "drift",
        "settings": {**{k_: v for k_, v in vars(args).items()}, "requests_per_phase": n, "max_new_tokens": max_new,
                     "num_draft_tokens": k, "feedback_top_k": top_k, "temperature": 0.0, "pair_dir": str(pair_dir),
                     "trainer_config": json.loads(json.dumps(cfg_a.model_dump(mode="json"))),
                     "pinned_cpus": {"engine": engine_cpu, "trainer": trainer_cpu}, "cpus": cpus,
                     "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__},
        "summary": summary,
        "alpha_code_pre": code_pre, "alpha_code_return": code_ret, "ceiling_alpha": ceiling_alpha,
        "frozen_code_return_minus_pre": frozen_code_shift,
        "budget_to_90pct_ceiling": budget,
        "lossless_mismatches": lossless,
        "online": online, "frozen": frozen, "ceiling": ceiling_rows,
        "swaps": swaps, "trainer": {"exit_code": rc, "final_status": trainer_final, "train_seconds_total": train_s_total,
                                    "train_seconds_to_prose_end": train_s_prose_end, "publish_decisions": publishes,
                                    "cpu_seconds_at": trainer_cpu_s,
                                    "note": "train_seconds is wall time inside training steps (the ceiling's budget); "
                                            "cpu_seconds_at is the process's CPU time (after model loading at 'start')"},
        "ceiling_training": ceiling_stats,
        "throughput_probe": probe,
        "throughput_probe_equal_priority": probes.get("equal_priority"),
        "timings": timings,
        "goals": goals,
        "png": str(png_path),
    }
    for rows in (online, frozen, ceiling_rows):
        for r in rows:
            r.pop("token_ids", None)
    json_path.write_text(json.dumps(clean_json(result), indent=1))
    print(_table(summary, goals))
    print(f"code α: online pre-switch {code_pre:.3f}, on return {code_ret:.3f}; the frozen arm's same windows "
          f"differ by {frozen_code_shift:+.3f} (prompt-set effect)")
    for name, pr in probes.items():
        print(f"throughput probe ({name}, trainer nice {pr['trainer_nice']}): median pair ratio {pr['ratio']:.3f}x "
              f"(pooled {pr['tokens_per_s_running']:.1f} tok/s running vs {pr['tokens_per_s_paused']:.1f} paused = "
              f"{pr['pooled_ratio']:.3f}x); trainer used {pr['trainer_busy_running']:.0%} of a core while running")
    print(f"lossless: {lossless} requests differ between arms (must be 0); swaps: "
          f"{sum('refused' not in s for s in swaps)} promoted, {sum('refused' in s for s in swaps)} refused")
    print(f"wrote {json_path} and {png_path} ({timings['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
