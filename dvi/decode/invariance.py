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

import torch

from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget

__all__ = ["FLOORS", "Invariance", "probe"]

log = logging.getLogger(__name__)

FLOORS = (1, 2, 4, 8)
"""Matmul row floors tried, cheapest first (a one-token step padded to 4 rows costs a 4-row GEMM)."""


@dataclass(frozen=True)
class Invariance:
    """The probe's verdict: `min_rows` makes verifies of `widths` bit-equal to steps (None: no floor did)."""

    min_rows: int | None
    widths: tuple[int, ...]
    device: str
    dtype: str

    @property
    def contract(self) -> str:
        """'bitwise' (greedy speculation equals plain decoding token for token) or 'near-tie'."""
        return "bitwise" if self.min_rows is not None else "near-tie"


_VERDICTS: dict[tuple, Invariance] = {}


def _key(lean: LeanModel, widths: tuple[int, ...]) -> tuple:
    c = lean.config
    return (type(lean).__name__, getattr(c, "model_type", None), lean.hidden, len(lean.layers), lean.heads,
            lean.kv_heads, lean.head_dim, int(lean.layers[0].gate_up.shape[0]), int(lean.head.shape[0]),
            lean.dtype, lean.device.type, widths)


def probe(lean: LeanModel, max_width: int = 17, context: int = 48, seed: int = 0) -> Invariance:
    """The smallest floor of `FLOORS` at which verifies of widths 2..max_width round like steps (cached)."""
    widths = tuple(w for w in (2, 3, 4, 5, 8, 9, 16, 17, 24, 32, 33) if w <= max(2, max_width))
    key = _key(lean, widths)
    if key not in _VERDICTS:
        floor = next((f for f in FLOORS if _rows_agree(lean, f, widths, context, seed)), None)
        _VERDICTS[key] = v = Invariance(floor, widths, lean.device.type, str(lean.dtype).removeprefix("torch."))
        log.info("greedy speculation on %s %s: %s (matmul row floor %s, verify widths up to %d)",
                 v.device, v.dtype, v.contract, floor, max(widths))
    return _VERDICTS[key]


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
