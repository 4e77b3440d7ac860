"""The README's headline numbers, written from the JSON the benchmarks wrote, so they stay true.

    .venv/bin/python scripts/readme_numbers.py           # rewrite the table between the markers in README.md
    .venv/bin/python scripts/readme_numbers.py --check   # exit 1 if README.md's table is not what the JSON says

Sources (committed): `docs/results/serve_speed.json` (`benchmarks/serve_speed.py`: `dvi serve` at batch 1 per
drafter kind against HF `generate`) and the shipped drafter's manifest (`unseen_agreement`, written by
`benchmarks/shipped_agreement.py`). Every row names the CPU its numbers were measured on. A new benchmark run goes in
by copying its JSON over the source and running this script; `tests/test_readme_numbers.py` fails while the README
and the sources disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SERVE_SPEED = ROOT / "docs" / "results" / "serve_speed.json"
BEGIN = "<!-- headline numbers: written by scripts/readme_numbers.py from the JSON below; run it, do not edit -->"
END = "<!-- /headline numbers -->"
DTYPES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16"}


def shipped_manifest() -> Path:
    """The shipped smollm2 drafter's manifest (wherever under trainers/ the shipped drafters live)."""
    found = sorted(ROOT.glob("trainers/**/shipped/smollm2/manifest.json"))
    if not found:
        raise FileNotFoundError("no trainers/**/shipped/smollm2/manifest.json")
    return found[0]


def _cpu(settings: dict, doc: dict) -> str:
    cpu = settings.get("cpu") or (doc.get("noted") or {}).get("cpu")
    if not cpu:
        raise ValueError(f"{SERVE_SPEED.name} names no CPU (settings.cpu)")
    return cpu


def _serve_speed() -> tuple[dict, str]:
    doc = json.loads(SERVE_SPEED.read_text(encoding="utf-8"))
    s = doc["settings"]
    return doc, f"{_cpu(s, doc)}, {DTYPES.get(s['dtype'], s['dtype'])}"


def speed_rows() -> list[list[str]]:
    """Per arm: code and chat tokens/s, tokens per target pass, greedy answers equal to speculation off's, CPU."""
    doc, where = _serve_speed()
    by = {(r["domain"], r["kind"]): r for r in doc["rows"]}
    off = {d: by[d, "off"] for d in ("code", "chat")}
    out = [["HF `generate`", *(f"{off[d]['hf_tokens_per_s']:.1f}" for d in ("code", "chat")), "1", "1", "", where],
           ["`dvi serve`, speculation off", *(f"{off[d]['tokens_per_s']:.1f} ({off[d]['vs_hf']:.2f}x HF)" for d in ("code", "chat")),
            "1", "1", "", where]]
    for kind, name in (("separate", "`dvi serve`, the shipped drafter (`separate`)"),
                       ("hybrid", "`dvi serve`, `hybrid` (drafter + suffix index)")):
        if ("code", kind) not in by:
            continue
        r = {d: by[d, kind] for d in ("code", "chat")}
        out.append([name, *(f"{r[d]['tokens_per_s']:.1f} ({r[d]['tokens_per_s'] / off[d]['tokens_per_s']:.2f}x off)"
                            for d in ("code", "chat")),
                    *(f"{r[d]['tokens_per_step']:.2f}" for d in ("code", "chat")),
                    " / ".join(f"{r[d]['same_text_as_off']} of {r[d]['answers']}" for d in ("code", "chat")), where])
    return out


def agreement_row() -> list[str]:
    """The shipped drafter's position-0 agreement on unseen code and chat, and the CPU it was measured on."""
    u = json.loads(shipped_manifest().read_text(encoding="utf-8"))["unseen_agreement"]
    cpu = re.search(r"\(([^()]*)\)\s*$", u["benchmark"])
    if cpu is None:
        raise ValueError("the shipped manifest's unseen_agreement.benchmark names no CPU")
    a = u["refined"]["agreement"]
    return [f"{a['code']['0']:.3f}", f"{a['chat']['0']:.3f}", cpu.group(1)]


def table() -> str:
    doc, _ = _serve_speed()
    s = doc["settings"]
    n = s["prompts"]
    code, chat, cpu = agreement_row()
    man = shipped_manifest().relative_to(ROOT)
    lines = [BEGIN, "",
             f"| batch 1, greedy, {s['max_tokens']} new tokens | code tok/s | chat tok/s "
             "| code tokens / target pass | chat tokens / target pass | greedy text = off (code / chat) | measured on |",
             "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in speed_rows()]
    lines += ["", "| the shipped drafter's top-1 agreement with the target, on text no build saw | code | chat "
                  "| measured on |", "|---|---|---|---|",
              f"| `benchmarks/shipped_agreement.py` (pip's source, general chat requests) | {code} | {chat} | {cpu} |",
              "", f"Written by `scripts/readme_numbers.py` from `{SERVE_SPEED.relative_to(ROOT)}` "
                  f"(`benchmarks/serve_speed.py`, {n['code']} code and {n['chat']} chat prompts no build saw, "
                  "tokens/s client-side over HTTP, one thread, each arm its own `dvi serve`, trainer off) and "
                  f"`{man}`. Greedy text may part from speculation off's at near-ties of bf16 on that CPU "
                  "([Greedy decoding](#greedy-decoding-what-holds-on-which-device)).", "", END]
    return "\n".join(lines)


def update(text: str) -> str:
    """`text` (a README) with the table between the markers rewritten; ValueError if the markers are missing."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md lacks the markers {BEGIN!r} ... {END!r}")
    return text[:i] + table() + text[j + len(END):]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if README.md's table differs from the sources")
    args = p.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    new = update(text)
    if args.check:
        if new != text:
            print("README.md's headline numbers differ from the benchmark JSON: run scripts/readme_numbers.py",
                  file=sys.stderr)
            return 1
        return 0
    if new != text:
        README.write_text(new, encoding="utf-8")
        print("README.md: headline numbers rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
