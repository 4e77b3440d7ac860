"""`serve.cpu_packed_weights`: the target's multi-row forwards on oneDNN-prepacked weights (CPU, fp32; bf16 on AMX). They
compute what the plain forward does up to float rounding, the engine stays lossless on them (greedy equal to the
target's own decode, or apart only on a float-noise tie), and the option starts `dvi serve`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_kernel import assert_batch_decodes_alone
from test_engine import assert_greedy_equal, reference
from tiny_models import tiny_llama

from dvi.decode.cpu_paths import AMX_ALIKE_ROWS, PackPlan, pack_plan, packed_linear
from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget
from dvi.decode.numerics import cpu_flags
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


def test_packed_weights_in_bf16_only_on_amx():
    """bf16 packs only where oneDNN runs them on AMX: there every forward takes them (each row as the row alone up to
    `AMX_ALIKE_ROWS`); elsewhere nothing is packed."""
    on_amx = "amx_bf16" in cpu_flags()
    assert LeanModel(_target().to(torch.bfloat16)).pack_multirow() == on_amx
    cpu = torch.device("cpu")
    assert pack_plan(cpu, torch.bfloat16, 8, frozenset({"avx512_bf16"})) is None
    assert pack_plan(cpu, torch.bfloat16, 8, frozenset({"amx_bf16"})) == PackPlan(1, 1, AMX_ALIKE_ROWS)
    assert pack_plan(cpu, torch.float32, 8, frozenset()) == PackPlan(8, 2, 0)
    assert pack_plan(torch.device("meta"), torch.float32, 8, frozenset()) is None


def _needs_onednn_bf16_packs() -> None:
    """These tests force the AMX plan on any CPU; oneDNN builds bf16 packs only with avx512bw/vl/dq or
    avx_ne_convert (an AVX2 Zen3 has neither, and the plan never packs bf16 there)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), 1)
    except RuntimeError as exc:
        pytest.skip(f"oneDNN cannot pack bf16 weights on this CPU: {exc}")


@torch.inference_mode()
def test_a_target_update_keeps_the_start_up_verdict_on_the_packs(monkeypatch):
    """Where the start-up check found a matmul's rows not rounding alike on the packs, a target update's repacking
    does not bring the promise back."""
    import dvi.decode.lean

    _needs_onednn_bf16_packs()
    monkeypatch.setattr(dvi.decode.lean, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    lean = LeanModel(_target().to(torch.bfloat16))
    assert lean.pack_multirow() and lean.pack_plan.alike == AMX_ALIKE_ROWS
    lean.pack_plan = lean.pack_plan._replace(alike=0)  # the check failed here
    old = lean.packs[0][0]
    lean.repack()
    assert lean.pack_plan.alike == 0 and lean.packs[0][0] is not old


def test_packed_matmuls_past_the_alike_rows_run_in_pieces():
    w = torch.randn(48, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    x = torch.randn(2, 5, 64)
    pieces = torch.cat([packed_linear(p, packed) for p in x.reshape(10, 64).split(3)]).view(2, 5, 48)
    assert torch.equal(packed_linear(x, packed, None, alike=3), pieces)
    torch.testing.assert_close(packed_linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_bf16_packs_for_every_forward_keep_a_batch_lossless(monkeypatch):
    """The AMX plan forced on any CPU (oneDNN runs bf16 packs there too, maybe not rows alike): every forward on the
    packs, the rows kernel dropped unless it serves every forward; where the start-up check finds rows alike, the
    batch contract is bitwise and a batch's greedy text with history drafts is each request's alone, speculation off's;
    where it does not, no promise is made (near-tie)."""
    import dvi.decode.lean
    from dvi.decode import rows_kernel

    _needs_onednn_bf16_packs()
    monkeypatch.setattr(dvi.decode.lean, "cpu_flags", lambda: frozenset({"amx_bf16"}))
    monkeypatch.setattr(dvi.decode.rows_kernel, "kernel_rows_measured", lambda lean: 8)  # AMX's timing: up to 8 rows
    target = _target().to(torch.bfloat16)
    opts = EngineOptions(cpu_packed_weights=True, cpu_rows_kernel="auto")
    off = SpeculativeEngine(target, None, options=opts)
    lean = off._target.lean
    assert lean.packs is not None and lean.pack_plan.rows == 1
    assert lean.kernel_rows == 0 or rows_kernel.load(torch.bfloat16) is None  # one path for every forward
    if not lean.pack_plan.alike:
        assert off._target.contract["batched"] == "near-tie"
        pytest.skip("oneDNN's bf16 packs do not round a matmul's rows as lone rows on this CPU")
    assert off._target.contract == {"one_request": "bitwise", "batched": "bitwise"}
    assert_batch_decodes_alone(target, off, opts, seed=3)


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
