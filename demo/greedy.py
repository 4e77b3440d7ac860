"""The demo's losslessness check for an engine dvi does not own (`serve.engine: vllm`), offline, after the server
stopped (like `demo.replay`), two ways (`serving.vllm_greedy`):

1. every greedy answer replayed teacher-forced through the target version that served it, in float32, in dvi's
   process: each served token must be the target's own argmax given the tokens before it. Where it is not, the gap
   between the target's top logit and the served token's is judged: within `dvi.decode.sampling.tie_bound` a
   float32 near-tie; within the bound vLLM's start-up probe measured on this device (/health `greedy_contract`:
   how far vLLM's kernels stand from transformers' on the same weights) a kernel near-tie; past it, a changed token.
2. every greedy answer's prompt replayed through a vLLM without speculation (`PlainVllm`, each target version in
   turn), the text compared: speculation on must equal vLLM's own plain decoding, which is what lossless means
   behind an engine dvi does not own. Where they part, the reference's gap between the two tokens is judged as in 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from dvi.feedback.record import FeedbackRecord
from serving.vllm_greedy import classify, first_difference, teacher_forced


@dataclass
class GreedyCheck:
    """What the check found over the greedy answers."""

    answers: int = 0
    equal: int = 0  # answers whose every token is the target's argmax
    positions: int = 0
    near_ties: int = 0  # positions where the served token is not the argmax, within the float32 tie bound
    within_bound: int = 0  # ... past it, within the device's measured bound (vLLM's kernels vs transformers')
    changed: list[dict[str, Any]] = field(default_factory=list)  # positions past the bound: where, and the gap
    bound: float = 0.0  # the device's bound the check judged with (0: none measured)
    plain: dict[str, Any] | None = None  # vs vLLM without speculation: answers, equal, divergences (None: not run)

    def line(self) -> str:
        verdict = "all equal" if self.equal == self.answers else (
            f"{len(self.changed)} tokens CHANGED" if self.changed else
            "equal up to float32 near-ties" if not self.within_bound else "equal within this device's bound")
        bound = f"; this device's bound {self.bound:.2g}, vLLM's start-up probe" if self.bound else ""
        out = (f"greedy answers vs the target's own argmax (teacher-forced, float32{bound}): {self.equal}/{self.answers} "
               f"equal at all {self.positions} positions, {self.near_ties} near-ties, {self.within_bound} within the "
               f"bound: {verdict}")
        if self.plain is not None:
            p = self.plain
            out += (f"\ngreedy answers vs vLLM's own text without speculation: {p['equal']}/{p['answers']} equal"
                    + (f", {len(p['changed'])} CHANGED" if p["changed"] else "")
                    + (f", {p['near_ties']} parted at near-ties" if p["near_ties"] else ""))
        return out

    @property
    def failed(self) -> bool:
        return bool(self.changed or (self.plain or {}).get("changed"))


def _greedy(records: Iterable[FeedbackRecord], targets: dict[int, Any], greedy_below: float) -> list[FeedbackRecord]:
    return [r for r in records if (r.temperature or 0.0) < greedy_below and int(r.target_version) in targets
            and len(r.token_ids)]


def check_greedy(records: Iterable[FeedbackRecord], targets: dict[int, torch.nn.Module], greedy_below: float = 1e-5,
                 bound: float = 0.0) -> GreedyCheck:
    """Check every greedy record (temperature below `greedy_below`) against `targets[record.target_version]`
    (a record whose target version is missing is skipped: its weights are gone), judging a token off the argmax
    by `bound` (the device's, from vLLM's start-up probe) past float32's near-tie."""
    out = GreedyCheck(bound=float(bound))
    for r in _greedy(records, targets, greedy_below):
        logits = teacher_forced(targets[int(r.target_version)], list(r.prompt_ids), list(r.token_ids))
        served = torch.tensor([int(t) for t in r.token_ids])
        top = logits.max(-1).values
        gaps = top - logits.gather(-1, served[:, None])[:, 0]
        out.answers += 1
        out.positions += len(served)
        bad = (gaps > 0).nonzero().flatten().tolist()
        out.equal += not bad
        for i in bad:
            cls = classify(float(gaps[i]), float(top[i]), out.bound, torch.float32)
            if cls == "near-tie":
                out.near_ties += 1
            elif cls == "bound":
                out.within_bound += 1
            else:
                out.changed.append({"request_id": r.request_id, "index": i, "gap": round(float(gaps[i]), 6)})
    return out


def check_plain(records: Iterable[FeedbackRecord], plain: dict[str, list[int]], targets: dict[int, torch.nn.Module],
                bound: float, greedy_below: float = 1e-5) -> dict[str, Any]:
    """Served greedy text against vLLM's without speculation (`plain`: request id -> its tokens for the same prompt
    and length): equal answers; where one parts, the reference's gap between the two tokens there, judged by `bound`."""
    out: dict[str, Any] = {"answers": 0, "equal": 0, "near_ties": 0, "changed": []}
    for r in _greedy(records, targets, greedy_below):
        if r.request_id not in plain:
            continue
        mine, theirs = list(r.token_ids), plain[r.request_id]
        out["answers"] += 1
        i = first_difference(mine, theirs)
        if i is None:
            out["equal"] += 1
            continue
        logits = teacher_forced(targets[int(r.target_version)], list(r.prompt_ids), mine[: i + 1])[i]
        gap = abs(float(logits[mine[i]] - logits[theirs[i]]))
        if classify(gap, float(logits.max()), bound, torch.float32) == "changed":
            out["changed"].append({"request_id": r.request_id, "index": i, "gap": round(gap, 6)})
        else:
            out["near_ties"] += 1
    return out


def plain_texts(cfg: Any, records: Iterable[FeedbackRecord], target: torch.nn.Module, tokenizer: Any,
                updates: dict[int, Path], root: Path, greedy_below: float = 1e-5) -> dict[str, list[int]]:
    """Every greedy record's prompt through a vLLM without speculation (`serving.vllm_greedy.PlainVllm`) on the target
    version that served it (v0 `target`, then each update file loaded in place), as long as the served answer:
    request id -> vLLM's plain tokens."""
    from serving.vllm_greedy import PlainVllm

    by_version: dict[int, list[FeedbackRecord]] = {}
    for r in _greedy(records, {0: None, **dict.fromkeys(updates)}, greedy_below):
        by_version.setdefault(int(r.target_version), []).append(r)
    out: dict[str, list[int]] = {}
    with PlainVllm(cfg.serve.vllm, target, tokenizer, root) as vllm:
        for version in sorted(by_version):
            if version:
                vllm.load_target(updates[version])
            rs = by_version[version]
            tokens = vllm.complete([list(r.prompt_ids) for r in rs], [len(r.token_ids) for r in rs])
            out.update({r.request_id: t for r, t in zip(rs, tokens, strict=True)})
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


def report_greedy(cfg: Any, records: dict[str, FeedbackRecord], update: Path, console: Any,
                  contract: dict[str, Any] | None = None, plain_root: Path | None = None) -> dict | None:
    """The demo's check behind vLLM (an engine dvi's tests do not decode with), printed: every greedy record against
    the target version that served it (v0 the pair's, v1 the update file's when it exists), judged by the device's
    bound from the server's `greedy_contract` (/health); then, with `plain_root`, against vLLM's own text without
    speculation. None if it failed."""
    from dvi.models.loading import find_tokenizer_path, load_tokenizer
    from serving.loading import pair_paths

    contract = contract or {}
    bound = float(contract.get("bound") or 0.0)
    degraded = contract.get("one_request") == "degraded"  # vLLM's kernels or weights are not the dtype's: a failure
    if contract:
        console.print(("[red]" if degraded else "") + "greedy contract behind vLLM (/health): " + ", ".join(
            f"{k} {contract[k]}" for k in ("dtype", "weights", "fpmath", "deviation", "bound", "one_request")
            if k in contract) + ("[/red]" if degraded else ""))
    console.print("checking every greedy answer against the target's own argmax (teacher-forced, float32) ...")
    updates = {1: update} if update.exists() else {}
    try:
        targets = demo_targets(pair_paths(cfg)[0], updates)
        found = check_greedy(records.values(), targets, bound=bound)
        if plain_root is not None:
            console.print("replaying every greedy prompt through vLLM without speculation ...")
            target_path, _, tok_path = pair_paths(cfg)
            tok = load_tokenizer(tok_path or find_tokenizer_path(target_path))
            plain = plain_texts(cfg, records.values(), targets[0], tok, updates, plain_root)
            found.plain = check_plain(records.values(), plain, targets, bound)
    except Exception as exc:  # noqa: BLE001 - the demo's table is still worth printing
        console.print(f"[red]greedy check failed: {type(exc).__name__}: {exc}[/red]")
        return None
    console.print(found.line() + (f"; first: {found.changed[:3]}" if found.changed else "")
                  + (f"; first: {found.plain['changed'][:3]}" if found.plain and found.plain["changed"] else ""))
    return {**asdict(found), "failed": found.failed or degraded, "contract": contract}
