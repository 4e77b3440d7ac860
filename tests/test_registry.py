import json
import os

import pytest
import torch
from registry_doors import load_adapter_into, publish_files, publish_full, publish_peft_adapter
from tiny_models import tiny_llama

from dvi.registry.store import MANIFEST_FIELDS, AdapterRejected, DrafterRegistry, ServingState

torch.set_num_threads(1)


def sd(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(4, 3, generator=g) * scale,
        "b.bias": torch.randn(5, generator=g) * scale,
    }


def test_publish_layout_latest_and_load(tmp_path):
    reg = DrafterRegistry(tmp_path)
    assert reg.latest() is None and reg.list_versions() == []
    v1 = publish_full(reg,
        sd(1), {"model_type": "llama"}, {"steps": 10, "records_seen": 3, "target_version": 2}
    )
    assert v1 == 1
    d = tmp_path / "drafter" / "v000001"
    assert sorted(os.listdir(d)) == ["config.json", "manifest.json", "model.safetensors"]
    assert (tmp_path / "drafter" / "LATEST").read_text().strip() == "v000001"
    man = json.loads((d / "manifest.json").read_text())
    for f in MANIFEST_FIELDS:
        assert f in man
    assert man["version"] == 1 and man["format"] == "full" and man["parent_version"] is None
    v2 = publish_full(reg, sd(2), {"model_type": "llama"}, {"heldout_alpha": 0.5})
    assert v2 == 2 and reg.latest() == 2 and reg.manifest(2).parent_version == 1
    state, man = reg.open_version(reg.latest(), expected=sd(0))
    assert man.version == 2 and torch.equal(state["a.weight"], sd(2)["a.weight"])
    # expected given as name -> (shape, dtype)
    reg.open_version(1, expected={"a.weight": ((4, 3), "float32"), "b.bias": ([5], torch.float32)})
    assert not [p for p in os.listdir(tmp_path / "drafter") if p.startswith(".tmp")]


def test_publish_files_dict(tmp_path):
    reg = DrafterRegistry(tmp_path)
    from safetensors.torch import save_file

    p = tmp_path / "w.safetensors"
    save_file(sd(0), str(p))
    v = publish_files(reg, {"adapter_model.safetensors": p, "adapter_config.json": b"{}"}, {"steps": 1})
    assert reg.manifest(v).format == "lora"
    reg.open_version(v, expected=sd(0))
    with pytest.raises(ValueError, match="adapter_config.json"):
        publish_files(reg, {"adapter_model.safetensors": p}, {})


def test_a_manifest_from_before_format_reads_in_one_kind_vocabulary(tmp_path):
    """A registry outlives an upgrade: a version whose manifest still says `kind` (its format) and a separate
    drafter's `drafter_kind` by its format's name reads as format + the config's kind names; a new manifest with
    an old kind name is refused."""
    reg = DrafterRegistry(tmp_path)
    v = publish_full(reg, sd(1), {"model_type": "llama"}, {"drafter_kind": "separate"})
    path = reg.version_dir(v) / "manifest.json"
    man = json.loads(path.read_text())
    assert man["drafter_kind"] == "separate" and "kind" not in man
    old = {k: val for k, val in man.items() if k != "format"} | {"kind": "full", "drafter_kind": "full"}
    path.write_text(json.dumps(old))
    got = reg.manifest(v)
    assert (got.format, got.drafter_kind) == ("full", "separate")
    reg.open_version(v, expected=sd(0), drafter_kind="separate", file_format="full")
    with pytest.raises(AdapterRejected, match="format is 'full', expected 'lora'"):
        reg.open_version(v, drafter_kind="separate", file_format="lora")
    path.write_text(json.dumps(man | {"drafter_kind": "lora"}))
    with pytest.raises(AdapterRejected, match="unknown drafter_kind 'lora'"):
        reg.manifest(v)


@pytest.mark.parametrize(
    "corrupt,reason",
    [
        (lambda d: (d / "manifest.json").write_text("{not json"), "does not parse"),
        (lambda d: (d / "manifest.json").unlink(), "manifest.json missing"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors missing"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\x00garbage"), "does not load"),
        (
            lambda d: (d / "manifest.json").write_text(
                json.dumps({**json.loads((d / "manifest.json").read_text()), "version": 9})
            ),
            "says version 9",
        ),
    ],
)
def test_corrupt_versions_rejected(tmp_path, corrupt, reason):
    reg = DrafterRegistry(tmp_path)
    v = publish_full(reg, sd(), {"a": 1}, {})
    corrupt(reg.version_dir(v))
    with pytest.raises(AdapterRejected, match=reason) as ei:
        reg.open_version(v, expected=sd())
    assert ei.value.version == v and ei.value.reason


def test_shape_dtype_names_nan_rejected(tmp_path):
    reg = DrafterRegistry(tmp_path)
    ref = sd()
    bad_shape = {**ref, "a.weight": torch.zeros(4, 4)}
    bad_dtype = {**ref, "b.bias": torch.zeros(5, dtype=torch.float16)}
    extra = {**ref, "c": torch.zeros(1)}
    nan = {**ref, "b.bias": torch.tensor([0.0, float("nan"), 0, 0, 0])}
    cases = [
        (bad_shape, "shape"),
        (bad_dtype, "dtype"),
        (extra, "unexpected"),
        ({"a.weight": ref["a.weight"]}, "missing"),
        (nan, "non-finite"),
    ]
    for state, reason in cases:
        v = publish_full(reg, state, {}, {})
        with pytest.raises(AdapterRejected, match=reason):
            reg.open_version(v, expected=ref)
    with pytest.raises(AdapterRejected, match="does not exist"):
        reg.open_version(999)


def rollback(reg: DrafterRegistry, to_version: int | None = None, reason: str = "") -> int:
    """An operator's rollback of LATEST, from the trainer's and the server's doors (no server does this: a server
    refuses the version it leaves and LATEST stays the trainer's): LATEST back to `to_version`, else to the newest
    older valid version not refused; the version left is refused."""
    cur = reg.latest()
    if to_version is None:
        bad = reg.rolled_back() | ({cur} if cur is not None else set())
        for v in reversed([v for v in reg.list_versions() if (cur is None or v < cur) and v not in bad]):
            try:
                reg.open_version(v)
            except AdapterRejected:
                continue
            to_version = v
            break
        if to_version is None:
            raise AdapterRejected(f"no valid version to roll back to from {cur}")
    reg.promote(to_version)
    if cur is not None and cur != to_version:
        reg.refuse(cur, f"rolled back: {reason}")
    return to_version


def test_rollback_pin_gc(tmp_path):
    reg = DrafterRegistry(tmp_path, keep_last=2)
    for i in range(3):
        publish_full(reg, sd(i), {}, {})
    assert reg.list_versions() == [2, 3]  # v1 collected
    reg.set_serving(ServingState(version=0, good=0, pinned=2))  # an admin pin: SERVING carries it
    assert rollback(reg, reason="alpha fell") == 2 and reg.latest() == 2
    assert 3 in reg.rolled_back()
    ev = reg.events()
    assert ev[-2]["event"] == "promote" and ev[-2]["version"] == 2 and ev[-2]["previous"] == 3
    assert ev[-1]["event"] == "refuse" and ev[-1]["version"] == 3 and "alpha fell" in ev[-1]["reason"]
    for i in range(4):
        publish_full(reg, sd(i), {}, {})
    # newest 2 kept, plus pinned v2; LATEST is v7
    assert reg.list_versions() == [2, 6, 7]
    # a rollback to a specific version; then LATEST (v6) survives gc even when old
    rollback(reg, to_version=6)
    reg.set_serving(ServingState())  # unpinned
    publish_full(reg, sd(0), {}, {}, set_latest=False)
    publish_full(reg, sd(0), {}, {}, set_latest=False)
    assert reg.latest() == 6 and reg.list_versions() == [6, 8, 9]
    reg.promote(9)
    assert reg.latest() == 9
    # rollback(None) skips rolled-back (v7, gone anyway) and invalid versions
    (reg.version_dir(8) / "model.safetensors").write_bytes(b"junk")
    assert rollback(reg) == 6
    with pytest.raises(AdapterRejected, match="no valid version"):
        rollback(reg)


def test_latest_garbage_is_none(tmp_path):
    reg = DrafterRegistry(tmp_path)
    (tmp_path / "drafter" / "LATEST").write_text("nonsense")
    assert reg.latest() is None


def _tiny_peft(r=4, seed=0):
    from peft import LoraConfig, get_peft_model

    # same base everywhere; `seed` only changes the adapter
    base = tiny_llama(0, hidden_size=16, intermediate_size=32, max_position_embeddings=64)
    torch.manual_seed(seed)
    lcfg = LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(base, lcfg)


def test_peft_publish_and_load_into(tmp_path):
    from peft import get_peft_model_state_dict

    reg = DrafterRegistry(tmp_path)
    trained = _tiny_peft(seed=1)
    v = publish_peft_adapter(reg, trained, {"steps": 5, "heldout_alpha": 0.7})
    assert sorted(os.listdir(reg.version_dir(v))) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    ]

    server = _tiny_peft(seed=2)  # same base shapes, different adapter values
    man = load_adapter_into(reg, server, v)
    assert man.version == v and man.format == "lora"
    a = get_peft_model_state_dict(trained)
    b = get_peft_model_state_dict(server)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        assert torch.allclose(trained(x).logits, server(x).logits, atol=1e-5)

    # a different LoRA rank is refused against the live adapter's shapes
    v2 = publish_peft_adapter(reg, _tiny_peft(r=8), {})
    with pytest.raises(AdapterRejected, match="shape"):
        load_adapter_into(reg, server, v2)
    # the failed load left the live adapter untouched
    b2 = get_peft_model_state_dict(server)
    assert all(torch.equal(b[k], b2[k]) for k in b)

    # a new adapter name is created from the version dir
    load_adapter_into(reg, server, v, adapter_name="fresh")
    assert "fresh" in server.peft_config


def test_symlinked_version_or_file_outside_is_refused_missing_is_transient(tmp_path):
    """Issue 17 items 12 and 13: a version dir (or file) symlinked out of the registry is refused;
    a version whose dir is not there (yet) is refused as transient, so the server retries it."""
    reg = DrafterRegistry(tmp_path / "reg")
    other = DrafterRegistry(tmp_path / "other")
    v = publish_full(other, sd(1), {"model_type": "llama"}, {})
    with pytest.raises(AdapterRejected) as exc:
        reg.open_version(1)
    assert exc.value.category == "missing" and exc.value.transient
    os.symlink(other.version_dir(v), reg.version_dir(1))
    with pytest.raises(AdapterRejected) as exc:
        reg.open_version(1)
    assert exc.value.category == "symlink" and not exc.value.transient
    v2 = publish_full(reg, sd(2), {"model_type": "llama"}, {})
    weights = reg.version_dir(v2) / "model.safetensors"
    weights.unlink()
    os.symlink(other.version_dir(v) / "model.safetensors", weights)
    with pytest.raises(AdapterRejected, match="outside the version directory"):
        reg.open_version(v2)


def test_peft_publish_named_adapter_round_trips(tmp_path):
    """peft saves a non-default adapter in a subdir; the version dir still holds the two files at its top."""
    from peft import get_peft_model_state_dict

    reg = DrafterRegistry(tmp_path)
    trained = _tiny_peft(seed=1)
    trained.add_adapter("drafty", trained.peft_config["default"])
    v = publish_peft_adapter(reg, trained, {}, adapter_name="drafty")
    assert sorted(os.listdir(reg.version_dir(v))) == ["adapter_config.json", "adapter_model.safetensors",
                                                      "manifest.json"]
    server = _tiny_peft(seed=2)
    server.add_adapter("drafty", server.peft_config["default"])
    load_adapter_into(reg, server, v, adapter_name="drafty")
    want = get_peft_model_state_dict(trained, adapter_name="drafty")
    got = get_peft_model_state_dict(server, adapter_name="drafty")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_history_and_refusals_are_bounded(tmp_path, monkeypatch):
    """Issue 27 §5: events.jsonl rotates (one old generation), REFUSED keeps the newest MAX_REFUSED, and a
    rollback reads REFUSED, not the whole history."""
    import dvi.registry.ledger as RL
    import dvi.registry.store as R

    monkeypatch.setattr(R, "EVENTS_MAX_BYTES", 2000)
    monkeypatch.setattr(RL, "MAX_REFUSED", 5)
    reg = DrafterRegistry(tmp_path, keep_last=100)
    for i in range(12):
        publish_full(reg, sd(i), {"model_type": "llama"}, {})
    for v in range(1, 12):
        reg.refuse(v, "x" * 100)
    sizes = [(reg.dir / n).stat().st_size for n in ("events.jsonl", "events.1.jsonl")]
    assert all(s <= 2000 + 400 for s in sizes)
    assert sorted(reg.refusals()) == [7, 8, 9, 10, 11]
    monkeypatch.setattr(DrafterRegistry, "events", lambda self: pytest.fail("rollback read the whole history"))
    assert rollback(reg, None, reason="test") == 6  # 7-11 refused; 12 is LATEST
    assert 12 in reg.refusals()


def test_replicas_sharing_a_registry_keep_their_own_server_records(tmp_path):
    from dvi.registry.ledger import ServingState

    trainer = DrafterRegistry(tmp_path)
    a, b = DrafterRegistry(tmp_path, replica="a"), DrafterRegistry(tmp_path, replica="b")
    for i in range(1, 5):
        publish_full(trainer, sd(i), {"model_type": "llama"}, {})
    a.set_serving(ServingState(version=4, good=2))
    b.set_serving(ServingState(version=1, good=1, pinned=1))
    a.refuse(3, "rolled back: α fell on a's traffic")
    assert a.refusals() == {3: "rolled back: α fell on a's traffic"} and b.refusals() == {}  # b may still serve 3
    assert (b.serving().version, a.serving().version) == (1, 4)
    assert {k: s.version for k, s in trainer.served_everywhere().items()} == {"a": 4, "b": 1}
    assert trainer.serving() == ServingState()  # the one-server record was never written
    DrafterRegistry(tmp_path, keep_last=1).gc()
    assert trainer.list_versions() == [1, 2, 4]  # each replica's served, good and pinned outlive keep_last
    with pytest.raises(ValueError, match="replica"):
        DrafterRegistry(tmp_path, replica="../x")
