"""Rows leaving a continuous batch: the last rows fill their places (`fill_order`) and a cache copies only the rows
that change slot, so a finishing row costs one row's copy, not every row's behind it."""

import itertools

import torch

from dvi.decode.seq import fill_order
from dvi.decode.slot_cache import SlotCache


def test_fill_order_keeps_every_survivor_once_and_moves_only_tail_rows():
    for rows in range(0, 7):
        for n in range(rows + 1):
            for leaving in itertools.combinations(range(rows), n):
                keep = fill_order(rows, set(leaving))
                survivors = [i for i in range(rows) if i not in leaving]
                assert sorted(keep) == survivors
                moved = [(j, i) for j, i in enumerate(keep) if i != j]
                assert len(moved) <= len(leaving)  # at most one row moves per leaving row
                assert all(j in leaving and i >= len(keep) for j, i in moved)


def test_slot_cache_select_rows_copies_moved_rows_and_keeps_the_rest():
    torch.manual_seed(0)
    cache = SlotCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu", slots=8, capacity=16)
    cache.add_rows(6)
    cache.kv.normal_()
    cache.lengths = [3, 9, 5, 12, 2, 7]
    before = cache.kv.clone()
    keep = fill_order(6, {0, 3})  # rows 4 and 5 move into slots 0 and 3
    assert keep == [4, 1, 2, 5]
    cache.select_rows(keep)
    assert cache.lengths == [2, 9, 5, 7]
    for j, i in enumerate(keep):
        n = cache.lengths[j]
        assert torch.equal(cache.kv[:, j, :n], before[:, i, :n])
    # rows that stayed in place were not rewritten at all (their columns past the length too)
    for j in (1, 2):
        assert torch.equal(cache.kv[:, j], before[:, j])
