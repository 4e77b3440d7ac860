"""Per-group LoRA adapters on one drafter, rows of many groups in one forward (issue 40).

Punica's and S-LoRA's batched adapters on a small CPU batch's terms: every resident adapter's A matrices sit side
by side, [in, S * R] for S adapters of R columns, so a forward multiplies all its rows by all of them in one GEMM,
keeps each row's own R columns (a mask; a row of no group keeps none) and multiplies by the stacked B [S * R, out]
in a second GEMM. Two GEMMs and a multiply per projection whatever the mix of groups; splitting the batch by group
would run a whole forward per group. The fused projections of `dvi.decode.lean` (q/k/v, gate/up) take their
modules' A side by side and their B block-diagonally, the LoRA scale folded into B.

Only the drafter reads these: a draft from any adapter is judged by the target, so output stays lossless.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["FUSED", "AdapterBank", "LoraFactors", "RowAdapters"]

FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
"""The lean forward's projections and the HF modules fused into each, in their order."""

_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraFactors:
    """One adapter in the lean forward's layout: per layer, per fused projection, (A [in, R], B [R, out]) with the
    LoRA scale folded into B; a projection none of whose modules is adapted is absent."""

    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def from_peft(cls, state: Mapping[str, torch.Tensor], scale: float, out_sizes: Mapping[str, int],
                  num_layers: int) -> LoraFactors:
        """From a peft LoRA state dict (`get_peft_model_state_dict`'s keys) of a Llama-family drafter with
        `num_layers` layers; `out_sizes` the output rows of each HF projection module (q_proj, k_proj, ...)."""
        mods: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for k, v in state.items():
            m = _KEY.search(k)
            if m is None:
                raise ValueError(f"LoRA tensor {k!r} is not a projection of a Llama-family decoder layer")
            mods.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = v.detach().float()
        for (layer, name), ab in mods.items():
            if layer >= num_layers or name not in out_sizes or set(ab) != {"A", "B"}:
                raise ValueError(f"LoRA tensors for layer {layer} {name} do not fit the drafter "
                                 f"({num_layers} layers; A and B both needed)")
        layers = []
        for i in range(num_layers):
            fused = {}
            for proj, names in FUSED.items():
                parts = [(n, mods.get((i, n))) for n in names]
                if all(p is None for _, p in parts):
                    continue
                fused[proj] = _fuse(parts, out_sizes, scale)
            layers.append(fused)
        return cls(layers)


def _fuse(parts: Sequence[tuple[str, dict[str, torch.Tensor] | None]], out_sizes: Mapping[str, int],
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A side by side [in, sum r], B block-diagonal [sum r, sum out] (a module without LoRA: zero columns)."""
    a_cols = [ab["A"].t() for _, ab in parts if ab is not None]
    rank = sum(x.shape[1] for x in a_cols)
    b = torch.zeros(rank, sum(out_sizes[n] for n, _ in parts))
    r0 = c0 = 0
    for n, ab in parts:
        if ab is not None:
            r = ab["A"].shape[0]
            if ab["B"].shape != (out_sizes[n], r):
                raise ValueError(f"LoRA B of {n} has shape {tuple(ab['B'].shape)}, expected {(out_sizes[n], r)}")
            b[r0 : r0 + r, c0 : c0 + out_sizes[n]] = ab["B"].t() * scale
            r0 += r
        c0 += out_sizes[n]
    return torch.cat(a_cols, 1), b


class RowAdapters:
    """One forward's rows and the adapter slot each reads (-1: none), over a bank's stacked factors."""

    def __init__(self, stacked: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]], slots: torch.Tensor,
                 dtype: torch.dtype):
        self.stacked = stacked
        self.slots = slots  # [B]
        self.dtype = dtype
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def add(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + each row's own adapter's delta on x [N, in] (N = rows x positions, rows in order)."""
        entry = self.stacked[layer].get(proj)
        if entry is None:
            return y
        a, b, r = entry
        mask = self._mask(x.shape[0], r, a.shape[1])
        return torch.addmm(y, (x @ a).mul_(mask), b)

    def _mask(self, n: int, r: int, width: int) -> torch.Tensor:
        key = (n, r)
        m = self._masks.get(key)
        if m is None:
            per_token = self.slots.repeat_interleave(n // self.slots.numel())  # [N]
            cols = torch.arange(width, device=self.slots.device) // r  # the slot each column belongs to
            m = self._masks[key] = (cols.view(1, -1) == per_token.view(-1, 1)).to(self.dtype)
        return m


class AdapterBank:
    """The resident adapters of one drafter, by group, stacked for `RowAdapters` (rebuilt when one changes)."""

    def __init__(self, num_layers: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.dtype, self.device = num_layers, dtype, torch.device(device)
        self.groups: dict[str, LoraFactors] = {}
        self._slot: dict[str, int] = {}
        self._stacked: list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]] = []

    def set(self, group: str, factors: LoraFactors | None) -> None:
        """Serve `factors` for `group`'s rows (None: its rows draft with the base again)."""
        if factors is None:
            self.groups.pop(group, None)
        else:
            if len(factors.layers) != self.num_layers:
                raise ValueError(f"an adapter of {len(factors.layers)} layers for a drafter of {self.num_layers}")
            self.groups[group] = factors
        self._restack()

    def _restack(self) -> None:
        order = sorted(self.groups)
        self._slot = {g: i for i, g in enumerate(order)}
        self._stacked = []
        for i in range(self.num_layers):
            layer = {}
            for proj in FUSED:
                have = [self.groups[g].layers[i].get(proj) for g in order]
                if all(h is None for h in have):
                    continue
                ref = next(h for h in have if h is not None)
                r = max(h[0].shape[1] for h in have if h is not None)
                a = torch.zeros(ref[0].shape[0], r * len(order))
                b = torch.zeros(r * len(order), ref[1].shape[1])
                for s, h in enumerate(have):
                    if h is not None:
                        a[:, s * r : s * r + h[0].shape[1]] = h[0]
                        b[s * r : s * r + h[1].shape[0]] = h[1]
                layer[proj] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype), r)
            self._stacked.append(layer)

    def rows(self, groups: Sequence[str]) -> RowAdapters | None:
        """The adapters of a batch whose row i belongs to `groups[i]`; None when no row's group has one."""
        slots = [self._slot.get(g, -1) for g in groups]
        if not self._slot or max(slots, default=-1) < 0:
            return None
        return RowAdapters(self._stacked, torch.tensor(slots, dtype=torch.long, device=self.device), self.dtype)


def projection_sizes(model: torch.nn.Module) -> dict[str, int]:
    """Output rows of each projection module of a Llama-family model's first decoder layer (q_proj, k_proj, ...)."""
    layer = model.model.layers[0]
    return {n: int(getattr(part, n).out_features) for part in (layer.self_attn, layer.mlp) for names in FUSED.values()
            for n in names if hasattr(part, n)}
