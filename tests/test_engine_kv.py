"""RaggedKV: masks with holes, per-row positions, rollback, compaction, row add/remove are exact per architecture."""

from __future__ import annotations

import pytest
import torch

from dvi.drafters import model_forward
from dvi.kv import prefill

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
