"""The target's side of the engine: its KV cache and forward behind one small interface (`TargetRunner`).

Two implementations: `LeanTarget` (Llama-family targets: `dvi.decode.lean`'s fused forward over a static
per-slot cache; no holes, so a rejected draft costs nothing to undo) and `RaggedTarget` (any HF causal LM:
its module forward over a `dvi.decode.kv.RaggedKV`). The engine keeps one of them and never looks inside.

Between steps the target's cache holds every token of a row but the last emitted one (the engine's `_last`).
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Protocol

import torch
from torch import nn

from dvi.decode.forward import model_forward
from dvi.decode.invariance import probe, rows_agree
from dvi.decode.kv import RaggedKV, prefill
from dvi.decode.lean import LeanModel, lean_supported
from dvi.decode.lean_target import LeanTarget
from dvi.decode.numerics import is_exact_greedy
from dvi.decode.prefix_cache import BLOCK, PrefixCache
from dvi.decode.rows_kernel import option_rows

__all__ = ["CpuMatmuls", "TargetRunner", "LeanTarget", "RaggedTarget", "target_runner", "plain_greedy",
           "with_prefix_cache"]

Features = list[torch.Tensor | None] | None
log = logging.getLogger(__name__)


class TargetRunner(Protocol):
    """What the engine asks of its target."""

    batch_size: int
    max_rows: int | None  # rows the runner can hold at once (captured graphs' fixed cache); None: no limit
    trees: bool  # whether `forward` scores draft trees (`tree`) and `keep_path` keeps their accepted paths
    ragged: bool  # whether a batch `forward` with `lens` scores only real drafts (padding costs nothing)
    prefix: PrefixCache | None  # prompts' leading keys and values kept for reuse (`with_prefix_cache`)

    def admit(self, contexts: list[list[int]], features: bool, lazy: bool = False) -> Features:
        """Rows holding `contexts` join at the end of the batch; with `features`, each row's final normed hidden
        states [len(context), H] (None for an empty context). `lazy`: the runner may prefill them inside the next
        `forward` instead (then no features)."""

    def forward(self, ids: torch.Tensor, features: bool, tree: list[list[int]] | None = None,
                lens: list[int] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Score ids [B, q] after each row's cached tokens: logits [B, q, V] (and features [B, q, H]); `tree` the
        parents of each row's nodes 1..q-1 (`dvi.decode.tree_attention`), only where `trees`; `lens` row i's real
        drafts: a runner may leave positions past them unscored (zero logits; their keys unwritten)."""

    def keep_path(self, paths: list[list[int]]) -> None:
        """After a tree forward, row i keeps its root and the nodes paths[i], in that order."""

    def keep(self, q: int, kept: list[int]) -> None:
        """After a forward of width q, row i keeps the first kept[i] of its q new entries."""

    def select_rows(self, keep: list[int]) -> None:
        """Only rows `keep` stay, in that order."""

    def rebuild(self, contexts: list[list[int]], features: bool) -> Features:
        """Recompute every row's cache from its tokens (new weights)."""

    def scratch(self) -> TargetRunner:
        """An empty runner over the same weights with its own cache (cost calibration's dummy rows)."""

    def tidy(self, speculating: bool) -> None:
        """Between steps: reclaim what rejected drafts left (RaggedKV's holes); a no-op for slots."""

    def reserve(self, rows: int, positions: int) -> int:
        """Cache room for `rows` rows of `positions` tokens now rather than as requests arrive; the bytes it holds."""

    def use_prefix_cache(self, tokens: int) -> str | None:
        """Keep prompts' leading keys and values for up to `tokens` positions (`prefix`); None, or why not."""


class RaggedTarget:
    """Any HF causal LM through its module forward (`dvi.decode.forward.model_forward`) over a `RaggedKV`."""

    prefix = None  # HF's forward: no prefix cache (`use_prefix_cache` says why)

    def __init__(self, model: nn.Module):
        self.model = model
        p0 = next(model.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.fn = model_forward(model)
        self._fn_features = None
        self.kv = RaggedKV(model.config, 0, self.device, self.dtype)

    @property
    def batch_size(self) -> int:
        return self.kv.batch_size

    max_rows = None
    trees = False  # HF's module forward over a RaggedKV verifies chains only
    ragged = False  # and scores every position of its [B, q]

    def _fn(self, features: bool):
        if not features:
            return self.fn
        if self._fn_features is None:
            self._fn_features = model_forward(self.model, with_features=True)
        return self._fn_features

    def _prefill(self, contexts: list[list[int]], features: bool) -> tuple[RaggedKV, Features]:
        if not features:
            return prefill(self.model.config, self.fn, contexts, self.device, self.dtype), None
        kv, out = prefill(self.model.config, self._fn(True), contexts, self.device, self.dtype, return_output=True)
        # [len(c), H] per row, left padding cut
        feats = [out[1][i, out[1].shape[1] - len(c):] if out is not None and len(c) else None
                 for i, c in enumerate(contexts)]
        return kv, feats

    def admit(self, contexts: list[list[int]], features: bool, lazy: bool = False) -> Features:
        kv, feats = self._prefill(contexts, features)
        self.kv.merge(kv)
        return feats

    def forward(self, ids: torch.Tensor, features: bool, lens: list[int] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.kv.forward(self._fn(features), ids)

    def keep(self, q: int, kept: list[int]) -> None:
        self.kv.rollback(q, torch.tensor(kept, dtype=torch.long, device=self.device))

    def select_rows(self, keep: list[int]) -> None:
        self.kv.select_rows(torch.tensor(keep, dtype=torch.long, device=self.device))

    def rebuild(self, contexts: list[list[int]], features: bool) -> Features:
        self.kv, feats = self._prefill(contexts, features)
        return feats

    def scratch(self) -> RaggedTarget:
        other = RaggedTarget.__new__(RaggedTarget)
        other.model, other.device, other.dtype = self.model, self.device, self.dtype
        other.fn, other._fn_features = self.fn, self._fn_features
        other.kv = RaggedKV(self.model.config, 0, self.device, self.dtype)
        return other

    @property
    def contract(self) -> dict[str, str]:
        """HF's module forward attends a verify row by row, but its matmuls' rounding was not probed."""
        return {"one_request": "near-tie", "batched": "near-tie"}

    def reserve(self, rows: int, positions: int) -> int:
        return 0  # a RaggedKV is rebuilt by every merge: there is nothing to hold ahead

    def use_prefix_cache(self, tokens: int) -> str | None:
        return "the target runs through HF's forward (dvi's lean forward does not serve it)"

    def tidy(self, speculating: bool) -> None:
        # While speculation is off (K = 0) holes left by earlier steps are pure overhead on every plain step.
        self.kv.maybe_compact(0.3 if speculating else 0.1)


class CpuMatmuls(NamedTuple):
    """The matmuls of a target's forwards on a CPU in fp32 (elsewhere no-ops). `packed`: forwards of more than one row
    on oneDNN-prepacked weights (`LeanModel.pack_multirow`). `rows_kernel`: forwards of up to `KERNEL_ROWS` rows (True)
    or of as many as it is timed faster for ("auto") through dvi's rows kernel (`LeanModel.use_rows_kernel`)."""

    packed: bool = False
    rows_kernel: bool | str = False


def target_runner(model: nn.Module, lean: bool = True, max_width: int = 17, graphs: bool = True,
                  max_batch: int = 16, max_context: int | None = None, cpu: CpuMatmuls = CpuMatmuls(),
                  tree_width: int = 0) -> TargetRunner:
    """`LeanTarget` where the architecture allows (and `lean`), else `RaggedTarget`. A lean target pads its
    matmuls to the row floor `dvi.decode.invariance.probe` measured for verifies up to `max_width` positions,
    and with `dvi.decode.numerics.set_exact_greedy` keeps every row of a batch bit-equal to its plain decode.
    On CUDA (`graphs`, not the exact mode) its forwards of up to `max_batch` rows, `max_width` positions and
    `max_context` columns replay captured graphs (`dvi.decode.graphs`). `cpu`: which matmuls a CPU in fp32 runs
    (`CpuMatmuls`), probed as they run. `tree_width`: the widest draft tree's verify (positions), probed too where an
    eager verify may score trees."""
    if not lean or lean_supported(model) is not None:
        return RaggedTarget(model)
    lm = LeanModel(model)
    if cpu.packed:
        lm.pack_multirow()
    if cpu.rows_kernel:
        lm.use_rows_kernel(option_rows(cpu.rows_kernel))
    if lm.pack_plan.alike:
        _check_packs_alike(lm)
    exact = is_exact_greedy(model)
    inv = probe(lm, max(max_width, tree_width), exact=exact, max_rows=max_batch * max_width)
    lm.row_chunk = inv.row_chunk
    captured = None
    if graphs and lm.device.type == "cuda" and not exact:
        from dvi.decode.graphs import GraphedForward

        captured = GraphedForward(lm, max_batch, max_width, max_context or lm.max_position, progress=True)
    return LeanTarget(lean=lm, exact=exact, min_rows=inv.min_rows or 1, invariance=inv, graphs=captured)


def _check_packs_alike(lm: LeanModel) -> None:
    """Where oneDNN's packs serve forwards promising each row a lone row's bits (`PackPlan.alike`, bf16 on AMX), check
    it on the model's own matmuls before a batch's greedy contract rests on it; where it fails, no promise."""
    alike = lm.pack_plan.alike
    ok = rows_agree(lm, 1, alike, 0)
    if not ok:
        lm.pack_plan = lm.pack_plan._replace(alike=0)
    log.info("%s on oneDNN's packed weights%s: rows of matmuls of up to %d rows %s", str(lm.dtype).removeprefix("torch."),
             " for every forward" if not lm.kernel_rows else f" past {lm.kernel_rows} rows", alike,
             "round as lone rows (checked; wider ones run in pieces)" if ok else "do NOT round as lone rows here")


def with_prefix_cache(runner: TargetRunner, tokens: int) -> TargetRunner:
    """`runner` keeping prompts' leading keys and values for up to `tokens` positions (`LeanTarget.use_prefix_cache`)
    where it can; logged either way (0: nothing, not logged)."""
    if tokens:
        why = runner.use_prefix_cache(tokens)
        if why:
            log.info("prefix cache off: %s", why)
        else:
            log.info("prefix cache: prompts' first %d tokens in blocks of %d kept for reuse (%.0f MiB; "
                     "serve.prefix_cache_tokens)", runner.prefix.blocks * BLOCK, BLOCK, runner.prefix.nbytes / 2**20)
    return runner


@torch.inference_mode()
def plain_greedy(target: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The target's own greedy decoding as the engine serves it without speculation (its runner: prefill of the
    prompt but its last token, then 1-token steps): n tokens and each step's logits [V] (fp32), the reference
    `dvi.decode.sampling.first_divergence` judges another decode against."""
    run = target_runner(target)
    dev = next(target.parameters()).device
    run.admit([list(prompt[:-1])], False)
    last, out, steps = prompt[-1], [], []
    for _ in range(n):
        logits = run.forward(torch.tensor([[last]], device=dev), False)[0, -1].float()
        run.keep(1, [1])
        steps.append(logits)
        last = int(logits.argmax())
        out.append(last)
    return out, steps
