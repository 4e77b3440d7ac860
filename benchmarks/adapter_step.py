"""What does drafting through per-group adapters cost (issue 40)? One drafter step at batch B with rows from G adapters.

Arms, interleaved per repeat, on the embedded pair's drafter (its draft vocabulary, the server's dtype on this CPU):

- lean: the served drafter's lean forward (`dvi.drafters.draft_cache.LeanDraftCache`), no adapters;
- lean + bank: the same with a bank of G rank-r adapters (`dvi.drafters.adapters`), row i in group i mod G;
- peft mixed: peft's own mixed-batch forward (`adapter_names=`) over HF's modules with a KV cache, G adapters;
- hf: the same HF forward without adapters (peft's baseline).

A step is `--k` forwards of one token per row after a `--context`-token prefill (what a draft of K costs).

    PYTHONPATH=. .venv/bin/python benchmarks/adapter_step.py [--json bench_results/adapter_step.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import built_pair, clean_json, goal, print_goals  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GOAL = 1.15  # lean + bank over lean, batch 16, 4 adapters


def peft_adapters(model, groups: int, rank: int):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    pm = get_peft_model(copy.deepcopy(model), cfg, adapter_name="g0")
    for g in range(1, groups):
        pm.add_adapter(f"g{g}", cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    return pm.eval()


def lean_arm(model, bank, groups: list[str], ctx: torch.Tensor, k: int):
    from dvi.drafters.draft_cache import LeanDraftCache

    def run() -> None:
        dc = LeanDraftCache(model, bank)
        dc.add_rows(ctx.shape[0], groups)
        dc.forward_rows(ctx.tolist())
        ids = ctx[:, -1:]
        t0 = time.perf_counter()
        for _ in range(k):
            ids = dc.forward(ids).argmax(-1, keepdim=True)
        return time.perf_counter() - t0
    return run


def hf_arm(model, ctx: torch.Tensor, k: int, adapter_names: list[str] | None):
    def run() -> float:
        kw = {"adapter_names": adapter_names} if adapter_names else {}
        out = model(input_ids=ctx, use_cache=True, **kw)
        past, ids = out.past_key_values, ctx[:, -1:]
        t0 = time.perf_counter()
        for _ in range(k):
            out = model(input_ids=ids, past_key_values=past, use_cache=True, **kw)
            past, ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
        return time.perf_counter() - t0
    return run


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="adapter_step", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="smollm2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def adapter_bank(drafter, pm, groups: int, dtype: torch.dtype):
    """The serving side's bank holding the same `groups` adapters as the PEFT model `pm`."""
    from peft import get_peft_model_state_dict

    from dvi.drafters.adapters import AdapterBank, LoraFactors, projection_sizes

    bank = AdapterBank(drafter.config.num_hidden_layers, dtype, torch.device("cpu"))
    sizes = projection_sizes(drafter)
    for g in range(groups):
        sd = get_peft_model_state_dict(pm, adapter_name=f"g{g}")
        bank.set(f"g{g}", LoraFactors.from_peft(sd, 2.0, sizes, drafter.config.num_hidden_layers))
    return bank


def interleaved(arms: dict, repeats: int, k: int) -> dict[str, list[float]]:
    """Seconds per forward of each arm, the arms taking turns each round, after two warm-up rounds."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats + 2):
        for name, run in arms.items():
            dt = run()
            if r >= 2:  # two warm-up rounds
                times[name].append(dt / k)
    return times


@torch.inference_mode()
def main(argv=None) -> int:
    from dvi.config import load_config
    from serving.loading import load_serving_pair
    from trainers.builds.shipped_drafter import cpu_model

    a = parse_args(argv)
    torch.set_num_threads(1)
    built_pair(a.preset, None)
    pair = load_serving_pair(load_config(None, [f"models.preset={a.preset}", "models.device=cpu"]))
    drafter = pair.drafter.eval()  # as `dvi serve` loads it: its dtype on this CPU, its draft vocabulary
    dtype = next(drafter.parameters()).dtype
    pm = peft_adapters(drafter, a.groups, a.rank)
    names = [f"g{i % a.groups}" for i in range(a.batch)]
    bank = adapter_bank(drafter, pm, a.groups, dtype)
    ctx = torch.randint(100, 8000, (a.batch, a.context), generator=torch.Generator().manual_seed(0))
    arms = {"lean": lean_arm(copy.deepcopy(drafter), None, names, ctx, a.k),
            "lean + bank": lean_arm(copy.deepcopy(drafter), bank, names, ctx, a.k),
            "hf": hf_arm(drafter, ctx, a.k, None), "peft mixed": hf_arm(pm, ctx, a.k, names)}
    times = interleaved(arms, a.repeats, a.k)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = [b / p for b, p in zip(times["lean + bank"], times["lean"], strict=True)]
    peft_ratios = [b / p for b, p in zip(times["peft mixed"], times["hf"], strict=True)]
    cpu = cpu_model()
    head = drafter.get_output_embeddings()
    rows = getattr(head, "num_ids", None) or head.weight.shape[0]
    print(f"{cpu}, {dtype}, draft vocabulary {rows}, batch {a.batch}, {a.groups} adapters of rank {a.rank}, "
          f"context {a.context}, {a.repeats} interleaved repeats")
    print(f"{'arm':<14}{'ms / forward':>14}")
    for k, v in med.items():
        print(f"{k:<14}{1e3 * v:>14.3f}")
    r_bank, r_peft = statistics.median(ratios), statistics.median(peft_ratios)
    print(f"lean + bank / lean: {r_bank:.3f}x (median of pairs); peft mixed / hf: {r_peft:.3f}x; "
          f"peft mixed / lean + bank: {med['peft mixed'] / med['lean + bank']:.2f}x")
    goals = [goal(f"drafter step, batch {a.batch}, {a.groups} adapters / no adapters", r_bank, GOAL, False)]
    print_goals(goals)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json({"cpu": cpu, "dtype": str(dtype), "args": vars(a) | {"json": str(a.json)},
                                                 "ms_per_forward": {k: 1e3 * v for k, v in med.items()},
                                                 "bank_ratio": r_bank, "peft_ratio": r_peft, "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
