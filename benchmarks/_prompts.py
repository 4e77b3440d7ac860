"""Code prompts no build saw, cut the same way everywhere: a function's surroundings, 48-96 tokens ending at a
line end (serve_speed, eagle_served, the drafter ceiling)."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path

__all__ = ["def_cut", "def_cuts", "pip_code_prompts"]


def def_cut(text: str, rng: random.Random, tok) -> list[int] | None:
    """The tokens around a random `def` line of `text`: from two lines before it, up to 96 tokens, cut at the end
    of its fourth line (at least 48 tokens); None where `text` has no `def` or too little around it."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
    if not starts:
        return None
    i = rng.choice(starts)
    ids = tok.encode("".join(lines[max(0, i - 2): i + 12]), add_special_tokens=False)
    if len(ids) < 48:
        return None
    cut = len(tok.encode("".join(lines[max(0, i - 2): i + 4]), add_special_tokens=False))
    return ids[: max(48, min(96, cut))]


def def_cuts(texts: Iterable[str], rng: random.Random, tok, n: int) -> list[list[int]]:
    """Up to n `def_cut`s, one per text, in the order given."""
    out = []
    for text in texts:
        ids = def_cut(text, rng, tok)
        if ids is not None:
            out.append(ids)
        if len(out) == n:
            break
    return out


def pip_code_prompts(tok, n: int, seed: int) -> list[list[int]]:
    """n cuts of pip's installed source (never in a build's data)."""
    import pip

    files = sorted(Path(pip.__file__).parent.rglob("*.py"))
    files = [f for f in files if "_vendor" not in f.parts and f.stat().st_size > 4000]
    rng = random.Random(seed)
    return def_cuts((f.read_text(errors="replace") for f in rng.sample(files, min(len(files), 4 * n))), rng, tok, n)
