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


def _code_files() -> list[Path]:
    return [p for pkg in ("dvi", "trainers", "serving") for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_modules_and_functions_stay_small() -> None:
    """Issue 16's bar, kept: a module reads in one sitting (<= 500 lines), a function on one screen
    (<= 60 lines) with at most 8 parameters (self/cls not counted; a config object holds the rest)."""
    too_long, too_big, too_many = [], [], []
    for path in _code_files():
        text = path.read_text()
        rel = path.relative_to(ROOT)
        if len(text.splitlines()) > 500:
            too_long.append(str(rel))
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            if node.end_lineno - node.lineno + 1 > 60:
                too_big.append(f"{rel}:{node.lineno} {node.name}")
            if len(params) + (a.vararg is not None) > 8:
                too_many.append(f"{rel}:{node.lineno} {node.name}")
    assert not too_long, f"modules over 500 lines: {too_long}"
    assert not too_big, f"functions over 60 lines: {too_big}"
    assert not too_many, f"functions with more than 8 parameters: {too_many}"
