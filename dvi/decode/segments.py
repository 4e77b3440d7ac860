"""Runs of one row's tokens that go through a forward beside its batch's rows (`dvi.decode.lean.LeanModel.forward`):
prefixes before the rows' step tokens (a joining row's prompt, a drafter's catch-up), tails after them (the drafts of
the few rows that drafted in a ragged verify). Each run attends causally over its own row's columns only. `cache`
below is the forward's `dvi.decode.slot_cache.SlotCache` (not imported: lean imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dvi.decode.attention import one_call

__all__ = ["NO_RUNS", "Runs", "Segments", "attend_segments"]


class Segments:
    """Runs of one row's tokens that go through a forward beside its batch's rows: row slots[i]'s tokens seqs[i] at
    columns starts[i].., through the same matmuls, writing their keys and values, each attending causally over its
    own row's columns (one attention call a run: what vLLM's ragged batches pay, not every row padded to the longest).
    As prefixes, before the rows' step tokens, their outputs dropped: a joining row's prompt (start 0), a drafter's
    catch-up; the weights stream once for the prefills and the step. As tails, after them, their logits returned:
    the drafts of the few rows that drafted in a ragged verify."""

    __slots__ = ("slots", "starts", "seqs", "width")

    def __init__(self, slots: list[int], starts: list[int], seqs: list[torch.Tensor], width: int = 0):
        if any(s.shape[0] == 0 for s in seqs):
            raise ValueError("an empty run (leave the row out)")
        self.slots, self.starts, self.seqs = slots, starts, seqs
        self.width = width  # tails: positions a row in the logits (its id, then up to width - 1 tail tokens)

    @property
    def positions(self) -> int:
        return sum(s.shape[0] for s in self.seqs)

    def placed(self, rows: int, device: torch.device) -> torch.Tensor:
        """Tails: the flat index (row * width + j) of each scored position, the rows' ids first, then each tail."""
        idx = [i * self.width for i in range(rows)]
        idx += [i * self.width + 1 + j for i, s in zip(self.slots, self.seqs, strict=True) for j in range(s.shape[0])]
        return torch.tensor(idx, dtype=torch.long, device=device)

    @property
    def columns(self) -> int:
        return max(a + s.shape[0] for a, s in zip(self.starts, self.seqs, strict=True))

    def placement(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per position, in order: its token, its column (= its position), its slot."""
        flat = torch.cat(self.seqs)
        col = torch.cat([torch.arange(a, a + s.shape[0], device=device) for a, s in zip(self.starts, self.seqs,
                                                                                         strict=True)])
        slot = torch.cat([torch.full((s.shape[0],), i, dtype=torch.long, device=device)
                          for i, s in zip(self.slots, self.seqs, strict=True)])
        return flat, col, slot

    def attending(self, cache: Any) -> list:
        """Per run: its row's keys and values per layer up to its last column, its length, and its causal mask
        (None from column 0: a plain causal call)."""
        out = []
        for i, a, s in zip(self.slots, self.starts, self.seqs, strict=True):
            n = s.shape[0]
            mask = None
            if a:
                cols = torch.arange(a + n, device=cache.device)
                mask = (cols.view(1, -1) <= cols[a:].view(-1, 1)).view(1, 1, n, a + n)
            out.append((cache.views(1, a + n, i), n, mask))
        return out


@dataclass(frozen=True)
class Runs:
    """What goes through a forward beside its batch's ids [B, q]: prefixes before them (start[b] counts them; their
    outputs are dropped), tails after ids [B, 1] (a ragged verify's drafts, `tails.width` positions a row in all:
    the forward then returns logits [B, tails.width, V], each row's id at position 0, its tail after it, zeros
    elsewhere). `copies` (dst slot, src slot, n): each layer's keys and values of src's columns 0..n-1 copied into
    dst's once the layer has written them, before any query attends (joining prompts that start alike: the first
    computes, the others copy)."""

    prefixes: Segments | None = None
    tails: Segments | None = None
    copies: tuple[tuple[int, int, int], ...] = ()

    def __bool__(self) -> bool:
        return self.prefixes is not None or self.tails is not None or bool(self.copies)

    def copy(self, layer_kv: torch.Tensor) -> None:
        """`copies` in one layer's cache [slots, capacity, 2, kv_heads, head_dim], in order (a source may itself
        be a copy's destination earlier in the list)."""
        for dst, src, n in self.copies:
            layer_kv[dst, :n] = layer_kv[src, :n]

    def pieces(self, n: int) -> list[int] | None:
        """Row counts a forward of n flat rows runs its matmuls in: the batch's and the tails' rows together, then each
        prefix alone, so a prompt's keys and values are what its own prefill computes whatever else the forward
        carries (bf16 GEMMs round a row by the row count; with one GEMM for all, a prompt's cache differed between
        a speculating server and one that does not: greedy answers parting at 8 rows, bf16, Intel AMX, 28 of 64
        against 10). None: one piece."""
        if self.prefixes is None:
            return None
        sizes = [s.shape[0] for s in self.prefixes.seqs]
        return [n - sum(sizes), *sizes]

    def place(self, cache: Any, placed: tuple[torch.Tensor, ...], columns: int) -> tuple:
        """The batch's (token, column, position, slot) per flat row with the tails' and then the prefixes' after
        them, the columns the forward reaches, and every run's attention inputs in that order (`attend_segments`;
        none without runs)."""
        segments = []
        for extra in (self.tails, self.prefixes):
            if extra is not None:
                flat, col, pos, slot = placed
                eflat, ecol, eslot = extra.placement(cache.device)
                placed = (torch.cat([flat, eflat]), torch.cat([col, ecol]), torch.cat([pos, ecol]),
                          torch.cat([slot, eslot]))
                columns = max(columns, extra.columns)
                segments += extra.attending(cache)
        return placed, columns, segments


NO_RUNS = Runs()
"""A forward with nothing beside its batch's rows (`Attention.runs` None)."""


def attend_segments(qrows: torch.Tensor, segments: list, layer: int, scale: float) -> list[torch.Tensor]:
    """Each run's queries (its row's positions start..start+n-1, in order) over that row's columns up to its own."""
    outs, at = [], 0
    for (keys, values), n, mask in segments:
        outs.append(one_call(qrows[at : at + n], 1, keys[layer], values[layer], mask, scale,
                             causal=mask is None and n > 1))
        at += n
    return outs
