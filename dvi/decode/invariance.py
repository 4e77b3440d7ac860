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
near-ties of the dtype (`dvi.decode.sampling.tie_bound`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial

import torch

from dvi.decode.lean import LeanModel, rows_linear
from dvi.decode.lean_target import LeanTarget

__all__ = ["FLOORS", "Invariance", "probe"]

log = logging.getLogger(__name__)

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

    @property
    def contract(self) -> str:
        """'bitwise' (greedy speculation equals plain decoding token for token) or 'near-tie'."""
        return "bitwise" if self.min_rows is not None else "near-tie"


_VERDICTS: dict[tuple, Invariance] = {}


def _key(lean: LeanModel, *rest) -> tuple:
    c = lean.config
    return (getattr(c, "model_type", None), lean.hidden, len(lean.layers), lean.heads, lean.kv_heads,
            lean.head_dim, int(lean.layers[0].gate_up.shape[0]), int(lean.head.shape[0]), lean.dtype,
            lean.device.type, lean.packs is not None, lean.head_pack is None and lean.head_path(), *rest)


def probe(lean: LeanModel, max_width: int = 17, exact: bool = False, max_rows: int = 0, context: int = 48,
          seed: int = 0) -> Invariance:
    """Do verifies of widths 2..`max_width` round like one-token steps on this device's kernels (cached per model
    shape and dtype)? Without `exact` only as the engine runs by default (floor 1: free); with it the smallest
    floor of `FLOORS` that makes them, which must also keep rows of matmuls up to `max_rows` rows (a batch's
    rows x positions) equal to a lone row's."""
    widths = tuple(w for w in (2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33) if w <= max(2, max_width))
    max_rows = max(max_rows, max(widths))
    key = _key(lean, widths, exact, max_rows)
    if key not in _VERDICTS:
        floors = FLOORS if exact else (1,)
        floor = next((f for f in floors if _rows_agree(lean, f, widths, context, seed)
                      and (not exact or _matmul_rows_agree(lean, f, max_rows, seed))), None)
        _VERDICTS[key] = v = Invariance(floor, widths, max_rows, exact, lean.device.type,
                                        str(lean.dtype).removeprefix("torch."))
        log.info("greedy speculation on %s %s%s: %s (matmul row floor %s, verify widths up to %d)", v.device, v.dtype,
                 " (exact mode)" if exact else "", v.contract, floor, max(widths))
    return _VERDICTS[key]


@torch.inference_mode()
def _matmul_rows_agree(lean: LeanModel, floor: int, max_rows: int, seed: int) -> bool:
    """Rows of the model's own matmuls at a few row counts up to `max_rows` equal a lone row padded to `floor`."""
    g = torch.Generator().manual_seed(seed)
    counts = sorted({m for m in (floor, floor + 1, 2 * floor + 1, 33, 64, 65, 128, 129, max_rows) if floor <= m <= max_rows})
    lw = lean.layers[0]
    packs = lean.packs[0] if lean.packs else (None,) * 4
    matmuls = [(lw.qkv, partial(rows_linear, w=lw.qkv, packed=packs[0])),
               (lw.o, partial(rows_linear, w=lw.o, packed=packs[1])),
               (lw.gate_up, partial(rows_linear, w=lw.gate_up, packed=packs[2])),
               (lw.down, partial(rows_linear, w=lw.down, packed=packs[3])),
               (lean.head, lean._logits)]  # the head as a forward runs it (a oneDNN pack, blockwise or whole)
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
def _rows_agree(lean: LeanModel, floor: int, widths: tuple[int, ...], context: int, seed: int) -> bool:
    """Do verifies of `widths` give, with row floor `floor`, logits bit-equal to 1-token steps' (random tokens)?"""
    dev = lean.device
    vocab = int(lean.embed.shape[0])
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, vocab, (context,), generator=g).tolist()
    toks = torch.randint(0, vocab, (max(widths),), generator=g).tolist()
    run = LeanTarget(lean=lean, exact=True, min_rows=floor)
    run.admit([ctx], False)

    def verify(ids: list[int]) -> torch.Tensor:
        run.cache.truncate([context])
        return run.forward(torch.tensor([ids], device=dev), False)[0]

    steps = []
    for t in toks:
        steps.append(run.forward(torch.tensor([[t]], device=dev), False)[0, 0])
        run.keep(1, [1])
    return all(torch.equal(verify(toks[:w])[j], steps[j]) for w in widths for j in range(w))
