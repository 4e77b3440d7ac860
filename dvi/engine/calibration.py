"""The dummy rows the engine hands to `dvi.decode.adaptive.calibrate` (its `CalibrationRows`): b rows of random
tokens with their own target and drafter caches, so cost calibration never touches in-flight requests.

Kept apart from `dvi.engine.speculative`, whose job is serving real rows; this module only times forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dvi.decode.adaptive import Calibrated, calibrate
from dvi.decode.kv import prefill
from dvi.drafters.draft_cache import DraftCache, RaggedDraftCache, draft_cache

__all__ = ["CalibrationSetup", "DummyRows", "calibrate_bucket"]


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


def calibrate_bucket(setup: CalibrationSetup, b: int, context: int = 128, reps: int = 3) -> Calibrated:
    """Draft and verify costs of batch size `b`, timed on `b` dummy rows of `context` tokens (capped so that
    K + 2 more still fit the target's context)."""
    if setup.max_context is not None:
        context = max(1, min(context, setup.max_context - setup.k_cap - 2))
    return calibrate(DummyRows(setup, b, context), max(1, setup.max_draft_tokens), reps, setup.k_cap)


class DummyRows:
    """b rows of `context` random tokens (one generator, seeded 0) with their own target and drafter
    caches: what `dvi.decode.adaptive.calibrate` times (`dvi.decode.adaptive.CalibrationRows`). Without a learned drafter
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
            self.dkv = draft_cache(d)
            self.dkv.rebuild(self.rows)

    def verify(self, k: int):
        ids = self._ids(k + 1)  # [b, K + 1]
        if self.setup.verify_features:  # the verify an eagle drafter needs also returns the target's features
            return lambda: self.tkv.forward(ids, True)[0].argmax(-1).tolist()
        return lambda: self.tkv.forward(ids, False).argmax(-1).tolist()

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
            return (out[0] if isinstance(out, tuple) else out).argmax(-1).tolist()

        return run

    def undo_drafts(self, n: int) -> None:
        if self.dkv is not None:
            self.dkv.keep(n, [0] * self.b)
