"""How a forward's queries attend over a `dvi.decode.lean.SlotCache`: one SDPA call for a batch (`one_call`), or
every query as its own batch element with a bucketed column count (`per_query`, the folded groups), so a verify row
rounds like the 1-token step it stands for. On a CPU the heads that share a kv head are folded into query rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dvi.decode.attention_kernel import KernelPlan, prefix_plan

__all__ = ["Attention", "BUCKET", "attend_real", "bucket_columns", "folded_groups", "kernel_plan", "one_call", "per_query"]


class Attention:
    """How one forward attends; the same for every layer, so it is decided once per forward.

    `single`: one SDPA call for all queries over the first `columns` positions with `mask` [B, 1, q, columns]
    (None: all visible; `causal`: a prefill over an empty row). `folded` (`groups`): every query is its own
    batch element with exactly `bucket_columns(p)` columns and the mask col <= p, so a query's arithmetic is
    the same whatever else the forward scores: a verify row rounds like the 1-token step at its position
    (SDPA's kernels round a query differently with the number of queries beside it, and with the number of
    masked columns after its own)."""

    __slots__ = ("columns", "mask", "causal", "groups", "real", "runs")
    depth = None  # a chain's queries sit at their columns (a draft tree's: `dvi.decode.tree_attention`)

    def __init__(self, columns: int, mask: torch.Tensor | None = None, causal: bool = False,
                 groups: list[tuple[int, int, int, int, torch.Tensor]] | None = None, real: torch.Tensor | None = None):
        self.columns, self.mask, self.causal, self.groups = columns, mask, causal, groups
        self.real = real  # [M] the flat positions (b * q + j) a ragged forward scores; None: all of them
        self.runs = None  # some rows' tokens beside the batch's, each over its own row (`dvi.decode.segments.Runs`)

    def attend(self, qrows: torch.Tensor, b: int, keys: torch.Tensor, values: torch.Tensor, scale: float,
               ) -> torch.Tensor:
        """Queries qrows [B * q, heads, ...] (rows in (b, j) order, head_dim elements each) over keys / values
        [B, kv_heads, columns, D] -> [B * q, heads * D]."""
        n, heads = qrows.shape[0], qrows.shape[1]
        q, d = n // b, keys.shape[3]
        if self.groups is None:
            return one_call(qrows, b, keys, values, self.mask, scale, self.causal)
        qf = qrows.view(n, heads, 1, d)  # every query its own batch element
        if b == 1 and len(self.groups) == 1:  # one row, one bucket: no slicing (every step of one request)
            mask = self.groups[0][4]
            kf, vf = (keys.expand(n, -1, -1, -1), values.expand(n, -1, -1, -1)) if n > 1 else (keys, values)
            return per_query(qf, kf, vf, mask, scale).view(n, heads * d)
        outs = []
        for row, j0, j1, length, mask in self.groups:  # queries j0..j1-1 of batch row `row`, `length` columns
            m = j1 - j0
            kf = keys[row : row + 1, :, :length].expand(m, -1, -1, -1)
            vf = values[row : row + 1, :, :length].expand(m, -1, -1, -1)
            outs.append(per_query(qf[row * q + j0 : row * q + j1], kf, vf, mask, scale))
        return torch.cat(outs).view(n, heads * d)


def per_query(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries qf [m, heads, 1, D], each its own batch element, over kf / vf [m, kv_heads, length, D]. On a CPU the
    heads sharing a kv head become that element's query rows (a fixed count per query, so a query still rounds
    alike whatever else the forward scores; see `one_call` for why)."""
    m, heads, d = qf.shape[0], qf.shape[1], qf.shape[3]
    kvh = kf.shape[1]
    if heads == kvh or kf.device.type != "cpu":
        return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, scale=scale, enable_gqa=heads != kvh)
    o = F.scaled_dot_product_attention(qf.reshape(m, kvh, heads // kvh, d), kf, vf, attn_mask=mask, scale=scale)
    return o.reshape(m, heads, 1, d)


def one_call(qrows: torch.Tensor, b: int, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
             scale: float, causal: bool = False) -> torch.Tensor:
    """All queries qrows [B * q, heads, ...] in one SDPA call over keys / values [B, kv_heads, columns, D] with
    `mask` [B, 1, q, columns] -> [B * q, heads * D]. On a CPU, grouped-query heads are folded into the query rows
    (the heads sharing a kv head become rows of one [B, kv_heads, group * q, D] call, as FlashDecoding does): SDPA's
    CPU kernels run `enable_gqa` with one query a row far below their rate for the folded shape (bf16 most of all).
    A causal call (a prefill) keeps its row order and is not folded."""
    n, heads = qrows.shape[0], qrows.shape[1]
    q, kvh, d = n // b, keys.shape[1], keys.shape[3]
    if heads == kvh or causal or keys.device.type != "cpu":
        qh = qrows.view(b, q, heads, d).transpose(1, 2)  # [B, heads, q, D]
        o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=heads != kvh)
        return o.transpose(1, 2).reshape(n, heads * d)
    g = heads // kvh  # query head h reads kv head h // g
    qh = qrows.view(b, q, kvh, g, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, g * q, d)  # rows (head in group, query)
    m = None if mask is None else mask.repeat(1, 1, g, 1)  # [B, 1, g * q, columns]: row r is query r % q
    o = F.scaled_dot_product_attention(qh, keys, values, attn_mask=m, scale=scale)  # [B, kv_heads, g * q, D]
    return o.view(b, kvh, g, q, d).permute(0, 3, 1, 2, 4).reshape(n, heads * d)


BUCKET = 64
"""Folded attention gives a query at position p exactly `bucket_columns(p)` columns (multiples of this)."""


def bucket_columns(p: int) -> int:
    return (p // BUCKET + 1) * BUCKET


def folded_groups(starts: list[int], q: int, columns: torch.Tensor, rows: list[int] | None = None,
                  ) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """`Attention.groups` for queries at positions starts[b] + j (j < q) of batch rows `rows` (default all):
    runs of a row's queries that share a column bucket, each with its [n, 1, 1, length] mask. `columns` is an
    arange at least as long as the longest bucket."""
    groups = []
    for b in rows if rows is not None else range(len(starts)):
        j = 0
        while j < q:
            length = bucket_columns(starts[b] + j)
            j1 = min(q, length - starts[b])  # queries whose position stays below `length`
            pos = torch.arange(starts[b] + j, starts[b] + j1, device=columns.device).view(-1, 1)
            groups.append((b, j, j1, length, (columns[:length].view(1, -1) <= pos).view(j1 - j, 1, 1, length)))
            j = j1
    return groups


def kernel_plan(attn: Attention, q: int, first_slot: int, col: torch.Tensor,
                 slot: torch.Tensor) -> KernelPlan | None:
    """The columns each of a forward's positions attends, as the attention kernel takes them (rows: absolute
    slots): a draft tree's plan (`TreeAttention.plan`, which carries no runs), or every position over its own slot's
    columns 0 .. its own (a step, a chain's verify, a prefill, a joining prompt, a tail) where `attn` is causal or
    its folded groups or mask say so. None (SDPA) for other masks."""
    tree = getattr(attn, "plan", None)
    if tree is not None:
        return tree._replace(rows=tree.rows + first_slot) if first_slot else tree
    if type(attn) is not Attention or (q > 1 and not attn.causal and attn.groups is None and attn.mask is None):
        return None
    return prefix_plan(slot.cpu(), col.cpu() + 1)


@torch.inference_mode()
def attend_real(attn: Attention, qrows: torch.Tensor, real: torch.Tensor, n: int, b: int, keys: torch.Tensor,
                 values: torch.Tensor, scale: float) -> torch.Tensor:
    """A ragged forward's attention: its M queries scattered to their places among the N = B * q of `attn` (the
    others zero: each query sees only its own row's columns, so they change nothing), gathered back -> [M, ...]."""
    full = qrows.new_zeros((n,) + tuple(qrows.shape[1:]))
    full.index_copy_(0, real, qrows)
    return attn.attend(full, b, keys, values, scale).index_select(0, real)
