"""A learned drafter's KV cache and forward, as its proposer uses them (`DraftCache`).

`LeanDraftCache` runs a plain Llama-family drafter (`separate`, merged weights) through `dvi.decode.lean`
over a static per-slot cache, as the target does: one forward of a draft step is ~27 aten ops a layer and
rejected drafts cost nothing to undo. `RaggedDraftCache` runs any drafter callable (LoRA-wrapped, early exit,
eagle) over a `dvi.decode.kv.RaggedKV`. A drafter's rounding decides nothing (its drafts are judged by the
target), so both attend their whole batch in one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from dvi.decode.attention import Attention
from dvi.decode.kv import RaggedKV, left_pad, prefill
from dvi.decode.lean import LeanModel, lean_supported
from dvi.decode.rows_kernel import option_rows
from dvi.decode.segments import Runs, Segments
from dvi.drafters.adapters import AdapterBank, RowAdapters

__all__ = ["DraftCache", "LeanDraftCache", "RaggedDraftCache", "draft_cache"]


class DraftCache(Protocol):
    def add_rows(self, n: int, groups: list[str] | None = None) -> None:
        """n empty rows at the end of the batch (their tokens arrive as the first forward's pending ones), of
        traffic groups `groups` (their adapters, where the cache serves any)."""

    def forward_rows(self, rows: list[list[int]], fn: Callable | None = None) -> torch.Tensor:
        """Append to each row its tokens `rows[i]` (at least one); logits [B, V] after each row's last one."""

    def forward(self, ids: torch.Tensor, fn: Callable | None = None) -> torch.Tensor:
        """Append ids [B, 1]; logits [B, V]."""

    def keep(self, q: int, kept: list[int]) -> None:
        """Of the last q entries appended per row, row i keeps its first kept[i]."""

    def select_rows(self, keep: list[int]) -> None: ...

    def rebuild(self, contexts: list[list[int]]) -> None:
        """Every row's cache holding `contexts[i]` (prefilled at once)."""

    def tidy(self) -> None: ...


class RaggedDraftCache:
    """Any drafter callable over a `RaggedKV` (`fn` overrides the callable per call: eagle's feature-bound one)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.kv = RaggedKV(drafter.config, 0, drafter.device, drafter.dtype)

    def add_rows(self, n: int, groups: list[str] | None = None) -> None:
        self.kv.merge(RaggedKV(self.drafter.config, n, self.drafter.device, self.drafter.dtype))

    def forward_rows(self, rows: list[list[int]], fn: Callable | None = None) -> torch.Tensor:
        if max(len(r) for r in rows) == 1:
            ids, valid = torch.tensor(rows, dtype=torch.long, device=self.drafter.device), None  # [B, 1]
        else:
            ids, valid = left_pad(rows, self.drafter.device)  # [B, M] each
        return self._last(self.kv.forward(fn or self.drafter, ids, valid, logits_to_keep=1))

    def forward(self, ids: torch.Tensor, fn: Callable | None = None) -> torch.Tensor:
        return self._last(self.kv.forward(fn or self.drafter, ids, None, logits_to_keep=1))

    @staticmethod
    def _last(out):
        """[B, 1, V] logits (or (logits, features) from a feature-bound callable) -> the same, last position."""
        return (out[0][:, -1], out[1]) if isinstance(out, tuple) else out[:, -1]

    def keep(self, q: int, kept: list[int]) -> None:
        self.kv.rollback(q, torch.tensor(kept, dtype=torch.long, device=self.drafter.device))

    def select_rows(self, keep: list[int]) -> None:
        self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.drafter.device))

    def rebuild(self, contexts: list[list[int]]) -> None:
        d = self.drafter
        self.kv = prefill(d.config, d, contexts, d.device, d.dtype)

    def tidy(self) -> None:
        self.kv.maybe_compact()


class LeanDraftCache:
    """A plain Llama-family drafter through `LeanModel` over a `SlotCache`; with a `bank`, each row drafts through
    its traffic group's adapter (`dvi.drafters.adapters`), all groups in the same forward."""

    def __init__(self, model, bank: AdapterBank | None = None, rows_kernel: bool | str = False):
        self.lean = LeanModel(model)
        if rows_kernel:  # the drafter's forwards on dvi's rows kernel, as the target's (`serve.cpu_rows_kernel`)
            self.lean.use_rows_kernel(option_rows(rows_kernel))
        self.cache = self.lean.new_cache()
        self._cols = torch.arange(0)
        self.device = self.lean.device
        self.bank = bank
        self.groups: list[str] = []  # each row's traffic group
        self._rows: RowAdapters | None = None
        self._rows_stale = True

    def adapters_changed(self) -> None:
        self._rows_stale = True

    def add_rows(self, n: int, groups: list[str] | None = None) -> None:
        self.cache.add_rows(n)
        self.groups.extend(groups if groups is not None else [""] * n)
        self._rows_stale = True

    def _adapters(self, groups: list[str] | None = None) -> RowAdapters | None:
        """The rows' adapters (of `groups` instead, for a forward over other rows); kept while rows and bank stay."""
        if self.bank is None:
            return None
        if groups is not None:
            return self.bank.rows(groups)
        if self._rows_stale:
            self._rows, self._rows_stale = self.bank.rows(self.groups), False
        return self._rows

    def _columns(self, n: int) -> torch.Tensor:
        if self._cols.numel() < n:
            self._cols = torch.arange(max(n, 2 * self._cols.numel()), device=self.device)
        return self._cols[:n]

    def _run(self, ids: torch.Tensor, pick: torch.Tensor, prefixes: Segments | None = None) -> torch.Tensor:
        """A forward of every row, `pick` [B] the position read per row; with `prefixes`, tokens that go before some
        rows' ids (the rows' lengths already count them)."""
        b, q = ids.shape
        starts = self.cache.lengths
        columns = max(starts) + q
        self.cache.reserve(b, columns)
        start = torch.tensor(starts, dtype=torch.long, device=self.device)
        mask = None
        if b > 1 or q > 1:
            pos = start.view(b, 1, 1) + torch.arange(q, device=self.device).view(1, q, 1)
            mask = (self._columns(columns).view(1, 1, columns) <= pos).unsqueeze(1)  # [B, 1, q, columns]
        if prefixes is None:
            self.lean.adapters = self._adapters()
        else:  # one adapter slot per token: the rows' ids, then the prefixes' tokens
            self.lean.adapters = self._adapters(self.groups + [self.groups[i] for i, t in zip(
                prefixes.slots, prefixes.seqs, strict=True) for _ in range(t.shape[0])])
        attn = Attention(columns, mask=mask)
        attn.runs = Runs(prefixes)  # (no prefixes: empty runs, as none)
        return self.lean.forward(self.cache, ids, start, attn, pick=pick)

    def forward_rows(self, rows: list[list[int]], fn: Callable | None = None) -> torch.Tensor:
        """Each row's logits after its last token. Where the rows' lengths differ (a catch-up: a row that just joined
        brings its whole prompt, the others one or two tokens), every row's tokens but its last go in as prefixes
        (`Segments`: each attends over its own row's columns only) and the last tokens as a one-token step: padding
        every row to the longest cost the drafter B times the catch-up in its projections, and B times the longest
        row's queries in its attention. Otherwise rows are right-padded with their own last token (an ordinary
        drafting step's 1 or 2 tokens a row keep the padded forward and its cached per-row adapters)."""
        lens = [len(r) for r in rows]
        m = max(lens)
        dev = self.device
        if len(rows) > 1 and m > 2 and min(lens) < m:  # a catch-up
            slots = [i for i, n in enumerate(lens) if n > 1]
            prefixes = Segments(slots, [self.cache.lengths[i] for i in slots],
                                [torch.tensor(rows[i][:-1], dtype=torch.long, device=dev) for i in slots])
            self.cache.reserve(len(rows), max(a + n for a, n in zip(self.cache.lengths, lens, strict=True)))
            self.cache.advance([n - 1 for n in lens])
            ids = torch.tensor([r[-1:] for r in rows], dtype=torch.long, device=dev)
            out = self._run(ids, torch.zeros(len(rows), dtype=torch.long, device=dev), prefixes=prefixes)
            self.cache.advance([1] * len(rows))
            return out
        ids = torch.tensor([r + [r[-1]] * (m - len(r)) for r in rows], dtype=torch.long, device=dev)
        out = self._run(ids, torch.tensor([n - 1 for n in lens], dtype=torch.long, device=dev))
        self.cache.advance(lens)
        return out

    def forward(self, ids: torch.Tensor, fn: Callable | None = None) -> torch.Tensor:
        out = self._run(ids, torch.zeros(ids.shape[0], dtype=torch.long, device=self.device))
        self.cache.advance([1] * ids.shape[0])
        return out

    def keep(self, q: int, kept: list[int]) -> None:
        self.cache.truncate([n - q + int(k) for n, k in zip(self.cache.lengths, kept, strict=True)])

    def select_rows(self, keep: list[int]) -> None:
        self.cache.select_rows(keep)
        self.groups = [self.groups[i] for i in keep]
        self._rows_stale = True

    def rebuild(self, contexts: list[list[int]]) -> None:
        groups = self.groups if len(self.groups) == len(contexts) else None
        self.cache = self.lean.new_cache(max(1, len(contexts)), self.cache.capacity)
        self.groups = []
        self.add_rows(len(contexts), groups)
        live = [i for i, c in enumerate(contexts) if c]
        for i in live:  # one row at a time into its own slot (a causal prefill over an empty row)
            self.lean.adapters = self._adapters([self.groups[i]])
            ids = torch.tensor([contexts[i]], dtype=torch.long, device=self.device)
            self.cache.reserve(i + 1, ids.shape[1])
            self.lean.forward(self.cache, ids, torch.zeros(1, dtype=torch.long, device=self.device),
                              Attention(ids.shape[1], causal=ids.shape[1] > 1), logits_to_keep=1, first_slot=i)
            self.cache.lengths[i] = ids.shape[1]

    def tidy(self) -> None:
        pass


def draft_cache(drafter, bank: AdapterBank | None = None, rows_kernel: bool | str = False) -> DraftCache:
    """`LeanDraftCache` for a `separate` drafter that `dvi.decode.lean` runs (plain Llama-family, merged
    weights; `rows_kernel` as `dvi.decode.target.CpuMatmuls`'), else `RaggedDraftCache`."""
    model = getattr(drafter, "model", None)
    if lean_drafter(drafter):
        return LeanDraftCache(model, bank, rows_kernel)
    return RaggedDraftCache(drafter)


def lean_drafter(drafter) -> bool:
    """Whether `drafter` drafts through `dvi.decode.lean` (and so can serve per-group adapters)."""
    model = getattr(drafter, "model", None)
    return getattr(drafter, "kind", None) == "separate" and model is not None \
        and not hasattr(model, "get_base_model") and lean_supported(model) is None
