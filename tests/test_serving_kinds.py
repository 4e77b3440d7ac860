"""Every documented `models.drafter_kind` starts `dvi serve` and serves through HTTP (issue 33 §1): on the
tiny pair always, on the embedded SmolLM2 pair where it is built (the kinds its default build covers).

Each server answers a greedy completion with the target's own greedy text (speculation off, same engine),
and reports its kind on /health."""

from __future__ import annotations

import pytest
from test_serving_helpers import ServerThread, tiny_config

KINDS = ["separate", "eagle", "early_exit", "suffix", "hybrid"]
PROMPT = "def parse_args(argv):\n    parser = "


def greedy_text(pair_dir, n: int) -> str:
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(pair_dir / "target", None, pair_dir / "tokenizer", device="cpu")
    ids = pair.tokenizer.encode(PROMPT, add_special_tokens=True)
    out = SpeculativeEngine(pair.target, None).generate([ids], n, stop_token_ids=list(pair.stop_ids))[0]
    return pair.tokenizer.decode(out.token_ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def plain_text(tiny_pair_dir) -> str:
    return greedy_text(tiny_pair_dir, 24)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_serves_the_tiny_pair(kind, tiny_pair_dir, tmp_path, plain_text):
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"models.drafter_kind={kind}", "sampling.max_new_tokens=24")
    with ServerThread(cfg) as s, s.client() as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain_text
        assert s.health()["drafter_kind"] == kind
