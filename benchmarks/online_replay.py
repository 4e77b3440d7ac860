"""Do the first online updates hurt? Real chat feedback of the built drafter, replayed into the online trainer.

Issue 24 §2: for each drafter kind, the served drafter (`serving.loading.load_serving_pair`, exactly what
`dvi serve` loads) decodes held-out chat instructions greedily through the real engine
(`dvi.engine.speculative.SpeculativeEngine`, feedback top-k as the server logs it; eagle rows carry the target's
features); the records are split by `dvi.feedback.shadow.is_heldout` (as every trainer rank and server does), and
the training part is fed to `trainers.online.OnlineTrainer` (the trainer process's own core: same
loss, replay, optimizer) a batch at a time. After each of the first 10 steps and at 20, 30, 40 the
held-out shadow α (`OnlineTrainer.publisher.shadow`, what a publish check scores) is printed next to the start.

Goal per kind: α after each of steps 1..10 >= start - 0.01, and α at step 40 > start.

    python benchmarks/online_replay.py --preset smollm2 [--kinds separate,eagle,early_exit] [--records 240]
        [--set trainer.learning_rate=3e-4 ...] [--json bench_results/online_replay.json] [--cache DIR]

Exits 0 whether or not the goals are met (they are in the JSON's `goals`).

Measured (2026-11-24, 2-core CPU shared with a model build; default trainer settings, lr 1e-3, no warm-up):
`early_exit` on the smollm2 build's early-exit drafter, 160 chat records (116 trained, 44 held out, 2112
positions): held-out α 0.098 at the start, 0.098-0.120 over steps 1-10 (never below the start), 0.135 at
20, 0.154 at 30, 0.161 at 40: both goals met. `separate` (same records, default settings): 0.382 at the
start, 0.387-0.394 over steps 1-10, 0.405 at 40: met. `eagle` (lr 3e-4): without warm-up 0.385 fell to 0.325
at step 2 (a miss) and reached 0.471 at 40; with 10 warm-up steps (now `trainer.eagle_warmup_steps`' default)
0.395-0.416 over steps 1-10 and 0.473 at 40: met.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal  # noqa: E402

KINDS = ("separate", "eagle", "early_exit")
REPORT_STEPS = (*range(1, 11), 20, 30, 40)


def _config(preset: str, kind: str, run_dir: Path, overrides: list[str]) -> Any:
    from dvi.config import load_config

    base = [f"models.preset={preset}", f"models.drafter_kind={kind}", "models.device=cpu", f"run_dir={run_dir}",
            f"feedback.dir={run_dir / 'feedback'}", f"registry.dir={run_dir / 'registry'}", "wandb.mode=disabled",
            "trainer.heldout_fraction=0.25"]
    return load_config(None, base + list(overrides))


def chat_feedback(cfg: Any, n: int, max_new_tokens: int, seed: int, batch: int = 16) -> list:
    """`n` greedy chat feedback records of the served drafter of `cfg` (held-out chat instructions)."""
    from dvi.data import chat_prompt_stream
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.feedback import FeedbackRecord
    from serving.loading import load_serving_pair

    pair = load_serving_pair(cfg)
    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter),
                            num_draft_tokens=cfg.speculation.num_draft_tokens,
                            feedback_top_k=cfg.feedback.top_k)
    prompts = list(itertools.islice(chat_prompt_stream(pair.tokenizer, "heldout", seed=seed, max_tokens=320), n))
    out = []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i: i + batch]
        out += [FeedbackRecord.from_result(res, domain="chat") for res in eng.generate(chunk, max_new_tokens)]
    return out


def cached_feedback(args: argparse.Namespace, kind: str, cfg: Any) -> list:
    """`chat_feedback`, kept as feedback shards under `--cache/<kind>` so that arms with other trainer
    settings replay the very same records (and skip the decoding)."""
    from dvi.feedback import FeedbackReader, FeedbackWriter

    if args.cache is None:
        return chat_feedback(cfg, args.records, args.max_new_tokens, args.seed)
    d = args.cache / kind
    reader = FeedbackReader(d) if d.is_dir() else None
    if reader is not None and reader.list_shards():
        return reader.read_records(reader.list_shards())
    records = chat_feedback(cfg, args.records, args.max_new_tokens, args.seed)
    w = FeedbackWriter(d, shard_records=64)
    for r in records:
        w.write(r)
    w.close()
    return records


def replay(cfg: Any, records: list, steps: int) -> dict[str, Any]:
    """Train on `records` (held-out ones scored only) for `steps` steps; held-out α at REPORT_STEPS."""
    from dvi.feedback.shadow import is_heldout
    from trainers.online.trainer import OnlineTrainer

    tr = OnlineTrainer.from_config(cfg)
    tr.registry = None  # measure only: nothing is published
    held = [r for r in records if is_heldout(r.request_id, cfg.trainer.heldout_fraction)]
    train = [r for r in records if not is_heldout(r.request_id, cfg.trainer.heldout_fraction)]
    tr.heldout.extend(r.compact() for r in held)
    start = tr.publisher.shadow()
    alphas: dict[int, float | None] = {0: start.alpha}
    n_new = max(1, round(cfg.trainer.batch_size * (1.0 - cfg.trainer.replay_ratio)))
    t0 = time.perf_counter()
    cursor = 0
    while tr.step < steps:
        before = tr.step
        if cursor < len(train):
            tr.train_on_records(train[cursor: cursor + n_new])
            cursor += n_new
        else:
            tr.train_on_replay(1)  # the records ran out: replay, as an idle trainer does
        if tr.step == before:
            break
        if tr.step in REPORT_STEPS or tr.step == steps:
            alphas[tr.step] = tr.publisher.shadow().alpha
            print(f"  step {tr.step:3d}: held-out α {alphas[tr.step]:.4f} (start {start.alpha:.4f}, "
                  f"loss {tr.last_losses.get('loss', float('nan')):.4f})", flush=True)
    return {"start": start.alpha, "alphas": alphas, "heldout_records": start.records,
            "heldout_positions": start.positions, "train_records": len(train), "new_records_used": min(cursor, len(train)),
            "steps": tr.step, "train_seconds": time.perf_counter() - t0}


def run_kind(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"online-replay-{kind}-") as tmp:
        cfg = _config(args.preset, kind, Path(tmp), args.set)
        t0 = time.perf_counter()
        records = cached_feedback(args, kind, cfg)
        gen_s = time.perf_counter() - t0
        print(f"{kind}: {len(records)} chat records in {gen_s:.0f}s", flush=True)
        res = replay(cfg, records, args.steps)
    a = res["alphas"]
    start = res["start"]
    early = [a.get(s) for s in range(1, 11)]
    worst = min((x for x in early if x is not None), default=None)
    res.update(kind=kind, generate_seconds=gen_s, worst_first_10=worst, goals=[
        goal(f"{kind}: min held-out α over steps 1-10 - start", None if worst is None else worst - start, -0.01),
        goal(f"{kind}: held-out α at step {args.steps} - start",
             None if a.get(args.steps) is None else a[args.steps] - start, 1e-9)])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--records", type=int, default=240)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="config override, e.g. trainer.learning_rate=3e-4")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cache", type=Path, default=None, help="dir keeping the decoded feedback per kind")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    results = [run_kind(args, k) for k in args.kinds.split(",") if k]
    shown = sorted({s for s in REPORT_STEPS if s <= args.steps} | {args.steps})
    print(f"\n{'kind':<11} {'start':>7} " + " ".join(f"{s:>6}" for s in shown))
    for r in results:
        row = " ".join(f"{(r['alphas'].get(s) or float('nan')):6.3f}" for s in shown)
        print(f"{r['kind']:<11} {r['start']:7.3f} {row}")
    for r in results:
        for g in r["goals"]:
            print(f"{'MET ' if g['met'] else 'MISS'} {g['name']}: {g['value']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(clean_json({"settings": vars(args) | {"json": str(args.json)},
                                                    "results": results}), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
