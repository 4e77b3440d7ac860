"""Code prompts no build saw, cut the same way everywhere: a function's surroundings, 48-96 tokens ending at a
line end (serve_speed, eagle_served, the drafter ceiling)."""

from __future__ import annotations

import random
from pathlib import Path

from dvi.data import def_cut, def_cuts

__all__ = ["def_cut", "def_cuts", "pip_code_prompts"]


def pip_code_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """n cuts of pip's installed source (never in a build's data)."""
    import pip

    files = sorted(Path(pip.__file__).parent.rglob("*.py"))
    files = [f for f in files if "_vendor" not in f.parts and f.stat().st_size > 4000]
    rng = random.Random(seed)
    return def_cuts((f.read_text(errors="replace") for f in rng.sample(files, min(len(files), 4 * n))), rng, tok, n)
