"""What this device's kernels guarantee: does a verify of K + 1 positions round like K + 1 one-token steps?

Greedy speculation is bit-equal to plain decoding only if the target's logits at a position do not depend
on how many positions the forward scores. Two things break that, and both depend on the machine:
attention (SDPA rounds a query differently with the queries and masked columns beside it) and the matmuls
(a BLAS picks another kernel by row count: MKL's fp32 GEMV for one row, another kernel for 2-3 rows, a third
from 4; oneDNN's bf16 kernels on AVX512-BF16 CPUs likewise). `dvi.decode.lean` removes the first by
construction (folded attention: each query alone over a bucketed column count) and can pad matmuls to a row
floor; which floor makes rows agree is a property of the kernels, so it is measured here, once per process
and model shape, on the model's own weights: the smallest floor at which verifies of every width give logits
bit-equal to the steps'. None: no floor does, and greedy speculation may part from plain decoding at
near-ties of the dtype (`dvi.decode.sampling.tie_bound`). A kernel may also round rows alike only up to some
row count (oneDNN's bf16 on Intel AMX: up to 32; a draft tree's verify scores more positions than a chain's):
then a one-request verify runs its matmuls in pieces of the widest width that agreed (`Invariance.row_chunk`,
`LeanModel.row_chunk`), kept where every width then agrees.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget

__all__ = ["FLOORS", "Invariance", "probe", "rows_agree"]

log = logging.getLogger(__name__)

WIDTHS = (2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33, 48, 64, 65, 96, 128, 129)
"""Verify widths probed (those up to the engine's widest verify, and that one): both sides of the powers of two where
kernels switch."""

FLOORS = (1, 2, 4, 8)
"""Matmul row floors tried, cheapest first (a one-token step padded to 4 rows costs a 4-row GEMM: in fp32 on an
AVX2 CPU, MKL's GEMV for one row is 2.5x faster than its GEMM for four, so only the exact mode pays a floor)."""


@dataclass(frozen=True)
class Invariance:
    """The probe's verdict: verifies of `widths` (and, in the exact mode, matmuls of up to `max_rows` rows) round
    like one-token steps at matmul row floor `min_rows`; None: no floor tried made them (`searched`: floors
    past 1 were tried, the exact mode's search)."""

    min_rows: int | None
    widths: tuple[int, ...]
    max_rows: int
    searched: bool
    device: str
    dtype: str
    row_chunk: int | None = None  # one-request matmuls in pieces of at most this many rows (None: whole)

    @property
    def contract(self) -> str:
        """'bitwise' (greedy speculation equals plain decoding token for token) or 'near-tie'."""
        return "bitwise" if self.min_rows is not None else "near-tie"


_VERDICTS: dict[tuple, Invariance] = {}


def _key(lean: LeanModel, *rest) -> tuple:
    c = lean.config
    return (getattr(c, "model_type", None), lean.hidden, len(lean.layers), lean.heads, lean.kv_heads,
            lean.head_dim, int(lean.layers[0].gate_up.shape[0]), int(lean.head.shape[0]), lean.dtype,
            lean.device.type, lean.packs is not None, lean.head_pack is None and lean.head_path(), lean.kernel_rows,
            lean.attn_kernel is not None, *rest)


def probe(lean: LeanModel, max_width: int = 17, exact: bool = False, max_rows: int = 0, context: int = 48,
          seed: int = 0) -> Invariance:
    """Do verifies of widths 2..`max_width` round like one-token steps on this device's kernels (cached per model
    shape and dtype)? Without `exact` only as the engine runs by default (floor 1: free); with it the smallest
    floor of `FLOORS` that makes them, which must also keep rows of matmuls up to `max_rows` rows (a batch's
    rows x positions) equal to a lone row's."""
    top = max(2, max_width)
    widths = tuple(sorted({w for w in WIDTHS if w <= top} | {top}))  # the widest itself too (a tree's 57)
    max_rows = max(max_rows, max(widths))
    key = _key(lean, widths, exact, max_rows)
    if key not in _VERDICTS:
        floors = FLOORS if exact else (1,)
        first = _agreeing_widths(lean, 1, widths, context, seed)  # floor 1's (the floors' first), kept for the pieces
        floor = next((f for f in floors
                      if (first if f == 1 else _agreeing_widths(lean, f, widths, context, seed)) == widths
                      and (not exact or rows_agree(lean, f, max_rows, seed))), None)
        chunk = None if floor is not None or exact else _row_chunk(lean, widths, first, context, seed)
        _VERDICTS[key] = v = Invariance(1 if chunk else floor, widths, max_rows, exact, lean.device.type,
                                        str(lean.dtype).removeprefix("torch."), chunk)
        log.info("greedy speculation on %s %s%s: %s (matmul row floor %s%s, verify widths up to %d)", v.device,
                 v.dtype, " (exact mode)" if exact else "", v.contract, v.min_rows,
                 f", one request's matmuls in pieces of {chunk} rows" if chunk else "", max(widths))
    return _VERDICTS[key]


def _row_chunk(lean: LeanModel, widths: tuple[int, ...], agreed: tuple[int, ...], context: int,
               seed: int) -> int | None:
    """The widest probed width up to which verifies agreed with steps (`agreed`), if matmuls in pieces of that many
    rows make every width agree (None: none does)."""
    ok = [w for w in widths if w < min(set(widths) - set(agreed), default=widths[-1] + 1)]  # the agreeing prefix
    if len(ok) < 2:  # pieces of two or three rows would cost a wide verify most of its width
        return None
    return ok[-1] if _agreeing_widths(lean, 1, widths, context, seed, chunk=ok[-1]) == widths else None


@torch.inference_mode()
def rows_agree(lean: LeanModel, floor: int, max_rows: int, seed: int) -> bool:
    """Rows of the model's own matmuls at a few row counts up to `max_rows` equal a lone row padded to `floor`."""
    g = torch.Generator().manual_seed(seed)
    counts = sorted({m for m in (floor, floor + 1, 2 * floor + 1, 33, 64, 65, 128, 129, max_rows) if floor <= m <= max_rows})
    lw = lean.layers[0]
    # each as a forward runs it (`LeanModel.linear`; the head: the rows kernel, a oneDNN pack, blockwise or whole)
    matmuls = [(w, partial(lean.linear, w=w)) for w in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [(lean.head, lean._logits)]
    for w, run in matmuls:
        x = torch.randn(max_rows, w.shape[1], generator=g).to(w)
        pad = torch.randn(max(0, floor - 1), w.shape[1], generator=g).to(w)
        # every row of the layer's projections (a kernel may round ~0.2% of rows of a bf16 GEMM unlike the row alone:
        # three rows a count missed it); the head's rows are long, three a count
        alone = [run(torch.cat([x[r : r + 1], pad]))[0] for r in range(max_rows)] if w is not lean.head else None
        for m in counts:
            got = run(x[:m])
            for r in range(m) if alone is not None else (0, m // 2, m - 1):
                if not torch.equal(got[r], alone[r] if alone is not None else run(torch.cat([x[r : r + 1], pad]))[0]):
                    return False
    return True


@torch.inference_mode()
def _agreeing_widths(lean: LeanModel, floor: int, widths: tuple[int, ...], context: int, seed: int,
                     chunk: int | None = None) -> tuple[int, ...]:
    """The `widths` whose verifies give, with row floor `floor` (and matmuls in pieces of `chunk` rows), logits
    bit-equal to 1-token steps' (random tokens)."""
    dev = lean.device
    vocab = int(lean.embed.shape[0])
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (context,), generator=g).tolist()
    toks = torch.randint(0, vocab, (max(widths),), generator=g).tolist()
    run = LeanTarget(lean=lean, exact=True, min_rows=floor)
    was, lean.row_chunk = lean.row_chunk, chunk
    try:
        run.admit([ctx], False)

        def verify(ids: list[int]) -> torch.Tensor:
            run.cache.truncate([context])
            return run.forward(torch.tensor([ids], device=dev), False)[0]

        steps = []
        for t in toks:
            steps.append(run.forward(torch.tensor([[t]], device=dev), False)[0, 0])
            run.keep(1, [1])
        return tuple(w for w in widths if all(torch.equal(got, steps[j]) for j, got in enumerate(verify(toks[:w]))))
    finally:
        lean.row_chunk = was
