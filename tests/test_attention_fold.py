"""The one-call attention's grouped-query fold (`dvi.decode.attention.one_call`) computes what SDPA's own grouped-query
path computes, for every query count, mask and dtype the engine's batched forwards use."""

import pytest
import torch
import torch.nn.functional as F

from dvi.decode.attention import one_call


def _reference(qrows, b, keys, values, mask, scale):
    n, heads = qrows.shape[0], qrows.shape[1]
    q, d = n // b, keys.shape[3]
    qh = qrows.view(b, q, heads, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(1, 2).reshape(n, heads * d)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,q", [(1, 1), (3, 1), (4, 2), (5, 4)])
def test_folded_grouped_query_attention_matches_sdpa(dtype, tol, b, q):
    g = torch.Generator().manual_seed(b * 10 + q)
    heads, kvh, d = 9, 3, 16
    starts = torch.randint(5, 40, (b,), generator=g)
    columns = int(starts.max()) + q
    cache = torch.randn(b, 64, 2, kvh, d, generator=g).to(dtype)  # the slot cache's strided layout
    keys = cache[:, :columns].select(2, 0).transpose(1, 2)
    values = cache[:, :columns].select(2, 1).transpose(1, 2)
    qrows = torch.randn(b * q, heads, 2, d // 2, generator=g).to(dtype)
    pos = starts.view(b, 1, 1) + torch.arange(q).view(1, q, 1)
    mask = (torch.arange(columns).view(1, 1, columns) <= pos).unsqueeze(1)  # [B, 1, q, columns]
    got = one_call(qrows, b, keys, values, mask, 0.25)
    want = _reference(qrows, b, keys, values, mask, 0.25)
    assert got.shape == want.shape == (b * q, heads * d)
    assert (got.float() - want.float()).abs().max().item() < tol
    # a query that sees no column of another row: moving row 0's keys changes no other row's output
    if b > 1:
        keys2 = keys.clone()
        keys2[0] += 1
        other = one_call(qrows, b, keys2, values, mask, 0.25)
        assert torch.equal(other[q:], got[q:]) and not torch.equal(other[:q], got[:q])
