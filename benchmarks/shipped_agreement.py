"""How good is a shipped drafter on text no build saw (issue 43)? Position-0 top-1 agreement of each given shipped
separate drafter with the target, on the target's greedy continuations of pip source cuts (code) and its greedy
replies to chat instructions written for the drafter-ceiling benchmark (chat): every scored position's first draft
is the drafter's argmax over its first N draft ids, the target's greedy token is the truth.

    PYTHONPATH=. .venv/bin/python benchmarks/shipped_agreement.py --drafter cpu=DIR --drafter gpu=DIR \\
        [--gpu-built gpu] [--json bench_results/shipped_agreement.json]

Prints a table per drafter and draft vocabulary size; writes JSON with a `goals` list (>= 0.45 code and >= 0.50 chat
at the served draft vocabulary for the drafter named by --gpu-built).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402

GOALS = {"code": 0.45, "chat": 0.50}  # issue 43, for a drafter built on a GPU


@torch.inference_mode()
def position0_hits(drafter, ev, order: torch.Tensor, sizes: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per size n, whether the drafter's argmax over `order[:n]` (0: the full vocabulary) is the target's greedy
    token, at every scored position (from each sequence's last prompt token), in order."""
    from trainers.builds.pretrained_eval import draft_top

    hits: dict[int, list[torch.Tensor]] = {n: [] for n in sizes}
    for i, seq in enumerate(ev.seqs):
        logits = drafter(input_ids=torch.tensor([seq])).logits[0]
        start, end = ev.starts[i], len(seq) - 1
        truth = ev.states.top[i, start:end]
        for n in sizes:
            hits[n].append(draft_top(logits[start:end], order[:n] if n else None) == truth)
    return {n: torch.cat(h) for n, h in hits.items()}


def position0_agreement(drafter, ev, order: torch.Tensor, sizes: tuple[int, ...]) -> dict[int, float]:
    """Share of scored positions where the drafter's first draft is the target's greedy token (`position0_hits`)."""
    return {n: float(h.float().mean()) if h.numel() else 0.0
            for n, h in position0_hits(drafter, ev, order, sizes).items()}


def main(argv=None) -> int:
    from benchmarks._ceiling_data import eval_sets
    from dvi.models.embedded import EmbeddedPaths, embedded_dir, get_preset
    from dvi.models.loading import load_causal_lm, load_tokenizer
    from trainers.builds.pretrained_build import make_drafter
    from trainers.builds.shipped_drafter import Shipped, _stored_order, load_into

    ap = argparse.ArgumentParser(prog="shipped_agreement", description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True, help="NAME=DIR of a shipped drafter (repeatable)")
    ap.add_argument("--gpu-built", help="the NAME whose agreement is held against the GPU goals")
    ap.add_argument("--pair", type=Path, default=None, help="built pair (default: the embedded cache's)")
    ap.add_argument("--n", type=int, default=24, help="prompts per domain (at most 24 chat)")
    ap.add_argument("--cache", type=Path, default=ROOT / "runs" / "shipped_agreement")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_results" / "shipped_agreement.json")
    a = ap.parse_args(argv)
    p = get_preset("smollm2")
    paths = EmbeddedPaths.at(a.pair or embedded_dir(p.name))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    target = load_causal_lm(paths.target, "cpu", "float32")
    tok = load_tokenizer(paths.tokenizer)
    a.cache.mkdir(parents=True, exist_ok=True)
    sets = eval_sets(target, tok, a.cache, (), n=a.n)
    sizes = (p.serve_draft_vocab, p.draft_vocab, 0)
    rows = {}
    for spec in a.drafter:
        name, _, d = spec.partition("=")
        shipped = Shipped(Path(d), json.loads((Path(d) / "manifest.json").read_text()))
        skeleton = make_drafter(target, p.drafter_layers, p.drafter_intermediate_size).to(torch.bfloat16)
        drafter = load_into(shipped, skeleton).float().eval()
        order = _stored_order(Path(d))
        rows[name] = {"dir": d, "tokens_trained": shipped.manifest["tokens_trained"],
                      "built_on": shipped.manifest["built_on"],
                      "agreement": {dom: position0_agreement(drafter, ev, order, sizes) for dom, ev in sets.items()}}
    print(f"position-0 top-1 agreement on unseen text ({a.n} pip cuts + 64 greedy tokens; {a.n} chat instructions "
          f"+ greedy replies), by draft vocabulary size (0 = full)")
    print(f"  {'drafter':<10}{'tokens':>14}  {'built on':<28}" + "".join(
        f"{dom + ' ' + (str(n // 1024) + 'k' if n else 'full'):>12}" for dom in sets for n in sizes))
    for name, r in rows.items():
        where = r["built_on"].get("gpu") or r["built_on"].get("cpu", "?")
        print(f"  {name:<10}{r['tokens_trained']:>14,}  {where[:28]:<28}" + "".join(
            f"{r['agreement'][dom][n]:>12.3f}" for dom in sets for n in sizes))
    goals = []
    if a.gpu_built in rows:
        agree = rows[a.gpu_built]["agreement"]
        goals = [goal(f"GPU-built drafter position-0 agreement, {dom} (unseen, {p.serve_draft_vocab} ids)",
                      agree[dom][p.serve_draft_vocab], want) for dom, want in GOALS.items()]
        print_goals(goals)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    out = {"benchmark": "shipped_agreement", "sizes": list(sizes), "n": a.n,
           "drafters": {k: {**v, "agreement": {d: {str(n): x for n, x in per.items()} for d, per in v["agreement"].items()}}
                        for k, v in rows.items()}, "goals": goals}
    a.json.write_text(json.dumps(clean_json(out), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
