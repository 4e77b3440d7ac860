"""Does greedy mean the same answer in the served dtype? (issue 27 §6)

On the real target in its serving dtype (bf16 on this CPU), one request at a time, greedy:
  1. width: logits of a (K+1)-token verify against the same positions decoded by 1-token steps (max abs
     logit difference, argmax flips, positions whose final hidden state differs at all, flips if the
     head ran in fp32 over the same bf16 hidden state), for the engine's target forward and, where the
     code has the switch, the forward without width-invariant attention; plus the lean prefill's last
     logits against HF's own forward;
  2. agreement: token-for-token equality of 64-token greedy completions with speculation (each drafter
     kind) vs without, and without vs HF `generate`, over unseen code and chat prompts; at each first
     divergence, the reference's top-2 logit gap against the dtype's rounding bound (dvi.decode.sampling.tie_bound);
  3. cost: tokens/s with speculation, width-invariant attention on vs off, interleaved per prompt.
Prints a table and writes JSON with a `goals` list. Runs against whatever `dvi` is importable, so the same
script measures an older checkout (PYTHONPATH) for "before" numbers.

  PYTHONPATH=$PWD timeout 900 python benchmarks/greedy_agreement.py --prompts 16 --out /tmp/ga.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import clean_json, goal  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default=None, help="target dir (default: the embedded smollm2 target)")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: next to the target)")
    p.add_argument("--drafter", default=None, help="separate drafter dir (default: the embedded one, if built)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=16, help="unseen prompts, half code, half chat")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="drafts per step (fixed K)")
    p.add_argument("--kinds", default="separate,eagle,early_exit",
                   help="drafter kinds; separate needs a drafter dir, eagle/early_exit run untrained if not built")
    p.add_argument("--early-exit-layers", type=int, default=8)
    p.add_argument("--width-prompts", type=int, default=4)
    p.add_argument("--timing-prompts", type=int, default=4)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--batch", type=int, default=0,
                   help="also decode the first N prompts as one ragged batch, default vs exact mode (0: skip)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default="greedy_agreement.json")
    return p.parse_args(argv)


def prompts(tok, n: int, seed: int) -> list[list[int]]:
    """n held-out prompts: alternately a code cut and a rendered chat instruction."""
    from dvi import data

    code = data.prompt_stream("code", tok, split="heldout", prompt_tokens=(48, 96), seed=seed)
    chat = data.chat_prompt_stream(tok, "heldout", seed=seed, max_tokens=320)
    return [list(next(code if i % 2 == 0 else chat)) for i in range(n)]


def target_fn(target, features: bool, invariant: bool | None):
    """The target forward as the engine builds it (invariant None), or with the switch set if it exists."""
    from dvi.decode.forward import model_forward

    if invariant is None:
        return model_forward(target, with_features=features)
    try:
        return model_forward(target, with_features=features, width_invariant=invariant)
    except TypeError:  # older code: no switch
        return None


@torch.inference_mode()
def width_check(target, ps: list[list[int]], k: int, steps: int, invariant: bool | None) -> dict | None:
    """1-token steps vs (K+1)-token forwards over the same tokens: logit and hidden-state differences."""
    from dvi.decode.kv import prefill

    fn = target_fn(target, True, invariant)
    if fn is None:
        return None
    w = target.get_output_embeddings().weight.float()
    st = dict(positions=0, max_abs_logit_diff=0.0, argmax_flips=0, fp32_head_flips=0, hidden_differs=0,
              exact_top2_ties=0, max_diff_in_eps_x_top=0.0)
    eps = torch.finfo(target.dtype).eps
    for p in ps:
        kv = prefill(target.config, fn, [p[:-1]], target.device, target.dtype)
        last, seq, one = p[-1], [p[-1]], []
        for _ in range(steps):
            lg, f = kv.forward(fn, torch.tensor([[last]]))
            one.append((lg[0, -1].float(), f[0, -1]))
            last = int(lg[0, -1].argmax())
            seq.append(last)
        kv = prefill(target.config, fn, [p[:-1]], target.device, target.dtype)
        for s in range(0, steps - k, k + 1):
            lg, f = kv.forward(fn, torch.tensor([seq[s : s + k + 1]]))
            for j in range(k + 1):
                (a, fa), b, fb = one[s + j], lg[0, j].float(), f[0, j]
                top = a.topk(2).values
                st["positions"] += 1
                st["max_abs_logit_diff"] = max(st["max_abs_logit_diff"], float((a - b).abs().max()))
                st["argmax_flips"] += int(a.argmax() != b.argmax())
                rel = float((a - b).abs().max()) / (eps * max(1.0, abs(float(top[0]))))
                st["max_diff_in_eps_x_top"] = max(st["max_diff_in_eps_x_top"], rel)
                st["fp32_head_flips"] += int((fa.float() @ w.T).argmax() != (fb.float() @ w.T).argmax())
                st["hidden_differs"] += int(bool((fa != fb).any()))
                st["exact_top2_ties"] += int(top[0] == top[1])
    return st


@torch.inference_mode()
def prefill_vs_hf(target, ps: list[list[int]]) -> float:
    """Max abs difference of the last-position logits: the engine's prefill vs HF's own forward (last
    position only, as `generate` runs it: the head over all L rows would round differently past 32 rows)."""
    from dvi.decode.kv import prefill

    fn, worst = target_fn(target, True, None), 0.0
    for p in ps:
        kv, out = prefill(target.config, fn, [p], target.device, target.dtype, return_output=True)
        hf = target(torch.tensor([p]), logits_to_keep=1).logits[0, -1].float()  # as `generate` asks for them
        worst = max(worst, float((out[0][0, -1].float() - hf).abs().max()))
        del kv
    return worst


def build_drafters(target, kinds: list[str], drafter_dir: Path | None, layers: int) -> dict:
    """name -> drafter: the built ones when present, else untrained eagle / plain early exit (the verify
    width, not the acceptance rate, is what decides agreement)."""
    from dvi.drafters.eagle import EagleDrafter
    from dvi.drafters.learned import EarlyExitDrafter, SeparateDrafter
    from dvi.models.loading import load_causal_lm

    out = {}
    for kind in kinds:
        if kind == "separate" and drafter_dir is not None and drafter_dir.is_dir():
            out[kind] = SeparateDrafter(load_causal_lm(drafter_dir, "cpu", target.dtype))
        elif kind == "eagle":
            out[kind] = EagleDrafter(target)
        elif kind == "early_exit":
            out[kind] = EarlyExitDrafter(target, layers, lora_rank=0)
    return out


@torch.inference_mode()
def hf_greedy(target, p: list[int], n: int) -> list[int]:
    ids = torch.tensor([p])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, eos_token_id=None, pad_token_id=0, temperature=None, top_p=None,
                          top_k=None)
    return out[0, len(p):].tolist()


def engine_greedy(target, drafter, p: list[int], n: int, k: int, invariant: bool | None = None
                  ) -> tuple[list[int], float, list[torch.Tensor]]:
    """The engine's greedy completion, its seconds, and (plain decoding) each step's logits [V]."""
    from dvi.decode.engine import SpeculativeEngine

    eng = SpeculativeEngine(target, drafter, num_draft_tokens=k, adaptive=False)
    if invariant is not None:
        fn = target_fn(target, False, invariant)
        if fn is not None:
            eng._tfn = fn
            if eng._features:
                eng._tfn_f = target_fn(target, True, invariant)
    tops: list[torch.Tensor] = []
    if drafter is None:
        orig = eng._tfn

        def spy(ids, *a, **kw):
            out = orig(ids, *a, **kw)
            if ids.shape[1] == 1:
                tops.append(out[0, -1].float())
            return out

        spy.explicit_mask = getattr(orig, "explicit_mask", False)
        eng._tfn = spy
    t0 = time.perf_counter()
    res = eng.generate([p], n)[0]
    return list(res.token_ids), time.perf_counter() - t0, tops


def divergence(ref: list[int], other: list[int], tops: list[torch.Tensor], dtype) -> dict | None:
    """`dvi.decode.sampling.first_divergence` (the gap at the first divergence against the dtype's tie bound);
    on code without it (a "before" checkout) the index and gap alone."""
    try:
        from dvi.decode.sampling import first_divergence
    except ImportError:
        i = next((j for j, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b), None)
        if i is None:
            return None
        top = tops[i].max()
        return {"index": i, "gap": float(top - tops[i][other[i]]), "top": float(top), "bound": None, "near_tie": None}
    return first_divergence(ref, other, tops, dtype)


def agreement(target, drafters: dict, ps: list[list[int]], n: int, k: int, hf: bool) -> dict:
    """Per drafter kind (and HF generate): how many completions equal the plain decode, token for token."""
    rows = {name: {"equal": 0, "n": 0, "divergences": []} for name in [*drafters, *(["hf_generate"] if hf else [])]}
    for pi, p in enumerate(ps):
        ref, _, tops = engine_greedy(target, None, p, n, k)
        others = {name: engine_greedy(target, d, p, n, k)[0] for name, d in drafters.items()}
        if hf:
            others["hf_generate"] = hf_greedy(target, p, n)
        for name, out in others.items():
            r = rows[name]
            r["n"] += 1
            div = divergence(ref, out, tops, target.dtype)
            if div is None:
                r["equal"] += 1
            else:
                r["divergences"].append({"prompt": pi, **div})
        print(f"  prompt {pi}: " + " ".join(f"{k_}={'=' if o == ref else 'DIFF'}" for k_, o in others.items()),
              flush=True)
    for r in rows.values():
        r["rate"] = r["equal"] / max(1, r["n"])
    return rows


def batched(target, drafter, ps: list[list[int]], n: int, k: int) -> dict | None:
    """One ragged batch with speculation, default vs `models.exact_greedy`: requests equal to their plain
    decode, first divergences, seconds."""
    try:
        from dvi.decode.numerics import set_exact_greedy
        from dvi.decode.target import plain_greedy
    except ImportError:
        return None
    from dvi.decode.engine import SpeculativeEngine
    from dvi.decode.sampling import first_divergence

    refs = [plain_greedy(target, p, n) for p in ps]
    out = {}
    for exact in (False, True):
        set_exact_greedy(target, exact)
        eng = SpeculativeEngine(target, drafter, num_draft_tokens=k, adaptive=False)
        t0 = time.perf_counter()
        res = eng.generate(ps, n)
        secs = time.perf_counter() - t0
        divs = [first_divergence(r, list(g.token_ids), lg, target.dtype) for (r, lg), g in zip(refs, res, strict=True)]
        out["exact" if exact else "default"] = {"equal": sum(d is None for d in divs), "n": len(ps), "seconds": secs,
                                                "divergences": [d for d in divs if d]}
    set_exact_greedy(target, False)
    return out


def timing(target, drafter, ps: list[list[int]], n: int, k: int) -> dict | None:
    """Tokens/s with speculation, width-invariant attention on vs off, interleaved prompt by prompt."""
    if target_fn(target, False, False) is None:
        return None
    secs = {True: 0.0, False: 0.0}
    toks = {True: 0, False: 0}
    engine_greedy(target, drafter, ps[0], 8, k, True)  # warm-up
    for p in ps:
        for inv in (False, True):
            out, s, _ = engine_greedy(target, drafter, p, n, k, inv)
            secs[inv] += s
            toks[inv] += len(out)
    on, off = toks[True] / secs[True], toks[False] / secs[False]
    return {"tok_s_invariant": on, "tok_s_plain": off, "cost": off / on - 1.0}


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import find_tokenizer_path, load_causal_lm, load_tokenizer

    emb = embedded_paths("smollm2")
    tpath = Path(args.target) if args.target else emb.target
    target = load_causal_lm(tpath, "cpu", args.dtype)
    tok = load_tokenizer(args.tokenizer or find_tokenizer_path(tpath))
    dpath = Path(args.drafter) if args.drafter else emb.drafter
    drafters = build_drafters(target, [x for x in args.kinds.split(",") if x], dpath, args.early_exit_layers)
    ps = prompts(tok, args.prompts, args.seed)
    wps = prompts(tok, args.width_prompts, args.seed + 1000)
    t0 = time.perf_counter()
    width = {"engine": width_check(target, wps, args.k, 40, None),
             "width_invariant_off": width_check(target, wps, args.k, 40, False)}
    pre = prefill_vs_hf(target, wps)
    print(f"width ({time.perf_counter() - t0:.0f}s): {json.dumps(width)}\nprefill vs HF max |dlogit|: {pre}",
          flush=True)
    agree = agreement(target, drafters, ps, args.max_new_tokens, args.k, not args.skip_hf)
    first = next(iter(drafters.values()), None)
    cost = timing(target, first, ps[: args.timing_prompts], args.max_new_tokens, args.k) if first else None
    batch = batched(target, first, ps[: args.batch], args.max_new_tokens, args.k) if first and args.batch else None
    report(args, target.dtype, width, pre, agree, cost, len(ps), batch)
    return 0


def report(args, dtype, width, pre, agree, cost, n, batch=None) -> None:
    print(f"\n{'comparison':<28}{'equal':>8}{'rate':>8}  first divergences (gap <= bound?)")
    for name, r in agree.items():
        divs = ", ".join(f"p{d['prompt']}@{d['index']} gap {d['gap']:.3f}/{d['bound'] or float('nan'):.3f}"
                         for d in r["divergences"])
        label = "plain vs HF generate" if name == "hf_generate" else f"spec ({name}) vs plain"
        print(f"{label:<28}{r['equal']:>5}/{r['n']:<2}{r['rate']:>8.2f}  {divs}")
    if cost:
        print(f"tokens/s with speculation: width-invariant {cost['tok_s_invariant']:.1f}, plain "
              f"{cost['tok_s_plain']:.1f} (cost {100 * cost['cost']:+.1f}%)")
    for mode, b in (batch or {}).items():
        print(f"batch of {b['n']}, {mode} mode: {b['equal']}/{b['n']} equal to the plain decode, {b['seconds']:.1f} s; "
              + ", ".join(f"@{d['index']} gap {d['gap']:.3f}/{d['bound']:.3f}" for d in b["divergences"]))
    goals = [goal(f"greedy_agreement_{name}", r["rate"], 0.95) for name, r in agree.items()]
    if batch:
        goals.append(goal("exact_mode_batch_agreement", batch["exact"]["equal"] / batch["exact"]["n"], 1.0))
    goals.append(goal("divergences_beyond_tie_bound", float(sum(
        not d["near_tie"] for r in agree.values() for d in r["divergences"] if d["near_tie"] is not None)), 0,
        higher_is_better=False))
    if width["engine"]:
        goals.append(goal("verify_vs_step_max_abs_logit_diff", width["engine"]["max_abs_logit_diff"], 0.0,
                          higher_is_better=False))
    if cost:
        goals.append(goal("width_invariant_speed_cost", cost["cost"], 0.10, higher_is_better=False))
    out = {"dtype": str(dtype), "prompts": n, "max_new_tokens": args.max_new_tokens, "k": args.k,
           "threads": args.threads, "width": width, "prefill_vs_hf_max_abs_logit_diff": pre,
           "agreement": agree, "speed": cost, "batched": batch, "goals": goals}
    Path(args.out).write_text(json.dumps(clean_json(out), indent=1))
    print(json.dumps(goals, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
