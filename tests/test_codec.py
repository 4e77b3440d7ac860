"""Issue 35 §3: one codec per drafter format (`dvi.registry.codec`), used by the trainer, the registry, the swapper
and the demo replay. Before, a version was written in two places (the trainer's kinds, the registry) and read in
three (`serving/drafter_load.py`, `Trainable.load_version`, `open_version`), and the swapper and the demo replay
imported a private `_module`."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import torch
from registry_doors import publish_full, publish_peft_adapter
from test_online import online_config
from test_serving_helpers import lora_copy, version_manifest

from dvi.drafters.adapters import LoraFactors, projection_sizes
from dvi.drafters.eagle import EagleDrafter
from dvi.drafters.learned import EarlyExitDrafter
from dvi.models.loading import load_pair
from dvi.registry.base import AdapterRejected
from dvi.registry.codec import (
    FULL,
    LORA,
    SharedTargetCodec,
    load_drafter_version,
    load_group_version,
    scoring_module,
)
from dvi.registry.store import DrafterRegistry
from trainers.online.trainables import make_trainable

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


def _perturb(params, seed: int = 0, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _drafters(pair, kind: str):
    """(the drafter a trainer trains, the live drafter a server builds versions on) of one format."""
    if kind == "lora":
        return lora_copy(pair.drafter, 0.3, 1), copy.deepcopy(pair.drafter)
    if kind == "full":
        trained = copy.deepcopy(pair.drafter)
        _perturb(trained.parameters())
        return trained, copy.deepcopy(pair.drafter)
    make = (lambda t: EarlyExitDrafter(t, 1, lora_rank=4, target_modules=["q_proj", "v_proj"])) if kind == "early_exit" \
        else EagleDrafter
    target = copy.deepcopy(pair.target)
    trained = make(target)
    _perturb(trained.trainable_parameters())
    return trained, make(target)


@pytest.mark.parametrize("kind", ["lora", "full", "early_exit", "eagle"])
def test_each_format_round_trips_through_its_one_codec(pair, tiny_pair_dir, tmp_path, kind) -> None:
    """The trainer publishes through its codec, reads the version back through it, and the server builds from it
    a drafter with the trained weights' logits."""
    trained, live = _drafters(pair, kind)
    tr = make_trainable(trained, "full" if kind == "full" else "lora",
                        online_config(tiny_pair_dir, tmp_path, *(["models.drafter_kind=" + kind]
                                                                 if kind in ("early_exit", "eagle") else [])))
    codec = {"lora": LORA, "full": FULL}.get(kind)
    assert tr.codec is codec if codec else isinstance(tr.codec, SharedTargetCodec) and tr.codec.kind == kind
    reg = DrafterRegistry(tmp_path / "registry")
    v = tr.publish(reg, version_manifest())
    man = reg.manifest(v)
    assert man.drafter_kind == tr.kind and man.format == tr.format
    back = tr.load_version(reg, v)
    assert back.keys() == tr.state().keys() and all(torch.equal(back[k], t) for k, t in tr.state().items())
    served, _ = load_drafter_version(reg, v, live)
    ids = torch.tensor([[5, 9, 17, 33, 65, 3, 7]])
    with torch.no_grad():
        if kind == "eagle":
            feats = torch.randn(1, ids.shape[1], pair.target.config.hidden_size)
            got, want = served.model(ids, feats).logits, trained.model(ids, feats).logits
        else:
            got = scoring_module(served)(input_ids=ids).logits
            want = scoring_module(trained)(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_a_groups_version_is_read_once_as_its_merged_drafter_and_its_row_factors(pair, tmp_path) -> None:
    """What a traffic group's lane loads (issue 40): the drafter its gates score and the factors its rows are served
    with come from one read; a version that is no LoRA of the base, or does not fit it, is refused at validation
    (before any shadow check), with the reason's kind."""
    base = pair.drafter
    reg = DrafterRegistry(tmp_path / "registry")
    pm = lora_copy(base, scale=0.2, seed=3, targets=("q_proj", "v_proj", "up_proj"))
    v = publish_peft_adapter(reg, pm, version_manifest())
    sizes, layers = projection_sizes(base), base.config.num_hidden_layers
    model, factors = load_group_version(reg, v, base, sizes, layers)
    sd, _ = reg.open_version(v)
    want = LoraFactors.from_peft(sd, 8 / 4, sizes, layers)
    assert [sorted(layer) for layer in factors.layers] == [sorted(layer) for layer in want.layers]
    for got_layer, want_layer in zip(factors.layers, want.layers, strict=True):
        for proj, (a, b) in got_layer.items():
            assert torch.equal(a, want_layer[proj][0]) and torch.equal(b, want_layer[proj][1])
    ids = torch.tensor([[5, 9, 17, 33, 65, 3, 7]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        model, factors = load_group_version(reg, v, base, sizes, layers)
        merged = copy.deepcopy(pm).merge_and_unload()(input_ids=ids).logits
        assert torch.allclose(model(input_ids=ids).logits, merged, atol=1e-5)
        assert torch.equal(base(input_ids=ids).logits, before)  # the merge wrote none of the base's tensors
    # a version holds copies of the adapted projections only; the rest (embeddings, head, norms) is the base's
    base_ptrs = {p.data_ptr() for p in base.parameters()}
    copied = sorted(n for n, p in model.named_parameters() if p.data_ptr() not in base_ptrs)
    assert copied and all(n.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "up_proj") for n in copied), copied
    assert len(copied) == 3 * layers
    full = publish_full(reg, base.state_dict(), base.config, version_manifest())
    with pytest.raises(AdapterRejected) as exc:
        load_group_version(reg, full, base, sizes, layers)
    assert exc.value.category == "architecture" and exc.value.version == full
    with pytest.raises(AdapterRejected) as exc:
        load_group_version(reg, v, base, sizes, layers - 1)  # the adapter has a layer the drafter lacks
    assert exc.value.category == "shape"


def _private_imports(path: Path) -> list[str]:
    """Names starting with `_` that a module imports from another project module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


def test_version_readers_import_no_private_name_and_one_module_builds_a_drafter() -> None:
    """The swapper, the demo replay and the trainer's kinds use the codec's public names; no second loader."""
    for rel in ("serving/drafter/lane.py", "demo/replay.py", "trainers/online/trainables.py"):
        assert not _private_imports(ROOT / rel), (rel, _private_imports(ROOT / rel))
    assert not (ROOT / "serving" / "drafter_load.py").exists()
    builders = [p.relative_to(ROOT).as_posix() for pkg in ("dvi", "serving", "trainers")
                for p in (ROOT / pkg).rglob("*.py") if "merge_and_unload" in p.read_text()]
    assert builders == ["dvi/registry/codec.py"], builders
