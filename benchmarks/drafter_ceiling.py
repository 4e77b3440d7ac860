"""How good can a learned drafter for SmolLM2 get (issue 34)? Candidate eagle-head designs trained on the target's
own data, scored on text no build saw, with learning curves and a fit to 10x the tokens.

Per design: position-0 top-1 agreement with the target (first drafts: true target features of every input) and
chained acceptance at K drafts a step (greedy; drafts 2..K read the head's own outputs, as served), on the target's
greedy continuations of pip source cuts (code) and of chat instructions written for this benchmark (chat), at
token-pass checkpoints; a power law on the misses (1 - agreement, K - accepted length) fitted to the later
checkpoints and read at 10x the tokens; the head's KV-cached draft step (ms, fp32, one thread) at 8k, 16k and
the full vocabulary beside the lean target's own step. Constant LR after warmup, so every checkpoint is a
head trained that long (no anneal at the end flatters the last one).

    PYTHONPATH=. nice -n 10 .venv/bin/python benchmarks/drafter_ceiling.py --designs eagle1,eagle3 \\
        --train-tokens 131072 --budget 131072 [--target DIR] [--json ...] [--png ...]

Prints a table and the goals, writes JSON (with a `goals` list; rewritten after every checkpoint) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402

FUSED = (2, 15, 28)
DESIGNS = {  # name -> (head kwargs, objective kwargs)
    "eagle1": ({}, {"feature_weight": 1.0, "chained": True}),  # today's recipe (final normed feature, 2 passes)
    "eagle1_ttt": ({}, {"feature_weight": 1.0, "ttt_steps": 4, "sample": 0.25}),
    "eagle3": ({"feature_layers": FUSED}, {"feature_weight": 0.0, "ttt_steps": 4, "sample": 0.25}),
    "eagle3_2layer": ({"feature_layers": FUSED, "num_layers": 2}, {"feature_weight": 0.0, "ttt_steps": 4,
                                                                   "sample": 0.25}),
    "eagle3_wide": ({"feature_layers": FUSED, "intermediate_size": 3072}, {"feature_weight": 0.0, "ttt_steps": 4,
                                                                          "sample": 0.25}),
}
MIX = {"code_text": 0.35, "code_greedy": 0.15, "chat": 0.4, "prose": 0.1}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="drafter_ceiling", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="converted target dir (default: the built pair's, else the build's "
                   "temporary one)")
    p.add_argument("--designs", default="eagle1,eagle1_ttt,eagle3")
    p.add_argument("--train-tokens", type=int, default=131072, help="labelled training tokens (windows x seq_len)")
    p.add_argument("--budget", type=int, default=131072, help="token-passes per design")
    p.add_argument("--checkpoints", type=int, default=5, help="evaluations per design (geometric in tokens)")
    p.add_argument("--chat-replies", type=int, default=128)
    p.add_argument("--code-continuations", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--train-vocab", type=int, default=16384)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=24)
    p.add_argument("--cache", default=str(Path.home() / ".cache/dvi/ceiling"))
    p.add_argument("--json", default="bench_results/drafter_ceiling.json")
    p.add_argument("--png", default="bench_results/drafter_ceiling.png")
    p.add_argument("--save-best", default=None, help="dir to save the best design's head into")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fresh", action="store_true", help="drop the designs an earlier run left in --json")
    return p.parse_args(argv)


def find_target(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from dvi.models.embedded import embedded_dir

    built = embedded_dir("smollm2") / "target"
    if built.exists():
        return built
    tmp = sorted(Path.home().glob(".cache/dvi/models/.tmp-smollm2-*/target"))
    if not tmp:
        sys.exit("no SmolLM2 target: run `dvi bootstrap --preset smollm2` (or pass --target)")
    return tmp[-1]


def fit_power(points: list[tuple[int, float]], ceiling: float, at: float) -> dict | None:
    """(ceiling - value) = c * tokens^-b fitted (least squares in log-log) to the later half of `points`
    (at least 3); the value at `at` tokens. None with too few usable points."""
    pts = [(t, ceiling - v) for t, v in points if ceiling - v > 1e-6 and t > 0]
    pts = pts[len(pts) // 2 - 1:] if len(pts) >= 4 else pts
    if len(pts) < 3:
        return None
    xs, ys = [math.log(t) for t, _ in pts], [math.log(m) for _, m in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    c = my - slope * mx
    return {"exponent": -slope, "value": ceiling - math.exp(c + slope * math.log(at)), "at_tokens": at,
            "fit_points": len(pts)}


@torch.inference_mode()
def step_costs(target, heads: dict, order: torch.Tensor, rounds: int = 3) -> dict:
    """Median ms of the lean target's batch-1 step and of each head's draft step at 8k / 16k / full ids."""
    from dvi.decode.attention import Attention
    from dvi.decode.lean import LeanModel
    from dvi.drafters.vocab import apply_draft_vocab
    from trainers.builds.eagle_build import eagle_step_ms

    lean = LeanModel(target)
    cache = lean.new_cache(1, 256)
    cache.add_rows(1)
    ctx = 128
    lean.forward(cache, torch.randint(0, 49152, (1, ctx)), torch.zeros(1, dtype=torch.long),
                 Attention(ctx, causal=True), logits_to_keep=1)
    cache.lengths[0] = ctx

    def target_ms(n: int = 24) -> float:
        times = []
        for _ in range(n):
            cache.truncate([ctx])
            t0 = time.perf_counter()
            lean.forward(cache, torch.tensor([[7]]), torch.tensor([ctx]), Attention(ctx + 1)).argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    out = {"target_ms": [], **{name: {"8192": [], "16384": [], "0": []} for name in heads}}
    for _ in range(rounds):
        out["target_ms"].append(target_ms())
        for name, d in heads.items():
            for n in ("8192", "16384", "0"):
                apply_draft_vocab(d.model, order[: int(n)] if int(n) else None)
                out[name][n].append(eagle_step_ms(d, steps=24))
            apply_draft_vocab(d.model, None)
    return {k: statistics.median(v) if k == "target_ms" else {n: statistics.median(x) for n, x in v.items()}
            for k, v in out.items()}


def evaluate(d, evals: dict, order: torch.Tensor, k: int, vocab: int = 8192) -> dict:
    from trainers.builds.eagle_eval import chain_acceptance

    out = {}
    for dom, ev in evals.items():
        hidden = ev.states.layers if d.model.fuse is not None else ev.states.final
        out[dom] = chain_acceptance(d.model, ev.seqs, ev.starts, hidden, ev.states.top,
                                    order[:vocab] if vocab else torch.arange(d.vocab_size), k)
    return out


def run_design(name: str, target, data: dict, evals: dict, order: torch.Tensor, args, record) -> tuple:
    """Train one design to `args.budget` token-passes, evaluating at geometric checkpoints; returns (head, result)."""
    from dvi.drafters.eagle import EagleDrafter
    from trainers.builds.eagle_build import EagleData, EagleObjective, distill_eagle
    from trainers.builds.offline import TrainSchedule

    head_kw, obj_kw = DESIGNS[name]
    torch.manual_seed(args.seed + 3)
    d = EagleDrafter(target, **head_kw)
    per_step = args.batch * args.seq_len
    steps = max(1, args.budget // per_step)
    marks = sorted({max(1, round(steps / 2 ** i)) for i in range(args.checkpoints)})
    curve: list[dict] = []
    t_start = time.perf_counter()
    evaluating = [0.0]

    def on_tokens(tokens: int) -> None:
        if tokens // per_step in marks:
            t0 = time.perf_counter()
            ev = evaluate(d, evals, order, args.k)
            evaluating[0] += time.perf_counter() - t0
            curve.append({"tokens": tokens, "train_s": time.perf_counter() - t_start - evaluating[0],
                          "eval_s": time.perf_counter() - t0, **ev})
            print(f"[ceiling] {name} @ {tokens:,} tokens: " + ", ".join(
                f"{dom} agree {v['agreement']:.3f} len {v['accept_length']:.2f}" for dom, v in ev.items()),
                file=sys.stderr, flush=True)
            record(name, {"curve": curve})

    sched = TrainSchedule(steps=steps, lr=args.lr, warmup=20, min_lr_ratio=1.0, grad_clip=1.0, progress=True,
                          desc=f"ceiling[{name}]")
    labels = EagleData(data["windows"], data["final"], data["layers"] if d.model.fuse is not None else None)
    stats = distill_eagle(d, labels, order[: args.train_vocab], sched, batch=args.batch,
                          objective=EagleObjective(**obj_kw), seed=args.seed, on_tokens=on_tokens)
    stats["wall_s"] -= evaluating[0]
    stats["tokens_per_s"] = stats["tokens"] / max(stats["wall_s"], 1e-9)
    final = curve[-1]
    vocab_agree = {str(n): {dom: v["agreement"] for dom, v in evaluate(d, evals, order, args.k, n).items()}
                   for n in (16384, 0)}
    vocab_agree["8192"] = {dom: final[dom]["agreement"] for dom in evals}
    fits = {}
    for dom in evals:
        fits[dom] = {
            "agreement": fit_power([(c["tokens"], c[dom]["agreement"]) for c in curve], 1.0, 10 * stats["tokens"]),
            "accept_length": fit_power([(c["tokens"], c[dom]["accept_length"]) for c in curve], float(args.k),
                                       10 * stats["tokens"])}
    return d, {"head": {k: list(v) if isinstance(v, tuple) else v for k, v in head_kw.items()},
               "objective": obj_kw, "train": stats, "curve": curve, "final": {dom: final[dom] for dom in evals},
               "agreement_by_vocab": vocab_agree, "extrapolated_10x": fits,
               "params": sum(p.numel() for p in d.trainable_parameters())}


def table(results: dict, costs: dict) -> str:
    lines = [f"{'design':<15}{'agree code':>11}{'agree chat':>11}{'len code':>9}{'len chat':>9}"
             f"{'ms 8k':>7}{'ms 16k':>7}{'ms full':>8}{'tokens':>10}{'train s':>9}"
             f"{'10x agree c/ch':>16}{'10x len c/ch':>14}"]
    for name, r in results.items():
        if "final" not in r:
            continue
        f, c, x = r["final"], costs.get(name, {}), r["extrapolated_10x"]

        def xv(dom, key, x=x):
            v = x[dom][key]
            return "  n/a" if v is None else f"{v['value']:.2f}"

        lines.append(f"{name:<15}{f['code']['agreement']:>11.3f}{f['chat']['agreement']:>11.3f}"
                     f"{f['code']['accept_length']:>9.2f}{f['chat']['accept_length']:>9.2f}"
                     f"{c.get('8192', float('nan')):>7.2f}{c.get('16384', float('nan')):>7.2f}"
                     f"{c.get('0', float('nan')):>8.2f}{r['train']['tokens']:>10,}{r['train']['wall_s']:>9.0f}"
                     f"{xv('code', 'agreement') + ' / ' + xv('chat', 'agreement'):>16}"
                     f"{xv('code', 'accept_length') + ' / ' + xv('chat', 'accept_length'):>14}")
    if "target_ms" in costs:
        lines.append(f"target step (lean, fp32, batch 1, 1 thread): {costs['target_ms']:.1f} ms")
    return "\n".join(lines)


def goals_of(results: dict, k: int) -> list[dict]:
    done = {n: r for n, r in results.items() if "final" in r}
    if not done:
        return []
    best = max(done, key=lambda n: sum(done[n]["final"][d]["accept_length"] for d in ("code", "chat")))
    r = done[best]
    out = []
    for dom in ("code", "chat"):
        out.append(goal(f"position-0 agreement, {dom} ({best}, measured)", r["final"][dom]["agreement"], 0.55))
    for dom in ("code", "chat"):
        out.append(goal(f"accepted length at K={k}, {dom} ({best}, measured)", r["final"][dom]["accept_length"], 1.8))
    for dom in ("code", "chat"):
        fa, fl = r["extrapolated_10x"][dom]["agreement"], r["extrapolated_10x"][dom]["accept_length"]
        out.append(goal(f"position-0 agreement, {dom} ({best}, fit at 10x tokens)", fa and fa["value"], 0.55))
        out.append(goal(f"accepted length at K={k}, {dom} ({best}, fit at 10x tokens)", fl and fl["value"], 1.8))
    return out


def plot(results: dict, path: Path, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for (row, key, label), dom in [((r, key, lab), dom) for r, (key, lab) in
                                    enumerate((("agreement", "position-0 agreement"),
                                               ("accept_length", f"accepted length (K={k})")))
                                    for dom in ("code", "chat")]:
        ax = axes[row][0 if dom == "code" else 1]
        for name, r in results.items():
            pts = [(c["tokens"], c[dom][key]) for c in r.get("curve", [])]
            if not pts:
                continue
            line, = ax.plot(*zip(*pts, strict=True), marker="o", label=name)
            fit = r.get("extrapolated_10x", {}).get(dom, {}).get(key)
            if fit:
                ax.plot([pts[-1][0], fit["at_tokens"]], [pts[-1][1], fit["value"]], ls="--", color=line.get_color())
        ax.axhline(0.55 if key == "agreement" else 1.8, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_title(f"{label}, {dom}")
        ax.set_xlabel("training token-passes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    from benchmarks._ceiling_data import eval_sets, train_states, train_streams, train_windows
    from dvi.drafters.vocab import frequent_token_ids
    from dvi.models.loading import load_causal_lm, load_tokenizer

    tdir = find_target(args.target)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    target = load_causal_lm(tdir, "cpu", "float32")
    for prm in target.parameters():
        prm.requires_grad_(False)
    tok = load_tokenizer(tdir.parent / "tokenizer")
    t0 = time.perf_counter()
    evals = eval_sets(target, tok, cache, FUSED, args.eval_prompts)
    streams = train_streams(target, tok, cache, args.chat_replies, args.code_continuations)
    windows = train_windows(streams, args.train_tokens // args.seq_len, args.seq_len, MIX, args.seed)
    layers, final, _top = train_states(target, windows, cache, FUSED)
    data = {"windows": windows, "layers": layers, "final": final}
    order = frequent_token_ids([w for w in windows], int(target.config.vocab_size),
                               always=sorted(set(tok.all_special_ids)), vocab_size=int(target.config.vocab_size))
    prep_s = time.perf_counter() - t0
    out_path = Path(args.json)
    results: dict = {}
    if out_path.exists() and not args.fresh:  # designs measured by earlier runs on the same data stay
        results = {n: r for n, r in json.loads(out_path.read_text()).get("designs", {}).items() if "final" in r}
    meta = {"target": str(tdir), "train_windows": int(windows.shape[0]), "seq_len": args.seq_len,
            "train_tokens": int(windows.shape[0] * args.seq_len), "mix": MIX, "fused_layers": list(FUSED),
            "budget_token_passes": args.budget, "k": args.k, "prep_s": prep_s, "threads": 1, "dtype": "float32",
            "eval": {dom: {"sequences": len(ev.seqs), "scored_positions": sum(len(s) - 1 - st for s, st in
                                                                                zip(ev.seqs, ev.starts, strict=True))}
                     for dom, ev in evals.items()},
            "stream_tokens": {k: int(v.numel()) for k, v in streams.items()}}

    def record(name: str, part: dict) -> None:
        results.setdefault(name, {}).update(part)
        write(out_path, meta, results, {}, args.k)

    from dvi.drafters.eagle import EagleDrafter
    from dvi.drafters.vocab import save_draft_vocab

    heads = {}
    for name in [n for n in args.designs.split(",") if n]:
        d, res = run_design(name, target, data, evals, order, args, record)
        results[name] = res
        record(name, res)
        d.save(cache / "heads" / name)
        save_draft_vocab(cache / "heads" / name, order[: args.train_vocab], int(target.config.vocab_size))
    for name in results:
        heads[name] = EagleDrafter.load(target, cache / "heads" / name)
    costs = step_costs(target, heads, order)
    print(table(results, costs))
    goals = write(out_path, meta, results, costs, args.k)
    print_goals(goals)
    plot(results, Path(args.png), args.k)
    if args.save_best and results:
        best = max(results, key=lambda n: sum(results[n]["final"][dm]["accept_length"] for dm in ("code", "chat")))
        heads[best].save(args.save_best)
    return 0


def write(path: Path, meta: dict, results: dict, costs: dict, k: int) -> list[dict]:
    goals = goals_of(results, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json({"meta": meta, "designs": results, "draft_ms": costs, "goals": goals}),
                               indent=1))
    return goals


if __name__ == "__main__":
    raise SystemExit(main())
