"""How often does a gate refuse a candidate that is no worse (issue 40)? Replays of equal drafters.

Two candidates equal in law: the served drafter with two independent random LoRA perturbations of the same size
(seed 1 and seed 2; neither is better in expectation), and one truly worse (a perturbation several times larger).
Records: the real target's greedy continuations of held-out code and prose prompts. Each trial draws a held-out
set of `--per-group` records per domain (the size a group gate judges on in a live server) and asks each group rule:

- margin only (the rule before this issue): refuse when a group falls by more than `gate_group_margin`;
- margin + z (`trainer.gate_z`): ... and by that many standard errors of the group's per-record differences.

False refusals are verdicts against either of the equal pair (judged both ways: their realised α differ a little),
power is verdicts against the worse one; each drafter scores every record once and the trials resample those scores.

    PYTHONPATH=. .venv/bin/python benchmarks/gate_noise.py [--json bench_results/gate_noise.json]
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import pickle
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal, print_goals  # noqa: E402

DOMAINS = ("code", "prose")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def perturbed(drafter, scale: float, seed: int):
    """The drafter with a random LoRA (B ~ N(0, scale), rank 16) merged in."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(drafter), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (scale if "lora_B" in n else p.shape[1] ** -0.5))
    return pm.merge_and_unload().eval()


def records(pair, tokenizer, n: int, max_new_tokens: int):
    """`n` greedy records per domain from the real pair (batched)."""
    from dvi.data import prompt_stream
    from dvi.decode.request import Request, SamplingParams
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.feedback.record import FeedbackRecord

    eng = SpeculativeEngine(pair.target, None)
    out = []
    for d in DOMAINS:
        for i, p in enumerate(itertools.islice(prompt_stream(d, tokenizer, prompt_tokens=(24, 96), seed=7), n)):
            eng.add_request(Request(f"{d}-{i}", p, SamplingParams(max_new_tokens), domain=d))
    while eng.has_unfinished():
        out += [FeedbackRecord.from_result(o.result) for o in eng.step() if o.finished]
    return out


def refusal_rate(new, old, rule, per_group: int, trials: int, seed: int) -> float:
    from dvi.feedback.heldout import group_of
    from dvi.feedback.verdict import judge

    rng = random.Random(seed)
    by_group: dict[str, list[int]] = {}
    for i, (rec, _, _) in enumerate(old):
        by_group.setdefault(group_of(rec), []).append(i)
    refused = 0
    for _ in range(trials):
        idx = [i for g in sorted(by_group) for i in rng.sample(by_group[g], min(per_group, len(by_group[g])))]
        v = judge([new[i] for i in idx], [old[i] for i in idx], rule)
        refused += any(g.worse for g in v.groups)
    return refused / trials


def main(argv=None) -> int:
    from dvi.config import load_config
    from dvi.feedback.shadow import hf_logits_fn, record_scores
    from dvi.feedback.verdict import Rule
    from dvi.models.loading import load_pair

    ap = argparse.ArgumentParser(prog="gate_noise", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--records", type=int, default=64, help="records per domain")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--per-group", type=int, default=12, help="records per group in a trial's held-out set")
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--scale", type=float, default=0.03, help="the equal candidates' LoRA B scale")
    ap.add_argument("--worse-scale", type=float, default=0.08)
    ap.add_argument("--records-cache", type=Path, default=None, help="pickle of the records (made once, then read)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    pair_dir, tokenizer = built_pair(a.preset, None)
    pair = load_pair(pair_dir / "target", pair_dir / "drafter", pair_dir / "tokenizer", device="cpu", dtype="float32")
    t0 = time.perf_counter()
    if a.records_cache is not None and a.records_cache.is_file():
        recs = pickle.loads(a.records_cache.read_bytes())
    else:
        recs = records(pair, tokenizer, a.records, a.max_new_tokens)
        if a.records_cache is not None:
            a.records_cache.write_bytes(pickle.dumps(recs))
    print(f"{len(recs)} records in {time.perf_counter() - t0:.0f}s")
    drafters = {"served": pair.drafter, "equal_a": perturbed(pair.drafter, a.scale, 1),
                "equal_b": perturbed(pair.drafter, a.scale, 2), "worse": perturbed(pair.drafter, a.worse_scale, 3)}
    scores = {k: record_scores(hf_logits_fn(m), recs) for k, m in drafters.items()}
    alpha = {k: sum(h for _, h, _ in s) / sum(n for _, _, n in s) for k, s in scores.items()}
    cfg = load_config()
    t = cfg.trainer
    rules = {"margin only": Rule("gate", None, t.gate_group_margin, t.gate_min_group_records),
             f"margin + z {t.gate_z:g}": Rule("gate", None, t.gate_group_margin, t.gate_min_group_records, z=t.gate_z)}
    rows = []
    for name, rule in rules.items():
        false = (refusal_rate(scores["equal_b"], scores["equal_a"], rule, a.per_group, a.trials, 0)
                 + refusal_rate(scores["equal_a"], scores["equal_b"], rule, a.per_group, a.trials, 2)) / 2  # both ways
        power = refusal_rate(scores["worse"], scores["served"], rule, a.per_group, a.trials, 1)
        rows.append({"rule": name, "false_refusal_rate": false, "refusal_rate_worse": power})
    print(f"pooled α: {', '.join(f'{k} {v:.3f}' for k, v in alpha.items())}")
    print(f"{'rule':<18}{'false refusals (equal)':>24}{'refusals (worse)':>18}   [{a.per_group} records a group, "
          f"{len(DOMAINS)} groups, {a.trials} trials]")
    for r in rows:
        print(f"{r['rule']:<18}{r['false_refusal_rate']:>24.3f}{r['refusal_rate_worse']:>18.3f}")
    goals = [goal("false refusal rate of equal drafters, margin + z", rows[1]["false_refusal_rate"], 0.05, False),
             goal("refusal rate of the worse drafter, margin + z", rows[1]["refusal_rate_worse"], 0.8)]
    print_goals(goals)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json({"args": {k: str(v) for k, v in vars(a).items()}, "alpha": alpha,
                                                 "rows": rows, "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
