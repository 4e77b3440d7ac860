"""Does a built drafter beat the one dvi ships? Both scored here, on the same text, before `export` replaces it.

A manifest's agreement cannot decide: its held-out code is the building machine's standard library, another text
under another Python (the GPU build's code agreement, 0.451 where it was built, is 0.368 on an Intel AMX machine's
stdlib). So the shipped drafter is rebuilt over the built pair's target and both are scored on the built pair's
held-out sets with its fp32 target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dvi.models.embedded import EmbeddedPaths, PretrainedPreset, read_manifest
from dvi.models.loading import load_causal_lm, load_tokenizer
from trainers.builds.pretrained_build import heldout_sets, make_drafter
from trainers.builds.pretrained_eval import agreement
from trainers.builds.shipped_drafter import Shipped, _stored_order, export, find, load_into


def strengths(built: Path, p: PretrainedPreset, old: Shipped) -> tuple[float, float]:
    """(the built pair's drafter, the shipped `old`): mean top-1 agreement over the held-out domains at the served
    draft vocabulary."""
    paths = EmbeddedPaths.at(built)
    target = load_causal_lm(paths.target, "cpu", "float32")
    evals, skips = heldout_sets(p, target, load_tokenizer(paths.tokenizer), (read_manifest(built) or {}).get("seed", 0))
    mine = load_causal_lm(paths.drafter, "cpu", "bfloat16").float().eval()
    theirs = load_into(old, make_drafter(target, p.drafter_layers, p.drafter_intermediate_size).to(torch.bfloat16))
    out = []
    for drafter, order in ((mine, _stored_order(paths.drafter)), (theirs.float().eval(), _stored_order(old.path))):
        n = min(p.serve_draft_vocab or order.numel(), order.numel())
        per = [agreement(target, drafter, w, order, (n,), skip=skips.get(d))[n] for d, w in evals.items()]
        out.append(sum(per) / max(1, len(per)))
    return out[0], out[1]


def ship_if_stronger(built: Path, p: PretrainedPreset, command: str, root: Path | None = None) -> Path:
    """`export` the built pair's drafter, unless a shipped one of the same recipe scores at least as well here
    (ValueError, with both numbers)."""
    old, _ = find(p, root)
    if old is not None:
        mine, theirs = strengths(built, p, old)
        if mine <= theirs:
            raise ValueError(f"not replacing the shipped drafter (mean agreement {theirs:.4f} on this build's held-out "
                             f"text) with one that is not stronger ({mine:.4f})")
    return export(built, p, command, root=root)
