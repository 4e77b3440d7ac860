"""`POST /admin/target` opens only files inside `serve.allowed_dirs` (issue 27 §4).

The directory named in the request may lie inside an allowed dir while the files it leads to do
not: a shard index naming `../` paths, a weights file or an index that is a symlink out. Every
file the loader would open is resolved (symlinks followed) and checked before anything is read;
a file outside is refused with a 403 naming it, and the served weights stay as they were.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_serving_helpers import ServerThread, engine_of, guarded_config

ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory, allowed_dir):
    run = tmp_path_factory.mktemp("confine-run")
    cfg = guarded_config(tiny_pair_dir, run, "k", ADMIN, allowed_dir)
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def weights(server, tmp_path_factory) -> tuple[dict, Path]:
    """The live target's tensors, and a copy saved outside every allowed dir."""
    from safetensors.torch import save_file

    sd = {k: v.detach().clone().contiguous() for k, v in engine_of(server).target.state_dict().items()}
    outside = tmp_path_factory.mktemp("outside")
    save_file(sd, str(outside / "model.safetensors"))
    return sd, outside


def _post(server, path: Path):
    with server.client(token=ADMIN) as admin:
        return admin.post("/admin/target", json={"path": str(path)})


def _index(dirpath: Path, shard: str, sd: dict) -> None:
    dirpath.mkdir()
    (dirpath / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: shard for k in sd}}))


def test_index_naming_parent_paths_is_refused(server, weights, allowed_dir) -> None:
    sd, outside = weights
    d = allowed_dir / "dotdot"
    rel = os.path.relpath(outside / "model.safetensors", d)
    assert rel.startswith("..")
    _index(d, rel, sd)
    version = server.state.target_version
    r = _post(server, d)
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["param"] == "path" and "model.safetensors" in err["message"], err
    assert server.state.target_version == version


def test_weights_symlink_out_is_refused(server, weights, allowed_dir) -> None:
    _, outside = weights
    d = allowed_dir / "linked"
    d.mkdir()
    os.symlink(outside / "model.safetensors", d / "model.safetensors")
    r = _post(server, d)
    assert r.status_code == 403, r.text
    assert "model.safetensors" in r.json()["error"]["message"]


def test_index_symlink_out_is_refused(server, weights, allowed_dir, tmp_path) -> None:
    sd, outside = weights
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in sd}}))
    d = allowed_dir / "linked-index"
    d.mkdir()
    os.symlink(idx, d / "model.safetensors.index.json")
    (d / "model.safetensors").symlink_to(outside / "model.safetensors")
    r = _post(server, d)
    assert r.status_code == 403, r.text
    assert "model.safetensors.index.json" in r.json()["error"]["message"]


def test_index_with_malformed_weight_map_is_a_400(server, allowed_dir) -> None:
    d = allowed_dir / "bad-index"
    d.mkdir()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    r = _post(server, d)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "path"


def test_sharded_dir_inside_loads(server, weights, allowed_dir) -> None:
    from safetensors.torch import save_file

    sd, _ = weights
    d = allowed_dir / "sharded"
    keys = sorted(sd)
    half = len(keys) // 2
    _index(d, "unused", {})
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(keys)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    save_file({k: sd[k] for k in keys[:half]}, str(d / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[half:]}, str(d / "model-00002-of-00002.safetensors"))
    v = server.state.target_version
    r = _post(server, d)
    assert r.status_code == 200, r.text
    assert r.json()["target_version"] == v + 1
