"""Cost calibration: `calibrate` times verifies of several K and a draft chain, interleaved, on the dummy rows the
engine builds (`DummyRows`, its `CalibrationRows`): b rows of random tokens with their own target and drafter caches,
so cost calibration never touches in-flight requests. What it measures feeds `dvi.decode.adaptive.AdaptiveK`.

Kept apart from `dvi.engine.speculative`, whose job is serving real rows; this module only times forwards.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from dvi.decode.kv import prefill
from dvi.decode.sampling import greedy_tokens
from dvi.drafters.draft_cache import DraftCache, RaggedDraftCache, draft_cache

__all__ = ["CalibrationRows", "Calibrated", "CalibrationSetup", "DummyRows", "calibrate", "calibrate_bucket"]


class CalibrationRows(Protocol):
    """Dummy rows with their own caches, built by the engine (in-flight rows are untouched). `verify(k)` and
    `draft(j)` draw their input ids and return the forward to time; `undo_*` drop the slots it added."""

    tokens: int  # tokens in the rows (what `prefill_drafter` runs the drafter over)

    def sync(self) -> None: ...  # wait for queued device work (CUDA); a no-op on CPU

    def prefill_drafter(self) -> None: ...

    def verify(self, k: int) -> Callable[[], object]: ...  # one target forward of [b, K + 1] tokens

    def undo_verify(self, k: int) -> None: ...

    def draft(self, j: int) -> Callable[[], object]: ...  # the j-th drafter forward after a verify

    def undo_drafts(self, n: int) -> None: ...


class Calibrated(NamedTuple):
    """The arguments of `AdaptiveK.set_costs` after the batch size."""

    verify: dict[int, float]  # seconds per verify step, per K
    draft: float  # warm seconds per drafter forward
    catchup_per_token: float  # seconds per token the drafter catches up on


def _timed(run: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - t0


def calibrate(rows: CalibrationRows, k_max: int, reps: int = 3, verify_max: int = 0) -> Calibrated:
    """Verify costs for several K (up to max(k_max, verify_max): suffix drafts may be longer than the learned
    drafter's) and a draft chain of k_max, interleaved, min of `reps` (k_max >= 1)."""
    catchup_per_token = _timed(rows.prefill_drafter, rows.sync) / rows.tokens  # what a drafter catch-up costs
    top = max(k_max, verify_max)
    ks = sorted({k for k in (0, 1, 2, 4, 8, 12, 16, 24, k_max, top) if k <= top})
    vt: dict[int, list[float]] = {k: [] for k in ks}
    chains: list[list[float]] = []  # cumulative seconds of the first 1..k_max drafts after a verify
    for _ in range(reps):
        for k in ks:
            vt[k].append(_timed(rows.verify(k), rows.sync))
            rows.undo_verify(k)
        # Draft chains as decoding runs them: right after a verify, the first forward takes the
        # two pending tokens (last draft + bonus) with the drafter's weights cold in the CPU caches;
        # later ones run warmer (measured here, 1-layer drafter: 1.3, 1.0, 0.75, 0.6 ms).
        chains.append(list(itertools.accumulate(_timed(rows.draft(j), rows.sync) for j in range(k_max))))
        rows.undo_drafts(k_max + 1)
    chain = [min(c[j] for c in chains) for j in range(k_max)]
    # The controller prices a step as K * draft + verify(K): draft is the warm marginal cost and
    # each measured K's verify carries the rest of its chain, so calibrated K values cost exactly
    # chain(K) + verify(K).
    draft = (chain[-1] - chain[0]) / (k_max - 1) if k_max > 1 else chain[0]
    verify = {k: min(v) + (chain[k - 1] - k * draft if 0 < k <= k_max else 0.0) for k, v in vt.items()}
    return Calibrated(verify, draft, catchup_per_token)


@dataclass(frozen=True)
class CalibrationSetup:
    """What the dummy rows time, handed over by the engine: its target (verifies return (logits, features) when
    the drafter reads features), its learned drafter (None: suffix drafts cost no
    model pass) and the limits K is chosen under."""

    target: Any  # the engine's `dvi.decode.target.TargetRunner` (rows get a scratch runner over its weights)
    verify_features: bool
    drafter: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context: int | None
    k_cap: int
    max_draft_tokens: int
    rows_kernel: bool | str = False  # the drafter's forwards on dvi's rows kernel, as it serves (`draft_cache`)


def calibrate_bucket(setup: CalibrationSetup, b: int, context: int = 128, reps: int = 3) -> Calibrated:
    """Draft and verify costs of batch size `b`, timed on `b` dummy rows of `context` tokens (capped so that
    K + 2 more still fit the target's context)."""
    if setup.max_context is not None:
        context = max(1, min(context, setup.max_context - setup.k_cap - 2))
    return calibrate(DummyRows(setup, b, context), max(1, setup.max_draft_tokens), reps, setup.k_cap)


class DummyRows:
    """b rows of `context` random tokens (one generator, seeded 0) with their own target and drafter
    caches: what `calibrate` times (`CalibrationRows`). Without a learned drafter
    (`suffix`) the draft forwards are no-ops: suffix drafts cost no model pass."""

    def __init__(self, setup: CalibrationSetup, b: int, context: int):
        self.setup, self.b, self.tokens = setup, b, b * context
        self.g = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, setup.vocab_size, (b, context), generator=self.g).tolist()
        self.sync = torch.cuda.synchronize if setup.device.type == "cuda" else (lambda: None)
        self.tkv = setup.target.scratch()
        self.tkv.admit(self.rows, False)
        self.dkv: DraftCache | None = None
        self.zeros = torch.zeros(b, dtype=torch.long, device=setup.device)

    def _ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, self.setup.vocab_size, (self.b, n), generator=self.g).to(self.setup.device)  # [b, n]

    def _drafter_fn(self, n: int):
        """The drafter callable for n inputs per row (an eagle head gets zero features: same cost)."""
        d = self.setup.drafter
        if not getattr(d, "needs_features", False):
            return d
        return d.with_features(torch.zeros(self.b, n, int(d.config.hidden_size), dtype=d.dtype, device=self.setup.device))

    def prefill_drafter(self) -> None:
        d = self.setup.drafter
        if d is None:
            return
        if getattr(d, "needs_features", False):  # eagle: its cache filled through the zero-feature callable
            self.dkv = RaggedDraftCache(d)
            self.dkv.kv = prefill(d.config, self._drafter_fn(len(self.rows[0])), self.rows, self.setup.device, d.dtype)
        else:  # the same cache the drafter's proposer serves with
            self.dkv = draft_cache(d, rows_kernel=self.setup.rows_kernel)
            self.dkv.rebuild(self.rows)

    def verify(self, k: int):
        """A verify and the argmax a greedy step takes of it (`greedy_tokens`, as the engine's: torch's `argmax` of 16
        bf16 rows x 5 x 49,152 took 13.7 ms of a 105 ms verify on Intel AMX, the step's vocabulary kernel ~1)."""
        ids = self._ids(k + 1)  # [b, K + 1]
        if self.setup.verify_features:  # the verify an eagle drafter needs also returns the target's features
            return lambda: greedy_tokens(self.tkv.forward(ids, True)[0]).tolist()
        return lambda: greedy_tokens(self.tkv.forward(ids, False)).tolist()

    def undo_verify(self, k: int) -> None:
        self.tkv.keep(k + 1, [0] * self.b)

    def draft(self, j: int):
        ids = self._ids(2 if j == 0 else 1)  # [b, 2] right after a verify (last draft + bonus), then [b, 1]
        if self.setup.drafter is None:
            return lambda: None
        fn = self._drafter_fn(ids.shape[1]) if getattr(self.setup.drafter, "needs_features", False) else None
        rows = ids.tolist()

        def run():
            out = self.dkv.forward_rows(rows, fn) if j == 0 else self.dkv.forward(ids, fn)
            return greedy_tokens(out[0] if isinstance(out, tuple) else out).tolist()

        return run

    def undo_drafts(self, n: int) -> None:
        if self.dkv is not None:
            self.dkv.keep(n, [0] * self.b)
