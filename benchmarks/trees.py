"""Draft trees against chains on the real pair (issue 57): what a learned drafter's next candidates buy per target
pass, what a verify of that width costs on this CPU, and what the adaptive pricing then chooses.

On unseen prompts (cuts of pip's source, chat instructions written for `benchmarks/serve_speed.py`), batch 1,
greedy, the shipped `separate` drafter in-process (`SpeculativeEngine`, one thread). Arms, interleaved prompt by
prompt: chains at fixed K, trees at the same K with `tree_width` siblings per depth, and the server's defaults
(adaptive K) with trees off and on. Beside each fixed arm, the tokens per pass its K and width predict from the
drafter's top-k coverage, teacher-forced on the target's own greedy replies (coverage c_w = P(target's token in
the drafter's top w + 1), alpha = c_0; per depth: continue with alpha, end on a sibling with c_w - alpha, miss
with 1 - c_w), and the verify cost of each width in plain steps. Through `dvi serve` the same comparison is
`benchmarks/serve_speed.py --kinds off,separate:chain,separate`.

    .venv/bin/python benchmarks/trees.py [--prompts 6] [--dtype auto|float32] [--json ...]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import goal, print_goals, write_json
from benchmarks._prompts import pip_code_prompts

TWO_LEVEL_W = 3  # siblings a depth of the two-level tree whose bound the benchmark prints


def parse_args(argv):
    p = argparse.ArgumentParser(prog="dvi bench trees", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smollm2")
    p.add_argument("--prompts", type=int, default=6, help="prompts per domain")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--shapes", default="2x0,2x3,2x7,4x0,4x3", help="fixed arms KxW: K drafts, W siblings per depth")
    p.add_argument("--json", default="bench_results/trees.json")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def predicted_tokens(alpha: float, cover: float, k: int) -> float:
    """Tokens per pass of k chain drafts with siblings covering `cover` of the target's tokens at each depth."""
    e = alpha ** k * (k + 1)
    for d in range(1, k + 1):
        e += alpha ** (d - 1) * ((cover - alpha) * (d + 1) + (1.0 - cover) * d)
    return e


def teacher_forced(drafter, vocab: int, seqs: list[tuple[list[int], list[int]]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, the drafter's logits before each of the target's tokens [L, V] and those tokens [L, 1]: one
    forward a sequence, read by `coverage` and `two_level`."""
    from dvi.drafters.vocab import fit_vocab

    out = []
    with torch.inference_mode():
        for prompt, reply in seqs:
            ids = torch.tensor([prompt + reply])
            logits = fit_vocab(drafter(input_ids=ids).logits[0].float(), vocab)  # [L, V]
            out.append((logits[len(prompt) - 1 : len(prompt) + len(reply) - 1], torch.tensor(reply).view(-1, 1)))
    return out


def coverage(forced: list[tuple[torch.Tensor, torch.Tensor]], widths: tuple[int, ...]) -> dict[int, float]:
    """Per width w, the share of the target's greedy tokens in the drafter's top w + 1, teacher-forced."""
    hits, n = dict.fromkeys(widths, 0), 0
    for logits, truth in forced:
        top = logits.topk(max(widths) + 1, -1).indices
        for w in widths:
            hits[w] += int((top[:, : w + 1] == truth).any(-1).sum())
        n += truth.shape[0]
    return {w: hits[w] / max(n, 1) for w in widths}


def two_level(forced: list[tuple[torch.Tensor, torch.Tensor]], w: int) -> dict[str, float]:
    """What one more level of tree could buy (issue 57's EAGLE-2-style expansion, not built), teacher-forced: the
    shares of positions whose target token is the drafter's top 1 (`top1`) or one of its next w (`sibling`), and the
    top-(w + 1) coverage at the next position after each (`after_top1`, `after_sibling`). The tree with the chain's
    draft and w siblings at depth 1 and w + 1 children under each (`two_level_nodes(w)`) makes `tokens` a pass; a
    chain of one draft `chain`."""
    pairs = []
    for logits, truth in forced:
        rank = (logits > logits.gather(1, truth)).sum(-1).tolist()
        pairs += list(zip(rank, rank[1:], strict=False))
    n = max(len(pairs), 1)
    top1 = [b for a, b in pairs if a == 0]
    sib = [b for a, b in pairs if 0 < a <= w]
    after = lambda xs: sum(b <= w for b in xs) / max(len(xs), 1)  # noqa: E731
    out = {"positions": len(pairs), "top1": len(top1) / n, "sibling": len(sib) / n, "after_top1": after(top1),
           "after_sibling": after(sib)}
    out["tokens"] = 1 + out["top1"] + out["sibling"] + out["top1"] * out["after_top1"] + out["sibling"] * out["after_sibling"]
    out["chain"] = 1 + out["top1"]
    return out


def two_level_nodes(w: int) -> int:
    """Draft nodes of `two_level`'s tree: w + 1 at depth 1, w + 1 under each."""
    return (w + 1) * (w + 2)


def verify_costs(target, widths: tuple[int, ...], context: int = 256, reps: int = 5) -> dict[int, float]:
    """Seconds of a one-row verify of each width, best of `reps`, widths interleaved (the lean forward)."""
    from dvi.decode.lean_target import LeanTarget

    lt = LeanTarget(target)
    lt.admit([torch.randint(100, 20000, (context,)).tolist()], False)
    best = dict.fromkeys(widths, float("inf"))
    with torch.inference_mode():
        for _ in range(reps):
            for w in widths:
                t0 = time.perf_counter()
                lt.forward(torch.randint(100, 20000, (1, w)), False)
                best[w] = min(best[w], time.perf_counter() - t0)
                lt.keep(w, [0])
    return best


def make_engine(pair, arm: dict):
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import EngineOptions, SpeculativeEngine

    return SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=arm["k"],
                             adaptive=arm["adaptive"], max_draft_tokens=8,
                             options=EngineOptions(tree_width=arm["w"]))


def run_arms(pair, arms: dict[str, dict], prompts: dict[str, list[list[int]]], max_tokens: int) -> dict:
    """Per domain and arm, each prompt's result (arms rotate per prompt); one warm-up request per engine."""
    engines = {name: make_engine(pair, arm) for name, arm in arms.items()}
    first = next(iter(prompts.values()))[0]
    for e in engines.values():
        e.generate([first], 8)
    out: dict[str, dict[str, list]] = {}
    names = list(arms)
    for domain, ps in prompts.items():
        res = out[domain] = {a: [] for a in names}
        for i, p in enumerate(ps):
            for name in names[i % len(names):] + names[: i % len(names)]:
                t0 = time.perf_counter()
                r = engines[name].generate([p], max_tokens)[0]
                res[name].append({"seconds": time.perf_counter() - t0, "tokens": list(r.token_ids),
                                  "steps": r.num_steps, "by_rank": list(r.accepted_by_rank)})
            print(f"  {domain} {i + 1}/{len(ps)}", flush=True)
    return out


def summarize(results: dict, arms: dict[str, dict], cover: dict[str, dict[int, float]], costs: dict[int, float],
              ) -> list[dict]:
    rows = []
    for domain, res in results.items():
        ref = res["2x0"] if "2x0" in res else next(iter(res.values()))
        for name, arm in arms.items():
            rs = res[name]
            toks, steps = sum(len(r["tokens"]) for r in rs), sum(r["steps"] for r in rs)
            c = cover[domain]
            pred = predicted_tokens(c[0], c.get(arm["w"], c[0]), arm["k"]) if not arm["adaptive"] else None
            width = arm["k"] * (1 + arm["w"]) + 1
            rows.append(dict(domain=domain, arm=name, tokens_per_s=toks / sum(r["seconds"] for r in rs),
                             tokens_per_pass=toks / steps, predicted_tokens_per_pass=pred,
                             verify_plain_steps=(costs[width] / costs[1]) if not arm["adaptive"] else None,
                             by_rank=[sum(r["by_rank"][j] for r in rs) for j in range(4)],
                             same_text_as_2x0=sum(a["tokens"] == b["tokens"] for a, b in zip(rs, ref, strict=True)),
                             answers=len(rs)))
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'domain':6s} {'arm':12s} {'tok/s':>6s} {'tok/pass':>8s} {'pred':>5s} {'verify':>6s} "
          f"{'=2x0':>5s}  accepted by rank")
    for r in rows:
        pred = "-" if r["predicted_tokens_per_pass"] is None else f"{r['predicted_tokens_per_pass']:.2f}"
        vc = "-" if r["verify_plain_steps"] is None else f"{r['verify_plain_steps']:.2f}"
        print(f"{r['domain']:6s} {r['arm']:12s} {r['tokens_per_s']:6.1f} {r['tokens_per_pass']:8.2f} {pred:>5s} "
              f"{vc:>6s} {r['same_text_as_2x0']:>2d}/{r['answers']:<2d}  {r['by_rank']}")


def tree_goals(rows: list[dict]) -> list[dict]:
    def row(domain, arm):
        return next((r for r in rows if r["domain"] == domain and r["arm"] == arm), None)

    goals = []
    for domain in dict.fromkeys(r["domain"] for r in rows):
        chain, tree = row(domain, "2x0"), row(domain, "2x3")
        if chain and tree:
            goals.append(goal(f"trees vs chains, tokens per pass, K=2 W=3 ({domain})",
                              tree["tokens_per_pass"] / chain["tokens_per_pass"], 1.3 if domain == "chat" else 1.0))
        a_chain, a_tree = row(domain, "adaptive"), row(domain, "adaptive+tree")
        if a_chain and a_tree:
            goals.append(goal(f"adaptive trees vs adaptive chains, tok/s ({domain})",
                              a_tree["tokens_per_s"] / a_chain["tokens_per_s"], 0.97))
        for r in rows:
            if r["domain"] == domain and r["predicted_tokens_per_pass"]:
                goals.append(goal(f"measured / predicted tokens per pass, {r['arm']} ({domain})",
                                  r["tokens_per_pass"] / r["predicted_tokens_per_pass"], 0.9))
    return goals


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks.serve_speed import chat_prompts
    from dvi.models.loading import load_embedded_pair

    pair = load_embedded_pair(args.preset, device="cpu", dtype=args.dtype)
    target, tok = pair.target.eval(), pair.tokenizer
    prompts = {"code": pip_code_prompts(tok, args.prompts, args.seed), "chat": chat_prompts(tok, args.prompts)}
    arms = {s: {"k": int(s.split("x")[0]), "w": int(s.split("x")[1]), "adaptive": False} for s in args.shapes.split(",")}
    arms |= {"adaptive": {"k": 4, "w": 0, "adaptive": True}, "adaptive+tree": {"k": 4, "w": 3, "adaptive": True}}
    t0 = time.time()
    results = run_arms(pair, arms, prompts, args.max_tokens)
    seqs = {d: [(p, r["tokens"]) for p, r in zip(prompts[d], results[d][next(iter(arms))], strict=True)]
            for d in prompts}
    vocab = target.get_output_embeddings().weight.shape[0]
    forced = {d: teacher_forced(pair.drafter, vocab, s) for d, s in seqs.items()}
    cover = {d: coverage(f, (0, 1, 3, 7)) for d, f in forced.items()}
    deeper = {d: two_level(f, TWO_LEVEL_W) for d, f in forced.items()}
    deep = two_level_nodes(TWO_LEVEL_W) + 1  # its verify's positions; a one-draft chain's: 2
    widths = tuple(sorted({1, 2, deep} | {a["k"] * (1 + a["w"]) + 1 for a in arms.values() if not a["adaptive"]}))
    costs = verify_costs(target, widths)
    rows = summarize(results, arms, cover, costs)
    print(f"\nbatch 1, greedy, {args.max_tokens} tokens, {target.dtype}, {platform.processor() or platform.machine()}")
    print("coverage (top-1/2/4/8): " + "; ".join(f"{d} " + " ".join(f"{c[w]:.2f}" for w in (0, 1, 3, 7))
                                                for d, c in cover.items()))
    print("verify cost in plain steps by width: " + " ".join(f"{w}:{costs[w] / costs[1]:.2f}" for w in widths))
    print_rows(rows)
    for d, t in deeper.items():  # (the drafter forward over the depth-1 nodes not priced: ~1 of its steps)
        print(f"two levels, W={TWO_LEVEL_W}, {deep - 1} nodes ({d}): {t['tokens']:.2f} tokens a pass against a one-draft "
              f"chain's {t['chain']:.2f} ({t['tokens'] / t['chain']:.2f}x), verify {costs[deep] / costs[2]:.2f}x the chain's; "
              f"top-4 coverage after a top-1 hit {t['after_top1']:.2f}, after a sibling's {t['after_sibling']:.2f}")
    goals = tree_goals(rows)
    print_goals(goals)
    write_json(args.json, {"benchmark": "trees", "settings": vars(args) | {"dtype": str(target.dtype),
               "machine": platform.platform()}, "coverage": cover, "two_level": deeper, "verify_seconds": costs, "rows": rows,
               "goals": goals, "wall_s": time.time() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
