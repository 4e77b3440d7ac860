"""How good a built drafter is: top-1 agreement with the target per domain and draft-vocabulary size, token
coverage of a draft vocabulary, and decode-step latencies in the serving dtype (what the build's manifest and
summary table report)."""

from __future__ import annotations

import statistics

import torch

from dvi.drafters.learned import EarlyExitDrafter
from dvi.drafters.vocab import apply_draft_vocab
from dvi.models.embedded import EmbeddedPaths, PretrainedPreset
from dvi.models.loading import decode_step_latency
from trainers.builds.build_common import scoring_batches


def draft_top(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """The drafter's greedy token over the draft vocabulary `ids` (None: the full vocabulary)."""
    return ids[logits[..., ids].argmax(-1)] if ids is not None else logits.argmax(-1)


def coverage(order: torch.Tensor, streams: list[torch.Tensor], n: int) -> float:
    """Share of the tokens in `streams` that the first `n` ids of `order` cover."""
    keep = torch.zeros(order.numel(), dtype=torch.bool)
    keep[order[:n]] = True
    total = sum(s.numel() for s in streams)
    return float(sum(int(keep[s].sum()) for s in streams)) / max(1, total)


@torch.inference_mode()
def agreement(target, drafter, windows: list[list[int]], order: torch.Tensor, sizes: tuple[int, ...],
              skip: list[int] | None = None, batch: int = 8) -> dict[int, float]:
    """Top-1 agreement of the drafter's argmax (over its first-N draft vocabulary, N in `sizes`,
    0 = full) with the target's greedy token, over every position of `windows` (after `skip[i]`)."""
    hits = {n: 0 for n in sizes}
    total = 0
    dev = next(target.parameters()).device
    order = order.to(dev)
    for ids, mask, valid in scoring_batches(windows, skip, batch):
        ids, mask, valid = ids.to(dev), mask.to(dev), valid.to(dev)
        t_top = target(input_ids=ids, attention_mask=mask).logits.argmax(-1)  # [B, T]
        d_logits = drafter(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
        total += int(valid.sum())
        for n in sizes:
            hits[n] += int(((draft_top(d_logits, order[:n] if n else None) == t_top) & valid).sum())
    return {n: hits[n] / max(1, total) for n in sizes}


def _head_slice_latency(drafter, n: int, steps: int, rows: torch.Tensor | None = None) -> float:
    """Decode-step ms of the drafter with its served head: a `SubsetHead` over the first `n` of `rows`
    (default: ids 0..n-1; n = 0: the full head). The full head is put back afterwards."""
    if n:
        apply_draft_vocab(drafter, rows[:n] if rows is not None else torch.arange(n))
    try:
        return decode_step_latency(drafter, steps=steps) * 1e3
    finally:
        apply_draft_vocab(drafter, None)


def latencies(target, drafter, sizes: tuple[int, ...], steps: int, dtype: str, rounds: int = 3) -> dict:
    """Batch-1 KV-cached decode step (ms, median of interleaved rounds, one thread) of the target and
    of the drafter at every draft vocabulary size, in the serving dtype."""
    from dvi.models.loading import resolve_dtype

    dt = resolve_dtype(dtype, "cpu")
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    t, d = target.to(dt), drafter.to(dt)
    try:
        t_ms, d_ms = [], {n: [] for n in sizes}
        for _ in range(rounds):
            t_ms.append(decode_step_latency(t, steps=steps) * 1e3)
            for n in sizes:
                d_ms[n].append(_head_slice_latency(d, n, steps))
    finally:
        torch.set_num_threads(prev)
    tm = statistics.median(t_ms)
    return {"dtype": dtype, "target_ms": tm,
            "drafter_ms": {str(n): statistics.median(v) for n, v in d_ms.items()},
            "ratio": {str(n): tm / statistics.median(v) for n, v in d_ms.items()}}


def evaluate(p: PretrainedPreset, target, drafter, order: torch.Tensor, streams: dict[str, torch.Tensor],
             heldout: tuple[dict, dict]) -> dict:
    """Top-1 agreement with the target per domain on the `heldout_sets` (held-out code and prose windows, the
    target's replies to held-out chat instructions) and per draft vocabulary size, token coverage, decode-step
    latencies."""
    evals, skips = heldout
    agree = {d: agreement(target, drafter, w, order, p.draft_vocab_sizes, skip=skips.get(d)) for d, w in evals.items()}
    return {"agreement": {d: {str(n): a for n, a in v.items()} for d, v in agree.items()},
            "coverage": {d: {str(n): coverage(order, [streams[d]], n) for n in p.draft_vocab_sizes if n}
                         for d in streams},
            "latency": latencies(target, drafter, p.draft_vocab_sizes, p.latency_steps, p.latency_dtype),
            "early_exit_agreement": None}


def evaluate_early_exit(p: PretrainedPreset, paths: EmbeddedPaths, target, early, order: torch.Tensor,
                        heldout: tuple[dict, dict], latency: dict) -> dict[str, float]:
    """The early-exit drafter's agreement per domain at the default draft vocabulary; its step time (as
    served: reloaded on the bf16 target) goes into `latency`."""
    evals, skips = heldout
    out = {d: agreement(target, early.model, w, order, (p.draft_vocab,), skip=skips.get(d))[p.draft_vocab]
           for d, w in evals.items()}
    served = EarlyExitDrafter.load(target, paths.early_exit)
    latency["early_exit_ms"] = _head_slice_latency(served.model, p.draft_vocab, p.latency_steps, rows=order)
    latency["early_exit_ratio"] = latency["target_ms"] / latency["early_exit_ms"]
    return out
