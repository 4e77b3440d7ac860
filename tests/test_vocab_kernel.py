"""dvi's vocabulary kernel (`dvi/decode/vocab_kernel.c`): the greedy token is torch's (the first of equal maxima),
the log-denominator torch's within fp32 rounding, the top k torch's values with equal logits ranked by index; and a
step's emitted log-probs and top k are the same through it as through torch's calls."""

from __future__ import annotations

import pytest
import torch

from dvi.decode import vocab_kernel
from dvi.decode.emit import emitted

KERNEL = vocab_kernel.load()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the vocabulary kernel cannot be built here")
DTYPES = [torch.float32, torch.bfloat16]


def _logits(rows: int, v: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, v, generator=g) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [1, 7, 8, 9, 64, 1000, 49155])
def test_argmax_is_torchs_first_of_equal_maxima(dtype, v):
    x = _logits(6, v, dtype, v)
    if v > 9:  # ties for the maximum, the later one in another vector lane and in the tail
        x[1, v // 2] = x[1, 3] = x[1, -1] = x[1].max() + 1
        x[2, :] = 0.5
    assert torch.equal(KERNEL.argmax(x), x.max(-1).indices)
    strided = torch.cat([x, x], 1)[:, :v]  # rows apart by 2v: the row stride is honoured
    assert torch.equal(KERNEL.argmax(strided), x.max(-1).indices)
    assert torch.equal(KERNEL.argmax(x.view(2, 3, v)), x.view(2, 3, v).max(-1).indices)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("v", "k"), [(9, 9), (100, 1), (1000, 32), (49155, 32)])
def test_stats_are_torchs_logsumexp_and_topk(dtype, v, k):
    x = _logits(5, v, dtype, 7 * v + k)
    lse, vals, ids = KERNEL.stats(x, k)
    xf = x.float()
    torch.testing.assert_close(lse, torch.logsumexp(xf, -1), rtol=2e-6, atol=2e-5)
    ref_vals = xf.topk(k, -1).values
    assert torch.equal(vals, ref_vals)  # the same k values, descending
    assert torch.equal(xf.gather(1, ids), vals)  # each id holds its value
    for r in range(x.shape[0]):
        assert len(set(ids[r].tolist())) == k
        for a in range(k - 1):  # equal logits by index, lowest first
            assert vals[r, a] > vals[r, a + 1] or ids[r, a] < ids[r, a + 1]
        inside = xf[r] > vals[r, -1]  # every logit above the k-th is among them
        assert set(torch.nonzero(inside).flatten().tolist()) <= set(ids[r].tolist())


def test_stats_refuse_a_k_past_the_vocabulary():
    with pytest.raises(ValueError, match="top k"):
        KERNEL.stats(_logits(2, 5, torch.float32, 0), 6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steps_emitted_logprobs_and_top_k_match_torchs(dtype, monkeypatch):
    """The same verify's outputs through the kernel and through torch's calls (the kernel switched off)."""
    g = torch.Generator().manual_seed(3)
    b, k, v = 4, 3, 5000
    logits = (torch.randn(b, k + 1, v, generator=g) * 3).to(dtype)
    drafts = torch.randint(0, v, (b, k), generator=g)
    n = torch.tensor([0, 3, 1, 2])
    nxt = torch.randint(0, v, (b,), generator=g)
    args = (drafts, n, nxt, logits, torch.zeros(b), True, 16)
    fast = emitted(*args)
    monkeypatch.setattr(vocab_kernel, "load", lambda: None)
    slow = emitted(*args)
    assert fast.n == slow.n and fast.tokens == slow.tokens and fast.drafts == slow.drafts
    assert fast.topk_ids == slow.topk_ids or dtype == torch.bfloat16  # bf16 logits tie: then ranked by index
    for f_row, s_row in zip(fast.logprobs, slow.logprobs, strict=True):
        assert f_row == pytest.approx(s_row, abs=3e-5)
    for f_row, s_row in zip(fast.topk_logprobs, slow.topk_logprobs, strict=True):
        for f, s in zip(f_row, s_row, strict=True):
            assert f == pytest.approx(s, abs=3e-5)
