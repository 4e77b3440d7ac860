"""`serve.cpu_packed_weights`: the target's multi-row forwards on oneDNN-prepacked weights (CPU, fp32). They
compute what the plain forward does up to float rounding, the engine stays lossless on them (greedy equal to the
target's own decode, or apart only on a float-noise tie), and the option starts `dvi serve`."""

from __future__ import annotations

import pytest
import torch
from test_engine import assert_greedy_equal, reference
from tiny_models import tiny_llama

from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget
from dvi.engine.speculative import EngineOptions, SpeculativeEngine

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _target():
    return tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)


@torch.inference_mode()
def test_packed_forwards_compute_what_the_plain_forward_does():
    target = _target()
    packed_model = LeanModel(target)
    assert packed_model.pack_multirow()
    packed, plain = LeanTarget(lean=packed_model), LeanTarget(lean=LeanModel(target))
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 30)]
    for run in (packed, plain):
        run.admit(contexts, False)
    for q, kept in [(1, [1, 1]), (5, [2, 5]), (3, [3, 1]), (1, [1, 1])]:
        ids = torch.randint(0, 128, (2, q), generator=g)
        a, b = packed.forward(ids, False), plain.forward(ids, False)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        packed.keep(q, kept)
        plain.keep(q, kept)


def test_packed_weights_do_nothing_off_fp32():
    assert not LeanModel(_target().to(torch.bfloat16)).pack_multirow()


def _suffix_engine(target, g: torch.Generator) -> tuple[SpeculativeEngine, list[list[int]]]:
    """A suffix-drafting engine on packed weights and three repetitive prompts (history drafts get accepted)."""
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    prompts = [(torch.randint(0, 128, (12,), generator=g).tolist() * 3)[: 30 + i] for i in range(3)]
    prop = make_proposer("suffix", None, 128, "cpu", settings=SuffixConfig(max_draft_tokens=4))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=4, max_draft_tokens=4,
                            options=EngineOptions(cpu_packed_weights=True))
    assert eng._target.lean.packs is not None
    return eng, prompts


def _lossless(eng: SpeculativeEngine, target, prompts: list[list[int]]) -> None:
    outs = eng.generate(prompts, 24)
    assert sum(o.num_drafted for o in outs) > 0
    for p, o in zip(prompts, outs, strict=True):
        assert_greedy_equal(target, p, list(o.token_ids), reference(target, p, 24))


@torch.inference_mode()
def test_engine_on_packed_weights_is_lossless_with_history_drafts():
    target = _target()
    eng, prompts = _suffix_engine(target, torch.Generator().manual_seed(1))
    _lossless(eng, target, prompts)


@torch.inference_mode()
def test_a_target_update_repacks_the_packed_weights():
    """New target weights load in place; the packed copies are remade from them (the first default-on run served
    the old target's verifies after a target update: greedy text parted from the new target's)."""
    target = _target()
    g = torch.Generator().manual_seed(2)
    eng, prompts = _suffix_engine(target, g)
    old = eng._target.lean.packs[0][0].to_dense().clone()
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in target.state_dict().items()
                   if k.endswith("proj.weight")}
    eng.update_target_weights(new_weights, version=1)
    assert not torch.equal(eng._target.lean.packs[0][0].to_dense(), old)
    _lossless(eng, target, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "false", "auto"])
@pytest.mark.parametrize("option", ["cpu_packed_weights", "cpu_rows_kernel"])
def test_every_value_of_the_cpu_matmul_options_starts_dvi_serve(tiny_pair_dir, tmp_path, option, value):
    """`serve.cpu_packed_weights` and `serve.cpu_rows_kernel` (`tests/test_rows_kernel.py`)."""
    from test_serving_helpers import ServerThread, tiny_config

    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=suffix", f"serve.{option}={value}")
    assert getattr(cfg.serve, option) == {"true": True, "false": False, "auto": "auto"}[value]
    with ServerThread(cfg) as s, s.client() as c:
        r = c.post("/v1/completions", json={"prompt": "def main(argv):\n", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0


def test_the_greedy_contract_is_probed_on_the_packed_weights():
    """A verdict probed on plain weights is not reused for packed ones (the probe's cache keys on the packing): the
    contract `dvi serve` reports is the one of the kernels it runs."""
    from dvi.decode.invariance import probe

    target = _target()
    plain, packed = LeanModel(target), LeanModel(target)
    packed.pack_multirow()
    assert probe(plain, 5, exact=True) is not probe(packed, 5, exact=True)
    assert probe(packed, 5) is probe(packed, 5)
