"""An eagle head in the engine, batch 1, greedy, on prompts no build saw: what `dvi serve` would get from it on
this machine, without HTTP (issue 34's served goals, measured before a pair is built around the head).

Arms, prompt by prompt in rotating order (a busy spell on the shared CPU hits each alike): speculation off (K = 0)
and the head at fixed K (`--k`, default 4) and adaptive K. Per arm and domain: tokens/s, speedup over off, drafted
steps, accepted length per drafting step, per-position acceptance (share of drafting steps whose first i drafts
were all accepted), and whether its text equals speculation off's.

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/eagle_served.py --head DIR [--target DIR] [--json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(prog="eagle_served", description=__doc__.splitlines()[0])
    p.add_argument("--head", required=True, help="an EagleDrafter.save() dir (with draft_vocab.safetensors)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", default="bench_results/eagle_served.json")
    return p.parse_args(argv)


def prompts_of(tok, n: int) -> dict[str, list[list[int]]]:
    from benchmarks._ceiling_data import CHAT_EVAL
    from benchmarks._prompts import pip_code_prompts
    from dvi import data

    return {"code": pip_code_prompts(tok, n, seed=1),
            "chat": [data.render_chat(tok, [{"role": "user", "content": c}]) for c in CHAT_EVAL[:n]]}


def run_arm(eng, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    r = eng.generate([prompt], n)[0]
    return {"seconds": time.perf_counter() - t0, "tokens": list(r.token_ids), "steps": r.num_steps,
            "drafted": r.num_drafted, "accepted": r.num_accepted,
            "acc_pos": list(r.accepted_per_position), "draft_pos": list(r.drafted_per_position)}


def summarise(runs: list[dict], off: list[dict] | None) -> dict:
    secs, toks = sum(r["seconds"] for r in runs), sum(len(r["tokens"]) for r in runs)
    width = max((len(r["acc_pos"]) for r in runs), default=0)
    acc = [sum(r["acc_pos"][i] for r in runs if i < len(r["acc_pos"])) for i in range(width)]
    first = sum(r["draft_pos"][0] for r in runs if r["draft_pos"])  # drafting steps
    out = {"tokens_per_s": toks / secs, "tokens": toks, "seconds": secs, "drafting_steps": first,
           "steps": sum(r["steps"] for r in runs),
           "accept_length": sum(acc) / first if first else None,
           "acceptance_per_position": [a / first for a in acc] if first else [],
           "alpha": sum(r["accepted"] for r in runs) / max(1, sum(r["drafted"] for r in runs))}
    if off is not None:
        out["speedup"] = (toks / secs) / (sum(len(r["tokens"]) for r in off) / sum(r["seconds"] for r in off))
        out["same_text"] = sum(a["tokens"] == b["tokens"] for a, b in zip(runs, off, strict=True)) / len(runs)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.drafter_ceiling import find_target
    from dvi.drafters.eagle import EagleDrafter
    from dvi.drafters.factory import proposer_for
    from dvi.drafters.vocab import load_draft_vocab
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_causal_lm, load_tokenizer

    tdir = find_target(args.target)
    target = load_causal_lm(tdir, "cpu", "float32")
    tok = load_tokenizer(tdir.parent / "tokenizer")
    ids = load_draft_vocab(Path(args.head), args.draft_vocab, int(target.config.vocab_size))
    head = EagleDrafter.load(target, args.head, vocab_ids=ids)
    arms = {"off": SpeculativeEngine(target, None, num_draft_tokens=0),
            f"eagle_k{args.k}": SpeculativeEngine(target, proposer_for(target, head), num_draft_tokens=args.k),
            "eagle_adaptive": SpeculativeEngine(target, proposer_for(target, head),
                                                num_draft_tokens=args.k, adaptive=True)}
    results: dict = {}
    for dom, prompts in prompts_of(tok, args.prompts).items():
        runs: dict[str, list] = {a: [] for a in arms}
        names = list(arms)
        for i, p in enumerate(prompts):
            for a in names[i % len(names):] + names[: i % len(names)]:
                runs[a].append(run_arm(arms[a], p, args.max_tokens))
        results[dom] = {a: summarise(rs, None if a == "off" else runs["off"]) for a, rs in runs.items()}
        for a, s in results[dom].items():
            print(f"{dom:<5} {a:<15} {s['tokens_per_s']:6.1f} tok/s  speedup {s.get('speedup', 1.0):.2f}x  "
                  f"accept length {s['accept_length'] or 0:.2f}  per position "
                  + " ".join(f"{x:.2f}" for x in s["acceptance_per_position"]), flush=True)
    best = f"eagle_k{args.k}"
    goals = []
    for dom, tgt in (("chat", 1.35), ("code", 1.3)):
        goals.append(goal(f"eagle alone vs speculation off, {dom} (engine, fp32, b1)", results[dom][best]["speedup"], tgt))
    for dom in ("code", "chat"):
        pp = results[dom][best]["acceptance_per_position"]
        goals.append(goal(f"position-0 acceptance, {dom}", pp[0] if pp else None, 0.55))
        goals.append(goal(f"accepted length per drafting step, {dom}", results[dom][best]["accept_length"], 1.8))
    print_goals(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(clean_json({"head": args.head, "target": str(tdir), "k": args.k,
                                                      "draft_vocab": args.draft_vocab, "dtype": "float32",
                                                      "results": results, "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
