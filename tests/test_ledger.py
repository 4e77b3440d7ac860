"""One writer per drafter-version fact (`dvi.registry.ledger`), checked over the code's write sites: the fact files
are named only in the ledger, each is written by one function, and each writer is called only by its owner (LATEST
by the registry's publish and promote, which the trainer calls; the server's facts by the server's swapper)."""

from __future__ import annotations

import ast
from pathlib import Path

from dvi.registry import ledger

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("dvi", "serving", "trainers") for p in sorted((ROOT / d).rglob("*.py"))]
LEDGER = ROOT / "dvi" / "registry" / "ledger.py"
WRITERS = {"atomic_write_text", "write_text", "write_bytes", "open", "replace", "rename", "append_jsonl"}


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            out += [(f"{node.name}.{f.name}", f) for f in node.body if isinstance(f, ast.FunctionDef)]
    return out


def _called(node: ast.AST) -> str | None:
    f = node.func if isinstance(node, ast.Call) else None
    return f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else None)


def test_the_fact_files_are_named_only_in_the_ledger():
    names = set(ledger.FACT_FILES)
    for path in SOURCES:
        if path == LEDGER:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            assert not (isinstance(node, ast.Constant) and node.value in names), (
                f"{path.relative_to(ROOT)}:{node.lineno} names the fact file {node.value!r}: only "
                "dvi/registry/ledger.py may")


def test_each_fact_has_one_writer():
    tree = ast.parse(LEDGER.read_text())
    writes: dict[str, set[str]] = {fact: set() for fact in ledger.FACT_FILES}
    for qual, fn in _functions(tree):
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and _called(n) in WRITERS):
            used = {n.id for a in call.args for n in ast.walk(a) if isinstance(n, ast.Name)}
            for fact in used & set(writes):
                writes[fact].add(qual)
    assert writes == {fact: {writer} for fact, writer in ledger.FACT_FILES.items()}


def test_each_writer_is_called_only_by_its_owner():
    """LATEST only from the registry's publish / promote (the trainer's doors); SERVING, REFUSED and PINNED only from
    the server (`serving/`) and the ledger itself; nothing in `serving/` moves LATEST or publishes."""
    owners = {"_set_latest": {"dvi/registry/store.py"}, "set_serving": {"serving/drafter/lane.py"},
              "refuse": {"serving/drafter/lane.py", "dvi/registry/ledger.py"}, "_write_pins": {"dvi/registry/ledger.py"},
              "pin": {"serving/drafter/lane.py", "serving/drafter/client.py"}, "unpin": {"serving/drafter/lane.py"}}
    trainer_doors = {"promote", "publish_full", "publish_drafter", "publish_peft_adapter", "_set_latest"}
    seen: dict[str, set[str]] = {name: set() for name in owners}
    for path in SOURCES:
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            name = _called(node) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if name in seen:
                seen[name].add(rel)
            assert not (rel.startswith("serving/") and name in trainer_doors), f"{rel}:{node.lineno} calls {name}"
    for name, where in seen.items():
        assert where <= owners[name], f"{name} is called from {sorted(where - owners[name])}"
