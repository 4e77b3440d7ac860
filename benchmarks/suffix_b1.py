"""Batch-1 greedy decoding of the suffix and hybrid kinds against a learned kind (`separate`, or `early_exit`) and speculation off (issue 26).

The real pair (SmolLM2-135M-Instruct, the preset's serving dtype), one thread, batch 1, greedy, `--n` new tokens,
held-out code and chat prompts plus a `repeat` workload where history repeats (the prompt holds code and asks
for it again, as an edit of a file the agent just read). Systems run interleaved per prompt (the first one
rotates), each engine keeps its suffix index across prompts, as a server does. Reports tokens/s, α and mean
accepted length per draft source, mean K, and the calibrated verify cost per K at batch 1 (where it bends).

    .venv/bin/python benchmarks/suffix_b1.py --prompts 4 [--json bench_results/suffix_b1.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (`dvi bench`, `python benchmarks/...`)
    sys.path.insert(0, str(ROOT))

from benchmarks._decode_arms import prompt_source
from dvi.decode.results import acceptance_rate, mean_accepted_length
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine

SYSTEMS = ("off", "learned", "suffix", "hybrid")


def _learned(pair, a):
    """The learned drafter: the pair's separate one, or (`--learned early_exit`) the saved early-exit dir."""
    from dvi.drafters.learned import EarlyExitDrafter, SeparateDrafter

    if a.learned == "separate":
        return SeparateDrafter(pair.drafter) if pair.drafter is not None else None
    from dvi.drafters.vocab import load_draft_vocab
    from dvi.models.loading import preset_draft_vocab

    path = Path(a.pair_dir) / "early_exit"
    rows = int(pair.target.get_output_embeddings().weight.shape[0])
    return EarlyExitDrafter.load(pair.target, path, vocab_ids=load_draft_vocab(path, preset_draft_vocab(a.preset), rows))


def _engines(pair, drafter, k_cap: int, threshold: float, systems: list[str], packed: bool,
             rows_kernel: bool | str) -> dict[str, SpeculativeEngine]:
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer
    from dvi.engine.options import EngineOptions

    vocab = int(pair.target.get_output_embeddings().weight.shape[0])
    sx = SuffixConfig(max_draft_tokens=k_cap, threshold=threshold)
    opts = EngineOptions(cpu_packed_weights=packed, cpu_rows_kernel=rows_kernel)
    out = {"off": SpeculativeEngine(pair.target, None, options=opts)}
    if "learned" in systems:
        out["learned"] = SpeculativeEngine(pair.target, proposer_for(pair.target, drafter), adaptive=True,
                                           options=opts)
    for kind in ("suffix", "hybrid"):
        if kind in systems:
            out[kind] = SpeculativeEngine(pair.target, make_proposer(kind, drafter, vocab, "cpu", settings=sx),
                                          adaptive=True, options=opts)
    return {s: out[s] for s in systems}


def _run(eng: SpeculativeEngine, prompt: list[int], n: int, rid: str) -> dict:
    eng.add_request(Request(rid, prompt, SamplingParams(max_new_tokens=n)))
    ks, t0, res = [], time.perf_counter(), None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                res = o.result
        ks.append(eng.last_k)
    return {"seconds": time.perf_counter() - t0, "tokens": len(res.token_ids), "steps": res.num_steps,
            "drafted": res.num_drafted, "accepted": res.num_accepted, "by_source": res.by_source,
            "k": ks, "token_ids": res.token_ids}


def _repeat_prompts(tok, seed: int, count: int) -> list[list[int]]:
    """Code the prompt shows, then asks for again: the output repeats the prompt (edits, re-reads, tool calls)."""
    stream = prompt_source("code", tok, seed + 5)
    out = []
    for _ in range(count):
        code = tok.decode(next(stream), skip_special_tokens=True)
        first = code.split("\n", 1)[0]
        out.append(tok.encode(code + "\n\n# The same code once more, unchanged:\n" + first + "\n"))
    return out


def _summary(runs: list[dict]) -> dict:
    sec, tok = sum(r["seconds"] for r in runs), sum(r["tokens"] for r in runs)
    src: dict[str, list[int]] = {}
    for r in runs:
        for s, c in r["by_source"].items():
            t = src.setdefault(s, [0, 0, 0])
            for j in range(3):
                t[j] += c[j]
    ks = [k for r in runs for k in r["k"]]
    return {"tokens_per_s": tok / sec, "tokens": tok, "seconds": sec,
            "alpha": acceptance_rate(sum(r["accepted"] for r in runs), sum(r["drafted"] for r in runs)),
            "mean_accepted_length": mean_accepted_length(sum(r["accepted"] for r in runs),
                                                         sum(r["steps"] for r in runs)),
            "mean_k": sum(ks) / max(1, len(ks)),
            "by_source": {s: {"drafts": c[0], "drafted": c[1], "accepted": c[2], "alpha": acceptance_rate(c[2], c[1]),
                              "mean_accepted_length": mean_accepted_length(c[2], c[0])} for s, c in src.items()}}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload")
    ap.add_argument("--workloads", default="code,chat,repeat")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--k-cap", type=int, default=16, help="longest suffix draft")
    ap.add_argument("--threshold", type=float, default=1.0, help="hybrid's suffix score threshold")
    ap.add_argument("--root", default=None, help="models cache root (default: dvi.models.embedded's)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="subset of off,learned,suffix,hybrid")
    ap.add_argument("--learned", default="separate", choices=["separate", "early_exit"],
                    help="the learned kind (alone and in hybrid); early_exit needs --pair-dir with early_exit/")
    ap.add_argument("--pair-dir", default=None, help="a dir with target/ and tokenizer/ (and drafter/) instead of "
                    "the built preset (suffix needs no drafter)")
    ap.add_argument("--packed", default="auto", choices=["auto", "true", "false"],
                    help="multi-row forwards on oneDNN-packed weights (`serve.cpu_packed_weights`; auto: as dvi serve)")
    ap.add_argument("--rows-kernel", default="auto", choices=["auto", "true", "false"],
                    help="steps and verifies on dvi's fp32 rows kernel (`serve.cpu_rows_kernel`; auto: as dvi serve)")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def _load(a: argparse.Namespace):
    """The pair at --pair-dir, else the built preset's."""
    from dvi.models.loading import load_embedded_pair

    if a.pair_dir:
        from dvi.models.loading import load_pair, serving_dtype

        d = Path(a.pair_dir)
        return load_pair(d / "target", d / "drafter" if (d / "drafter").is_dir() else None, d / "tokenizer",
                         device="cpu", dtype=serving_dtype(a.preset, "auto", "cpu"))
    return load_embedded_pair(a.preset, a.root)


def _workload(w: str, a: argparse.Namespace, tok, engines: dict) -> dict:
    """Every system on one workload's prompts (rotating who goes first), summarised per system and printed."""
    systems = list(engines)
    stream = prompt_source("code" if w == "repeat" else w, tok, 0)
    prompts = _repeat_prompts(tok, 0, a.prompts) if w == "repeat" else [next(stream) for _ in range(a.prompts)]
    runs: dict[str, list] = {s: [] for s in systems}
    for i, p in enumerate(prompts):
        order = systems[i % len(systems):] + systems[: i % len(systems)]
        for s in order:
            runs[s].append(_run(engines[s], p, a.n, f"{w}-{i}-{s}"))
        ref = runs["off"][-1]["token_ids"]
        same = {s: runs[s][-1]["token_ids"] == ref for s in systems}
        print(f"{w} prompt {i}: same output as off: {same}", flush=True)
    res = {s: _summary(r) for s, r in runs.items()}
    for s in systems:
        res[s]["speedup_vs_off"] = res[s]["tokens_per_s"] / res["off"]["tokens_per_s"]
    for s, r in res.items():
        src = ", ".join(f"{k}: α {v['alpha'] if v['alpha'] is None else round(v['alpha'], 3)} "
                        f"len {v['mean_accepted_length'] and round(v['mean_accepted_length'], 2)}"
                        for k, v in r["by_source"].items())
        print(f"{w:7s} {s:9s} {r['tokens_per_s']:7.1f} tok/s  x{r['speedup_vs_off']:.2f}  mean K "
              f"{r['mean_k']:.1f}  {src}", flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    pair = _load(a)
    tok = pair.tokenizer
    systems = [s for s in a.systems.split(",") if s]
    from dvi.engine.options import packed_weights

    packed = packed_weights({"true": True, "false": False}.get(a.packed, "auto"), pair.target)
    rows_kernel = {"true": True, "false": False}.get(a.rows_kernel, "auto")
    engines = _engines(pair, _learned(pair, a), a.k_cap, a.threshold, systems, packed, rows_kernel)
    with torch.inference_mode():
        for e in engines.values():
            e.calibrate([1])
    sfx = engines.get("suffix") or engines.get("hybrid")
    verify_ms = {k: round(v * 1e3, 2) for k, v in sorted(sfx.controller.costs.verify[1].items())} if sfx else {}
    print("calibrated verify ms per K at batch 1 (suffix engine):", verify_ms, "dtype", pair.target.dtype, flush=True)
    warm = prompt_source("code", tok, 99)
    for name, e in engines.items():
        _run(e, next(warm), 16, f"warm-{name}")
    out: dict = {"settings": vars(a), "verify_ms_b1": verify_ms,
                 "workloads": {w: _workload(w, a, tok, engines) for w in a.workloads.split(",")}}
    for name, e in engines.items():
        st = e.proposer.stats()
        if st:
            print(f"{name}: index {st}; tree seconds/step median "
                  f"{sorted(e.suffix_step_seconds)[len(e.suffix_step_seconds) // 2] * 1e6:.0f} us", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
