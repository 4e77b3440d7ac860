"""The demo's losslessness check for an engine dvi does not own (`serve.engine: vllm`): every greedy answer replayed
teacher-forced through the target version that served it, in float32, in dvi's process.

Each served token must be the target's own argmax given the tokens before it: what the same target decoding
greedily without speculation chooses there. Where it is not, the check reports the gap between the target's top
logit and the served token's: within `dvi.decode.sampling.tie_bound` it is a near-tie that two float32
implementations of the same model (vLLM's CPU kernels, transformers' eager ones) may break either way; past it, a
token speculation changed. Offline, after the server stopped, like `demo.replay`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dvi.decode.sampling import tie_bound
from dvi.feedback.record import FeedbackRecord


@dataclass
class GreedyCheck:
    """What the check found over the greedy answers."""

    answers: int = 0
    equal: int = 0  # answers whose every token is the target's argmax
    positions: int = 0
    near_ties: int = 0  # positions where the served token is not the argmax, within the float32 tie bound
    changed: list[dict[str, Any]] = field(default_factory=list)  # positions past the bound: where, and the gap

    def line(self) -> str:
        verdict = "all equal" if self.equal == self.answers else (
            "equal up to float32 near-ties" if not self.changed else f"{len(self.changed)} tokens CHANGED")
        return (f"greedy answers vs the target's own argmax (teacher-forced, float32): {self.equal}/{self.answers} "
                f"equal at all {self.positions} positions, {self.near_ties} near-ties: {verdict}")


def check_greedy(records: Iterable[FeedbackRecord], targets: dict[int, torch.nn.Module],
                 greedy_below: float = 1e-5) -> GreedyCheck:
    """Check every greedy record (temperature below `greedy_below`) against `targets[record.target_version]`
    (a record whose target version is missing is skipped: its weights are gone)."""
    out = GreedyCheck()
    for r in records:
        target = targets.get(int(r.target_version))
        if (r.temperature or 0.0) >= greedy_below or target is None or not len(r.token_ids):
            continue
        ids = [int(t) for t in r.prompt_ids] + [int(t) for t in r.token_ids]
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, len(r.prompt_ids) - 1: len(ids) - 1].float()
        served = torch.tensor([int(t) for t in r.token_ids])
        top = logits.max(-1).values
        gaps = top - logits.gather(-1, served[:, None])[:, 0]
        out.answers += 1
        out.positions += len(served)
        bad = (gaps > 0).nonzero().flatten().tolist()
        out.equal += not bad
        for i in bad:
            if float(gaps[i]) <= tie_bound(top[i], torch.float32):
                out.near_ties += 1
            else:
                out.changed.append({"request_id": r.request_id, "index": i, "gap": round(float(gaps[i]), 6)})
    return out


def demo_targets(target_dir: str | Path, updates: dict[int, Path]) -> dict[int, torch.nn.Module]:
    """{target version: the target in float32}: v0 from the pair's dir, each later one with `updates[v]`'s weights."""
    import copy

    from dvi.models.loading import load_causal_lm, load_state_dict

    base = load_causal_lm(target_dir, "cpu", "float32")
    out = {0: base}
    for version, path in updates.items():
        model = copy.deepcopy(base)
        model.load_state_dict(load_state_dict(path), strict=False)
        out[version] = model.eval()
    return out


def report_greedy(cfg: Any, records: dict[str, FeedbackRecord], update: Path, console: Any) -> dict | None:
    """The demo's check behind vLLM (an engine dvi's tests do not decode with), printed: every greedy record against
    the target version that served it (v0 the pair's, v1 the update file's when it exists); None if it failed."""
    from serving.loading import pair_paths

    console.print("checking every greedy answer against the target's own argmax (teacher-forced, float32) ...")
    try:
        found = check_greedy(records.values(), demo_targets(pair_paths(cfg)[0], {1: update} if update.exists() else {}))
    except Exception as exc:  # noqa: BLE001 - the demo's table is still worth printing
        console.print(f"[red]greedy check failed: {type(exc).__name__}: {exc}[/red]")
        return None
    console.print(found.line() + (f"; first: {found.changed[:3]}" if found.changed else ""))
    return asdict(found)
