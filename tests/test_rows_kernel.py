"""`serve.cpu_rows_kernel`: dvi's rows kernels (`dvi/decode/rows_kernel.c`, fp32 on AVX2 + FMA;
`rows_kernel_bf16.c`, bf16 on AVX512-BF16, tested where the CPU has it). Each computes F.linear up to float rounding, rounds a row alike alone or beside others (so a one-request verify rounds like the steps it stands for and
the probe says so), keeps the engine lossless, and says why where it cannot run (every value of the option starts
`dvi serve`: `tests/test_packed_weights.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine import assert_greedy_equal, reference
from tiny_models import tiny_llama

from dvi.decode import rows_kernel
from dvi.decode.lean import LeanModel
from dvi.decode.numerics import cpu_flags
from dvi.decode.rows_kernel import KERNEL_PROBE_ROWS, kernel_rows_from_ratios, kernel_rows_measured
from dvi.decode.target import CpuMatmuls, target_runner
from dvi.engine.speculative import EngineOptions, SpeculativeEngine

KERNEL = rows_kernel.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"rows kernel unavailable: {rows_kernel.unavailable_reason()}")
BF16 = rows_kernel.load(torch.bfloat16)
# each test of both dtypes runs the bf16 kernel where this CPU has AVX512-BF16 (an AMX Xeon, a Zen 4 or later)
DTYPES = [pytest.param(torch.float32, id="fp32", marks=needs_kernel),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif(
              BF16 is None, reason=f"bf16 rows kernel unavailable: {rows_kernel.unavailable_reason(torch.bfloat16)}"))]


def _forget_builds() -> None:
    rows_kernel._loaded.cache_clear(), rows_kernel._build_loaded.cache_clear()


def _target(dtype: torch.dtype = torch.float32):
    return tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2).to(dtype)


def _kernel(dtype: torch.dtype) -> rows_kernel.RowsKernel:
    return KERNEL if dtype == torch.float32 else BF16


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4, 8), (3, 7, 13), (5, 130, 64), (17, 33, 576), (2, 1, 5),
                                           (8, 16, 32), (40, 48, 9), (13, 17, 1536), (26, 70, 96)])
def test_the_kernel_computes_what_f_linear_does(dtype, m, n, k):
    if dtype == torch.bfloat16 and k % 2:
        k += 1  # the bf16 kernel multiplies pairs of columns (an odd width is refused: below)
    g = torch.Generator().manual_seed(m * n + k)
    x, w, b = (torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype),
               torch.randn(n, generator=g).to(dtype))
    exact = F.linear(x.double(), w.double(), b.double())
    got = _kernel(dtype).linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    # one fp32 chain over k per output: its rounding grows with k (~k x eps x |terms|); bf16 rounds the product and
    # then the bias' sum to bf16 (2^-8 relative each)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=5e-8 * k + (dtype != torch.float32) * 2e-2)
    # a strided x (a view of every other column) and leading dimensions work too
    wide = torch.randn(m, 2 * k, generator=g).to(dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(_kernel(dtype).linear(wide[:, ::2], w), F.linear(wide[:, ::2], w), **tol)
    torch.testing.assert_close(_kernel(dtype).linear(x.view(1, m, k), w), F.linear(x, w).view(1, m, n), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_rounds_alike_alone_and_beside_others(dtype):
    """Each output is one accumulation over k in order whatever the row count and tiling: a row of a 40-row product
    is bit-equal to the row alone (torch's GEMMs differ here: MKL's GEMV and its GEMMs round a row apart)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 576, generator=g).to(dtype), torch.randn(203, 576, generator=g).to(dtype)
    kernel = _kernel(dtype)
    alone = torch.cat([kernel.linear(x[r : r + 1], w) for r in range(40)])
    for m in (2, 3, 4, 7, 8, 13, 20, 25, 40):
        assert torch.equal(kernel.linear(x[:m], w), alone[:m]), m


def test_every_fp32_build_gives_the_same_bits():
    """The AVX-512 build (where the CPU has avx512f) and the AVX2 build keep each output one fma chain over k in
    order: a server rounds alike whichever its CPU loads. Where only one build runs, it is the one `load` serves."""
    kernels = rows_kernel.builds()
    if not kernels:
        pytest.skip(f"rows kernel unavailable: {rows_kernel.unavailable_reason()}")
    assert kernels[0] is KERNEL and KERNEL.isa == ("AVX-512" if "avx512f" in cpu_flags() else "AVX2")
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(40, 1536, generator=g), torch.randn(211, 1536, generator=g)
    for m in (1, 5, 6, 7, 13, 16, 17, 40):
        outs = [k.linear(x[:m], w) for k in kernels]
        assert all(torch.equal(o, outs[0]) for o in outs), m
    if len(kernels) > 1:  # the builds pack differently: weights packed for one are refused by the other
        with pytest.raises(ValueError, match="packed for the AVX-512 build reach the AVX2 build"):
            kernels[1].rows(x, kernels[0].pack(w))


def _hf_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMS norm: the mean of squares in fp32, x * rsqrt rounded to x's dtype, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_calls_compute_the_layers_norm_swiglu_and_residual(dtype):
    """`fused` folds a layer's RMS norm or SwiGLU before the matmul and the residual add after it: the norm as Hugging
    Face's module computes it (bf16: the same bits; fp32: its mean of squares in another order), silu(gate) * up as
    torch's (within the exp's last bits), the add exactly as torch adds; each row alone whatever the row count."""
    kernel = _kernel(dtype)
    g = torch.Generator().manual_seed(7)
    k, n = 576, 204  # (the bf16 kernel takes an even input width: the down projection's is n)
    x, ln = (torch.randn(17, k, generator=g) * 3).to(dtype), torch.randn(k, generator=g).to(dtype)
    w, res = torch.randn(n, k, generator=g).to(dtype) / 24, torch.randn(17, n, generator=g).to(dtype)
    p = kernel.pack(w)
    got = kernel.fused(x, p, norm=(ln, 1e-5))
    ref = kernel.rows(_hf_norm(x, ln, 1e-5), p)
    if dtype == torch.bfloat16:
        assert torch.equal(got, ref)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(kernel.fused(x, p, norm=(ln, 1e-5), residual=res), got + res)
    alone = torch.cat([kernel.fused(x[r : r + 1], p, norm=(ln, 1e-5)) for r in range(17)])
    assert torch.equal(alone, got)
    wd = torch.randn(k, n, generator=g).to(dtype) / 16
    gu = (torch.randn(17, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gu.chunk(2, -1)
    swiglu = kernel.fused(gu, kernel.pack(wd), swiglu=True, residual=x)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 2e-2}
    torch.testing.assert_close(swiglu, kernel.rows((F.silu(gate) * up).contiguous(), kernel.pack(wd)) + x, **tol)
    with pytest.raises(ValueError, match="swiglu"):
        kernel.fused(x, kernel.pack(wd), swiglu=True)
    with pytest.raises(ValueError, match="norm's weight"):
        kernel.fused(x, p, norm=(ln[:-2], 1e-5))
    with pytest.raises(ValueError, match="residual"):
        kernel.fused(x, p, residual=res[:3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_prologue_alone_feeds_what_the_fused_call_multiplies(dtype):
    """`prologue` (the norm or SwiGLU alone, for matmuls another library runs) gives the rows `fused` multiplies: the
    same bits through the kernel's matmul, each row alike alone; a bad input is refused by name."""
    kernel = _kernel(dtype)
    g = torch.Generator().manual_seed(5)
    k, n = 576, 96
    x, ln = (torch.randn(13, k, generator=g) * 3).to(dtype), torch.randn(k, generator=g).to(dtype)
    w, wd = torch.randn(n, k, generator=g).to(dtype) / 24, torch.randn(k, n, generator=g).to(dtype) / 16
    gu = (torch.randn(13, 2 * n, generator=g) * 4).to(dtype)
    normed, gated = kernel.prologue(x, (ln, 1e-5)), kernel.prologue(gu)
    assert normed.shape == (13, k) and gated.shape == (13, n)
    assert torch.equal(kernel.rows(normed, kernel.pack(w)), kernel.fused(x, kernel.pack(w), norm=(ln, 1e-5)))
    assert torch.equal(kernel.rows(gated, kernel.pack(wd)), kernel.fused(gu, kernel.pack(wd), swiglu=True))
    assert torch.equal(torch.cat([kernel.prologue(x[r : r + 1], (ln, 1e-5)) for r in range(13)]), normed)
    if dtype == torch.bfloat16:
        assert torch.equal(normed, _hf_norm(x, ln, 1e-5))
    with pytest.raises(ValueError, match="norm's weight"):
        kernel.prologue(x, (ln[:-2], 1e-5))
    with pytest.raises(ValueError, match="rows kernel takes 2-d"):
        kernel.prologue(x.float() if dtype == torch.bfloat16 else x.double(), (ln, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_forwards_on_onednns_packs_take_the_kernels_elementwise_calls(dtype, monkeypatch):
    """Where the kernel serves no matmul (oneDNN's packs do: an AMX CPU's bf16), a forward's norms, SwiGLU and RoPE
    still go through its calls (`KernelMath`), computing what torch's calls do; a verify's rows round like its steps."""
    from dvi.decode import lean_layer
    from dvi.decode.lean_target import LeanTarget

    target = _target(dtype)
    kern, plain = LeanModel(target), LeanModel(target)
    assert kern.use_rows_kernel(0) == 0 and kern.elementwise is None  # rows=0: torch's calls alone
    kern.use_rows_kernel(1)
    kern.kernel_rows = 0  # no matmul on the kernel: its elementwise calls stay
    assert kern.elementwise is not None
    used = []
    rope = lean_layer.KernelMath.rope_store
    monkeypatch.setattr(lean_layer.KernelMath, "rope_store", lambda self, *a: used.append(1) or rope(self, *a))
    a, b = LeanTarget(lean=kern), LeanTarget(lean=plain)
    g = torch.Generator().manual_seed(3)
    ctxs = [torch.randint(0, 128, (20 + i,), generator=g).tolist() for i in range(3)]
    a.admit(ctxs, False), b.admit(ctxs, False)
    ids = torch.randint(0, 128, (3, 4), generator=g)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.forward(ids, False), b.forward(ids, False), rtol=tol, atol=tol)
    assert used, "the forward took torch's calls"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_rotates_and_stores_as_torchs_calls_do(dtype):
    """`rope_store` gives the bits of torch's x * cos + x.flip(halves) * sin (products and sum rounded alike) and
    writes each row's k|v part where index_put_ does, nothing else of the cache."""
    from dvi.decode.lean_layer import TorchMath

    kernel = _kernel(dtype)
    g = torch.Generator().manual_seed(11)
    n, heads, kvh, d = 7, 9, 3, 64
    qkv = torch.randn(n, heads + 2 * kvh, 2, d // 2, generator=g).to(dtype)
    cos, sin = (torch.randn(n, heads + 2 * kvh, 2, d // 2, generator=g).to(dtype) for _ in range(2))
    slot, col = torch.tensor([0, 0, 1, 2, 2, 2, 1]), torch.tensor([5, 6, 0, 3, 9, 4, 1])
    kv_ref = torch.randn(3, 12, 2, kvh, d, generator=g).to(dtype)
    kv = kv_ref.clone()
    ref = TorchMath.rope_store(qkv, cos, sin, kv_ref, slot, col, heads)
    got = kernel.rope_store(qkv.contiguous(), cos.contiguous(), sin.contiguous(), d, heads * d, kv, slot, col)
    assert torch.equal(got.view(ref.shape), ref) and torch.equal(kv, kv_ref)
    with pytest.raises(ValueError, match="rope_store"):
        kernel.rope_store(qkv, cos, sin, d, heads * d + d, kv, slot, col)
    with pytest.raises(IndexError, match="outside the cache"):  # checked before anything is written
        kernel.rope_store(qkv.contiguous(), cos.contiguous(), sin.contiguous(), d, heads * d, kv, slot, col + 6)
    assert torch.equal(kv, kv_ref)


def test_every_fp32_build_fuses_to_the_same_bits():
    kernels = rows_kernel.builds()
    if len(kernels) < 2:
        pytest.skip("one fp32 build runs here")
    g = torch.Generator().manual_seed(2)
    x, ln, w = torch.randn(13, 576, generator=g), torch.randn(576, generator=g), torch.randn(64, 576, generator=g)
    gu, wd = torch.randn(13, 1152, generator=g), torch.randn(40, 576, generator=g)
    outs = [(k.fused(x, k.pack(w), norm=(ln, 1e-5), residual=x[:, :64].contiguous()),
             k.fused(gu, k.pack(wd), swiglu=True)) for k in kernels]
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


@needs_kernel
def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="fp32"):
        KERNEL.linear(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="2-d"):
        KERNEL.linear(torch.zeros(1, 8), torch.zeros(8))
    with pytest.raises(ValueError, match="columns"):
        KERNEL.linear(torch.zeros(1, 8), torch.zeros(4, 9))
    with pytest.raises(ValueError, match="fp32 rows"):  # packed fp32 weights read as another dtype's rows
        KERNEL.rows(torch.zeros(1, 8, dtype=torch.bfloat16), KERNEL.pack(torch.zeros(4, 8)))


@pytest.mark.skipif(BF16 is None, reason=f"bf16 rows kernel unavailable: {rows_kernel.unavailable_reason(torch.bfloat16)}")
def test_bad_bf16_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="even input width"):
        BF16.linear(torch.zeros(1, 9, dtype=torch.bfloat16), torch.zeros(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        BF16.linear(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.bfloat16))
    lean = LeanModel(tiny_llama(0, intermediate_size=63).to(torch.bfloat16))  # the down projection's input: 63 wide
    assert lean.use_rows_kernel(16) == 0 and lean.kernel is None  # torch's kernels serve that model


def test_a_dtype_without_a_kernel_says_so():
    assert rows_kernel.load(torch.float16) is None
    assert "float16" in rows_kernel.unavailable_reason(torch.float16)


def test_without_a_compiler_it_says_why_and_torch_serves(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _forget_builds()
    try:
        assert rows_kernel.load() is None
        assert rows_kernel.unavailable_reason()
        lean = LeanModel(_target())
        assert lean.use_rows_kernel(4) == 0 and lean.kernel_rows == 0
    finally:
        monkeypatch.undo()
        _forget_builds()


@needs_kernel
def test_the_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _forget_builds()
    try:
        assert rows_kernel.load() is not None
        built = list((tmp_path / "dvi" / "kernels").glob("rows_kernel*.so"))
        assert len(built) == 1 and not list(built[0].parent.glob(".tmp-*"))
    finally:
        monkeypatch.undo()
        _forget_builds()


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_forwards_on_the_kernel_compute_what_torch_does_and_verifies_round_like_steps(dtype):
    target = _target(dtype)
    with_kernel, plain = LeanModel(target), LeanModel(target)
    assert with_kernel.use_rows_kernel(16) == 16 and with_kernel.kernel.dtype == dtype
    run = target_runner(target, max_width=9, cpu=CpuMatmuls(rows_kernel=True))
    assert run.lean.kernel_rows == 16 and run.contract["one_request"] == "bitwise"
    from dvi.decode.lean_target import LeanTarget

    a, b = LeanTarget(lean=with_kernel), LeanTarget(lean=plain)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 128, (20,), generator=g).tolist()
    a.admit([ctx], False), b.admit([ctx], False)
    ids = torch.randint(0, 128, (1, 5), generator=g)
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: kernels round each matmul's output apart
    torch.testing.assert_close(a.forward(ids, False), b.forward(ids, False), rtol=tol, atol=tol)


def test_a_count_where_the_kernel_and_torch_are_even_does_not_cut_the_counts_it_wins():
    """The threshold a server keeps for its lifetime: a count the two paths tie at (AMD Zen 5, fp32, 4 rows: 0.95-1.03
    over five probes) no longer stops the kernel short of the 8-64-row forwards it wins by 15-35%."""
    zen5 = [0.48, 0.93, 1.03, 0.71, 0.64, 0.75, 0.85, 1.00]  # its time over torch's at KERNEL_PROBE_ROWS
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, zen5) == 256
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, zen5[:-1] + [1.05]) == 64  # a clear loss at the widest count
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, [0.5, 0.9, 1.1, 1.2, 1.3, 1.3, 1.3, 1.3]) == 2  # losses add up
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, [1.1, 0.5, 0.5]) == 0  # it loses alone at one row: none
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, [1.0, 1.02, 1.02]) == 4  # even within the tolerance: the kernel
    assert kernel_rows_from_ratios(KERNEL_PROBE_ROWS, []) == 0


@needs_kernel
def test_the_measured_rows_are_a_probed_count():
    lean = LeanModel(_target())
    assert lean.use_rows_kernel() in (0, *KERNEL_PROBE_ROWS[:-1], rows_kernel.EVERY_ROW)
    assert lean.kernel is None or kernel_rows_measured(lean) == lean.kernel_rows  # timed once per shape


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_a_target_update_repacks_the_kernels_panels_and_stays_lossless(dtype):
    """New target weights load in place; the kernel's panels are packed again from them, else its forwards would go
    on computing with the old target."""
    target = _target(dtype)
    g = torch.Generator().manual_seed(2)
    prompts = [(torch.randint(0, 128, (12,), generator=g).tolist() * 3)[: 30 + i] for i in range(3)]
    eng = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel=True))
    lean = eng._target.lean
    panels = lean._panels_of[lean.layers[0].qkv.data_ptr()]
    old = panels.data.clone()
    eng.generate(prompts, 8)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=g).to(dtype) for k, v in target.state_dict().items()
                   if k.endswith("proj.weight")}
    eng.update_target_weights(new_weights, version=1)
    assert not torch.equal(panels.data, old)
    assert torch.equal(panels.data, _kernel(dtype).pack(lean.layers[0].qkv).data)
    for p, o in zip(prompts, eng.generate(prompts, 16), strict=True):
        if dtype == torch.float32:
            assert_greedy_equal(target, p, list(o.token_ids), reference(target, p, 16))
    # the engine's plain decode after the update is HF's on the new weights (bf16: the first tokens, before kernels
    # that round apart meet a near-tie) and a lone request's speculation its plain decode token for token
    off = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel=True))
    assert off._target.lean.kernel_rows == 16
    assert off.generate([prompts[0]], 4)[0].token_ids == reference(target, prompts[0], 4)


@needs_kernel
@torch.inference_mode()
def test_where_the_kernel_wins_every_probe_onednns_packs_are_dropped(monkeypatch):
    """The kernel then serves every forward, the widest prefill too (`EVERY_ROW`): the weights are held twice (the
    model's and the panels), not three times, and its forwards compute what torch's do."""
    monkeypatch.setattr(rows_kernel, "kernel_rows_measured", lambda lean: rows_kernel.EVERY_ROW)
    target = _target()
    lm = LeanModel(target)
    assert lm.pack_multirow() and lm.use_rows_kernel() == rows_kernel.EVERY_ROW
    assert lm.packs is None and not lm._pack_of and lm.head_pack is None
    calls = []
    kernel_rows = lm.kernel.rows
    monkeypatch.setattr(lm.kernel, "rows", lambda x, *a: calls.append(x.shape[0]) or kernel_rows(x, *a))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(KERNEL_PROBE_ROWS[-1] + 3, lm.hidden, generator=g)
    w = lm.layers[0].qkv
    torch.testing.assert_close(lm.linear(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lm.linear(x[:5], w), F.linear(x[:5], w), rtol=1e-4, atol=1e-4)
    assert calls == [KERNEL_PROBE_ROWS[-1] + 3, 5]


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_engine_on_the_kernel_is_lossless_with_history_drafts(dtype):
    from dvi.config import SuffixConfig
    from dvi.drafters.factory import make_proposer

    target = _target(dtype)
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(0, 128, (12,), generator=g).tolist() * 3)[: 30 + i] for i in range(3)]
    prop = make_proposer("suffix", None, 128, "cpu", settings=SuffixConfig(max_draft_tokens=4))
    eng = SpeculativeEngine(target, prop, num_draft_tokens=4, max_draft_tokens=4,
                            options=EngineOptions(cpu_packed_weights=True, cpu_rows_kernel=True))
    assert eng._target.lean.kernel_rows == 16 and eng._target.contract["one_request"] == "bitwise"
    outs = eng.generate(prompts, 24)
    assert sum(o.num_drafted for o in outs) > 0
    for p, o in zip(prompts, outs, strict=True):
        assert_greedy_equal(target, p, list(o.token_ids), reference(target, p, 24))
    # alone, each request's greedy text is the engine's own plain decode token for token (bitwise contract)
    off = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel=True))
    for p in prompts:
        assert eng.generate([p], 24)[0].token_ids == off.generate([p], 24)[0].token_ids


@needs_kernel
def test_weights_the_kernel_cannot_take_leave_torch_serving():
    lean = LeanModel(_target())
    lw = lean.layers[0]
    lw.o = lw.o.double()
    assert lean.use_rows_kernel(16) == 0 and lean.kernel is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.0, 0.8), (1.0, 1.0)])
def test_sampling_on_the_kernel_follows_the_target(dtype, temperature, top_p):
    """Chi-square of the first two sampled tokens against the target's warped law, the learned drafter proposing and
    the target verifying on the kernel (its forwards' logits, not torch's, are what the rule samples from)."""
    from test_sampling import N_SAMPLES, PROMPT, exact_two_token_law, tiny_lm, two_token_pvalue

    from dvi.drafters.factory import proposer_for

    target, drafter = tiny_lm(0).to(dtype), tiny_lm(1).to(dtype)
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=2,
                            options=EngineOptions(cpu_rows_kernel=True))
    lean = eng._target.lean
    assert lean.kernel_rows == 16
    calls, torch_linear = [0], LeanModel.linear

    def counted(x, w, bias=None):
        calls[0] += x.shape[0] <= lean.kernel_rows
        return torch_linear(lean, x, w, bias)

    lean.linear = counted
    res = []  # 5 rows a call: a verify of 5 x 3 positions stays within the kernel's 16 rows
    for start in range(0, N_SAMPLES, 5):
        res += eng.generate([PROMPT] * 5, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=11 + start)
    assert calls[0] > 0
    alpha = sum(r.num_accepted for r in res) / max(1, sum(r.num_drafted for r in res))
    assert 0.1 < alpha < 0.95  # the rule really had to accept and reject
    assert two_token_pvalue(res, exact_two_token_law(target, temperature, 0, top_p)) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_the_learned_drafter_drafts_on_the_kernel_too_and_keeps_it_across_swaps(dtype):
    """`serve.cpu_rows_kernel` covers the learned drafter's forwards (its one-row steps would otherwise stream its
    weights through torch's slower kernels every drafted token): on at start, after a hot swap, and lossless."""
    from dvi.drafters.draft_cache import LeanDraftCache
    from dvi.drafters.factory import proposer_for
    from dvi.drafters.vocab import apply_draft_vocab

    target = _target(dtype)
    drafter = tiny_llama(5, vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2).to(dtype)
    apply_draft_vocab(drafter, torch.arange(0, 128, 2))  # a reduced draft vocabulary: its rows on the kernel too
    g = torch.Generator().manual_seed(4)
    prompts = [(torch.randint(0, 128, (10,), generator=g).tolist() * 3)[: 24 + i] for i in range(3)]
    eng = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3,
                            options=EngineOptions(cpu_rows_kernel=True))
    off = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel=True))
    dkv = eng.proposer.dkv
    assert isinstance(dkv, LeanDraftCache) and dkv.lean.kernel_rows == 16 and dkv.lean.kernel.dtype == dtype
    assert dkv.lean.head_panels is not None and dkv.lean.head_panels.out_features == 64
    x = torch.randn(3, 64, generator=g).to(dtype)
    got, ref = dkv.lean._logits(x), dkv.lean.head_module(x)
    assert torch.equal(got.isinf(), ref.isinf()) and got[:, 1::2].isinf().all()  # only the subset's ids finite
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[:, ::2], ref[:, ::2], rtol=tol, atol=tol)
    assert all(o.num_drafted > 0 for o in eng.generate(prompts, 12))
    for p in prompts:  # alone, each request's greedy text is the plain decode's (bitwise contract)
        assert eng.generate([p], 12)[0].token_ids == off.generate([p], 12)[0].token_ids
    eng.set_drafter(tiny_llama(6, vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2).to(dtype), version=1)
    assert eng.proposer.dkv is not dkv and eng.proposer.dkv.lean.kernel_rows == 16
    for p in prompts:
        assert eng.generate([p], 12)[0].token_ids == off.generate([p], 12)[0].token_ids
    torch_drafts = SpeculativeEngine(target, proposer_for(target, drafter), num_draft_tokens=3)
    assert torch_drafts.proposer.dkv.lean.kernel is None  # the option off: torch's kernels, the drafter's too
