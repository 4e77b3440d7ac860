"""Is there something to recover on a new domain? The frozen drafter's α there vs on the build's domains.

Scores a built pair's `separate` drafter (top-1 agreement with the target's greedy token, at the served
draft vocabulary) on held-out code windows and on the target's own greedy replies to held-out chat and
sql requests (reply positions only). With `--distill-tokens N` it then distills a copy of the drafter
on the target's replies to *train*-split sql requests for N token-passes (`trainers.builds.subset_distill`,
the build's machinery and LR) and scores the copy again: a cheap proxy for the offline ceiling, with
its budget stated, so the gap the online arm should close has a lower bound.

    python -m benchmarks.domain_gap --out runs/domain_gap.json [--distill-tokens 65536]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (`dvi bench`, `python benchmarks/...`)
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--pair-dir", type=Path, default=None,
                    help="a pair dir (default: the preset's built pair); needs target/, tokenizer/ and the kind's dir")
    ap.add_argument("--kind", choices=("separate", "early_exit"), default="separate")
    ap.add_argument("--prompts", type=int, default=24, help="held-out chat and sql requests scored")
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--code-chars", type=int, default=20_000, help="held-out code text scored")
    ap.add_argument("--distill-tokens", type=int, default=0, help="token-passes of the sql distillation (0: none)")
    ap.add_argument("--train-prompts", type=int, default=64, help="train-split sql requests answered for it")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    return ap.parse_args(argv)


def heldout(target, tok, p, args: argparse.Namespace) -> tuple[dict, dict]:
    """Scoring windows per domain and the prompt positions to skip (only replies are scored)."""
    from dvi import data
    from trainers.builds.pretrained_build import _encode, _windows, greedy_replies

    sets, skips = {"code": _windows(_encode(tok, data.sample_docs("code", "heldout", args.code_chars)), p.seq_len)}, {}
    for dom, stream in (("chat", data.chat_prompt_stream), ("sql", data.sql_prompt_stream)):
        prompts = list(itertools.islice(stream(tok, "heldout", seed=args.seed, max_tokens=320), args.prompts))
        sets[dom] = greedy_replies(target, tok, prompts, args.reply_tokens, desc=f"{dom} replies")
        skips[dom] = [len(x) - 1 for x in prompts]
    return sets, skips


def score(target, drafter, order: torch.Tensor, n: int, sets: dict, skips: dict) -> dict[str, float]:
    from trainers.builds.pretrained_eval import agreement

    return {d: agreement(target, drafter, w, order, (n,), skip=skips.get(d))[n] for d, w in sets.items()}


def distill_sql(target, tok, drafter, order: torch.Tensor, p, args: argparse.Namespace) -> tuple[object, dict]:
    """A float copy of `drafter` distilled on the target's replies to train-split sql requests."""
    import copy

    from dvi import data
    from trainers.builds.offline import pack_docs, token_batches
    from trainers.builds.pretrained_build import greedy_replies, schedule
    from trainers.builds.subset_distill import distill_subset, teacher_states

    t0 = time.perf_counter()
    prompts = list(itertools.islice(data.sql_prompt_stream(tok, "train", seed=args.seed, max_tokens=320),
                                    args.train_prompts))
    stream = pack_docs(greedy_replies(target, tok, prompts, args.reply_tokens, desc="sql train replies"), None, None)
    n_windows = max(p.distill_batch, stream.numel() // p.seq_len)
    windows = next(token_batches([stream], n_windows, p.seq_len, seed=args.seed + 1))
    states = teacher_states(target, windows)
    label_s = time.perf_counter() - t0
    student = copy.deepcopy(drafter).float()
    stats = distill_subset(student, target.lm_head.weight, windows, states, order[: p.train_vocab],
                           schedule(p, args.distill_tokens, "sql distill", False), batch=p.distill_batch,
                           seed=args.seed)
    stats.update(train_text_tokens=int(stream.numel()), label_s=label_s, windows=int(n_windows))
    return student.to(torch.bfloat16).eval(), stats


def main(argv: list[str] | None = None) -> int:
    from dvi.drafters.vocab import load_draft_vocab
    from dvi.models.embedded import PRESETS, EmbeddedPaths, embedded_paths, is_built
    from dvi.models.loading import load_causal_lm
    from trainers.builds.pretrained_build import _load_target

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    p = PRESETS[args.preset]
    paths = EmbeddedPaths.at(args.pair_dir) if args.pair_dir else embedded_paths(args.preset)
    src = paths.drafter if args.kind == "separate" else paths.early_exit
    if not (args.pair_dir or is_built(paths.root, args.preset)) or not src.is_dir():
        raise SystemExit(f"no {args.kind} drafter at {src}: run `dvi bootstrap --kinds {args.kind}` first")
    if args.distill_tokens and args.kind != "separate":
        raise SystemExit("--distill-tokens distils the separate drafter only")
    target, tok = _load_target(paths)
    if args.kind == "separate":
        drafter = load_causal_lm(paths.drafter, "cpu", "bfloat16")
    else:
        from dvi.drafters.learned import EarlyExitDrafter

        drafter = EarlyExitDrafter.load(target, paths.early_exit).model
    # the first train_vocab ids of the stored priority order (what was trained); scored at the served prefix
    order = load_draft_vocab(src, size=min(p.train_vocab, p.draft_vocab))  # the stored ids (16k: the trained ones)
    n = p.serve_draft_vocab
    served = load_draft_vocab(src, size=n)
    t0 = time.perf_counter()
    sets, skips = heldout(target, tok, p, args)
    out = {"preset": args.preset, "kind": args.kind, "pair_dir": str(paths.root), "draft_vocab": n, "args": {k: str(v) for k, v in vars(args).items()},
           "scored_tokens": {d: sum(len(w) for w in ws) - sum(skips.get(d, [0])) for d, ws in sets.items()},
           "frozen": score(target, drafter, served, n, sets, skips)}
    out["heldout_s"] = time.perf_counter() - t0
    print(f"frozen {args.kind} α (top-1 agreement): " + json.dumps(out["frozen"]), file=sys.stderr)
    if args.distill_tokens:
        student, stats = distill_sql(target, tok, drafter, order, p, args)
        out["sql_distilled"] = {"stats": stats, "agreement": score(target, student, served, n, sets, skips)}
        out["gap"] = out["sql_distilled"]["agreement"]["sql"] - out["frozen"]["sql"]
        print("after sql distillation: " + json.dumps(out["sql_distilled"]), file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(clean_json(out), indent=1))
    print(json.dumps(clean_json(out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
