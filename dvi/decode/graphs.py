"""CUDA graphs of the lean forward (issue 33 §3): a step the GPU does not wait on the host for.

On a GPU a small target's step is almost all host work (~900 kernel launches of microseconds each for
SmolLM2-135M, whose arithmetic takes well under a millisecond). `GraphedForward` captures
`dvi.decode.lean.LeanModel.forward` once per static bucket (rows, positions per row, attended columns) into a
`torch.cuda.CUDAGraph`, at start-up with a progress bar, over a `SlotCache` allocated for the largest bucket
(a graph holds its tensors' addresses: the cache never moves). A call copies its ids and row lengths into
the static inputs and replays the smallest bucket that fits. Padding rows use free slots and padding
positions land past their row's length, so both are overwritten before anyone attends to them; their outputs
are dropped. Attention is one masked SDPA call per layer over the bucket's columns: a row may part from its
lone plain decode at near-ties only (`dvi.decode.sampling.tie_bound`); the exact mode runs eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from dvi.decode.attention import Attention
from dvi.decode.lean import LeanModel
from dvi.decode.slot_cache import SlotCache

__all__ = ["StaticForward", "GraphedForward", "buckets_up_to"]

log = logging.getLogger(__name__)


def buckets_up_to(limit: int, ladder: tuple[int, ...]) -> tuple[int, ...]:
    """The rungs of `ladder` below `limit`, then `limit` itself."""
    return tuple(sorted({x for x in ladder if x < limit} | {limit}))


def _fit(n: int, rungs: tuple[int, ...]) -> int | None:
    return next((r for r in rungs if r >= n), None)


class StaticForward:
    """`LeanModel.forward` at static shapes: per (rows, width, columns) bucket, over static input buffers and a
    cache allocated for the largest bucket. What `GraphedForward` captures; run eagerly (any device) it is the
    same arithmetic, so the bucketing and padding are tested where no GPU is.

    `features`: the forwards also return the final normed hidden states (an eagle drafter reads them); `pick`:
    they return, per row, the logits at position pick[b] only (a drafter's first forward over its pending tokens)."""

    def __init__(self, lean: LeanModel, max_batch: int, max_width: int, max_context: int,
                 features: bool = False, pick: bool = False):
        self.lean, self.features, self.pick_mode = lean, features, pick
        self.batches = buckets_up_to(max_batch, (1, 2, 4, 8, 16, 32, 64, 128))
        self.widths = buckets_up_to(max_width, (1, 2, 3, 5, 9, 17))
        self.columns = buckets_up_to(max_context, (256, 1024, 4096))
        capacity = self.columns[-1] + self.widths[-1]
        dev = lean.device
        self.cache: SlotCache = lean.new_cache(self.batches[-1], capacity)
        self.cache.frozen = True
        lean._rope_tables(capacity)  # grown now: nothing may allocate inside a capture
        self.ids = torch.zeros(self.batches[-1], self.widths[-1], dtype=torch.long, device=dev)
        self.starts = torch.zeros(self.batches[-1], dtype=torch.long, device=dev)
        self.picks = torch.zeros(self.batches[-1], dtype=torch.long, device=dev)
        self._cols = torch.arange(capacity, device=dev)
        self._steps = torch.arange(self.widths[-1], device=dev)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def _body(self, b: int, w: int, c: int):
        start = self.starts[:b]
        pos = start.view(b, 1, 1) + self._steps[:w].view(1, w, 1)  # [b, w, 1]
        mask = (self._cols[:c].view(1, 1, c) <= pos).unsqueeze(1)  # [b, 1, w, c]
        return self.lean.forward(self.cache, self.ids[:b, :w], start, Attention(c, mask=mask),
                                 features=self.features, pick=self.picks[:b] if self.pick_mode else None)

    def fits(self, b: int, q: int, columns: int) -> bool:
        return b <= self.batches[-1] and q <= self.widths[-1] and columns <= self.columns[-1]

    def _key(self, b: int, q: int, starts: list[int]) -> tuple[int, int, int]:
        return _fit(b, self.batches), _fit(q, self.widths), _fit(max(starts) + q, self.columns)

    def _load(self, key: tuple[int, int, int], ids: torch.Tensor, starts: list[int], pick: torch.Tensor | None) -> None:
        """The call's inputs into the static buffers (padding rows: free slots, from position 0)."""
        b, q = ids.shape
        self.ids[:b, :q].copy_(ids)
        host = torch.tensor(starts, dtype=torch.long)
        self.starts[:b].copy_(host.pin_memory() if self.starts.is_cuda else host, non_blocking=True)
        if key[0] > b:
            self.starts[b : key[0]].zero_()
        if pick is not None:
            self.picks[:b].copy_(pick)

    def _cut(self, out, b: int, q: int):
        if self.pick_mode:
            return out[:b]
        if self.features:
            return out[0][:b, :q], out[1][:b, :q]
        return out[:b, :q]

    def __call__(self, ids: torch.Tensor, starts: list[int], pick: torch.Tensor | None = None):
        """ids [b, q] after rows 0..b-1's `starts` (host lengths); the outputs as `LeanModel.forward` returns
        them, cut to [b, q]."""
        b, q = ids.shape
        key = self._key(b, q, starts)
        self._load(key, ids, starts, pick)
        return self._cut(self._body(*key), b, q)


class GraphedForward(StaticForward):
    """`StaticForward` with every bucket captured as a `torch.cuda.CUDAGraph` at start-up and replayed."""

    def __init__(self, lean: LeanModel, max_batch: int, max_width: int, max_context: int,
                 features: bool = False, pick: bool = False, progress: bool = True):
        if lean.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        super().__init__(lean, max_batch, max_width, max_context, features, pick)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, object]] = {}
        self._capture_all(progress)

    @torch.inference_mode()
    def _capture_all(self, progress: bool) -> None:
        from tqdm import tqdm

        keys = [(b, w, c) for b in self.batches for w in self.widths for c in self.columns]
        t0 = time.perf_counter()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: kernels chosen, workspaces allocated, outside any graph
            for key in keys[:: max(1, len(keys) // 8)] + keys[-1:]:
                self._body(*key)
        torch.cuda.current_stream().wait_stream(side)
        for key in tqdm(keys, desc="capturing CUDA graphs", disable=not progress, leave=False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._body(*key)
            self.graphs[key] = (g, out)
        torch.cuda.synchronize()
        self.cache.kv.zero_()  # the captures wrote into the cache
        log.info("captured %d CUDA graphs (rows %s, widths %s, columns %s) in %.1fs", len(keys), self.batches,
                 self.widths, self.columns, time.perf_counter() - t0)

    def __call__(self, ids: torch.Tensor, starts: list[int], pick: torch.Tensor | None = None):
        """As `StaticForward`, by replaying the bucket's graph: views of its static output, valid until the next
        call."""
        b, q = ids.shape
        key = self._key(b, q, starts)
        g, out = self.graphs[key]
        self._load(key, ids, starts, pick)
        g.replay()
        return self._cut(out, b, q)
