"""The import arrows of DESIGN.md: serving and trainers import dvi; dvi imports neither
(except its CLI, the composition root, which imports them lazily inside subcommands)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_dvi_does_not_import_trainers_or_serving() -> None:
    for path in (ROOT / "dvi").rglob("*.py"):
        if path.name == "cli.py":
            assert not _module_level_imports(path) & {"trainers", "serving", "benchmarks"}, path
            continue
        assert not _imported_top_levels(path) & {"trainers", "serving", "benchmarks"}, path


def test_trainers_and_serving_do_not_import_each_other_or_benchmarks() -> None:
    for pkg, banned in (("trainers", {"serving", "benchmarks"}), ("serving", {"trainers", "benchmarks"})):
        for path in (ROOT / pkg).rglob("*.py"):
            assert not _imported_top_levels(path) & banned, path
