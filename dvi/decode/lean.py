"""A Llama-family decoder's forward as plain tensor functions over a static per-slot KV cache.

HF's module forward dispatches about 60 aten ops per layer per step (norms in five ops, RoPE through
`rotate_half`, three projections, a cache that concatenates); on a GPU every op is a launch and on a CPU a few
microseconds of host work, which for a small target is most of a step. Here a layer is about 27 ops: the
q/k/v and gate/up projections are one matmul each (the HF modules' weights become views into the fused
tensors, so in-place weight updates reach both), RoPE is applied to the whole fused q/k/v row at once (v rows
pass through with cos 1 and sin 0, exactly), and one `index_put_` writes a step's keys and values.

The cache (`SlotCache`) is one tensor per model, [layers, slots, capacity, 2, kv_heads, head_dim]: batch row
i lives in slot i with its tokens at positions 0..length-1. A forward writes its q new entries at
length..length+q-1; `SlotCache.advance` then keeps n of them, so a rejected draft is overwritten later: no
holes, no validity masks, no compaction, and every shape depends only on (rows, q, capacity).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dvi.decode.attention import Attention, attend_real, kernel_plan
from dvi.decode.attention_kernel import AttentionKernel
from dvi.decode.cpu_paths import HEAD_BLOCK, NO_PACKS, blockwise, head_block_rows, pack_plan, packed_linear
from dvi.decode.lean_layer import layer_math
from dvi.decode.numerics import cpu_flags
from dvi.decode.segments import NO_RUNS, Runs, attend_segments
from dvi.decode.slot_cache import SlotCache

if TYPE_CHECKING:
    from dvi.decode.rows_kernel import Panels, RowsKernel

__all__ = ["LEAN_TYPES", "lean_supported", "LeanModel", "SlotCache"]

LEAN_TYPES = {"llama", "qwen2", "qwen3", "mistral"}
"""Architectures `LeanModel` runs (a Llama decoder layer, optionally with q/k biases or per-head q/k norms)."""


def lean_supported(model: nn.Module) -> str | None:
    """None when `LeanModel(model)` can run it, else why not (the engine then uses HF's module forward)."""
    cfg, base = model.config, getattr(model, "model", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in LEAN_TYPES:
        return f"model_type {model_type!r} is not one of {sorted(LEAN_TYPES)}"
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return "not a decoder with embed_tokens / rotary_emb / layers / norm"
    if not hasattr(model, "lm_head"):
        return "no lm_head"
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    window = getattr(cfg, "sliding_window", None)
    if types != {"full_attention"} or (window and not getattr(cfg, "layer_types", None)):
        return "sliding-window attention"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope"):
        return f"rope_type {rope!r} depends on the sequence length"
    layer = base.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None or not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "unexpected decoder layer"
    if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
        return "unexpected MLP"
    if any(type(m) is not nn.Linear for layer in base.layers for m in (
            layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
            layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
        return "projections that are not plain nn.Linear (LoRA adapters not merged?)"
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"activation {act!r} (silu expected)"
    return None


def _fuse(mods: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight [sum(out), in] (and bias) for `mods`, whose own Parameters become views of it: an in-place
    update of either (load_state_dict, an optimizer, `update_target_weights`) is seen by both."""
    w = torch.cat([m.weight.detach() for m in mods])
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight.data = w[off : off + n]
        off += n
    if all(m.bias is None for m in mods):
        return w, None
    b = torch.cat([m.bias.detach() if m.bias is not None else w.new_zeros(m.weight.shape[0]) for m in mods])
    off = 0
    for m in mods:
        n = m.weight.shape[0]
        if m.bias is not None:
            m.bias.data = b[off : off + n]
        off += n
    return w, b


class _Layer:
    """One decoder layer's tensors, fused."""

    __slots__ = ("ln_in", "qkv", "qkv_bias", "o", "ln_post", "gate_up", "down", "q_norm", "k_norm")

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln_in = layer.input_layernorm.weight
        self.qkv, self.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.ln_post = attn.o_proj.weight, layer.post_attention_layernorm.weight
        self.gate_up, self.down = _fuse([mlp.gate_proj, mlp.up_proj])[0], mlp.down_proj.weight
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm, self.k_norm = (qn.weight if qn is not None else None), (kn.weight if kn is not None else None)


class LeanModel:
    """The forward of a Llama-family causal LM (`lean_supported`) over a `SlotCache`, in ~27 aten ops a layer.

    `forward(cache, ids, start)` scores ids [B, q] placed at positions start[b]..start[b]+q-1 of rows 0..B-1,
    writing their keys and values; attention sees, for the query at position p, the row's columns 0..p. It
    returns logits [B, q or keep, V] and, with `features`, the final normed hidden states [B, q, H]."""

    def __init__(self, model: nn.Module):
        why = lean_supported(model)
        if why is not None:
            raise ValueError(f"lean forward: {why}")
        cfg, base = model.config, model.model
        self.config = cfg
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.layers = [_Layer(layer) for layer in base.layers[: cfg.num_hidden_layers]]
        attn = base.layers[0].self_attn
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads)
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        self.eps = float(cfg.rms_norm_eps)
        self.hidden = int(cfg.hidden_size)
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        head = model.lm_head
        self.head = head.weight
        # a plain Linear runs as F.linear; anything else (a reduced draft vocabulary's SubsetHead) as itself
        self.head_module = None if type(head) is nn.Linear and head.bias is None else head
        # On a CPU a GEMM of a few rows may pack the whole LM head first (MKL, fp32), where blocks of HEAD_BLOCK rows
        # are packed while in cache (views, no copy; the same logits to rounding): from how many rows is measured once
        big = self.head.device.type == "cpu" and self.head.shape[0] >= 4 * HEAD_BLOCK
        self.head_blocks = self.head.split(HEAD_BLOCK) if big and self.head_module is None else None
        # from how many rows the head runs blockwise (None: never); measured on first use (`head_path`)
        self.head_block_rows: int | None = None
        self._head_unmeasured = self.head_blocks is not None
        # oneDNN-prepacked copies of the layer and head weights for forwards of more than one row (`pack_multirow`)
        self.packs: list[tuple[torch.Tensor, ...]] | None = None
        self._pack_of: dict[int, torch.Tensor] = {}  # a layer weight's data_ptr -> its pack (`linear`)
        self.head_pack: torch.Tensor | None = None
        self.pack_plan = NO_PACKS
        # forwards of up to this many rows run every matmul through dvi's rows kernel (`use_rows_kernel`; 0: never)
        self.kernel_rows = 0
        self.kernel: RowsKernel | None = None
        # its elementwise calls (norms, SwiGLU, RoPE) where it loaded, whatever matmuls it serves (`layer_math`)
        self.elementwise: RowsKernel | None = None
        self._panels_of: dict[int, Panels] = {}  # a layer weight's data_ptr -> the kernel's packed copy (`linear`)
        self.head_panels, self.head_bias = None, None  # the head's; a reduced draft vocabulary's bias rows beside
        # every forward's attention, each query over its own slot's columns, through dvi's attention kernel
        # (`dvi.decode.attention_kernel`, switched on with the rows kernel: `use_rows_kernel`); None: torch's SDPA
        self.attn_kernel: AttentionKernel | None = None
        # a one-row folded forward (a verify whose rows must round like lone steps) runs its matmuls in pieces of at
        # most this many rows where wider GEMMs round rows apart (`dvi.decode.invariance`; None: whole; not prefills)
        self.row_chunk: int | None = None
        self.max_position = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        # what `features` returns: None, the final normed hidden state [.., H] (what the LM head multiplies); or
        # the residual stream after each listed layer, concatenated [.., len * H] (EAGLE-3's low / mid / high)
        self.feature_layers: tuple[int, ...] | None = None
        # per-row LoRA adapters of the rows the next forwards score (`dvi.drafters.adapters.RowAdapters`, set by a
        # drafter's cache before each step's forwards; None: the plain weights)
        self.adapters = None
        self.rotary = base.rotary_emb
        self.cos = self.sin = torch.zeros(0, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self._rope_tables(256)

    @torch.inference_mode()
    def pack_multirow(self, rows: int = 8) -> bool:
        """Forwards through oneDNN on weights reordered once (`dvi.decode.cpu_paths.pack_plan`: fp32's multi-row
        forwards, a verify's cost then growing slower with its width; bf16's every forward on an AMX CPU). Costs a
        second copy of the target's weights; False where no plan packs (nothing packed)."""
        plan = pack_plan(self.device, self.dtype, rows, cpu_flags())
        if plan is None:
            return False
        pack = torch.ops.mkldnn._reorder_linear_weight
        self._pack_rows, self.pack_plan, rows = rows, plan, plan.rows
        self.packs = [(pack(lw.qkv, rows), pack(lw.o, rows), pack(lw.gate_up, rows), pack(lw.down, rows))
                      for lw in self.layers]
        self._pack_of = {w.data_ptr(): p for lw, ps in zip(self.layers, self.packs, strict=True)
                         for w, p in zip((lw.qkv, lw.o, lw.gate_up, lw.down), ps, strict=True)}
        self.head_pack = pack(self.head, rows) if self.head_module is None else None
        return True

    @torch.inference_mode()
    def use_rows_kernel(self, rows: int | None = None) -> int:
        """Forwards of up to `rows` rows (None: as many as `kernel_rows_measured` finds it faster for) through
        dvi's rows kernel for the model's dtype (`dvi.decode.rows_kernel`: fp32, or bf16 on an AVX512-BF16 CPU) on a
        packed copy of the weights. Where it wins at every probed row count, oneDNN's packs (`pack_multirow`) are
        dropped: the kernel serves what they served, and torch's GEMM the widest prefills, so the target's weights
        are held twice, not three times. Its elementwise calls serve the forwards whose matmuls it does not
        (`lean_layer.KernelMath`). On a CPU where it builds only; returns the rows it serves (0: none)."""
        from dvi.decode.rows_kernel import EVERY_ROW, KERNEL_PROBE_ROWS, kernel_rows_measured, load

        self.kernel, self._panels_of, self.head_panels, self.kernel_rows, self.attn_kernel = None, {}, None, 0, None
        self.elementwise = None
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) or rows == 0:
            return 0
        self._use_attention_kernel()
        self.kernel = self.elementwise = load(self.dtype)
        if self.kernel is None:
            return 0
        try:  # packing checks each weight, and the copy's alignment
            self.kernel.check_weights(self.head)
            head = self._head_weight()
            matrices = list(self._matrices())
            panels = self.kernel.pack_all(matrices + ([head[0]] if head is not None else []))
            self._panels_of = {w.data_ptr(): p for w, p in zip(matrices, panels[:len(matrices)], strict=True)}
            self.head_panels, self.head_bias = (panels[-1], head[1]) if head is not None else (None, None)
        except ValueError as e:  # torch's kernels serve what the kernel cannot take
            self.kernel, self._panels_of, self.head_panels = None, {}, None
            logging.getLogger(__name__).info("rows kernel not used: %s", e)
            return 0
        self.kernel_rows = kernel_rows_measured(self) if rows is None else max(0, int(rows))
        if rows is None and self.pack_plan.alike and self.kernel_rows != EVERY_ROW:  # one path every forward, rows alike
            self.kernel_rows = 0
        if not self.kernel_rows:
            self.kernel, self._panels_of, self.head_panels = None, {}, None
        elif rows is None and self.kernel_rows >= KERNEL_PROBE_ROWS[-1] and self.packs is not None:
            self.packs, self._pack_of, self.head_pack, self.pack_plan = None, {}, None, NO_PACKS
            logging.getLogger(__name__).info("oneDNN's packed weights dropped: the rows kernel serves their forwards")
        return self.kernel_rows

    def _use_attention_kernel(self) -> None:
        from dvi.decode import attention_kernel

        kernel = attention_kernel.load()
        why = kernel and kernel.supports(self.dtype, self.heads, self.kv_heads, self.head_dim)
        if why:
            logging.getLogger(__name__).info("attention kernel not used: it does not attend %s", why)
        self.attn_kernel = None if why else kernel

    def repack(self) -> None:
        """New weights were loaded in place (a target update): the packed copies are remade from them, else the
        forwards would go on computing with the old target; the start-up check's verdict on them stands."""
        if self.packs is not None:
            plan, _ = self.pack_plan, self.pack_multirow(self._pack_rows)
            self.pack_plan = plan
        if self._panels_of:
            for w in self._matrices():
                self._panels_of[w.data_ptr()].refill(w)
        if self.head_panels is not None:
            self.head_panels.refill(self._head_weight()[0])
            self.head_bias = self._head_weight()[1]

    def _head_weight(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The weight (and bias) the LM head multiplies: the plain head's, a reduced draft vocabulary's rows
        (`dvi.drafters.vocab.SubsetHead`, placed into the full vocabulary after), or None (another module serves)."""
        if self.head_module is None:
            return self.head, None
        subset = getattr(self.head_module, "subset_weight", None)
        return subset() if subset is not None else None

    def _matrices(self) -> list[torch.Tensor]:
        """The layers' weights the forward multiplies through `linear`, in order."""
        return [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    @torch.inference_mode()
    def _rope_tables(self, positions: int) -> None:
        """Per position, cos and sign-folded sin for the whole fused q/k/v row [P, (heads + 2 kv_heads) * D]
        (q and k heads rotate, v heads get cos 1 and sin 0), exactly as HF's rotary embedding computes them (its
        own module, on all positions at once); grown by doubling as contexts get longer."""
        positions = min(max(positions, 2 * self.cos.shape[0]), self.max_position)
        pos = torch.arange(positions, device=self.device).unsqueeze(0)
        probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)  # [1, P, D]
        half, d, rot = self.head_dim // 2, self.head_dim, self.heads + self.kv_heads
        sign = torch.cat([-torch.ones(half, device=sin.device), torch.ones(d - half, device=sin.device)]).to(sin)
        sin = sin[0] * sign  # rotate_half(x) * sin == flip_halves(x) * (sign * sin), exactly
        ones, zeros = torch.ones_like(sin), torch.zeros_like(sin)
        self.cos = torch.cat([cos[0].repeat(1, rot), ones.repeat(1, self.kv_heads)], 1).contiguous()
        self.sin = torch.cat([sin.repeat(1, rot), zeros.repeat(1, self.kv_heads)], 1).contiguous()

    def new_cache(self, slots: int = 1, capacity: int = 256) -> SlotCache:
        return SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device, slots, capacity)

    def _rope(self, pos: torch.Tensor, n: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [N, heads + 2 kv_heads, 2, D / 2] for positions `pos` [N] (`last`: the largest)."""
        last = min(last, self.max_position - 1)  # positions are clamped there: a table never needs more rows
        if last >= self.cos.shape[0]:
            self._rope_tables(last + 1)
        shape = (n, self.heads + 2 * self.kv_heads, 2, self.head_dim // 2)
        return self.cos.index_select(0, pos).view(shape), self.sin.index_select(0, pos).view(shape)

    @torch.no_grad()
    def forward(self, cache: SlotCache, ids: torch.Tensor, start: torch.Tensor, attn: Attention,
                logits_to_keep: int = 0, features: bool = False, first_slot: int = 0,
                pick: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """ids [B, q] at columns start[b] + j of slots first_slot..first_slot+B-1, attending as `attn` says;
        logits [B, q or logits_to_keep, V] (and the final normed hidden states [B, q, H] with `features`), or
        with `pick` [B] only row b's position pick[b]: logits [B, V] (in a ragged forward, pick[b] indexes the scored
        positions). A draft tree's nodes (`attn.depth` [B, q]) are rotated at positions start[b] + depth[b, j], not
        at their columns. A ragged verify's `attn.real` [M]: the flat indices (b * q + j) of the positions to score,
        in order; only they run through the projections and write keys and values, the others come back as zero
        logits (no features). `attn.runs`: some rows' tokens
        before or after their ids in this same forward (`dvi.decode.segments.Runs`, which says what comes back)."""
        b, q = ids.shape
        runs = attn.runs or NO_RUNS
        _refuse(attn, q, features, logits_to_keep, pick, runs)
        tails, real = runs.tails, attn.real
        heads, kvh, d = self.heads, self.kv_heads, self.head_dim
        flat, col, pos, slot = self._placement(ids, start, attn, first_slot, real)
        n_batch, columns = flat.shape[0], attn.columns
        (flat, col, pos, slot), columns, segments = runs.place(cache, (flat, col, pos, slot), columns)
        n = flat.shape[0]
        cos, sin = self._rope(pos.clamp(max=self.max_position - 1), n, columns)
        attend = self._attend(cache, attn, (b, q, first_slot, n_batch, columns), (col, slot), real, segments)
        x = F.embedding(flat, self.embed)  # [N, H]
        taps = self.feature_layers if features else None
        tapped = []
        lin, chunk = self._matmuls(n, b, attn.groups is not None and not segments, runs.pieces(n))
        ad = self.adapters
        mm = layer_math(self.kernel, self.elementwise, self._panels_of, lin, self.hidden, self.eps, ad,
                        self._fused_rows(n, chunk))
        for i, lw in enumerate(self.layers):
            qkv = mm.normed(x, lw.ln_in, lw.qkv, lw.qkv_bias, i, "qkv").view(n, heads + 2 * kvh, 2, d // 2)
            if lw.q_norm is not None:
                qkv = torch.cat([F.rms_norm(qkv[:, :heads].reshape(n, heads, d), (d,), lw.q_norm, self.eps),
                                 F.rms_norm(qkv[:, heads : heads + kvh].reshape(n, kvh, d), (d,), lw.k_norm, self.eps),
                                 qkv[:, heads + kvh :].reshape(n, kvh, d)], 1).view(n, heads + 2 * kvh, 2, d // 2)
            qkv = mm.rope_store(qkv, cos, sin, cache.per_layer[i], slot, col, heads)
            runs.copy(cache.per_layer[i])
            x = mm.added(x, attend(qkv[:, :heads], i), lw.o, i, "o")
            x = mm.swiglu_added(x, mm.normed(x, lw.ln_post, lw.gate_up, None, i, "gate_up"), lw.down, i, "down")
            if taps and i in taps:
                tapped.append(x)
        if tails is not None:  # the batch's ids and the tails (the prefixes' outputs are not asked for)
            return self._real_logits(x[: n_batch + tails.positions], tails.placed(b, self.device), b, tails.width)
        if segments:
            x = x[:n_batch]  # the prefixes' outputs are not asked for
        if real is not None:
            if pick is not None:  # [B] indices into the M scored positions: row b's logits [B, V]
                return self._logits(F.rms_norm(x.index_select(0, pick), (self.hidden,), self.norm, self.eps))
            return self._real_logits(x, real, b, q)
        return self._outputs(x, b, q, logits_to_keep, features, pick, tapped, chunk)

    def _fused_rows(self, n: int, chunk: int | None) -> bool:
        """The fused calls serve n rows where the kernel serves each matmul, or a one-request verify's pieces (`row_chunk`:
        each row from its own row alone, so whole it has a step's bits, its bf16 norms rounded as a step's too)."""
        return n <= self.kernel_rows or (chunk is not None and 0 < chunk <= self.kernel_rows)

    def _attend(self, cache: SlotCache, attn: Attention, shape: tuple[int, int, int, int, int],
                placed: tuple[torch.Tensor, torch.Tensor], real: torch.Tensor | None,
                segments: list) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """This forward's attention, (every position's queries [n, heads, ...], layer) -> [n, heads * D]: the attention
        kernel where it serves and can say which columns each query sees (then every query, a batch row's, a
        joining prompt's or a tail's, is computed alone, alike whatever else the forward carries), else SDPA calls:
        `attn`'s for the batch's rows (a ragged forward's scored queries placed among the others), one per run.
        shape: (B, q, first slot, the batch's positions, the columns the forward reaches); placed: every position's
        cache column and slot."""
        b, q, first_slot, n_batch, columns = shape
        plan = kernel_plan(attn, q, first_slot, *placed) if self.attn_kernel else None
        if plan is not None:
            kk, kv = cache.views(int(plan.rows.max()) + 1 if plan.rows.numel() else 1, columns)
            return lambda qrows, i: self.attn_kernel.attend(qrows.flatten(2), kk[i], kv[i], plan, self.scale)
        keys, values = cache.views(b, attn.columns, first_slot)

        def sdpa(qrows: torch.Tensor, i: int) -> torch.Tensor:
            rows = qrows[:n_batch]
            o = attn.attend(rows, b, keys[i], values[i], self.scale) if real is None else \
                attend_real(attn, rows, real, b * q, b, keys[i], values[i], self.scale)
            return torch.cat([o, *attend_segments(qrows[n_batch:], segments, i, self.scale)]) if segments else o
        return sdpa

    def _matmuls(self, n: int, b: int, folded: bool, pieces: list[int] | None = None) -> tuple:
        """A forward of n rows' linear, and the pieces a one-row folded forward runs its matmuls in (`row_chunk`; None:
        whole). `pieces`: row counts the matmuls run in instead (each prefix its own, `Runs.pieces`). Each piece takes
        the kernel its own row count takes (`linear`)."""
        if pieces is not None:
            return partial(_in_pieces, self.linear, pieces), None
        rc = self.row_chunk
        chunk = rc if rc and b == 1 and n > rc and folded else None
        return (partial(_in_pieces, self.linear, chunk) if chunk else self.linear), chunk

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [m, in] through one of the layers' weights w as a forward runs it: the rows kernel up to `kernel_rows`
        rows, oneDNN's pack of w (`pack_multirow`) past one row, else F.linear (MKL's GEMV for one row)."""
        m = x.shape[0]
        if m <= self.kernel_rows:
            return self.kernel.rows(x, self._panels_of[w.data_ptr()], bias)
        if m >= self.pack_plan.from_rows and self._pack_of:
            return packed_linear(x, self._pack_of[w.data_ptr()], bias, self.pack_plan.alike)
        return F.linear(x, w, bias)

    def _placement(self, ids: torch.Tensor, start: torch.Tensor, attn: Attention, first_slot: int,
                   real: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Per scored position (all B * q, or the `real` ones): its token, cache column, rotary position, slot."""
        b, q = ids.shape
        n = b * q
        col = (start.view(b, 1) + torch.arange(q, device=self.device)).view(n)  # [N] cache columns
        pos = col if attn.depth is None else (start.view(b, 1) + attn.depth).view(n)  # [N] positions
        if b > 1:
            slot = torch.arange(first_slot, first_slot + b, device=self.device).repeat_interleave(q)
        else:
            slot = torch.full_like(col, first_slot)
        flat = ids.reshape(n)
        if real is None:
            return flat, col, pos, slot
        return flat[real], col[real], pos[real], slot[real]

    def _outputs(self, x: torch.Tensor, b: int, q: int, logits_to_keep: int, features: bool,
                 pick: torch.Tensor | None, tapped: list[torch.Tensor],
                 chunk: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        n = b * q
        if chunk:  # the head too, in pieces (`row_chunk`)
            def head(f: torch.Tensor) -> torch.Tensor:
                flat = f.reshape(-1, f.shape[-1])
                return torch.cat([self._logits(p) for p in flat.split(chunk)]).view(*f.shape[:-1], -1)
        else:
            head = self._logits
        x = x.view(b, q, self.hidden)
        if pick is not None:
            x = x.view(n, self.hidden).index_select(0, pick + torch.arange(0, n, q, device=self.device))
            return head(F.rms_norm(x, (self.hidden,), self.norm, self.eps))
        if logits_to_keep and not features:
            x = x[:, -logits_to_keep:]
        f = F.rms_norm(x, (self.hidden,), self.norm, self.eps)
        if tapped:
            return head(f[:, -logits_to_keep:] if logits_to_keep else f), torch.cat(tapped, -1).view(b, q, -1)
        return (head(f[:, -logits_to_keep:] if logits_to_keep else f), f) if features else \
            head(f[:, -logits_to_keep:] if logits_to_keep else f)

    def _real_logits(self, x: torch.Tensor, real: torch.Tensor, b: int, q: int) -> torch.Tensor:
        """A ragged forward's logits for its M scored positions x [M, H], placed at their flat indices of [B, q];
        unscored positions are left unset (the acceptance rules read a row's positions up to its drafts only,
        `dvi.decode.sampling.real_positions`): zeroing B x q vocabulary rows cost more than the M scored ones where
        one row of many drafted deep."""
        logits = self._logits(F.rms_norm(x, (self.hidden,), self.norm, self.eps))
        out = logits.new_empty(b * q, logits.shape[-1])
        return out.index_copy_(0, real, logits).view(b, q, -1)

    def _logits(self, f: torch.Tensor) -> torch.Tensor:
        if f.numel() <= self.kernel_rows * f.shape[-1] and self.head_panels is not None:
            if self.head_module is None:
                return self.kernel.rows(f.reshape(-1, f.shape[-1]), self.head_panels).view(*f.shape[:-1], -1)
            sub = self.kernel.rows(f.reshape(-1, f.shape[-1]), self.head_panels, self.head_bias)
            return self.head_module.placed(sub.view(*f.shape[:-1], -1))
        if self.head_module is not None:
            return self.head_module(f)
        if self.head_pack is not None and f.numel() >= self.pack_plan.from_rows * f.shape[-1]:
            return packed_linear(f, self.head_pack, None, self.pack_plan.alike)
        if self.head_blocks is not None and f.numel() > f.shape[-1]:
            rows = self.head_path()
            if rows is not None and f.numel() >= rows * f.shape[-1]:
                return blockwise(f, self.head_blocks)
        return F.linear(f, self.head)

    def head_path(self) -> int | None:
        """`head_block_rows`, timed once on first use: by the start-up invariance probe of a served target, whose
        verdict (`dvi.decode.invariance`) is then that of the path chosen."""
        if self._head_unmeasured:
            self._head_unmeasured = False
            self.head_block_rows = head_block_rows(self.head, self.head_blocks)
        return self.head_block_rows


def _refuse(attn: Attention, q: int, features: bool, logits_to_keep: int, pick: torch.Tensor | None,
            runs: Runs) -> None:
    """`LeanModel.forward`'s combinations that it does not compute, said plainly."""
    if attn.real is not None and (features or logits_to_keep):
        raise ValueError("a ragged forward returns logits of every position, or with `pick` of some")
    if runs and (features or attn.depth is not None):
        raise ValueError("prefixes and tails ride on a chain's forward without features")
    if runs.tails is not None and (q != 1 or attn.real is not None or pick is not None or logits_to_keep):
        raise ValueError("tails follow a one-token step's ids and come back whole")


def _in_pieces(lin: Any, rows: int | list[int], x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               ) -> torch.Tensor:
    """`lin(x, w, bias)` over x's rows in pieces of at most `rows` (`LeanModel.row_chunk`), or of the listed sizes."""
    return torch.cat([lin(p, w, bias) for p in x.split(rows)])

