"""Host work per generated token, measured where nobody has a GPU (issue 33 §5).

The target's architecture (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head dim 64, vocabulary 49,152) at
width 64 with random weights, on the CPU, one thread: the arithmetic nearly vanishes and what remains is the
host work a GPU would wait on. Per arm: aten ops dispatched per generated token (counted with a
`TorchDispatchMode`: a count that stands in for kernel launches and does not wobble on a shared machine) and
wall milliseconds per token (median of --reps runs). Arms: dvi with speculation off, dvi `suffix` (K = 4), dvi
`separate` (a 1-layer drafter of the same width, K = 4) and HF `generate`; plus one `suffix` verify step of
width 16 (15 drafts + the last token). 200-token prompt, 64 new tokens, greedy.

Prints a table and writes JSON with a `goals` list. Exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active (by name too)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_name: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.by_name[str(func)] += 1
        return func(*args, **(kwargs or {}))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dvi bench overhead", description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench_results/overhead.json")
    p.add_argument("--dtype", default="float32", help="float32 (what this CPU serves) | bfloat16")
    p.add_argument("--width", type=int, default=64, help="hidden size (one head of 64 per 64)")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5, help="timed runs per arm (median reported)")
    p.add_argument("--verify-width", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def models(width: int, dtype: torch.dtype, seed: int):
    """The target at `width` and a 1-layer drafter of the same shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, width // 64 * 9 // 9)  # SmolLM2: head dim 64; keep the 3:1 query / KV head ratio where it fits
    kv = max(1, heads // 3)
    common = dict(vocab_size=49152, hidden_size=width, intermediate_size=width * 8 // 3, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30, **common)).eval().to(dtype)
    drafter = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **common)).eval().to(dtype)
    return target, drafter


def engine_for(kind: str, target, drafter) -> SpeculativeEngine:
    from dvi.drafters.factory import make_proposer

    if kind == "plain":
        return SpeculativeEngine(target, None, num_draft_tokens=0, adaptive=False)
    if kind == "separate":
        return SpeculativeEngine(target, proposer_for(target, drafter),
                                 num_draft_tokens=4, adaptive=False, max_draft_tokens=4)
    from dvi.config import SuffixConfig

    prop = make_proposer("suffix", None, target.config.vocab_size, "cpu", settings=SuffixConfig(max_draft_tokens=4))
    return SpeculativeEngine(target, prop, num_draft_tokens=4, adaptive=False, max_draft_tokens=4)


def run_dvi(eng: SpeculativeEngine, prompt: list[int], n: int) -> dict:
    eng.add_request(Request(f"r{time.perf_counter_ns()}", list(prompt), SamplingParams(max_new_tokens=n)))
    steps = 0
    res = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                res = o.result
        steps += 1
    return {"tokens": len(res.token_ids), "steps": steps, "drafted": res.num_drafted, "accepted": res.num_accepted}


def run_hf(target, prompt: list[int], n: int) -> dict:
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return {"tokens": int(out.shape[1] - ids.shape[1]), "steps": int(out.shape[1] - ids.shape[1])}


def measure(fn, reps: int) -> dict:
    """Ops counted on one run, wall time the median of `reps` more (after one warm-up)."""
    fn()
    counter = OpCounter()
    with torch.inference_mode(), counter:
        info = fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        with torch.inference_mode():
            fn()
        times.append(time.perf_counter() - t0)
    tok = max(1, info["tokens"])
    return {**info, "ops": counter.total, "ops_per_token": counter.total / tok,
            "ms_per_token": statistics.median(times) / tok * 1e3, "ms_runs": [t * 1e3 for t in times],
            "top_ops": {k: v / tok for k, v in counter.by_name.most_common(12)}}


def verify_step(target, prompt: list[int], width: int, reps: int) -> dict:
    """One `suffix` step that verifies `width` positions: a prompt made of a repeated pattern, so the request's
    own suffix index proposes width - 1 drafts, and the step timed from proposal to emitted tokens."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    pattern = prompt[:40]
    rep_prompt = (pattern * (len(prompt) // len(pattern) + 2))[: len(prompt)]
    prop = make_proposer("suffix", None, target.config.vocab_size, "cpu",
                          settings=SuffixConfig(max_draft_tokens=width - 1))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=width - 1, adaptive=False, max_draft_tokens=width - 1)
    ops, times, ks = [], [], []
    for i in range(2 * reps + 1):  # a warm-up, then counted and timed steps alternately: the op counter's Python
        counted = i % 2 == 1       # dispatch hook costs more than the ops it counts, so no timed step runs under it
        eng.add_request(Request(f"v{i}", list(rep_prompt), SamplingParams(max_new_tokens=width + 2)))
        with torch.inference_mode():
            eng._admit()  # the prefill, outside the timed step (the pattern's next 15 tokens are proposed next)
        counter = OpCounter()
        t0 = time.perf_counter()
        with torch.inference_mode(), counter if counted else contextlib.nullcontext():
            eng.step()
        dt = time.perf_counter() - t0
        if i:
            ks.append(eng.last_k)
            if counted:
                ops.append(counter.total)
            else:
                times.append(dt)
        eng.abort(f"v{i}")
        eng.step()
    return {"width": width, "k": ks, "ops": ops, "ms": statistics.median(times) * 1e3,
            "ms_runs": [t * 1e3 for t in times]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    target, drafter = models(args.width, dtype, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, 49152, (args.prompt_tokens,), generator=g).tolist()
    n = args.new_tokens
    arms = {}
    for kind in ("plain", "suffix", "separate"):
        eng = engine_for(kind, target, drafter)
        arms[f"dvi {kind}"] = measure(lambda eng=eng: run_dvi(eng, prompt, n), args.reps)
    arms["HF generate"] = measure(lambda: run_hf(target, prompt, n), args.reps)
    verify = verify_step(target, prompt, args.verify_width, args.reps)

    print(f"\noverhead: target architecture at width {args.width}, {args.dtype}, 1 thread, "
          f"{args.prompt_tokens}-token prompt, {n} new tokens")
    print(f"{'arm':<14} {'ops/token':>10} {'ms/token':>9} {'tokens/step':>12}")
    for name, a in arms.items():
        print(f"{name:<14} {a['ops_per_token']:>10.0f} {a['ms_per_token']:>9.2f} {a['tokens'] / a['steps']:>12.2f}")
    print(f"suffix verify step of width {verify['width']} (K = {verify['k'][0]}): {statistics.median(verify['ops']):.0f} "
          f"ops, {verify['ms']:.2f} ms")
    plain, hf = arms["dvi plain"], arms["HF generate"]
    goals = [
        goal("dvi plain aten ops per token", plain["ops_per_token"], 925, higher_is_better=False),
        goal("dvi plain host ms per token", plain["ms_per_token"], 4.3, higher_is_better=False),
        goal(f"suffix verify step of width {verify['width']}, ms", verify["ms"], 15.0, higher_is_better=False),
        goal("dvi plain ops / HF generate ops", plain["ops_per_token"] / hf["ops_per_token"], 1.0, higher_is_better=False),
    ]
    print_goals(goals)
    out = clean_json({"settings": vars(args), "torch": torch.__version__, "arms": arms, "verify_step": verify,
                      "goals": goals})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
