"""Greedy text behind vLLM, its causes apart (issue 60 §1): vLLM's kernels, vLLM's speculation, dvi's drafter swap,
and the weights dvi hands vLLM.

Each arm starts one vLLM (`serving.vllm_process`, as `dvi serve` does) on the pair exported from dvi in a dtype
(`fp32`: the checkpoint's own float32 weights; `bf16`: the pair loaded in bfloat16, as `models.dtype auto` loads it on
a bf16-native CPU, then served by vLLM in float32), with speculation off or on (dvi's drafter, K draft tokens),
optionally with a drafter swap (dvi's in-place reload of a perturbed drafter) before its requests, and optionally
with environment overrides for vLLM over what dvi sets (e.g. ONEDNN_DEFAULT_FPMATH_MODE=BF16 over dvi's STRICT). The same prompts (code completions and SQL
chats, as the demo sends) go to every arm, `--concurrency` in flight, greedy, `--max-tokens` each (EOS ignored).

Per arm: against the fp32 reference (the checkpoint's target in float32, transformers, teacher-forced on the arm's
own text, as `demo.greedy` checks): positions whose token is not the reference's argmax, split into float32
near-ties and changed tokens with their gaps; the largest deviation of vLLM's top-k log-prob gaps from the
reference's logit gaps (the kernels' error, measured); the same against the bf16-rounded weights' own fp32
reference. Between arms: answers whose text equals (speculation on vs off, swap vs no swap).

    .venv/bin/python benchmarks/vllm_greedy.py [--prompts 24] [--max-tokens 64] [--arms off-fp32,on-fp32,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import goal, print_goals, write_json

ARMS = {  # name: (weights, speculation, swap)
    "off-bf16": ("bf16", False, False), "on-bf16": ("bf16", True, False),
    "off-fp32": ("fp32", False, False), "on-fp32": ("fp32", True, False), "swap-fp32": ("fp32", True, True),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dvi bench vllm_greedy", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--prompts", type=int, default=24, help="half code completions, half SQL chats")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step with speculation on")
    p.add_argument("--arms", default="off-bf16,on-bf16,off-fp32,on-fp32,swap-fp32",
                   help=f"comma list of {sorted(ARMS)}; NAME@KEY=VALUE[;KEY=VALUE] adds environment overrides")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--json", default="bench_results/vllm_greedy.json")
    return p.parse_args(argv)


def prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    from dvi.data import prompt_stream, sql_prompt_stream

    code, sql = prompt_stream("code", tok, seed=seed), sql_prompt_stream(tok, seed=seed)
    return [next(code) if i % 2 == 0 else next(sql) for i in range(n)]


def parse_arm(spec: str) -> tuple[str, tuple[str, bool, bool], dict[str, str]]:
    name, _, env = spec.partition("@")
    if name not in ARMS:
        sys.exit(f"unknown arm {name!r}: one of {sorted(ARMS)}")
    pairs = dict(kv.split("=", 1) for kv in env.split(";") if kv) if env else {}
    return spec, ARMS[name], pairs


def load(cfg, dtype: str):
    from serving.loading import load_serving_pair

    return load_serving_pair(cfg.model_copy(update={"models": cfg.models.model_copy(update={"dtype": dtype})}))


def run_arm(cfg, pair, root: Path, spec: bool, swap: bool, env: dict[str, str], k: int, ids: list[list[int]],
            args) -> dict:
    from serving.vllm_drafter import ServedDrafter
    from serving.vllm_greedy import complete
    from serving.vllm_process import VllmProcess, export_pair, write_tensors

    tdir, ddir = export_pair(pair.target, pair.drafter, pair.tokenizer, root)
    served = ServedDrafter.of_model(ddir, pair.drafter)
    served.write_all()
    proc = VllmProcess(cfg.serve.vllm, tdir, ddir, "dvi", k if spec else 0, args.top_k, root / "vllm.log")
    pinned = proc.env
    proc.env = lambda: {**pinned(), **env}  # the arm's overrides over what dvi pins (FP32_EXACT_ENV)
    t0 = time.perf_counter()
    proc.start()
    start_s = time.perf_counter() - t0
    try:
        swap_info = None
        if swap:  # the drafter's decoder layers + noise, loaded in place as dvi's swap does
            g = torch.Generator().manual_seed(1)
            new = {n: (v + torch.randn(v.shape, generator=g) * 0.2 * float(v.float().std())).to(v.dtype)
                   if ".layers." in n and v.ndim == 2 else v for n, v in pair.drafter.state_dict().items()}
            changed = served.diff(new, 1)
            cand = root / "candidate.safetensors"
            write_tensors(changed, cand)
            r = httpx.post(proc.url + "/collective_rpc", timeout=300,
                           json={"method": "dvi_reload_drafter", "args": [str(cand)]})
            swap_info = {"status": r.status_code, "tensors": len(changed)}

        t0 = time.perf_counter()
        answers = complete(proc.url, "dvi", ids, args.max_tokens, top_k=args.top_k, concurrency=args.concurrency)
        gen_s = time.perf_counter() - t0
    finally:
        proc.stop()
    return {"answers": answers, "start_s": start_s, "gen_s": gen_s, "swap": swap_info}


def judge(ref_model, ids: list[list[int]], answers: list[dict]) -> dict:
    """The arm's answers teacher-forced through `ref_model` (float32), as the demo's check judges them (no device
    bound: float32 near-ties only), and vLLM's deviation from it (`serving.vllm_greedy.deviation`)."""
    from serving.vllm_greedy import classify, deviation, teacher_forced

    out = {"answers": len(answers), "equal": 0, "positions": 0, "near_ties": 0, "changed": [], "max_dev": 0.0}
    for p, a in zip(ids, answers, strict=True):
        toks = a["tokens"]
        logits = teacher_forced(ref_model, p, toks)
        top = logits.max(-1).values
        gaps = top - logits.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        out["positions"] += len(toks)
        bad = (gaps > 0).nonzero().flatten().tolist()
        out["equal"] += not bad
        for i in bad:
            if classify(float(gaps[i]), float(top[i]), 0.0, torch.float32) == "near-tie":
                out["near_ties"] += 1
            else:
                out["changed"].append({"index": i, "gap": round(float(gaps[i]), 6)})
        out["max_dev"] = max(out["max_dev"], deviation(logits, toks, a["top"]))
    out["max_dev"] = round(out["max_dev"], 6)
    return out


def same_text(a: list[dict], b: list[dict]) -> dict:
    firsts = []
    for x, y in zip(a, b, strict=True):
        i = next((j for j, (s, t) in enumerate(zip(x["tokens"], y["tokens"], strict=False)) if s != t), None)
        if i is not None:
            firsts.append(i)
    return {"equal": len(a) - len(firsts), "answers": len(a), "first_divergences": firsts[:8]}


def main(argv=None) -> int:
    args = parse_args(argv)
    from dvi.config import load_config
    from dvi.models.loading import load_causal_lm, load_tokenizer
    from serving.loading import pair_paths

    cfg = load_config(None, [f"models.preset={args.preset}", "serve.engine=vllm", "wandb.mode=disabled",
                             "serve.vllm.max_model_len=1024"])
    target_dir = pair_paths(cfg)[0]
    tok = load_tokenizer(pair_paths(cfg)[2])
    ids = prompts(tok, args.prompts)
    arms = [parse_arm(s) for s in args.arms.split(",") if s]
    ref32 = load_causal_lm(target_dir, "cpu", "float32")
    ref_b = None
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dvi-vllm-greedy-") as tmp:
        pairs = {}
        for spec, (weights, speculate, swap), env in arms:
            if weights not in pairs:
                pairs[weights] = load(cfg, "float32" if weights == "fp32" else "bfloat16")
            print(f"arm {spec}: weights {weights}, speculation {'on' if speculate else 'off'}"
                  f"{', after a drafter swap' if swap else ''}{', env ' + json.dumps(env) if env else ''} ...", flush=True)
            root = Path(tmp) / spec.replace("@", "_").replace(";", "_").replace("=", "-")
            res = run_arm(cfg, pairs[weights], root, speculate, swap, env, args.k, ids, args)
            res["judge_fp32"] = judge(ref32, ids, res["answers"])
            if weights == "bf16":
                if ref_b is None:
                    ref_b = load_causal_lm(target_dir, "cpu", "bfloat16").float()
                res["judge_bf16_weights"] = judge(ref_b, ids, res["answers"])
            results[spec] = res
            j = res["judge_fp32"]
            print(f"  vs fp32 reference: {j['equal']}/{j['answers']} equal, {j['positions']} positions, "
                  f"{j['near_ties']} near-ties, {len(j['changed'])} changed (first {j['changed'][:3]}), "
                  f"max |log-prob gap - ref logit gap| {j['max_dev']:.2e}; start {res['start_s']:.0f}s, "
                  f"generation {res['gen_s']:.0f}s", flush=True)
            if "judge_bf16_weights" in res:
                jb = res["judge_bf16_weights"]
                print(f"  vs the bf16-rounded weights in fp32: {jb['equal']}/{jb['answers']} equal, {jb['near_ties']} "
                      f"near-ties, {len(jb['changed'])} changed, max dev {jb['max_dev']:.2e}", flush=True)
    comparisons = {}
    names = list(results)
    for a in names:
        for b in names:
            if a < b and ARMS[a.split("@")[0]][0] == ARMS[b.split("@")[0]][0]:
                comparisons[f"{a} vs {b}"] = c = same_text(results[a]["answers"], results[b]["answers"])
                print(f"{a} vs {b}: {c['equal']}/{c['answers']} answers equal; first divergences {c['first_divergences']}")
    goals = [goal(f"{n}: tokens changed vs the fp32 reference", len(r["judge_fp32"]["changed"]), 0, False)
             for n, r in results.items()]
    goals += [goal(f"{k}: answers equal", c["equal"] / c["answers"], 1.0) for k, c in comparisons.items()]
    print_goals(goals)
    for r in results.values():
        for a in r["answers"]:
            a.pop("top")
    write_json(args.json, {"host": platform.processor() or platform.machine(), "args": vars(args), "arms": results,
                           "comparisons": comparisons, "goals": goals})
    return 0


if __name__ == "__main__":
    sys.exit(main())
