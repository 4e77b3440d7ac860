"""`SlotCache`: the lean forward's keys and values, one tensor per model (`dvi.decode.lean`).

[layers, slots, capacity, 2, kv_heads, head_dim]: batch row i lives in slot i with its tokens at positions
0..length-1; a forward writes its q new entries at length..length+q-1 and `advance` keeps n of them, so a rejected
draft is overwritten later (no holes, no validity masks, no compaction).
"""

from __future__ import annotations

import torch

__all__ = ["SlotCache"]


class SlotCache:
    """Keys and values of up to `slots` rows: [layers, slots, capacity, 2, kv_heads, head_dim], zero-filled
    (masked columns are multiplied by 0 in attention: garbage there must be finite). `lengths` (host ints) is
    what each row holds; capacity and slots grow by doubling (`reserve`), which a captured graph never sees
    because its caller reserves the maximum first."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 slots: int = 1, capacity: int = 256):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.lengths: list[int] = []
        self.frozen = False  # a captured CUDA graph holds this cache's address: it may not move
        self._alloc(max(1, slots), max(16, capacity))

    def _alloc(self, slots: int, capacity: int) -> None:
        old = getattr(self, "kv", None)
        with torch.inference_mode(False), torch.no_grad():  # a normal tensor: updatable in and out of inference mode
            self.kv = torch.zeros(self.layers, slots, capacity, 2, self.kv_heads, self.head_dim, dtype=self.dtype,
                                  device=self.device)
            if old is not None and self.lengths:  # lengths may count entries a forward is about to write (`Segments`)
                b, n = min(len(self.lengths), old.shape[1]), min(max(self.lengths), old.shape[2])
                self.kv[:, :b, :n].copy_(old[:, :b, :n])
            self.per_layer = self.kv.unbind(0)  # [slots, capacity, 2, kv_heads, head_dim] each, for index_put_

    @property
    def slots(self) -> int:
        return self.kv.shape[1]

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def reserve(self, rows: int, columns: int) -> None:
        """Room for `rows` rows of `columns` positions (doubling)."""
        if rows > self.slots or columns > self.capacity:
            if self.frozen:
                raise ValueError(f"{rows} rows of {columns} positions do not fit the CUDA-graph KV cache "
                                 f"({self.slots} slots of {self.capacity}): raise the engine's max_batch / "
                                 "max_context, or serve without CUDA graphs")
            s, c = self.slots, self.capacity
            while s < rows:
                s *= 2
            while c < columns:
                c *= 2
            self._alloc(s, c)

    def views(self, rows: int, columns: int, first: int = 0) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per layer, keys and values of slots first..first+rows-1, positions 0..columns-1, as SDPA wants them:
        [rows, kv_heads, columns, head_dim] (strided views, no copy)."""
        kv = self.kv[:, first : first + rows, :columns]
        return kv.select(3, 0).transpose(2, 3).unbind(0), kv.select(3, 1).transpose(2, 3).unbind(0)

    def add_rows(self, n: int) -> list[int]:
        """n empty rows at the end of the batch; returns their slots."""
        b = len(self.lengths)
        self.reserve(b + n, 1)
        self.lengths.extend([0] * n)
        return list(range(b, b + n))

    def advance(self, kept: list[int]) -> None:
        """Row i keeps the first kept[i] entries its last forward wrote."""
        self.lengths = [a + int(k) for a, k in zip(self.lengths, kept, strict=True)]

    def truncate(self, lengths: list[int]) -> None:
        self.lengths = [int(x) for x in lengths]

    @torch.no_grad()
    def select_rows(self, keep: list[int]) -> None:
        """Only rows `keep` stay, in that order, in slots 0..len(keep)-1: only the rows that change slot are copied
        (the engine fills a leaving row's slot with the last row, `dvi.decode.seq.fill_order`, so a row that
        finishes moves one row, not every row behind it)."""
        moved = [(j, i) for j, i in enumerate(keep) if i != j]
        n = max((self.lengths[i] for _, i in moved), default=0)
        if n > 0:
            dst, src = (torch.tensor(x, dtype=torch.long, device=self.device) for x in zip(*moved, strict=True))
            self.kv[:, dst, :n] = self.kv[:, src, :n]  # the source rows are read before any is written
        self.lengths = [self.lengths[i] for i in keep]
