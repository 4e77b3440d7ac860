"""The README's first screen (issue 59 §7): what dvi is, the two commands, the demo's picture, and headline numbers
that `scripts/readme_numbers.py` wrote from committed benchmark JSON, each naming its CPU, so they stay true."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = runpy.run_path(str(ROOT / "scripts" / "readme_numbers.py"))


def test_readme_table_is_what_the_benchmark_json_says() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert SCRIPT["update"](text) == text, "README.md's headline numbers are stale: run scripts/readme_numbers.py"
    assert SCRIPT["main"](["--check"]) == 0


def test_the_check_fails_on_a_changed_number() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    doc = json.loads(SCRIPT["SERVE_SPEED"].read_text(encoding="utf-8"))
    off = next(r for r in doc["rows"] if r["domain"] == "code" and r["kind"] == "off")
    shown = f"{off['tokens_per_s']:.1f} ({off['vs_hf']:.2f}x HF)"
    assert shown in text
    tampered = text.replace(shown, f"{off['tokens_per_s'] * 2:.1f} ({off['vs_hf']:.2f}x HF)", 1)
    assert SCRIPT["update"](tampered) == text
    with pytest.raises(ValueError, match="markers"):
        SCRIPT["update"](text.replace(SCRIPT["END"], ""))


def test_every_number_names_its_cpu() -> None:
    table = SCRIPT["table"]()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    body = [r for r in rows if any(ch.isdigit() for ch in r.split("|")[2])]
    assert len(body) >= 5
    for r in body:
        cpu = r.rstrip(" |").rsplit("|", 1)[1].strip()
        assert "cores" in cpu and ("AMD" in cpu or "Intel" in cpu), r


def test_first_screen_says_what_dvi_is_then_the_two_commands_and_the_numbers() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    first = "\n".join(lines[:40])
    assert first.startswith("# dvi")
    assert "make demo" in first and "make test" in first
    assert "alpha.png" in first
    assert SCRIPT["BEGIN"] in first
    assert next(i for i, line in enumerate(lines) if line.startswith("make demo")) < 12  # after 2-5 lines of what dvi is
