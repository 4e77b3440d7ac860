"""Is the shipped drafter's chat agreement limited by its depth or by its text (issue 43)? Both arms go on from the
shipped one-layer drafter on the same new text (the target's own open chats and replies, `--seed`) for the same
token budget: `one` trains it as it is; `two` first grows a second layer (a copy of target layer `--grow-from` whose
attention output and down projections start at zero, so the grown drafter computes exactly the shipped one) and
trains both layers. Scored like `benchmarks/shipped_agreement.py`: position-0 top-1 agreement on unseen pip cuts and
chat replies, at the served draft vocabulary, with the paired difference's standard error (same positions).

    PYTHONPATH=. nice .venv/bin/python benchmarks/drafter_depth.py [--tokens 786432] [--open-chats 1024] [--seed 2]

Prints a table; writes JSON with a `goals` list (two layers >= one layer + 0.02 on chat: the bar for a deeper
recipe, whose second layer costs serving a drafter step more).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402

MIX = (("chat_open", 0.4), ("chat", 0.15), ("code", 0.2), ("code_greedy", 0.15), ("prose", 0.1))  # the refinement's
DEEPER_BAR = 0.02


def parse_args(argv):
    p = argparse.ArgumentParser(prog="drafter_depth", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=786_432, help="token-passes per arm")
    p.add_argument("--open-chats", type=int, default=1024)
    p.add_argument("--seed", type=int, default=2, help="of the new text (the shipped drafter saw seeds 0 and 1's)")
    p.add_argument("--grow-from", type=int, default=29, help="target layer the second layer starts from")
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--cache", type=Path, default=ROOT / "runs" / "drafter_depth")
    p.add_argument("--json", type=Path, default=ROOT / "bench_results" / "drafter_depth.json")
    return p.parse_args(argv)


def hits(drafter, sets: dict, order: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """Per domain, whether the drafter's first draft (argmax over order[:n]) is the target's token, position by
    position, scored as shipped (bf16 weights)."""
    from benchmarks.shipped_agreement import position0_hits

    d = drafter.to(torch.bfloat16).float().eval()
    return {dom: position0_hits(d, ev, order, (n,))[n] for dom, ev in sets.items()}


def grown(one_layer, target, p, src: int):
    """The one-layer drafter with a second layer (target layer `src`, o_proj and down_proj zeroed): same function."""
    from trainers.builds.pretrained_build import make_drafter

    two = make_drafter(target, (*p.drafter_layers, src), p.drafter_intermediate_size).float()
    with torch.no_grad():
        two.model.layers[0].load_state_dict(one_layer.model.layers[0].state_dict())
        two.model.norm.weight.copy_(one_layer.model.norm.weight)
        two.lm_head.weight.copy_(one_layer.lm_head.weight)
        two.model.layers[1].self_attn.o_proj.weight.zero_()
        two.model.layers[1].mlp.down_proj.weight.zero_()
    return two


def new_text(target, tok, budget, seed: int, cache: Path) -> dict[str, torch.Tensor]:
    """The training text of `seed` (generated once, then read from `cache`)."""
    from trainers.builds.device_build import training_streams

    f = cache / f"streams_seed{seed}_open{budget.open_chats}.pt"
    if f.exists():
        return torch.load(f)
    walls: dict[str, float] = {}
    streams = training_streams(target, tok, budget, seed, True, walls)
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(streams, f)
    return streams


@dataclass
class _Start:
    """What both arms start from: the target, the shipped drafter, the new text and its draft vocabulary order."""
    a: argparse.Namespace
    p: Any
    paths: Any
    target: Any
    tok: Any
    budget: Any
    streams: dict[str, torch.Tensor]
    shipped: Any
    stored: torch.Tensor
    order: torch.Tensor

    def one_layer(self):
        from trainers.builds.pretrained_build import make_drafter
        from trainers.builds.shipped_drafter import load_into

        skeleton = make_drafter(self.target, self.p.drafter_layers, self.p.drafter_intermediate_size).to(torch.bfloat16)
        return load_into(self.shipped, skeleton).float()


def _start(a: argparse.Namespace) -> _Start:
    from dvi.drafters.vocab import frequent_token_ids
    from dvi.models.embedded import EmbeddedPaths, embedded_dir, get_preset
    from trainers.builds.device_build import Budget, _load
    from trainers.builds.shipped_drafter import SHIPPED_ROOT, _stored_order, read

    p = get_preset("smollm2")
    paths = EmbeddedPaths.at(embedded_dir(p.name))
    target, tok = _load(paths, "cpu")
    budget = Budget(tokens=a.tokens, seconds=1e9, chat_replies=128, code_continuations=128, open_chats=a.open_chats,
                    batch_windows=8, gen_batch=64, lr=a.lr, mix=MIX)
    streams = new_text(target, tok, budget, a.seed, a.cache)
    init = SHIPPED_ROOT / p.name
    shipped, why = read(p, init)
    if shipped is None:
        raise SystemExit(f"drafter_depth: {why}")
    stored = _stored_order(init)
    vocab = int(target.config.vocab_size)
    order = frequent_token_ids(list(streams.values()), vocab, always=sorted(set(tok.all_special_ids)), vocab_size=vocab)
    order = torch.cat([stored, order[~torch.isin(order, stored)]])  # the shipped head rows stay the trained ones
    return _Start(a, p, paths, target, tok, budget, streams, shipped, stored, order)


def _train(st: _Start, arm: str) -> tuple[Any, dict]:
    """Arm `one` (the shipped drafter as it is) or `two` (grown by a layer) trained on the new text."""
    from trainers.builds.build_common import schedule
    from trainers.builds.device_build import distill_online

    p, a, budget = st.p, st.a, st.budget
    d = st.one_layer() if arm == "one" else grown(st.one_layer(), st.target, p, a.grow_from)
    sched = replace(schedule(p, budget.tokens, f"drafter[{arm}]", True, lr=budget.lr), probe=None)
    t0 = time.perf_counter()
    stats = distill_online(d, st.target, st.streams, st.order[: p.train_vocab], budget, sched, p.seq_len, a.seed)
    return d, {"wall_s": time.perf_counter() - t0, "tokens_per_s": stats["tokens_per_s"],
               "kl": [stats["first_loss"], stats["final_loss"]], "params": sum(x.numel() for x in d.parameters())}


def _print_table(a, n: int, rate: dict, arms: dict, diff: dict, same_start: bool) -> None:
    doms = list(diff)
    print(f"position-0 agreement on unseen text at {n} draft ids ({a.tokens:,} token-passes per arm, seed {a.seed}; "
          f"the grown drafter starts equal to the shipped one: {same_start})")
    print(f"  {'arm':<9}" + "".join(f"{dom:>9}" for dom in doms) + f"{'wall s':>9}{'tok/s':>8}")
    for k, v in rate.items():
        extra = arms.get(k, {})
        print(f"  {k:<9}" + "".join(f"{v[d]:>9.3f}" for d in doms)
              + (f"{extra['wall_s']:>9.0f}{extra['tokens_per_s']:>8.0f}" if extra else ""))
    print("  two - one: " + ", ".join(f"{d} {v['mean']:+.3f} ± {v['se']:.3f} (paired SE, {v['positions']} positions)"
                                      for d, v in diff.items()))


def main(argv=None) -> int:
    from benchmarks._ceiling_data import eval_sets
    from dvi.models.loading import load_causal_lm

    a = parse_args(argv)
    st = _start(a)
    p, target = st.p, st.target
    sets = eval_sets(load_causal_lm(st.paths.target, "cpu", "float32"), st.tok, ROOT / "runs" / "shipped_agreement",
                     (), n=24)
    n = p.serve_draft_vocab
    scored = {"shipped": hits(st.one_layer(), sets, st.stored, n)}
    grown_start = hits(grown(st.one_layer(), target, p, a.grow_from), sets, st.stored, n)
    arms: dict[str, dict] = {}
    for arm in ("one", "two"):
        d, arms[arm] = _train(st, arm)
        scored[arm] = hits(d, sets, st.stored, n)
    rate = {k: {dom: float(h.float().mean()) for dom, h in v.items()} for k, v in scored.items()}
    diff = {}
    for dom in sets:
        x = scored["two"][dom].float() - scored["one"][dom].float()
        diff[dom] = {"mean": float(x.mean()), "se": float(x.std() / len(x) ** 0.5), "positions": len(x)}
    same_start = all(torch.equal(grown_start[d], scored["shipped"][d]) for d in sets)
    _print_table(a, n, rate, arms, diff, same_start)
    goals = [goal("two layers - one layer, chat position-0 agreement (unseen)", diff["chat"]["mean"], DEEPER_BAR),
             goal("the grown drafter starts as the shipped one (1 = every position equal)", float(same_start), 1.0)]
    print_goals(goals)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(clean_json({"benchmark": "drafter_depth", "args": {k: str(v) for k, v in vars(a).items()},
                                             "agreement": rate, "two_minus_one": diff, "arms": arms,
                                             "training_text_tokens": {k: int(v.numel()) for k, v in st.streams.items()},
                                             "goals": goals}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
