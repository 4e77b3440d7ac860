"""One writer per drafter-version fact (`dvi.registry.ledger`), checked over the code's write sites: the fact files
are named only in the ledger, each is written by one function, and each writer is called only by its owner (LATEST
by the registry's publish and promote, which the trainer calls; the server's facts by the server's drafter lane); and
at run time, from one thread each (LATEST the trainer's, SERVING and REFUSED one replica's drafter thread)."""

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
    names = set(ledger.FACT_FILES) | {ledger.RETIRED_PINNED}
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
    """LATEST only from the registry's publish / promote (the trainer's doors); SERVING and REFUSED only from the
    server's drafter lane (`serving/drafter/lane.py`, run by the drafter thread alone: `serving.drafter.client`);
    nothing in `serving/` moves LATEST or publishes. PINNED is no fact any more: only the lane's start retires it."""
    owners = {"_set_latest": {"dvi/registry/store.py"}, "set_serving": {"serving/drafter/lane.py"},
              "refuse": {"serving/drafter/lane.py"}, "retire_pinned": {"serving/drafter/lane.py"}}
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


def test_each_fact_is_written_from_one_thread(tiny_pair_dir, tmp_path, monkeypatch):
    """Issue 58 §3, per thread: LATEST from the trainer's (here the test's thread, publishing), SERVING and REFUSED from
    one replica's drafter thread alone, whatever thread sends the pins, rollbacks and finished requests that move them
    (the admin's, the engine's: messages to the drafter wing's door). An older registry's PINNED file is read once at
    start and removed; SERVING carries the pin."""
    import collections
    import concurrent.futures
    import threading

    from registry_doors import publish_peft_adapter
    from test_serving_helpers import lora_copy, version_manifest

    from dvi.models.loading import load_causal_lm
    from dvi.registry.store import DrafterRegistry, ServingState
    from serving.drafter.client import DrafterClient, Observed, Pin, Rollback
    from serving.drafter.lane import Lane
    from serving.drafter.policy import LifecyclePolicy
    from serving.engine_client import EngineSnapshot

    writers: dict[str, set[str]] = collections.defaultdict(set)
    for cls, name, fact in ((ledger.TrainerFacts, "_set_latest", ledger.LATEST),
                            (ledger.ServerFacts, "set_serving", ledger.SERVING),
                            (ledger.ServerFacts, "refuse", ledger.REFUSED)):
        def spy(self, *a, _real=getattr(cls, name), _fact=fact, **k):
            writers[_fact].add(threading.current_thread().name)
            return _real(self, *a, **k)

        monkeypatch.setattr(cls, name, spy)

    class Engine:
        snapshot = EngineSnapshot()

        def command(self, cmd) -> concurrent.futures.Future:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(None)
            return fut

        def busy(self) -> bool:
            return False

    drafter = load_causal_lm(tiny_pair_dir / "drafter", "cpu", "float32")
    reg = DrafterRegistry(tmp_path / "registry")
    v1 = publish_peft_adapter(reg, lora_copy(drafter), version_manifest())
    v2 = publish_peft_adapter(reg, lora_copy(drafter), version_manifest())
    reg.set_serving(ServingState(version=v1, good=v1, pinned=v1))  # a server of the older layout pinned v1 ...
    (reg.dir / "PINNED").write_text(f"[{v1}, {v2}]")  # ... and wrote PINNED beside it (v2: a pin it lost in a crash)
    writers.clear()
    policy = LifecyclePolicy(poll_seconds=0.05, shadow_margin=0.01, rollback_window=4, rollback_margin=0.05)
    door = DrafterClient(Lane(reg, Engine(), drafter, policy))
    door.start()
    try:
        assert door.command(Pin(None)).result(timeout=60) == v1  # restored pinned, then unpinned
        assert not (reg.dir / "PINNED").exists() and reg.retire_pinned() is None
        assert [e["versions"] for e in reg.events() if e["event"] == "retire_pinned"] == [[v1, v2]]
        sender = threading.Thread(target=lambda: door.observe(Observed(3, 1, v1)), name="engine")
        sender.start()
        sender.join()
        assert door.command(Pin(0)).result(timeout=60) == 0
        assert door.command(Pin(None)).result(timeout=60) == 0
        assert door.command(Pin(v2)).result(timeout=60) == v2
        assert door.command(Pin(None)).result(timeout=60) == v2
        assert door.command(Rollback("test")).result(timeout=60) == v1
        v3 = publish_peft_adapter(reg, lora_copy(drafter), version_manifest())
    finally:
        door.stop()
    assert reg.serving() == ServingState(version=v1, good=v1, pinned=None) and v2 in reg.refusals()
    pins = [e["event"] for e in reg.events() if e["event"] in ("pin", "unpin")]
    assert pins == ["pin", "unpin", "pin", "unpin", "pin", "unpin"]  # SERVING's pin, in the registry's history
    assert reg.latest() == v3
    assert dict(writers) == {ledger.SERVING: {"dvi-drafter"}, ledger.REFUSED: {"dvi-drafter"},
                             ledger.LATEST: {"MainThread"}}
