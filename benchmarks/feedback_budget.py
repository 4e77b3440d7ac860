"""Feedback bytes per record, measured, and the disk budget of a week at a given request rate.

Real engine output (held-out code and prose prompts of 32-128 tokens, greedy, --max-tokens new
tokens, the target's top-k per position as the server logs it) is written through
`FeedbackWriter` in shards of `feedback.shard_records`, and the shard bytes per record are measured.
An eagle drafter's records also carry the target's hidden states (fp16, 2·H bytes per position):
that case is measured by attaching random fp16 bytes of the exact size to the same records
(incompressible, as real states nearly are). From those figures: the bytes a week at --rate
requests per second would write, how much of it `feedback.retention_bytes` keeps (hours of
history), and the disk bound of the whole run with the default config (feedback retention + the
rotated logs + the compacted consumed log; registry versions and the checkpoint are per drafter
and reported apart).

    .venv/bin/python benchmarks/feedback_budget.py --preset smollm2 [--json bench_results/feedback_budget.json]
        [models.target=DIR models.tokenizer=DIR]   # any pair; with no drafter the records are as large

Measured (2-core CPU, 64 records): smollm2 16.7 KB per record (eagle 180 KB), tiny 13.3 KB.

Writes JSON (settings, raw figures, `goals`), prints the figures, exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal
from dvi.config import DviConfig, load_config
from dvi.fsutil import tree_bytes

GIB = 2**30


def _records(cfg: DviConfig, n: int, max_tokens: int, batch: int) -> list:
    """`n` feedback records from real greedy decoding of held-out prompts (half code, half prose)."""
    import torch

    from dvi.data import prompt_stream
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.feedback import FeedbackRecord
    from dvi.models.loading import load_pair_from_config

    torch.set_num_threads(1)
    pair = load_pair_from_config(cfg.models)
    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter),
                               num_draft_tokens=3, feedback_top_k=cfg.feedback.top_k)
    code = prompt_stream("code", pair.tokenizer, seed=cfg.seed)
    prose = prompt_stream("prose", pair.tokenizer, seed=cfg.seed)
    out = []
    while len(out) < n:
        chunk = [next(code) if i % 2 == 0 else next(prose) for i in range(batch)]
        out += [FeedbackRecord.from_result(r, domain="default") for r in engine.generate(chunk, max_new_tokens=max_tokens)]
    return out[:n], int(pair.target.config.hidden_size)


def _bytes_per_record(records: list, shard_records: int, hidden_dim: int = 0) -> float:
    """Shard bytes per record when `records` are written as the server writes them."""
    import dataclasses

    from dvi.feedback import FeedbackWriter

    with tempfile.TemporaryDirectory() as d:
        with FeedbackWriter(Path(d) / "fb", shard_records=shard_records) as w:
            for r in records:
                if hidden_dim:
                    n = len(r.prompt_ids) + len(r.token_ids) - 1
                    r = dataclasses.replace(r, hidden=os.urandom(2 * hidden_dim * n), hidden_dim=hidden_dim)
                w.write(r)
        return tree_bytes(Path(d) / "fb") / len(records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--records", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--json", default="bench_results/feedback_budget.json")
    ap.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    a = ap.parse_args(argv)
    cfg = load_config(None, [f"models.preset={a.preset}", *a.overrides])
    t0 = time.perf_counter()
    records, hidden_dim = _records(cfg, a.records, a.max_tokens, a.batch)
    fb, files = cfg.feedback, cfg.files
    per = _bytes_per_record(records, fb.shard_records)
    per_eagle = _bytes_per_record(records, fb.shard_records, hidden_dim)
    n_week = a.rate * 86400 * a.days
    # rotated logs: metrics.jsonl (server, trainer), swap_events.jsonl, trainer.log, trainer/quarantined_records.jsonl
    logs_bound = 5 * (1 + files.log_backups) * files.log_max_bytes + files.consumed_log_max_bytes
    res = {
        "settings": {"preset": a.preset, "records": len(records), "max_tokens": a.max_tokens, "top_k": fb.top_k,
                     "shard_records": fb.shard_records, "rate_per_s": a.rate, "days": a.days,
                     "retention_bytes": fb.retention_bytes, "log_max_bytes": files.log_max_bytes,
                     "log_backups": files.log_backups, "consumed_log_max_bytes": files.consumed_log_max_bytes},
        "mean_prompt_tokens": sum(len(r.prompt_ids) for r in records) / len(records),
        "mean_new_tokens": sum(len(r.token_ids) for r in records) / len(records),
        "bytes_per_record": per, "bytes_per_record_eagle": per_eagle, "hidden_dim": hidden_dim,
        "week_bytes_unbounded": per * n_week, "week_bytes_unbounded_eagle": per_eagle * n_week,
        "retention_holds_hours": fb.retention_bytes / (per * a.rate) / 3600 if fb.retention_bytes else None,
        "retention_holds_hours_eagle": fb.retention_bytes / (per_eagle * a.rate) / 3600 if fb.retention_bytes else None,
        "logs_bound_bytes": logs_bound,
        "run_bound_bytes": (fb.retention_bytes or 0) + logs_bound,
        "wall_s": time.perf_counter() - t0,
    }
    bound = res["run_bound_bytes"]
    res["goals"] = [goal("feedback + logs bound with the default config (GiB)", bound / GIB, 2.5, False),
                    goal("a week at the rate fits the bound (1 = yes: retention caps it)",
                         1.0 if fb.retention_bytes is not None else 0.0, 1.0)]
    for k in ("bytes_per_record", "bytes_per_record_eagle", "week_bytes_unbounded", "retention_holds_hours",
              "retention_holds_hours_eagle", "run_bound_bytes"):
        print(f"{k:>32}: {res[k]:,.1f}" if res[k] is not None else f"{k:>32}: -")
    for g in res["goals"]:
        print(f"goal {g['name']}: {g['value']:.3f} (target {g['target']}) {'met' if g['met'] else 'MISSED'}")
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(clean_json(res), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
