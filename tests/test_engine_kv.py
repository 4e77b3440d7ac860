"""RaggedKV: masks with holes, per-row positions, rollback, compaction, row add/remove are exact per architecture."""

from __future__ import annotations

import pytest
import torch

from dvi.decode.forward import model_forward
from dvi.decode.kv import prefill

torch.set_num_threads(1)


def _model(fam):
    from test_engine import tiny

    return tiny(fam, seed=3)


def _ref_last(model, seq):
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("fam", ["llama", "qwen2", "qwen3", "mistral", "gpt2", "gpt_neox"])
def test_ragged_ops_match_full_recompute(fam):
    model = _model(fam)
    fn = model_forward(model)
    seqs = [[5, 6, 7, 8, 9, 10, 11], [1, 2], [3, 4, 5, 6]]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        kv = prefill(model.config, fn, [s[:-1] for s in seqs])
        last = [s[-1] for s in seqs]
        for step in range(6):
            # feed last token + 3 "drafts", keep a random number per row (holes in the middle of rows)
            drafts = torch.randint(0, 300, (len(seqs), 3), generator=g)
            ids = torch.cat([torch.tensor(last).unsqueeze(1), drafts], 1)
            logits = kv.forward(fn, ids)
            keep = torch.randint(0, 4, (len(seqs),), generator=g)
            for b, s in enumerate(seqs):
                for j in range(4):  # every verified position matches a full recompute
                    ref = _ref_last(model, s + drafts[b, :j].tolist())
                    assert torch.allclose(logits[b, j], ref, atol=1e-4), (fam, step, b, j)
            kv.rollback(4, keep + 1)
            for b, s in enumerate(seqs):
                s.extend(drafts[b, : int(keep[b])].tolist())
                s.append(int(torch.randint(0, 300, (1,), generator=g)))
                last[b] = s[-1]
            assert kv.lengths.tolist() == [len(s) - 1 for s in seqs]
            if step == 2:
                kv.compact()
                assert not bool((~kv.valid).all(0).any())  # no column unused by every row
            if step == 3:  # remove the middle row, add a new one
                kv.select_rows(torch.tensor([0, 2]))
                seqs, last = [seqs[0], seqs[2]], [last[0], last[2]]
                new = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]
                kv.merge(prefill(model.config, fn, [new[:-1]]))
                seqs.append(new)
                last.append(new[-1])


def test_batch_one_never_has_holes():
    model = _model("llama")
    fn = model_forward(model)
    with torch.inference_mode():
        kv = prefill(model.config, fn, [[1, 2, 3]])
        for keep in (1, 4, 2):
            kv.forward(fn, torch.tensor([[4, 5, 6, 7]]))
            kv.rollback(4, torch.tensor([keep]))
            assert not kv.has_holes and kv.num_cols == int(kv.lengths[0])


# ---------------------------------------------------------------- BufferedLayer / BufferedCache
def _kv(b, n, seed, h=2, d=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)


def test_buffered_layer_grows_by_doubling_and_matches_cat():
    from dvi.decode.kv import BufferedLayer

    layer = BufferedLayer()
    ref_k, ref_v = _kv(3, 0, 0)
    reallocs, last_buf = 0, None
    for step in range(40):
        k, v = _kv(3, 1 + step % 4, step + 1)
        ref_k, ref_v = torch.cat([ref_k, k], 2), torch.cat([ref_v, v], 2)
        ok, ov = layer.update(k, v)
        assert torch.equal(ok, ref_k) and torch.equal(ov, ref_v)
        assert layer.get_seq_length() == ref_k.shape[2]
        if layer._kb is not last_buf:
            reallocs, last_buf = reallocs + 1, layer._kb
        assert ok.data_ptr() == layer._kb.data_ptr()  # a view of the buffer, no copy
    assert layer._kb.shape[2] >= ref_k.shape[2]
    assert reallocs <= 4  # ~100 columns appended 40 times: doubling, not one copy per step


def test_buffered_layer_rollback_window_and_overwrite():
    from dvi.decode.kv import BufferedLayer

    layer = BufferedLayer()
    k0, v0 = _kv(2, 10, 1)
    layer.update(k0, v0)
    buf = layer._kb
    layer.crop(-3)  # HF API: drop 3 trailing columns
    assert torch.equal(layer.keys, k0[:, :, :7])
    layer.set_window(2, 7)  # drop 2 leading columns (no copy)
    assert torch.equal(layer.keys, k0[:, :, 2:7]) and layer._kb is buf
    k1, v1 = _kv(2, 4, 2)
    ok, ov = layer.update(k1, v1)  # overwrites the rolled-back slots in place
    assert torch.equal(ok, torch.cat([k0[:, :, 2:7], k1], 2)) and torch.equal(ov, torch.cat([v0[:, :, 2:7], v1], 2))


def test_buffered_layer_select_gather_match_plain_ops():
    from dvi.decode.kv import BufferedLayer

    layer = BufferedLayer()
    k, v = _kv(4, 9, 3)
    layer.update(k, v)
    layer.set_window(1, 9)
    k, v = k[:, :, 1:], v[:, :, 1:]
    idx = torch.tensor([3, 0, 2])
    layer.select_rows(idx)
    k, v = k.index_select(0, idx), v.index_select(0, idx)
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    cols = torch.tensor([[0, 2, 5], [1, 3, 7], [4, 6, 7]])
    layer.gather_cols(cols)
    gi = cols.view(3, 1, 3, 1).expand(3, 2, 3, 4)
    k, v = k.gather(2, gi), v.gather(2, gi)
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    k2, v2 = _kv(3, 2, 4)
    ok, _ = layer.update(k2, v2)  # spare capacity kept after select/gather
    assert torch.equal(ok, torch.cat([k, k2], 2))


def test_ragged_merge_select_compact_match_plain_tensors():
    """RaggedKV's buffered merge/select_rows/compact equal the same ops done on plain (cat) tensors."""
    model = _model("llama")
    fn = model_forward(model)
    with torch.inference_mode():
        a = prefill(model.config, fn, [[1, 2, 3, 4, 5], [6, 7]])
        b = prefill(model.config, fn, [[8, 9, 10, 11, 12, 13, 14]])
        ka = [(x.keys.clone(), x.values.clone()) for x in a.cache.layers]
        kb = [(x.keys.clone(), x.values.clone()) for x in b.cache.layers]
        la, lb = a.num_cols, b.num_cols
        a.merge(b)
        length = max(la, lb)
        for layer, (k1, v1), (k2, v2) in zip(a.cache.layers, ka, kb, strict=True):

            def lp(t, n):
                return torch.cat([t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3]), t], 2)

            ref_k = torch.cat([lp(k1, length - la), lp(k2, length - lb)], 0)
            ref_v = torch.cat([lp(v1, length - la), lp(v2, length - lb)], 0)
            assert torch.equal(layer.keys, ref_k) and torch.equal(layer.values, ref_v)
        # holes, then compaction and row removal
        a.forward(fn, torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]))
        a.rollback(3, torch.tensor([1, 3, 2]))
        before = [(x.keys.clone(), x.values.clone()) for x in a.cache.layers]
        valid = a.valid.clone()
        a.compact()
        order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices[:, valid.shape[1] - a.num_cols :]
        for layer, (k, v) in zip(a.cache.layers, before, strict=True):
            gi = order.view(3, 1, -1, 1).expand(3, k.shape[1], order.shape[1], k.shape[3])
            assert torch.equal(layer.keys, k.gather(2, gi)) and torch.equal(layer.values, v.gather(2, gi))
        before = [(x.keys.clone(), x.values.clone()) for x in a.cache.layers]
        a.select_rows(torch.tensor([2, 0]))
        for layer, (k, v) in zip(a.cache.layers, before, strict=True):
            sel_k, sel_v = k[[2, 0]], v[[2, 0]]
            cut = sel_k.shape[2] - a.num_cols  # leading columns nobody uses any more are trimmed
            assert torch.equal(layer.keys, sel_k[:, :, cut:]) and torch.equal(layer.values, sel_v[:, :, cut:])


def test_maybe_compact_ignores_left_padding_it_cannot_remove():
    model = _model("llama")
    fn = model_forward(model)
    with torch.inference_mode():
        kv = prefill(model.config, fn, [list(range(1, 21)), [1, 2]])  # 90% of row 1 is left padding
        assert kv.hole_fraction() > 0.4
        layer_buf = kv.cache.layers[0]._kb
        kv.maybe_compact()
        assert kv.num_cols == 20 and kv.cache.layers[0]._kb is layer_buf  # nothing to gain: no re-gather
        kv.forward(fn, torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]] * 2))
        kv.rollback(10, torch.tensor([2, 10]))  # row 0 keeps 2 of 10: 8 removable columns of 30
        kv.maybe_compact(0.3)
        assert kv.num_cols == 30
        kv.maybe_compact(0.1)
        assert kv.num_cols == 22 and kv.lengths.tolist() == [22, 12]
