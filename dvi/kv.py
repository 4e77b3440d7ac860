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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

# fn(input_ids, attention_mask, position_ids, past_key_values, logits_to_keep) -> logits
ModelFn = Callable[..., torch.Tensor]


def _mask_kind(config) -> tuple[str, int | None]:
    """How this architecture wants its mask: 'full', 'window' (one windowed mask) or 'dict' (hybrid layers)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        if "sliding_attention" in kinds and window:
            return ("dict" if "full_attention" in kinds else "window"), int(window)
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
        self.kind, self.window = _mask_kind(config)
        mp = getattr(config, "max_position_embeddings", None)
        self.max_position = int(mp) if mp else None
        self.cache = DynamicCache()
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
        # multi-token query or windowed attention (SDPA's is_causal is wrong with a cache).
        need = holes or (getattr(fn, "explicit_mask", False) and (q > 1 or self.kind != "full"))
        mask = self._build_mask(qpos, new_valid) if need else None
        logits = fn(input_ids, mask, qpos, self.cache, logits_to_keep)
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.pos = torch.cat([self.pos, qpos], dim=1)
        self.lengths = self.lengths + added
        self.has_holes = holes
        return logits

    def _build_mask(self, qpos: torch.Tensor, new_valid: torch.Tensor):
        b, q = qpos.shape
        kv_valid = torch.cat([self.valid, new_valid], dim=1)
        kv_pos = torch.cat([self.pos, qpos], dim=1)
        length = kv_valid.shape[1]
        allowed = kv_valid.unsqueeze(1) & (kv_pos.unsqueeze(1) <= qpos.unsqueeze(2))
        # Every query may see itself, so padded queries never get an all-masked row (NaN-free hole slots).
        diag = torch.zeros(q, length, dtype=torch.bool, device=self.device)
        diag[:, length - q :] = torch.eye(q, dtype=torch.bool, device=self.device)
        full = allowed | diag
        neg = torch.finfo(self.dtype).min
        if self.kind == "full":
            return self._to_additive(full, neg)
        windowed = (allowed & (qpos.unsqueeze(2) - kv_pos.unsqueeze(1) < self.window)) | diag
        if self.kind == "window":
            return self._to_additive(windowed, neg)
        return {
            "full_attention": self._to_additive(full, neg),
            "sliding_attention": self._to_additive(windowed, neg),
        }

    def _to_additive(self, allowed: torch.Tensor, neg: float) -> torch.Tensor:
        m = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        return m.masked_fill_(~allowed, neg).unsqueeze(1)

    # ---------------------------------------------------------------- rollback / trimming
    def rollback(self, tail: int, keep: torch.Tensor) -> None:
        """Among the last `tail` columns keep only each row's first `keep[b]` valid slots."""
        if tail <= 0:
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
        used = self.valid.any(0)
        if self.batch_size == 0 or not bool(used.any()):
            self._set_cols(0, 0)
            return
        idx = used.nonzero().squeeze(1)
        start, end = int(idx[0]), int(idx[-1]) + 1
        if start > 0 or end < self.num_cols:
            self._set_cols(start, end)
        self.has_holes = not bool(self.valid.all())

    def _set_cols(self, start: int, end: int) -> None:
        self.valid = self.valid[:, start:end]
        self.pos = self.pos[:, start:end]
        if end <= start:
            self.cache = DynamicCache()
            self.has_holes = False
            return
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
                layer.keys = layer.keys[:, :, start:end]
                layer.values = layer.values[:, :, start:end]

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
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
                b, h, _, d = layer.keys.shape
                gi = idx.view(b, 1, new_len, 1).expand(b, h, new_len, d)
                layer.keys = layer.keys.gather(2, gi)
                layer.values = layer.values.gather(2, gi)
        self.has_holes = not bool(self.valid.all())

    def maybe_compact(self, max_hole_fraction: float = 0.3, min_cols: int = 8) -> None:
        if self.has_holes and self.num_cols >= min_cols and self.hole_fraction() > max_hole_fraction:
            self.compact()

    # ---------------------------------------------------------------- rows
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only rows `index` (in that order)."""
        self.valid = self.valid.index_select(0, index)
        self.pos = self.pos.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
        if self.num_cols == 0 or index.numel() == 0:
            self.cache = DynamicCache()
            self.valid = self.valid[:, :0]
            self.pos = self.pos[:, :0]
            self.has_holes = False
            return
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
                layer.keys = layer.keys.index_select(0, index)
                layer.values = layer.values.index_select(0, index)
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
        layers = []
        if length > 0:
            ref = ka if ka else kb
            for i in range(len(ref)):
                parts_k, parts_v = [], []
                for kv, n, l_own in ((ka, self.batch_size, la), (kb, other.batch_size, lb)):
                    k, v = (kv[i] if kv else (None, None))
                    rk, rv = ref[i]
                    if k is None:
                        k = rk.new_zeros(n, rk.shape[1], 0, rk.shape[3])
                        v = rv.new_zeros(n, rv.shape[1], 0, rv.shape[3])
                    pad = length - l_own
                    if pad:
                        k = torch.cat([k.new_zeros(n, k.shape[1], pad, k.shape[3]), k], dim=2)
                        v = torch.cat([v.new_zeros(n, v.shape[1], pad, v.shape[3]), v], dim=2)
                    parts_k.append(k)
                    parts_v.append(v)
                layers.append((torch.cat(parts_k, 0), torch.cat(parts_v, 0)))
        self.cache = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()

        def lpad(t: torch.Tensor, n: int, fill) -> torch.Tensor:
            return torch.cat([torch.full((t.shape[0], n), fill, dtype=t.dtype, device=t.device), t], 1) if n else t

        self.valid = torch.cat([lpad(self.valid, length - la, False), lpad(other.valid, length - lb, False)], 0)
        self.pos = torch.cat([lpad(self.pos, length - la, 0), lpad(other.pos, length - lb, 0)], 0)
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.has_holes = not bool(self.valid.all())


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for layer in cache.layers:
        if getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.numel() > 0:
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
) -> RaggedKV:
    """Build a RaggedKV for new rows holding `token_lists` (may be empty lists), left-padded, one forward."""
    kv = RaggedKV(config, len(token_lists), device=device, dtype=dtype)
    m = max((len(t) for t in token_lists), default=0)
    if m == 0:
        return kv
    ids = torch.zeros(len(token_lists), m, dtype=torch.long)
    valid = torch.zeros(len(token_lists), m, dtype=torch.bool)
    for i, t in enumerate(token_lists):
        if t:
            ids[i, m - len(t) :] = torch.tensor(t, dtype=torch.long)
            valid[i, m - len(t) :] = True
    kv.forward(fn, ids.to(kv.device), valid.to(kv.device), logits_to_keep=1)
    kv.trim()
    return kv
