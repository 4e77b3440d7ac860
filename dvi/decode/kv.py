"""Batched ragged KV state over one Hugging Face `DynamicCache`.

Rows of a speculative batch accept different numbers of tokens each step. We keep ONE cache per model
whose columns are aligned across rows and track, per row and column, whether the slot holds a real
token (`valid`) and its absolute position (`pos`). Rejected slots become holes; the model sees a
4-D additive attention mask built from `valid`/`pos` (so holes, left padding and sliding windows are
handled identically for every architecture, because HF 5.x passes a 4-D mask through untouched) and
explicit per-row `position_ids` (RoPE and GPT-2's absolute embeddings both read them).

* rollback: mark rejected slots invalid, then crop trailing columns no row uses (batch 1 never has holes);
* compact: gather each row's valid slots to the right when holes pile up;
* add rows: prefill new sequences in their own `RaggedKV` and `merge` (left-pad + concat);
* remove rows: `select_rows` (batch index select), then trim columns nobody uses.

When there are no holes at all we pass `attention_mask=None` and let HF build its (fast) causal mask.

The cache is a `BufferedCache`: each layer keeps K/V buffers with spare capacity, writes new K/V in
place and hands the model views of its window of valid columns (HF's `DynamicLayer` concatenates the
whole cache on every forward). Rollback/trim only move the window; compaction, row selection and
merges write into fresh buffers that again keep spare capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep) -> logits
ModelFn = Callable[..., torch.Tensor]
# widest query whose [q, q] identity a RaggedKV keeps (every verify and catch-up width; prefills build theirs)
EYE_CACHE_MAX = 64


def _capacity(n: int) -> int:
    """Columns to allocate for `n` used ones (doubling: amortised O(1) copies per appended column)."""
    return max(2 * n, n + 32)


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` whose K/V live in preallocated buffers [B, H, capacity, D].

    `keys`/`values` are views of the window `[off, off + len)` of the buffers; `update` copies the new
    states in place after the window (growing the buffers by doubling when full) instead of
    concatenating the whole cache.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._kb: torch.Tensor | None = None
        self._vb: torch.Tensor | None = None
        self._off = 0
        self._len = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._kb.narrow(2, self._off, self._len)
        self.values = self._vb.narrow(2, self._off, self._len)

    def _alloc(self, b: int, k_like: torch.Tensor, v_like: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        kb = k_like.new_empty(b, k_like.shape[1], cap, k_like.shape[3])
        vb = v_like.new_empty(b, v_like.shape[1], cap, v_like.shape[3])
        return kb, vb

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self._off + self._len
        kb = self._kb
        if kb is None or end + n > kb.shape[2] or kb.shape[0] != key_states.shape[0]:
            need = self._len + n
            nkb, nvb = self._alloc(key_states.shape[0], key_states, value_states, _capacity(need))
            if self._len:
                nkb[:, :, : self._len].copy_(self.keys)
                nvb[:, :, : self._len].copy_(self.values)
            self._kb, self._vb, self._off, end = nkb, nvb, 0, self._len
        self._kb[:, :, end : end + n].copy_(key_states)
        self._vb[:, :, end : end + n].copy_(value_states)
        self._len += n
        self._views()
        return self.keys, self.values

    # ------------------------------------------------------------ window / contents (used by RaggedKV)
    def set_window(self, start: int, end: int) -> None:
        """Keep columns [start, end) of the current window (no copy)."""
        if self._kb is None:
            return
        self._off += start
        self._len = max(0, end - start)
        self._views()

    def assign(self, keys: torch.Tensor, values: torch.Tensor, spare: bool = True) -> None:
        """Replace the contents by `keys`/`values` [B, H, L, D] (copied into buffers with spare capacity)."""
        length = keys.shape[2]
        cap = _capacity(length) if spare else length
        self._kb, self._vb = self._alloc(keys.shape[0], keys, values, cap)
        self._kb[:, :, :length].copy_(keys)
        self._vb[:, :, :length].copy_(values)
        self._off, self._len = 0, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._views()

    def gather_cols(self, idx: torch.Tensor) -> None:
        """Per row, keep the columns `idx` [B, L'] of the window (in that order)."""
        b, h, _, d = self.keys.shape
        n = idx.shape[1]
        nkb, nvb = self._alloc(b, self.keys, self.values, _capacity(n))
        torch.gather(self.keys, 2, idx.view(b, 1, n, 1).expand(b, h, n, d), out=nkb[:, :, :n])
        dv = self.values.shape[3]
        hv = self.values.shape[1]
        torch.gather(self.values, 2, idx.view(b, 1, n, 1).expand(b, hv, n, dv), out=nvb[:, :, :n])
        self._kb, self._vb, self._off, self._len = nkb, nvb, 0, n
        self._views()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (in that order)."""
        n = self._len
        nkb, nvb = self._alloc(index.numel(), self.keys, self.values, _capacity(n))
        torch.index_select(self.keys, 0, index, out=nkb[:, :, :n])
        torch.index_select(self.values, 0, index, out=nvb[:, :, :n])
        self._kb, self._vb, self._off = nkb, nvb, 0
        self._views()

    # ------------------------------------------------------------ HF cache-layer API
    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self._kb is None:
            return
        self._len = max(0, self._len - abs(tokens_to_remove))
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self.select_rows(torch.as_tensor(indices, device=self.keys.device).reshape(-1))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.get_seq_length() > 0:
            self.select_rows(beam_idx.to(self.keys.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self.assign(self.keys.repeat_interleave(repeats, dim=0), self.values.repeat_interleave(repeats, dim=0))

    def reset(self) -> None:
        self._kb = self._vb = None
        self._off = self._len = 0
        super().reset()


class BufferedCache(DynamicCache):
    """A `DynamicCache` whose layers are `BufferedLayer`s (created lazily, one per model layer)."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        super().__init__()
        self.layer_class_to_replicate = BufferedLayer
        for k, v in layers or ():
            layer = BufferedLayer()
            layer.assign(k, v)
            self.layers.append(layer)


def _live(layer) -> bool:
    return getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0


def mask_layout(config) -> tuple[str, int | None]:
    """How this architecture wants its mask: 'full', 'window' (one windowed mask) or 'dict' (hybrid layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        types = set(layer_types)
        if "sliding_attention" in types and window:
            return ("dict" if "full_attention" in types else "window"), int(window)
        return "full", None
    if window:
        return "window", int(window)
    return "full", None


class RaggedKV:
    """KV cache + per-slot validity/positions for a batch of sequences of different lengths."""

    def __init__(self, config, batch_size: int = 0, device: torch.device | str = "cpu", dtype=torch.float32):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.mask_layout, self.window = mask_layout(config)
        mp = getattr(config, "max_position_embeddings", None)
        self.max_position = int(mp) if mp else None
        self.cache = BufferedCache()
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device)
        self.pos = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.has_holes = False

    # ---------------------------------------------------------------- shape
    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def num_cols(self) -> int:
        return self.valid.shape[1]

    def hole_fraction(self) -> float:
        if self.valid.numel() == 0:
            return 0.0
        return 1.0 - float(self.valid.float().mean())

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        fn: ModelFn,
        input_ids: torch.Tensor,
        input_valid: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Run `fn` on `input_ids` [B, q] appended after each row's cached tokens; returns the logits.

        `input_valid` [B, q] marks padding inside the new block (e.g. left padding of a prefill);
        invalid inputs become holes that no later token attends to.
        """
        b, q = input_ids.shape
        steps = torch.arange(q, device=self.device)
        if input_valid is None:
            qpos = self.lengths.unsqueeze(1) + steps
            holes = self.has_holes
            new_valid = torch.ones(b, q, dtype=torch.bool, device=self.device)
            added = q
        else:
            qpos = self.lengths.unsqueeze(1) + input_valid.long().cumsum(1) - 1
            qpos.clamp_(min=0)
            holes = self.has_holes or not bool(input_valid.all())
            new_valid = input_valid
            added = input_valid.long().sum(1)
        if self.max_position is not None:
            # Only inputs past a finishing row's last emitted token can get here; their outputs are discarded.
            qpos.clamp_(max=self.max_position - 1)
        # HF forwards build their own causal mask when there are no holes; lean forwards need one for any
        # multi-token query over a cache or windowed attention (SDPA's is_causal is wrong with a cache). A
        # hole-free prefill over an empty cache takes SDPA's is_causal path, as HF's own forward does: same
        # kernel, same rounding, so bf16 greedy decoding starts from the same cache as HF `generate`.
        need = holes or (getattr(fn, "explicit_mask", False) and ((q > 1 and self.num_cols > 0) or self.mask_layout != "full"))
        kv_valid = torch.cat([self.valid, new_valid], dim=1)
        kv_pos = torch.cat([self.pos, qpos], dim=1)
        mask = self._build_mask(qpos, kv_valid, kv_pos) if need else None
        logits = fn(input_ids, mask, qpos, self.cache, logits_to_keep)
        self.valid, self.pos = kv_valid, kv_pos
        self.lengths = self.lengths + added
        self.has_holes = holes
        return logits

    def _build_mask(self, qpos: torch.Tensor, kv_valid: torch.Tensor, kv_pos: torch.Tensor):
        q = qpos.shape[1]
        length = kv_valid.shape[1]
        allowed = kv_valid.unsqueeze(1) & (kv_pos.unsqueeze(1) <= qpos.unsqueeze(2))
        # Every query may see itself, so padded queries never get an all-masked row (NaN-free hole slots).
        eye = self._eye(q)
        if self.mask_layout == "full":
            allowed[:, :, length - q :] |= eye
            return self._to_additive(allowed)
        windowed = allowed & (qpos.unsqueeze(2) - kv_pos.unsqueeze(1) < self.window)
        windowed[:, :, length - q :] |= eye
        if self.mask_layout == "window":
            return self._to_additive(windowed)
        allowed[:, :, length - q :] |= eye
        return {"full_attention": self._to_additive(allowed), "sliding_attention": self._to_additive(windowed)}

    def _eye(self, q: int) -> torch.Tensor:
        """[q, q] identity; kept for the widths a step repeats (verify, catch-up), not a prefill's: one per
        distinct prompt length would grow with traffic (a 4k-token prompt's is 16 MiB)."""
        if q > EYE_CACHE_MAX:
            return torch.eye(q, dtype=torch.bool, device=self.device)
        cache = self.__dict__.setdefault("_eyes", {})
        e = cache.get(q)
        if e is None:
            e = cache[q] = torch.eye(q, dtype=torch.bool, device=self.device)
        return e

    def _to_additive(self, allowed: torch.Tensor) -> torch.Tensor:
        consts = self.__dict__.get("_mask_consts")
        if consts is None:
            consts = self._mask_consts = (
                torch.zeros((), dtype=self.dtype, device=self.device),
                torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device),
            )
        return torch.where(allowed, *consts).unsqueeze(1)

    # ---------------------------------------------------------------- rollback / trimming
    def rollback(self, tail: int, keep: torch.Tensor) -> None:
        """Among the last `tail` columns keep only each row's first `keep[b]` valid slots."""
        if tail <= 0:
            return
        if self.batch_size == 1 and not self.has_holes:
            # One hole-free row: rejected slots are the trailing ones; just shorten the window.
            drop = max(0, min(tail, self.num_cols) - int(keep[0]))
            if drop:
                self.lengths = self.lengths - drop
                self._set_cols(0, self.num_cols - drop)
            return
        tv = self.valid[:, -tail:]
        new_tv = tv & (tv.long().cumsum(1) <= keep.unsqueeze(1))
        self.lengths = self.lengths - (tv.long().sum(1) - new_tv.long().sum(1))
        self.valid = torch.cat([self.valid[:, :-tail], new_tv], dim=1)
        self.trim()

    def trim(self) -> None:
        """Drop leading/trailing columns that no row uses; refresh the hole flag."""
        if self.num_cols == 0:
            self.has_holes = False
            return
        idx = self.valid.any(0).nonzero().squeeze(1) if self.batch_size else self.valid.new_zeros(0)
        if idx.numel() == 0:
            self._set_cols(0, 0)
            return
        start, end = idx[[0, -1]].tolist()
        end += 1
        if start > 0 or end < self.num_cols:
            self._set_cols(start, end)
        self.has_holes = not bool(self.valid.all())

    def _set_cols(self, start: int, end: int) -> None:
        self.valid = self.valid[:, start:end]
        self.pos = self.pos[:, start:end]
        if end <= start:
            self.cache = BufferedCache()
            self.has_holes = False
            return
        for layer in self.cache.layers:
            if _live(layer):
                layer.set_window(start, end)

    def compact(self) -> None:
        """Move each row's valid slots to the right end (left padding only), shrinking the column count."""
        if not self.has_holes or self.num_cols == 0:
            return
        counts = self.valid.long().sum(1)
        new_len = int(counts.max())
        order = torch.sort(self.valid.to(torch.uint8), dim=1, stable=True).indices
        idx = order[:, self.num_cols - new_len :]
        self.valid = self.valid.gather(1, idx)
        self.pos = self.pos.gather(1, idx)
        for layer in self.cache.layers:
            if _live(layer):
                layer.gather_cols(idx)
        self.has_holes = not bool(self.valid.all())

    def maybe_compact(self, max_hole_fraction: float = 0.3, min_cols: int = 8) -> None:
        """Compact when more than `max_hole_fraction` of the columns would go (left padding that
        compaction cannot remove does not count, so a padded batch is not re-gathered every step)."""
        if self.has_holes and self.num_cols >= min_cols and self.batch_size:
            removable = 1.0 - int(self.valid.sum(1).max()) / self.num_cols
            if removable > max_hole_fraction:
                self.compact()

    # ---------------------------------------------------------------- rows
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only rows `index` (in that order)."""
        self.valid = self.valid.index_select(0, index)
        self.pos = self.pos.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        if self.num_cols == 0 or index.numel() == 0:
            self.cache = BufferedCache()
            self.valid = self.valid[:, :0]
            self.pos = self.pos[:, :0]
            self.has_holes = False
            return
        for layer in self.cache.layers:
            if _live(layer):
                layer.select_rows(index)
        self.trim()

    def merge(self, other: RaggedKV) -> None:
        """Append the rows of `other` (left-padding whichever side is shorter)."""
        if other.batch_size == 0:
            return
        if self.batch_size == 0:
            self.cache, self.valid, self.pos = other.cache, other.valid, other.pos
            self.lengths, self.has_holes = other.lengths, other.has_holes
            return
        la, lb = self.num_cols, other.num_cols
        length = max(la, lb)
        ka, kb = _layers(self.cache), _layers(other.cache)
        na, nb = self.batch_size, other.batch_size
        cache = BufferedCache()
        ref = ka if ka else kb
        if length > 0 and ref:
            cap = _capacity(length)
            for i in range(len(ref)):
                layer = BufferedLayer()
                rk, rv = ref[i]
                kbuf, vbuf = layer._alloc(na + nb, rk, rv, cap)
                for kv, r0, n, l_own in ((ka, 0, na, la), (kb, na, nb, lb)):
                    pad = length - l_own if kv else length
                    if pad:
                        kbuf[r0 : r0 + n, :, :pad].zero_()
                        vbuf[r0 : r0 + n, :, :pad].zero_()
                    if kv and l_own:
                        kbuf[r0 : r0 + n, :, pad:length].copy_(kv[i][0])
                        vbuf[r0 : r0 + n, :, pad:length].copy_(kv[i][1])
                layer._kb, layer._vb, layer._off, layer._len = kbuf, vbuf, 0, length
                layer.lazy_initialization(rk, rv)
                layer._views()
                cache.layers.append(layer)
        self.cache = cache

        def lpad(t: torch.Tensor, n: int, fill) -> torch.Tensor:
            return torch.cat([torch.full((t.shape[0], n), fill, dtype=t.dtype, device=t.device), t], 1) if n else t

        self.valid = torch.cat([lpad(self.valid, length - la, False), lpad(other.valid, length - lb, False)], 0)
        self.pos = torch.cat([lpad(self.pos, length - la, 0), lpad(other.pos, length - lb, 0)], 0)
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.has_holes = not bool(self.valid.all())


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        if _live(layer):
            out.append((layer.keys, layer.values))
        else:
            return []
    return out


def prefill(
    config,
    fn: ModelFn,
    token_lists: list[list[int]],
    device: torch.device | str = "cpu",
    dtype=torch.float32,
    return_output: bool = False,
):
    """Build a RaggedKV for new rows holding `token_lists` (may be empty lists), left-padded, one forward.

    With `return_output`, returns (RaggedKV, what `fn` returned): the caller wants the outputs, e.g.
    the target's features for an eagle drafter (None when no row has tokens)."""
    if getattr(fn, "exact_rows", False) and len(token_lists) > 1:
        return _prefill_rows(config, fn, token_lists, device, dtype, return_output)
    kv = RaggedKV(config, len(token_lists), device=device, dtype=dtype)
    if max((len(t) for t in token_lists), default=0) == 0:
        return (kv, None) if return_output else kv
    ids, valid = left_pad(token_lists, kv.device)
    out = kv.forward(fn, ids, valid, logits_to_keep=1)
    kv.trim()
    return (kv, out) if return_output else kv


def _prefill_rows(config, fn: ModelFn, token_lists: list[list[int]], device, dtype, return_output: bool):
    """`prefill` one row at a time, merged (the exact mode: each row's cache as its lone prefill makes it).
    Outputs are stacked as the batched prefill returns them: logits [B, 1, V] and, when `fn` returns
    (logits, features), features [B, M, H] left-padded with zeros to the longest row."""
    kv = RaggedKV(config, 0, device=device, dtype=dtype)
    outs = []
    for t in token_lists:
        one, out = prefill(config, fn, [t], device, dtype, return_output=True)
        kv.merge(one)
        outs.append(out)
    ref = next((o for o in outs if o is not None), None)
    if not return_output or ref is None:
        return (kv, None) if return_output else kv
    pairs = isinstance(ref, tuple)
    m = max(len(t) for t in token_lists)
    lg0, f0 = (ref[0], ref[1]) if pairs else (ref, None)
    logits, feats = [], []
    for o in outs:
        lg, f = (o if pairs else (o, None)) if o is not None else (torch.zeros_like(lg0), None)
        logits.append(lg)
        if pairs:
            f = f if f is not None else f0.new_zeros(1, 0, f0.shape[2])
            feats.append(torch.cat([f.new_zeros(1, m - f.shape[1], f.shape[2]), f], 1))
    logits = torch.cat(logits, 0)
    return kv, ((logits, torch.cat(feats, 0)) if pairs else logits)


def left_pad(token_lists: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths right-aligned to the longest M: ids [B, M] (0 where padded) and valid [B, M]."""
    m = max(len(t) for t in token_lists)
    ids = torch.zeros(len(token_lists), m, dtype=torch.long)
    valid = torch.zeros(len(token_lists), m, dtype=torch.bool)
    for i, t in enumerate(token_lists):
        if t:
            ids[i, m - len(t):] = torch.tensor(t, dtype=torch.long)
            valid[i, m - len(t):] = True
    return ids.to(device), valid.to(device)
