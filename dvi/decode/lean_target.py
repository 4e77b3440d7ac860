"""`LeanTarget`: the engine's target for Llama-family models (`dvi.decode.lean` over a `SlotCache`).

A row's cache has no holes: a forward writes q entries after the row's length and `keep` moves the length past
the ones the target kept, so undoing rejected drafts costs nothing.

What greedy speculation guarantees (`contract`, measured at start-up by `dvi.decode.invariance.probe`): one
request at a time, a verify rounds like the 1-token steps it stands for (folded attention,
`dvi.decode.attention.Attention`) wherever this device's matmuls round a row alike at any row count ("bitwise"),
else greedy text may part from plain decoding at near-ties of the dtype (`dvi.decode.sampling.tie_bound`).
A batch of several rows attends in one SDPA call (near-tie). The exact mode (`exact`) makes every row bitwise:
folded attention for every row and matmuls padded to the probed row floor `min_rows`; where no floor works, each
verified position runs as its own one-row step (exact, at K + 1 steps' cost).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from dvi.decode.attention import Attention, bucket_columns, folded_groups
from dvi.decode.lean import LeanModel
from dvi.decode.prefix_cache import BLOCK, PrefixCache
from dvi.decode.rows_kernel import EVERY_ROW
from dvi.decode.sampling import real_positions
from dvi.decode.segments import NO_RUNS, Runs, Segments
from dvi.decode.tree_attention import compact_moves, node_depths, tree_attention

__all__ = ["LeanTarget"]

Features = list[torch.Tensor | None] | None


class _Join(NamedTuple):
    """A row admitted lazily, prefilled in the next forward: its context, the columns it already holds (copied from
    the prefix cache), and the earlier joining row `src` whose first `shared` columns it copies as that forward
    writes them (-1: none)."""

    ctx: list[int]
    filled: int
    src: int = -1
    shared: int = 0

    @property
    def start(self) -> int:
        """Its first column the forward computes."""
        return max(self.filled, self.shared)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class LeanTarget:
    """A Llama-family target through `LeanModel` over a `SlotCache` (`dvi.decode.target.TargetRunner`)."""

    def __init__(self, model: nn.Module | None = None, lean: LeanModel | None = None, exact: bool = False,
                 min_rows: int = 1, invariance=None, graphs=None):
        self.lean = lean if lean is not None else LeanModel(model)
        self.exact, self.min_rows, self.invariance = bool(exact), int(min_rows), invariance
        # the exact mode where no row floor made verifies round like steps: every position its own step
        self.stepwise = self.exact and invariance is not None and invariance.min_rows is None
        self.graphs = graphs  # a `dvi.decode.graphs.GraphedForward` (CUDA): its cache is this runner's
        self.cache = graphs.cache if graphs is not None else self.lean.new_cache()
        self._cols = torch.arange(0)
        self._joining: dict[int, _Join] = {}  # slot -> a row admitted lazily, prefilled in the next forward
        self.prefix: PrefixCache | None = None  # `use_prefix_cache`

    @property
    def batch_size(self) -> int:
        return self.cache.batch_size

    @property
    def max_rows(self) -> int | None:
        """Rows the captured graphs' cache holds (None: the cache grows)."""
        return self.graphs.batches[-1] if self.graphs is not None else None

    @property
    def contract(self) -> dict[str, str]:
        """What greedy speculation guarantees one request at a time and in batches: 'bitwise' or 'near-tie'
        (see the module doc; CUDA graphs attend in one call). Batches are bitwise where dvi's kernels compute every
        position alone (the rows kernel at every row count, `EVERY_ROW`, and the attention kernel) and torch runs
        the elementwise ops on one thread: with more, torch splits a tensor into chunks at element counts that part a
        row, and a chunk's tail takes the scalar path (its exp may round apart from the vectorized one)."""
        if self.exact:
            return {"one_request": "bitwise", "batched": "bitwise"}
        one = (self.invariance is None or self.invariance.min_rows is not None) and self.graphs is None
        alone = one and self.positions_alone
        return {"one_request": "bitwise" if one else "near-tie", "batched": "bitwise" if alone else "near-tie"}

    @property
    def positions_alone(self) -> bool:
        """Whether every position of every eager forward is computed alone, the same bits whatever else the forward
        carries (`contract`): dvi's rows kernel at every row count, or oneDNN's packs promising it (`PackPlan.alike`,
        checked) at every row count, and dvi's attention kernel, torch on one thread."""
        lean = self.lean
        matmuls = lean.kernel_rows == EVERY_ROW or (not lean.kernel_rows and lean.pack_plan.alike > 0)
        return matmuls and lean.attn_kernel is not None and torch.get_num_threads() == 1

    def _columns(self, n: int) -> torch.Tensor:
        if self._cols.numel() < n:
            self._cols = torch.arange(max(n, 2 * self._cols.numel()), device=self.lean.device)
        return self._cols[:n]

    def use_prefix_cache(self, tokens: int) -> str | None:
        """Prompts' leading keys and values kept for up to `tokens` positions (`PrefixCache`) and copied into a later
        prompt that starts alike, instead of its prefill computing them again; None, or why it is not used: only
        where every position rounds alike whatever forward computes it (`contract`: batched "bitwise"), so a prompt
        served from the cache decodes exactly as from a cold prefill."""
        self.prefix = None
        if tokens <= 0:
            return "no tokens to hold"
        if not self.positions_alone or self.graphs is not None:
            return ("a prompt's keys and values computed in another forward would round apart here (dvi's CPU kernels "
                    "do not serve every forward on one thread: the greedy contract for batches is near-tie)")
        lean = self.lean
        self.prefix = PrefixCache(len(lean.layers), lean.kv_heads, lean.head_dim, lean.dtype, lean.device, tokens)
        return None

    def admit(self, contexts: list[list[int]], features: bool, lazy: bool = False) -> Features:
        """`lazy`: where the next forward can carry them (`joins`), the rows' prefills ride on it (`Segments`) instead
        of running now, each a forward of its own. Each row first takes what the prefix cache holds of its context."""
        if lazy and self.joins(len(contexts), features):
            for ctx in contexts:
                (slot,) = self.cache.add_rows(1)
                join = self._shared(_Join(list(ctx), self._reuse(slot, ctx, features)))
                if join.start < len(ctx) or join.src >= 0:
                    self._joining[slot] = join
            return None
        self._flush()
        feats = []
        for ctx in contexts:
            (slot,) = self.cache.add_rows(1)
            feats.append(self._prefill(slot, ctx, features, self._reuse(slot, ctx, features)))
        return feats if features else None

    def _reuse(self, slot: int, ctx: list[int], features: bool) -> int:
        """The cached keys and values `ctx` starts with, copied into row `slot`; the columns filled (none where the
        prefill must return features of every position, or the target runs adapters of its own)."""
        if not self._caching(features):
            return 0
        self.cache.reserve(slot + 1, len(ctx) + 1)
        filled = self.prefix.copy_into(ctx, self.cache.kv[:, slot])
        self.cache.lengths[slot] = filled
        return filled

    def _shared(self, join: _Join) -> _Join:
        """`join` sharing its longest common start with a row joining in the same forward, where that is longer than
        what the prefix cache gave it (a GRPO group's samples of one prompt, admitted at once: none is cached yet)."""
        if not self._caching(False):
            return join
        best, src = join.filled, -1
        for slot, other in self._joining.items():
            n = _common(join.ctx, other.ctx)
            if n > best:
                best, src = n, slot
        if src < 0:
            return join
        self.prefix.count_shared(best - join.filled, hit=join.filled == 0)
        return join._replace(src=src, shared=best)

    def _remember(self, slot: int, ctx: list[int]) -> None:
        """Row `slot`'s context, just prefilled, into the prefix cache."""
        if self._caching(False) and len(ctx) >= BLOCK:
            self.prefix.keep(ctx, self.cache.kv[:, slot])

    def _caching(self, features: bool) -> bool:
        """Whether prompts are served from and kept in the prefix cache now: not where the prefill must return every
        position's features, the target runs adapters of its own, or torch's threads were raised since (a position
        would then round by what its forward carries)."""
        return self.prefix is not None and not features and self.lean.adapters is None \
            and torch.get_num_threads() == 1

    def _prefill(self, slot: int, ctx: list[int], features: bool, filled: int = 0) -> torch.Tensor | None:
        """Row `slot` gets `ctx` as a forward of its own, causal over the row's own columns as HF's prefill of a
        prompt, after the `filled` columns the prefix cache gave it; its final normed hidden states with `features`
        (None for an empty context)."""
        n = len(ctx)
        if n == filled:
            self.cache.lengths[slot] = n
            return None
        self.cache.reserve(slot + 1, n)
        dev = self.lean.device
        ids = torch.tensor([ctx[filled:]], dtype=torch.long, device=dev)
        if filled:  # the new positions over the cached columns and, causally, each other
            cols = self._columns(n)
            attn = Attention(n, mask=(cols.view(1, -1) <= cols[filled:].view(-1, 1)).view(1, 1, n - filled, n))
        else:
            attn = Attention(n, causal=n > 1)
        out = self.lean.forward(self.cache, ids, torch.tensor([filled], dtype=torch.long, device=dev), attn,
                                logits_to_keep=1, features=features, first_slot=slot)
        self.cache.lengths[slot] = n
        self._remember(slot, ctx)
        return out[1][0] if features else None

    def joins(self, rows: int, features: bool) -> bool:
        """Whether `rows` new rows may join inside the next forward: eager forwards outside the exact mode, no
        features, and a batch of two rows or more (a lone request keeps its bitwise verify: `contract`)."""
        return (not features and not self.exact and self.graphs is None and self.lean.adapters is None
                and self.cache.batch_size + rows >= 2)

    def _flush(self) -> None:
        """Rows admitted lazily get their prefills now, each its own forward (what the next forward cannot carry)."""
        for slot, join in sorted(self._joining.items()):  # a row's source is an earlier slot: prefilled before it
            if join.src >= 0:
                self.cache.kv[:, slot, : join.shared] = self.cache.kv[:, join.src, : join.shared]
            self._prefill(slot, join.ctx, False, join.start)
        self._joining = {}

    def attention(self, q: int) -> Attention:
        """How the next forward of q positions per row attends (see the module doc)."""
        starts, b = self.cache.lengths, self.cache.batch_size
        if b == 1 or self.exact:
            columns = max(bucket_columns(s + q - 1) for s in starts)
            return Attention(columns, groups=folded_groups(starts, q, self._columns(columns)))
        columns = max(starts) + q
        start = torch.tensor(starts, dtype=torch.long, device=self.lean.device)
        pos = start.view(b, 1, 1) + torch.arange(q, device=self.lean.device).view(1, q, 1)  # [B, q, 1]
        return Attention(columns, mask=(self._columns(columns).view(1, 1, columns) <= pos).unsqueeze(1))

    @property
    def row_chunk(self) -> int | None:
        """A one-row verify's matmul pieces (`LeanModel.row_chunk`, the probe's `Invariance.row_chunk`)."""
        return self.lean.row_chunk

    @property
    def trees(self) -> bool:
        """Whether a verify may score draft trees: eager forwards only (the exact mode's stepwise last resort
        scores positions one at a time along a chain; captured CUDA graphs are keyed by chain width)."""
        return not self.stepwise and self.graphs is None

    def forward(self, ids: torch.Tensor, features: bool, tree: list[list[int]] | None = None,
                lens: list[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Matmuls see at least `min_rows` rows: a shorter forward gets junk positions after each row's real ones
        (their keys land past the row's length, to be overwritten; their outputs are dropped). `tree`: per row the
        parents of draft nodes 1..q-1 (`dvi.decode.tree_attention`). `lens`: row i's real drafts (of q - 1): a batch
        verify scores only those and the row's last token (`ragged_rows`), like vLLM's flattened batch."""
        joining = dict(self._joining) if self._joining else None
        out = self._forward(ids, features, tree, lens)
        if joining and not self._joining:  # their prefills rode on this forward (or ran before it)
            for slot, join in joining.items():
                self._remember(slot, join.ctx)
        return out

    def _forward(self, ids: torch.Tensor, features: bool, tree: list[list[int]] | None,
                 lens: list[int] | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, q = ids.shape
        prefixes = None
        if self._joining:
            if tree is None and not features and self.joins(0, features):
                prefixes = self._prefixes()
            else:
                self._flush()
        if tree is not None:
            return self._eager(ids, features, tree)
        real = self.ragged_rows(lens, q) if lens is not None and not features and b > 1 else None
        if real is not None and 0 < sum(n > 0 for n in lens) <= b // 2:
            return self._tails(ids, lens, prefixes)
        if real is not None or prefixes is not None:
            return self._eager(ids, False, scored=real, prefixes=prefixes)
        if self.stepwise and (q > 1 or b > 1):
            return self._stepwise(ids, features)
        if not features and self.graphs is not None and not self.exact \
                and self.graphs.fits(b, q, max(self.cache.lengths) + q):
            return self.graphs(ids, self.cache.lengths)
        return self._eager(ids, features)

    def _eager(self, ids: torch.Tensor, features: bool, tree: list[list[int]] | None = None,
               scored: torch.Tensor | None = None, prefixes: Runs | None = None,
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        b, q = ids.shape
        real = q
        if b * q < self.min_rows:
            q = -(-self.min_rows // b)
            ids = torch.cat([ids, ids[:, -1:].expand(b, q - real)], 1)
        if tree is None:
            attn = self.attention(q)
            attn.real = scored  # a ragged verify's scored positions (never padded: `ragged` excludes the exact mode)
        else:
            tree = [list(p) + [0] * (q - 1 - len(p)) for p in tree]  # junk positions: leaves of the root
            starts = self.cache.lengths
            arange = self._columns(bucket_columns(max(starts) + q - 1))
            attn = tree_attention(starts, tree, q, arange, folded=b == 1 or self.exact)
            attn.depth = torch.tensor([node_depths(p) for p in tree], dtype=torch.long, device=self.lean.device)
        self.cache.reserve(b, attn.columns)
        start = torch.tensor(self.cache.lengths, dtype=torch.long, device=self.lean.device)
        if prefixes is not None:  # (never with a tree: `forward` runs pending prefills first there)
            attn.runs = prefixes
        out = self.lean.forward(self.cache, ids, start, attn, features=features)
        if q == real:
            return out
        return (out[0][:, :real], out[1][:, :real]) if features else out[:, :real]

    def _tails(self, ids: torch.Tensor, lens: list[int], prefixes: Runs | None) -> torch.Tensor:
        """A ragged verify where at most half the rows drafted: every row's last token as a one-token step, the
        drafting rows' drafts as tails (`Segments`), each attending over its own row only; the padded ragged forward
        attends every row's K + 1 queries."""
        b, q = ids.shape
        rows = [i for i, n in enumerate(lens) if n > 0]
        starts = self.cache.lengths
        tails = Segments(rows, [starts[i] + 1 for i in rows], [ids[i, 1 : 1 + min(lens[i], q - 1)] for i in rows],
                         width=q)
        attn = self.attention(1)
        self.cache.reserve(b, max(attn.columns, tails.columns))
        start = torch.tensor(starts, dtype=torch.long, device=self.lean.device)
        attn.runs = dataclasses.replace(prefixes or NO_RUNS, tails=tails)
        return self.lean.forward(self.cache, ids[:, :1], start, attn)

    def _prefixes(self) -> Runs:
        """The lazily admitted rows' contexts as this forward's prefixes (after what they hold or share), and the
        shared columns each copies from its source row as the forward writes them; their lengths now count them."""
        dev = self.lean.device
        joins = sorted(self._joining.items())
        ride = [(s, j) for s, j in joins if j.start < len(j.ctx)]
        prefixes = Segments([s for s, _ in ride], [j.start for _, j in ride],
                            [torch.tensor(j.ctx[j.start :], dtype=torch.long, device=dev) for _, j in ride]) \
            if ride else None
        self.cache.reserve(self.cache.batch_size, max(len(j.ctx) for _, j in joins) + 1)
        for s, j in joins:
            self.cache.lengths[s] = len(j.ctx)
        self._joining = {}
        return Runs(prefixes, copies=tuple((s, j.src, j.shared) for s, j in joins if j.src >= 0))

    @property
    def ragged(self) -> bool:
        """Whether a batch verify skips padding (`ragged_rows`): eager forwards outside the exact mode."""
        return not self.exact and self.graphs is None

    def ragged_rows(self, lens: list[int], q: int) -> torch.Tensor | None:
        """The flat indices (i * q + j, j <= lens[i]) a ragged verify scores; None where every row fills q, or where
        every position must be scored (the exact mode's padded or stepwise forwards, captured CUDA graphs)."""
        if not self.ragged or all(n + 1 >= q for n in lens):
            return None
        return real_positions(lens, q, self.lean.device)

    def _stepwise(self, ids: torch.Tensor, features: bool):
        """Each row's positions one at a time, each a one-row forward over its own slot: what its plain decode
        computes, bit for bit (the exact mode's last resort)."""
        b, q = ids.shape
        outs, feats = [], []
        for i in range(b):
            row, frow = [], []
            for j in range(q):
                start = self.cache.lengths[i] + j
                attn = Attention(bucket_columns(start), groups=folded_groups([start], 1, self._columns(bucket_columns(start))))
                self.cache.reserve(self.cache.batch_size, attn.columns)
                out = self.lean.forward(self.cache, ids[i : i + 1, j : j + 1],
                                        torch.tensor([start], device=self.lean.device), attn, features=features,
                                        first_slot=i)
                row.append(out[0] if features else out)
                if features:
                    frow.append(out[1])
            outs.append(torch.cat(row, 1))
            feats.append(torch.cat(frow, 1) if features else None)
        logits = torch.cat(outs)
        return (logits, torch.cat(feats)) if features else logits

    def keep(self, q: int, kept: list[int]) -> None:
        self.cache.advance(kept)

    @torch.no_grad()
    def keep_path(self, paths: list[list[int]]) -> None:
        """After a tree verify, row i keeps its root and accepted nodes paths[i], moved to follow the root."""
        moves = compact_moves(self.cache.lengths, paths)
        if moves is not None:
            dev = self.lean.device
            slots, src, dst = (torch.tensor(x, dtype=torch.long, device=dev) for x in moves)
            kv = self.cache.kv
            kv[:, slots, dst] = kv[:, slots, src]
        self.cache.advance([len(p) + 1 for p in paths])

    def select_rows(self, keep: list[int]) -> None:
        self._flush()
        self.cache.select_rows(keep)

    def rebuild(self, contexts: list[list[int]], features: bool) -> Features:
        self.lean.repack()  # new target weights: packed copies made from the old ones are stale
        if self.prefix is not None:  # and so are cached prompts' keys and values
            self.prefix.clear()
        self._joining = {}  # the rows' contexts come again, whole
        self.cache.truncate([])  # the same cache (a captured graph holds its address); stale entries are masked
        return self.admit(contexts, features)

    def scratch(self) -> LeanTarget:
        """Eager, with its own cache (captured graphs are bound to this runner's slots, which in-flight rows
        hold): on CUDA, cost calibration times eager forwards."""
        return LeanTarget(lean=self.lean, exact=self.exact, min_rows=self.min_rows, invariance=self.invariance)

    def reserve(self, rows: int, positions: int) -> int:
        if not self.cache.frozen:  # a captured graph's cache was allocated whole for its largest bucket
            self.cache.reserve(rows, positions)
        return self.cache.kv.numel() * self.cache.kv.element_size()

    def tidy(self, speculating: bool) -> None:
        pass
