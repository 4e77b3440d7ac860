"""What an eagle head is worth before it is served: first-draft agreement and chained acceptance (K drafts a
step, greedy, each draft reading the head's own previous output) on the target's greedy text.

On greedy text the token after position j *is* the target's choice, so a chain of drafts started at position s
is accepted up to its first draft that differs from the target's argmax; every start s of the scored region is
one drafting step. Computed by the training-time-test unroll (`trainers.builds.eagle_ttt.chain_predictions`), which is
proven equal to the engine's stepped drafting.
"""

from __future__ import annotations

import torch

from dvi.drafters.eagle import EagleModel
from dvi.feedback.shadow import accepted_drafts
from trainers.builds.eagle_ttt import chain_predictions

__all__ = ["chain_acceptance"]


@torch.inference_mode()
def chain_acceptance(model: EagleModel, seqs: list[list[int]], starts: list[int], hidden: torch.Tensor,
                     top: torch.Tensor, vocab_ids: torch.Tensor, k: int = 4, batch: int = 8) -> dict:
    """`seqs` token ids (prompt + the target's greedy continuation), scored from position `starts[i]`; `hidden`
    [N, T, feature_dim] the target's features of each position (right-padded), `top` [N, T] its greedy token
    after each position; `vocab_ids` the draft vocabulary. Returns position-0 agreement (first drafts over every
    scored position), P(accepted length >= i) for i = 1..k (what served per-position acceptance counts), the
    mean accepted length of a K-draft step and the share of positions where the text is the target's argmax
    (1.0 up to near-ties: the check that the text is greedy)."""
    head = model.lm_head.weight[vocab_ids].float()  # [n, H]
    hits = total = 0
    reach = torch.zeros(k)
    steps = greedy = scored = 0
    for i in range(0, len(seqs), batch):
        rows = seqs[i: i + batch]
        t = max(map(len, rows))
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        for r, s in enumerate(rows):
            ids[r, : len(s)] = torch.tensor(s)
        preds = chain_predictions(model, ids, hidden[i: i + len(rows), :t], head, vocab_ids, k)  # [k, B, T]
        tops = top[i: i + len(rows), :t]
        for r, s in enumerate(rows):
            n, s0 = len(s), starts[i + r]
            first = preds[0, r, s0: n - 1] == tops[r, s0: n - 1]
            hits, total = hits + int(first.sum()), total + first.numel()
            greedy += int((ids[r, s0 + 1: n] == tops[r, s0: n - 1]).sum())
            scored += n - 1 - s0
            m = n - k + 1 - s0  # chains started at s0 .. n - k, each drafting positions st .. st + k - 1
            if m <= 0:
                continue
            ok = torch.stack([preds[j, r, s0 + j: s0 + j + m] == tops[r, s0 + j: s0 + j + m] for j in range(k)])
            length = accepted_drafts(ok)  # [m]: accepted drafts of each chain
            reach += torch.stack([(length > j).sum() for j in range(k)]).float()
            steps += m
    per_position = (reach / max(1, steps)).tolist()
    return {"agreement": hits / max(1, total), "acceptance": per_position, "accept_length": sum(per_position),
            "steps": steps, "positions": total, "greedy_share": greedy / max(1, scored)}
