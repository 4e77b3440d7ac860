"""Can a tenant's own adapter beat one shared drafter on prompts it never saw, and with which recipe (issue 40)?

Offline, on the records of a `benchmarks/groups.py` run (its feedback log: three tenants' real target responses).
The records are split by prompt, not by request: a quarter of the distinct prompts of each tenant (by a hash of
their token ids) are the evaluation set, and no record of those prompts is trained on, so a tenant that repeats a
prompt (sql and chat traffic do: 239 distinct of 357 sql requests) cannot be scored on what it memorised. The rest
is fed, in the order the server logged it, to the trainer process's own code:

- shared: one `OnlineTrainer` over the drafter's LoRA (`trainer.adapter_key: none`);
- adapters: `trainers.online.groups.GroupLanes`, one adapter per tenant (`trainer.adapter_key: domain`);

a shard of `--shard` records at a time, each followed by idle replay as the live trainer runs it (per active lane,
up to `trainer.idle_replay_epochs` replays per record). The weights at the end are scored (teacher-forced top-1
agreement, `dvi.feedback.shadow.record_scores`) on each tenant's evaluation records, beside the frozen drafter.
Each `--recipe` (semicolon-separated override lists, applied to both arms) is one pair of arms.

    PYTHONPATH=. .venv/bin/python benchmarks/lane_recipe.py --records runs/groups20k/adapters/feedback
        [--recipe "trainer.learning_rate=3e-4" --recipe "trainer.lora_rank=64"] [--json bench_results/lane_recipe.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402
from benchmarks.groups import TENANTS  # noqa: E402


def prompt_is_eval(prompt_ids, fraction: float) -> bool:
    digest = hashlib.sha256(json.dumps(list(prompt_ids)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_by_prompt(records: list, fraction: float) -> tuple[list, dict[str, list]]:
    """(training records in log order, per tenant one record per distinct evaluation prompt)."""
    train, evals, seen = [], {t: [] for t in TENANTS}, set()
    for r in sorted(records, key=lambda r: r.finished_at):
        if r.domain not in TENANTS or not len(r.token_ids):
            continue
        key = tuple(r.prompt_ids)
        if not prompt_is_eval(key, fraction):
            train.append(r)
        elif key not in seen:
            seen.add(key)
            evals[r.domain].append(r)
    return train, evals


def make_cfg(run_dir: Path, key: str, overrides: list[str]):
    from demo.scenario import LANE_WARMUP
    from dvi.config import load_config

    lane = [f"trainer.{k}={v}" for k, v in LANE_WARMUP.items() if k != "heldout_fraction"]
    base = ["models.preset=smollm2", "models.drafter_kind=separate", "models.device=cpu", f"run_dir={run_dir}",
            f"feedback.dir={run_dir / 'feedback'}", f"registry.dir={run_dir / 'registry'}", "wandb.mode=disabled",
            "trainer.heldout_fraction=0.0", "trainer.publish_every_steps=1000000", f"trainer.adapter_key={key}"]
    return load_config(None, base + lane + list(overrides))


def train_arm(key: str, train: list, overrides: list[str], shard: int, base=None) -> tuple[dict, int, float, object]:
    """({tenant: scorer of its weights at the end}, steps, seconds, the arm's shared trainer) of one arm; `base`: a
    drafter to start from instead of the shipped one (the adapters then sit on a drafter that learned)."""
    from trainers.online.groups import GroupLanes
    from trainers.online.trainables import load_drafter_for_training
    from trainers.online.trainer import OnlineTrainer

    run_dir = Path(tempfile.mkdtemp(prefix=f"lane_recipe_{key}_"))
    cfg = make_cfg(run_dir, key, overrides)
    drafter, pad_id = load_drafter_for_training(cfg)
    main = OnlineTrainer(cfg, drafter if base is None else base, registry=None, run_dir=run_dir, pad_id=pad_id)
    lanes = GroupLanes(main, cfg, main.rundir) if key != "none" else None
    t0 = time.perf_counter()
    for i in range(0, len(train), shard):
        part = train[i: i + shard]
        if lanes is None:
            main.train_on_records(part)
            while main.may_replay_idle() and main.train_on_replay(1).steps:
                pass
        else:
            lanes.train_on_records(part)
            while lanes.train_on_replay(1).steps:
                pass
        steps = lanes.step if lanes else main.step
        print(f"\r  {key}: {min(i + shard, len(train))}/{len(train)} records, {steps} steps, "
              f"{time.perf_counter() - t0:.0f} s", end="", flush=True)
    print()
    if lanes is None:
        scorers = dict.fromkeys(TENANTS, main.publisher.scorer())
    else:
        scorers = {t: lanes.lanes[t].publisher.scorer() for t in TENANTS if t in lanes.lanes}
    return scorers, (lanes.step if lanes else main.step), time.perf_counter() - t0, main


def alpha(scorer, records: list) -> float:
    scored = scorer(records)
    return sum(h for _, h, _ in scored) / max(1, sum(n for _, _, n in scored))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lane_recipe", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=Path, required=True, help="a groups run arm's feedback dir")
    ap.add_argument("--recipe", action="append", default=None,
                    help="semicolon-separated config overrides for both arms (repeatable; default: none)")
    ap.add_argument("--eval-fraction", type=float, default=0.25)
    ap.add_argument("--shard", type=int, default=32)
    ap.add_argument("--stacked", action="store_true",
                    help="also adapters on the shared arm's drafter (its LoRA merged): a base that keeps learning")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    from demo.replay import read_records

    torch.manual_seed(0)
    train, evals = split_by_prompt(list(read_records(a.records).values()), a.eval_fraction)
    print(f"{len(train)} training records; evaluation prompts " + ", ".join(f"{t} {len(evals[t])}" for t in TENANTS))
    results, goals = [], []
    untrained, *_ = train_arm("none", [], [], a.shard)  # the frozen drafter: a trainer that took no step
    frozen = {t: alpha(untrained[t], evals[t]) for t in TENANTS}
    for recipe in a.recipe or [""]:
        overrides = [o for o in recipe.split(";") if o]
        row = {"recipe": recipe or "(defaults)", "arms": {}}
        learned = None
        for name, key in (("shared", "none"), ("adapters", "domain")) + ((("stacked", "domain"),) if a.stacked else ()):
            scorers, steps, secs, main_trainer = train_arm(key, train, overrides, a.shard,
                                                           learned if name == "stacked" else None)
            row["arms"][name] = {"steps": steps, "seconds": secs,
                                 "alpha": {t: alpha(scorers[t], evals[t]) for t in TENANTS if t in scorers}}
            if name == "shared" and a.stacked:
                learned = main_trainer.trainable.drafter.merge_and_unload()
        row["frozen"] = frozen
        results.append(row)
        stacked = row["arms"].get("stacked", {}).get("alpha", {})
        print(f"\nrecipe {row['recipe']}\n{'tenant':<8}{'frozen':>10}{'shared':>10}{'adapters':>10}{'diff':>10}"
              + (f"{'stacked':>10}{'diff':>10}" if stacked else ""))
        for t in TENANTS:
            s, ad = row["arms"]["shared"]["alpha"][t], row["arms"]["adapters"]["alpha"].get(t)
            print(f"{t:<8}{frozen[t]:>10.3f}{s:>10.3f}{(ad or 0):>10.3f}{(ad or 0) - s:>+10.3f}"
                  + (f"{stacked.get(t, 0):>10.3f}{stacked.get(t, 0) - s:>+10.3f}" if stacked else ""))
            goals.append(goal(f"{row['recipe']}: {t} adapter - shared (unseen prompts)",
                              None if ad is None else ad - s, 0.05))
    print_goals(goals)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json({"args": {k: str(v) for k, v in vars(a).items()},
                                                 "results": results, "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
