"""Decode speed of dvi's speculative engine on the embedded pair (issue 3).

Per setting (domain x temperature x batch size) it measures, on the same held-out prompts in one run:
dvi speculative (adaptive K), dvi with speculation off, HF `generate` of the target alone, HF
assisted generation (`assistant_model=` the same drafter, batch 1 only) and HF prompt-lookup decoding
(`prompt_lookup_num_tokens`, the model-free speculation a transformers user has, batch 1 only); plus alpha, mean accepted length,
per-position acceptance, and the speedup that alpha, K and the measured draft/verify costs predict
(E[tokens/step] / (K*c_draft + c_verify(K)) relative to a plain step), and measured / predicted.
Writes one JSON (settings, raw figures, goals) and prints a table that ends with the goals. Exits 0.
The arms and the figures computed from their runs live in `benchmarks/_decode_arms.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import goal, print_goals
from benchmarks._decode_arms import (
    _draft_vocab,
    build_drafters,
    dvi_run,
    hf_compiled,
    hf_generate,
    merge_runs,
    predicted,
    prompt_source,
    same_text,
    serve_history,
)
from dvi.decode.results import fmt_rate
from dvi.decode.step_costs import batch_bucket
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dvi bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--root", default=None, help="models cache root (default: dvi.models.embedded's)")
    p.add_argument("--json", default="bench_results/decode.json")
    p.add_argument("--domains", default="code,chat", help="code (held-out stdlib source) | chat (chat-template "
                   "instructions from held-out code and prose) | prose | agentic (an agent's edits of the same few "
                   "functions, again and again: history repeats)")
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--batch-sizes", default="1,4,16")
    p.add_argument("--kinds", default="separate,eagle,early_exit", help="drafter kinds to measure: separate | eagle "
                   "(the built head on the target's features) | early_exit | suffix (model-free, dvi.drafters.suffix) | hybrid "
                   "(suffix when its score clears the threshold, else --hybrid-kind)")
    p.add_argument("--hybrid-kind", default="separate", help="the learned kind a hybrid falls back to")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="HF prompt lookup's prompt_lookup_num_tokens (0: skip that arm)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary size (default: the preset's served size, else all stored ids; 0: full)")
    p.add_argument("--early-exit-layers", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts-b1", type=int, default=4, help="prompts (one at a time) for batch-1 settings")
    p.add_argument("--history", type=int, default=0,
                   help="suffix / hybrid: before each setting, N other held-out prompts of its domain are served "
                   "(greedy, untimed) and their outputs join the suffix index, as in a server that has been "
                   "serving that traffic (0: a cold index)")
    p.add_argument("--batches", type=int, default=1, help="batches per setting for batch sizes > 1")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--max-draft-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (models and engine on this device)")
    p.add_argument("--dtype", default="auto", help="auto (the preset's serving dtype: bf16 on CPUs with native "
                   "bf16, and on CUDA) | float32 | bfloat16 | float16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-compile-timeout", type=float, default=0.0,
                   help="seconds an arm of HF generate with a static cache + torch.compile(mode='reduce-overhead') "
                        "may take, compilation included, per setting (its own process; 0: skip the arm)")
    return p.parse_args(argv)


def _share(x: float | None) -> str:
    return "   -" if x is None else f"{x:4.2f}"


@dataclass
class _Bench:
    """What every setting is measured with: the pair, one adaptive engine per drafter kind and one with speculation
    off, HF assisted generation's drafter, the suffix caches of `suffix` / `hybrid`, and the warm-up prompts."""
    args: argparse.Namespace
    pair: Any
    assistant: Any
    kinds: list[str]
    drafters: dict
    engines: dict[str, SpeculativeEngine]
    plain: SpeculativeEngine
    caches: list
    warm: Iterator

    @property
    def target(self):
        return self.pair.target


def _load(args) -> _Bench:
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_causal_lm, load_embedded_pair

    pair = load_embedded_pair(args.preset, args.root, device=args.device, dtype=args.dtype,
                              draft_vocab_size=args.draft_vocab)
    target = pair.target.eval()
    # HF assisted generation gets the same separate drafter with its full vocabulary (a plain HF model)
    assistant = load_causal_lm(embedded_paths(args.preset, args.root).drafter, args.device, target.dtype)
    kinds = [k for k in args.kinds.split(",") if k]
    caches: list = []   # the suffix caches of `suffix` / `hybrid`
    drafters = build_drafters(pair, kinds, args, caches)
    engines = {k: SpeculativeEngine(target, proposer_for(target, d),
                                    num_draft_tokens=args.num_draft_tokens, adaptive=True,
                                    max_draft_tokens=args.max_draft_tokens) for k, d in drafters.items()}
    domains = [d for d in args.domains.split(",") if d]
    warm = prompt_source(domains[0], pair.tokenizer, args.seed + 99)
    return _Bench(args, pair, assistant, kinds, drafters, engines, SpeculativeEngine(target, None), caches, warm)


def _warm_up(bench: _Bench, bss: list[int]) -> None:
    """Every code path (and the cost model at each batch size) on prompts not measured after."""
    warm, target = bench.warm, bench.target
    buckets = sorted({batch_bucket(x) for b in bss for x in range(1, b + 1)})
    for eng in bench.engines.values():
        eng.calibrate(buckets)
    for b in bss:
        wb = [[next(warm) for _ in range(b)]]
        for eng in bench.engines.values():
            dvi_run(eng, wb, 16, 0.0)
        dvi_run(bench.plain, wb, 8, 0.0)
    hf_generate(target, [[next(warm)]], 8, 0.0)
    hf_generate(target, [[next(warm)]], 8, 0.0, assistant=bench.assistant)
    if bench.args.prompt_lookup_tokens:
        hf_generate(target, [[next(warm)]], 8, 0.0, lookup=bench.args.prompt_lookup_tokens)


def _run_systems(bench: _Bench, systems: list[str], units: list, temp: float) -> dict[str, list]:
    """Each system's runs over the units. Round-robin over systems per unit (rotating who goes first): load from
    other processes on a shared CPU then hits every system alike instead of whichever ran during a busy spell."""
    args, n = bench.args, bench.args.max_new_tokens
    res: dict[str, list] = {s: [] for s in systems}
    for ui, unit in enumerate(units):
        order = systems[ui % len(systems):] + systems[: ui % len(systems)]
        for sname in order:
            seed = args.seed + 7919 * ui
            if sname == "off":
                res[sname].append(dvi_run(bench.plain, [unit], n, temp, seed=seed))
            elif sname in bench.engines:
                res[sname].append(dvi_run(bench.engines[sname], [unit], n, temp, seed=seed))
            else:
                res[sname].append(hf_generate(bench.target, [unit], n, temp,
                                              bench.assistant if sname == "assisted" else None, seed,
                                              args.prompt_lookup_tokens if sname == "lookup" else 0))
    return res


def _rate(runs: list | None) -> float | None:
    """Tokens per second over HF runs ((seconds, tokens, texts) each)."""
    return sum(x[1] for x in runs) / sum(x[0] for x in runs) if runs else None


def _baselines(bench: _Bench, res: dict[str, list], units: list, temp: float, b: int) -> dict:
    """What every kind of one setting is compared with: speculation off, HF generate (eager, compiled), HF
    assisted generation and HF prompt lookup; and how many prompts the setting ran."""
    args = bench.args
    comp = hf_compiled(args, units, [[next(bench.warm) for _ in range(b)]], args.max_new_tokens) \
        if args.hf_compile_timeout > 0 and temp == 0 else None
    return dict(off=merge_runs(res["off"]), hf_rate=_rate(res["hf"]), comp_rate=comp[1] / comp[0] if comp else None,
                hf_texts=[t for x in res["hf"] for t in x[2]], asst_rate=_rate(res["assisted"]) if b == 1 else None,
                look=res.get("lookup"), look_rate=_rate(res.get("lookup")), prompts=sum(len(x) for x in units))


def _kind_row(bench: _Bench, kind: str, runs: list, base: dict, setting: dict) -> dict:
    """One drafter kind's row of one setting: its run against the baselines, and the predicted speedup."""
    run, off, hf_rate = merge_runs(runs), base["off"], base["hf_rate"]
    comp_rate, asst_rate, look, look_rate = base["comp_rate"], base["asst_rate"], base["look"], base["look_rate"]
    pred = predicted(bench.engines[kind], run)
    row = dict(**setting, kind=kind, prompts=base["prompts"], dvi=run | {"k_per_step": None, "texts": None},
               dvi_off=off | {"k_per_step": None, "texts": None}, hf_generate_tokens_per_s=hf_rate,
               speedup_vs_off=run["tokens_per_s"] / off["tokens_per_s"],
               speedup_vs_hf=run["tokens_per_s"] / hf_rate, **pred)
    if comp_rate:
        row["hf_compiled_tokens_per_s"] = comp_rate
        row["speedup_vs_hf_compiled"] = run["tokens_per_s"] / comp_rate
        row["off_vs_hf_compiled"] = off["tokens_per_s"] / comp_rate
    if asst_rate:
        row["hf_assisted_tokens_per_s"] = asst_rate
        row["speedup_vs_hf_assisted"] = run["tokens_per_s"] / asst_rate
    if setting["temperature"] == 0:  # greedy: is each fast path's text the plain decoding's? (bf16 width effects)
        row["dvi_same_text_as_off"] = same_text(run["texts"], off["texts"])
        if look:
            row["hf_prompt_lookup_same_text_as_hf"] = same_text([t for x in look for t in x[2]], base["hf_texts"])
    if look_rate:
        row["hf_prompt_lookup_tokens_per_s"] = look_rate
        row["hf_prompt_lookup_vs_hf"] = look_rate / hf_rate
        row["speedup_vs_hf_prompt_lookup"] = run["tokens_per_s"] / look_rate
    ps = row["predicted_speedup"]
    row["measured_over_predicted"] = row["speedup_vs_off"] / ps if ps else None
    print(f"  {setting['domain']:5s} T={setting['temperature']:g} B={setting['batch_size']:2d} {kind:10s}: dvi "
          f"{run['tokens_per_s']:7.1f} tok/s  off {off['tokens_per_s']:7.1f}  hf {hf_rate:7.1f}  lookup "
          f"{look_rate or 0:7.1f}  alpha {fmt_rate(run['alpha'], 2)}  K~{pred['mean_k']:.1f}", flush=True)
    return row


def _measure(bench: _Bench, domain: str, temp: float, b: int) -> list[dict]:
    """One setting (domain x temperature x batch size): every system on the same prompts, a row per drafter kind."""
    args, kinds = bench.args, bench.kinds
    for cache in bench.caches:   # settings reuse the prompts: no setting may draft from another's outputs
        cache.clear()
    stream = prompt_source(domain, bench.pair.tokenizer, args.seed)
    nb = args.prompts_b1 if b == 1 else args.batches
    units = [[next(stream) for _ in range(b)] for _ in range(nb)]
    if args.history and bench.caches:  # later draws of the same stream, none equal to a measured prompt
        seen = {tuple(p) for u in units for p in u}
        serve_history(bench.plain, bench.caches, (p for p in stream if tuple(p) not in seen), args.history,
                      args.max_new_tokens)
    systems = ["off", "hf", *kinds] + (["assisted"] if b == 1 else []) + (
        ["lookup"] if b == 1 and args.prompt_lookup_tokens else [])
    res = _run_systems(bench, systems, units, temp)
    base = _baselines(bench, res, units, temp, b)
    setting = dict(domain=domain, temperature=temp, batch_size=b)
    return [_kind_row(bench, kind, res[kind], base, setting) for kind in kinds]


def _find(rows: list[dict], domain: str, kind: str | None = None, temp: float = 0.0, b: int = 1) -> dict | None:
    """The first row of a setting (of one drafter kind, when named)."""
    return next((r for r in rows if (kind is None or r["kind"] == kind) and r["domain"] == domain
                 and r["temperature"] == temp and r["batch_size"] == b), None)


def _best(rows: list[dict], domain: str, temp: float, b: int, key: str = "speedup_vs_hf") -> dict | None:
    cands = [r for r in rows if r["domain"] == domain and r["temperature"] == temp and r["batch_size"] == b]
    return max(cands, key=lambda r: r[key] or 0.0) if cands else None


def _goals(rows: list[dict], bss: list[int], on_cuda: bool) -> list:
    code1, chat1 = _best(rows, "code", 0.0, 1), _best(rows, "chat", 0.0, 1)
    eagle1 = _find(rows, "code", "eagle")
    b16 = [r for r in rows if r["batch_size"] == max(bss)]
    hyb_code, hyb_chat = _find(rows, "code", "hybrid"), _find(rows, "chat", "hybrid")
    hyb16 = [r for r in b16 if r["kind"] == "hybrid"]
    goals = [
        goal("eagle vs HF generate (code, greedy, batch 1)", eagle1 and eagle1["speedup_vs_hf"], 2.0),
        goal("eagle vs HF assisted generation (code, greedy, batch 1)",
             eagle1 and eagle1.get("speedup_vs_hf_assisted"), 1.5),
        goal("best drafter vs HF generate (code, greedy, batch 1)", code1 and code1["speedup_vs_hf"], 1.8),
        goal("best drafter vs HF generate (chat, greedy, batch 1)", chat1 and chat1["speedup_vs_hf"], 1.4),
        goal("best drafter vs HF assisted generation (code, greedy, batch 1)",
             code1 and code1.get("speedup_vs_hf_assisted"), 1.3),
        goal("measured / predicted speedup (code, greedy, batch 1, best drafter)",
             code1 and code1["measured_over_predicted"], 0.9),
        goal(f"batch {max(bss)}: worst dvi vs speculation off over domains, temperatures and kinds",
             min((r["speedup_vs_off"] for r in b16), default=None), 1.0),
        goal("hybrid vs HF prompt lookup (code, greedy, batch 1)",
             hyb_code and hyb_code.get("speedup_vs_hf_prompt_lookup"), 1.2),
        goal("hybrid vs HF generate (chat, greedy, batch 1)", hyb_chat and hyb_chat["speedup_vs_hf"], 1.3),
        goal(f"hybrid, batch {max(bss)}: worst vs speculation off over domains and temperatures",
             min((r["speedup_vs_off"] for r in hyb16), default=None), 1.0),
    ]
    return goals + (_gpu_goals(rows, bss) if on_cuda else [])


def _gpu_goals(rows: list[dict], bss: list[int]) -> list:
    """Issue 33's GPU goals (speculation off is the same in every row of a setting)."""
    def off_vs_hf(domain, b):
        r = _find(rows, domain, b=b)
        return r and r["dvi_off"]["tokens_per_s"] / r["hf_generate_tokens_per_s"]

    sfx = _find(rows, "code", "suffix")
    return [
        goal("GPU: dvi speculation off vs HF generate eager (code, greedy, batch 1)", off_vs_hf("code", 1), 5.0),
        goal("GPU: suffix vs dvi speculation off (code, greedy, batch 1)", sfx and sfx["speedup_vs_off"], 1.5),
        goal(f"GPU: dvi speculation off vs HF generate eager (code, greedy, batch {max(bss)})",
             off_vs_hf("code", max(bss)), 3.0),
    ]


def _report(bench: _Bench, rows: list[dict], goals: list, runtime_s: float) -> dict:
    """The JSON the benchmark writes: its settings, the models, a row per setting and kind, the goals."""
    target, args = bench.target, bench.args
    return dict(
        benchmark="decode",
        settings=vars(args) | {
            "device": str(target.device),
            "device_name": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
            "dtype": str(target.dtype),
            "torch_threads": torch.get_num_threads(),
        },
        models=dict(
            target_layers=target.config.num_hidden_layers, target_hidden=target.config.hidden_size,
            drafter_layers=bench.pair.drafter.config.num_hidden_layers, vocab=target.config.vocab_size,
            draft_vocab={k: _draft_vocab(d) for k, d in bench.drafters.items()},
        ),
        results=rows,
        goals=goals,
        runtime_s=runtime_s,
    )


def _print_table(rows: list[dict]) -> None:
    hdr = (
        f"{'domain':6s} {'T':>3s} {'B':>3s} {'kind':10s} {'dvi tok/s':>9s} {'off':>7s} {'HF':>7s} {'HFasst':>7s} {'alpha':>5s} "
        f"{'acc.len':>7s} {'K':>4s} {'xoff':>5s} {'xHF':>5s} {'xAsst':>5s} {'PLD':>7s} {'PLDxHF':>6s} {'xPLD':>5s} {'pred':>5s} "
        f"{'m/p':>5s} {'=off':>4s} {'PLD=':>4s}  per-position acceptance"
    )
    print("\n" + hdr)
    print("-" * len(hdr))
    for r in rows:
        pp = " ".join("-" if a is None else f"{a:.2f}" for a in r["dvi"]["per_position_acceptance"][:6])
        asst = r.get("hf_assisted_tokens_per_s")
        xa = r.get("speedup_vs_hf_assisted")
        ps, mp = r["predicted_speedup"], r["measured_over_predicted"]
        pld, pld_hf, xpld = (r.get(k) for k in ("hf_prompt_lookup_tokens_per_s", "hf_prompt_lookup_vs_hf",
                                                 "speedup_vs_hf_prompt_lookup"))
        print(
            f"{r['domain']:6s} {r['temperature']:3g} {r['batch_size']:3d} {r['kind']:10s} {r['dvi']['tokens_per_s']:9.1f} "
            f"{r['dvi_off']['tokens_per_s']:7.1f} {r['hf_generate_tokens_per_s']:7.1f} "
            f"{(f'{asst:7.1f}' if asst else '      -')} {fmt_rate(r['dvi']['alpha'], 2):>5} {fmt_rate(r['dvi']['mean_accepted_length'], 2):>7} "
            f"{r['mean_k']:4.1f} {r['speedup_vs_off']:5.2f} {r['speedup_vs_hf']:5.2f} "
            f"{(f'{xa:5.2f}' if xa else '    -')} {(f'{pld:7.1f}' if pld else '      -')} "
            f"{(f'{pld_hf:6.2f}' if pld_hf else '     -')} {(f'{xpld:5.2f}' if xpld else '    -')} {(f'{ps:5.2f}' if ps else '    -')} {(f'{mp:5.2f}' if mp else '    -')} "
            f"{_share(r.get('dvi_same_text_as_off'))} {_share(r.get('hf_prompt_lookup_same_text_as_hf'))}  {pp}"
        )


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    bench = _load(args)
    domains = [d for d in args.domains.split(",") if d]
    temps = [float(t) for t in args.temperatures.split(",") if t]
    bss = [int(b) for b in args.batch_sizes.split(",") if b]
    _warm_up(bench, bss)
    rows = [row for domain, temp, b in itertools.product(domains, temps, bss) for row in _measure(bench, domain, temp, b)]
    goals = _goals(rows, bss, bench.target.device.type == "cuda")
    out = _report(bench, rows, goals, time.perf_counter() - t_start)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str))
    _print_table(rows)
    print_goals(goals)
    print(f"\nwrote {path} ({out['runtime_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
