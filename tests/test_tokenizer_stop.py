"""Issue 36 item 10 (serving side): the server stops on every eos the model has, and says when the tokenizer
disagrees with the model's configs.

The pair here is the tiny one with what transformers 5.17 did to SmolLM2's converted tokenizer (eos = bos,
while config.json says otherwise) and a generation_config with a list of eos ids (Llama 3's shape). Before,
only `tokenizer.eos_token_id` stopped a request: an answer ran past the model's own end, and nothing was said.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from test_serving_helpers import ServerThread, tiny_config

from dvi.models.loading import load_pair, load_tokenizer

EXTRA_EOS = 7  # an ordinary token the generation config also ends on


@pytest.fixture(scope="module")
def skewed_pair(tiny_pair_dir, tmp_path_factory):
    """(target dir with eos [1, 7] in generation_config.json, tokenizer dir whose eos is its bos)."""
    root = tmp_path_factory.mktemp("skewed")
    target = root / "target"
    shutil.copytree(tiny_pair_dir / "target", target)
    gen = json.loads((target / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], EXTRA_EOS]
    (target / "generation_config.json").write_text(json.dumps(gen))
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    tok.eos_token = tok.bos_token  # what transformers 5.17 built from SmolLM2's GGUF: eos = bos
    tok.save_pretrained(root / "tokenizer")
    return target, root / "tokenizer"


@pytest.fixture(scope="module")
def server(tiny_pair_dir, skewed_pair, tmp_path_factory):
    target, tokenizer = skewed_pair
    cfg = tiny_config(tiny_pair_dir, tmp_path_factory.mktemp("skewed-run"), f"models.target={target}",
                      f"models.tokenizer={tokenizer}")
    with ServerThread(cfg) as s:
        yield s


@pytest.mark.parametrize("eos", [1, EXTRA_EOS], ids=["config_eos", "generation_config_list"])
def test_every_model_eos_stops_a_request(server, eos) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "def f(x):\n", "max_tokens": 12, "logit_bias": {str(eos): 100}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] == 1


def test_the_mismatch_is_said_at_load_and_on_health(server, skewed_pair, tiny_pair_dir, caplog) -> None:
    tok_info = server.health()["tokenizer"]
    assert tok_info["stop_token_ids"] == [0, 1, EXTRA_EOS]
    [warning] = tok_info["warnings"]
    assert "eos is '<|bos|>' (0)" in warning and "'<|eos|>' (1)" in warning and "dvi stops on all of them" in warning
    target, tokenizer = skewed_pair
    with caplog.at_level(logging.WARNING, logger="dvi.models"):
        pair = load_pair(target, None, tokenizer, device="cpu")
    assert pair.warnings == [warning] and warning in caplog.text
    assert load_pair(tiny_pair_dir / "target", None, tiny_pair_dir / "tokenizer", device="cpu").warnings == []
