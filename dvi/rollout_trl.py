"""TRL's ``GRPOTrainer(rollout_func=...)`` extension point (TRL >= 0.23; checked against 1.16) served by dvi.

A job of its own beside `dvi.rollout`: the rollout engine knows nothing of TRL; this adapter speaks TRL's calling
convention (prompts as text, chats or ids; the trainer's sampling settings; its per-step metrics) and syncs the
GRPO policy's weights into the dvi target whenever the trainer's ``global_step`` moved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dvi.rollout import Rollout, RolloutEngine, RolloutStats, policy_state_dict, validate_prompts

__all__ = ["SamplingOverrides", "TRLRolloutFunc", "trl_rollout_func"]


@dataclass(frozen=True)
class SamplingOverrides:
    """Sampling settings that replace the GRPO trainer's own; None keeps the trainer's (or, where it has none,
    temperature 1, top-p 1, no top-k, 64 new tokens)."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # step i samples with seed + i; None: unseeded

    def resolve(self, trainer: Any) -> dict[str, Any]:
        """`generate_rollouts` keyword arguments for the trainer's current step."""

        def pick(mine: Any, theirs: Any, default: Any) -> Any:
            if mine is not None:
                return mine
            return theirs if theirs is not None else default

        step = int(trainer.state.global_step)
        return {
            "max_new_tokens": int(pick(self.max_new_tokens, getattr(trainer, "max_completion_length", None), 64)),
            "temperature": float(pick(self.temperature, getattr(trainer, "temperature", None), 1.0)),
            "top_p": float(pick(self.top_p, getattr(trainer, "top_p", None), 1.0)),
            "top_k": int(pick(self.top_k, getattr(trainer, "top_k", None), 0) or 0),
            "seed": None if self.seed is None else self.seed + step,
            "stop_token_ids": list(getattr(trainer, "eos_token_ids", None) or []) or None,
        }


class TRLRolloutFunc:
    """Callable for ``trl.GRPOTrainer(rollout_func=...)`` that generates with dvi.

    TRL 1.16 calls ``rollout_func(prompts, trainer)`` with the per-process slice of the
    generation batch (its sampler already repeats each prompt ``num_generations`` times) and
    requires a dict with ``prompt_ids``, ``completion_ids`` and ``logprobs`` (one entry per
    prompt it passed); other keys are forwarded to the reward functions. So this returns one
    completion per prompt entry, plus ``dvi_alpha`` / ``dvi_target_version`` /
    ``dvi_drafter_version`` per completion for rewards or logging.

    Before generating it copies the GRPO policy's weights into the dvi target whenever
    ``trainer.state.global_step`` changed since the last sync (and on the first call), tagging
    the target with ``version = global_step``. Sampling settings default to the trainer's
    (``temperature``, ``top_p``, ``top_k``, ``max_completion_length``, eos ids); a `SamplingOverrides`
    replaces any of them. With `log_metrics`, α, mean accepted length, tokens/s and the versions of each
    generation batch join the trainer's logged metrics under the `dvi.metrics` names.
    """

    def __init__(
        self,
        rollout_engine: RolloutEngine,
        sync_weights: bool = True,
        sampling: SamplingOverrides = SamplingOverrides(),
        on_rollouts: Callable[[list[Rollout], RolloutStats, Any], None] | None = None,
        log_metrics: bool = True,
    ) -> None:
        self.rollouts = rollout_engine
        self.log_metrics = log_metrics
        self.sync_weights = sync_weights
        self.sampling = sampling
        self.on_rollouts = on_rollouts
        self.last_synced_step: int | None = None
        self.num_syncs = 0
        self.history: list[dict[str, float | int]] = []

    def _maybe_sync(self, trainer: Any) -> None:
        step = int(trainer.state.global_step)
        if not self.sync_weights or step == self.last_synced_step:
            return
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        if model is self.rollouts.target:
            # Same module object: nothing to copy, only the version moves.
            self.rollouts.engine.target_version = step
        else:
            self.rollouts.update_target_weights(policy_state_dict(model), version=step)
        self.last_synced_step = step
        self.num_syncs += 1

    def _tokenize(self, prompts: list, trainer: Any) -> list[list[int]]:
        tok = trainer.processing_class
        if prompts and isinstance(prompts[0], list) and prompts[0] and isinstance(prompts[0][0], dict):
            enc = tok.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                          return_dict=True, **getattr(trainer, "chat_template_kwargs", {}))
            return [list(x) for x in enc["input_ids"]]
        if prompts and isinstance(prompts[0], str):
            return [list(x) for x in tok(text=prompts)["input_ids"]]
        return validate_prompts(prompts)  # already token ids

    @staticmethod
    def _log_to_trainer(stats: RolloutStats, trainer: Any) -> None:
        """Put α & co. into GRPOTrainer's own per-step metrics, so they reach its loggers (wandb, ...).

        Uses `trainer._metrics[mode]` (lists TRL averages at each log step); skipped when absent.
        """
        from dvi import metrics as M

        store = getattr(trainer, "_metrics", None)
        if not isinstance(store, dict):
            return
        model = getattr(trainer, "model", None)
        mode = "train" if getattr(model, "training", True) else "eval"
        if mode not in store:
            return
        values = {
            M.ACCEPTANCE_RATE: stats.alpha,
            M.MEAN_ACCEPTED_LENGTH: stats.mean_accepted_length,
            M.TOKENS_PER_SECOND: stats.tokens_per_s,
            M.TARGET_VERSION: float(stats.target_version),
            M.DRAFTER_VERSION: float(stats.drafter_version),
        }
        for name, value in values.items():
            if value is not None:  # no data (nothing drafted): leave a gap, not a false number
                store[mode][name].append(float(value))

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        self._maybe_sync(trainer)
        prompt_ids = self._tokenize(prompts, trainer)
        rollouts = self.rollouts.generate_rollouts(prompt_ids, n=1, **self.sampling.resolve(trainer))
        stats = self.rollouts.last_stats
        assert stats is not None
        self.history.append({"global_step": int(trainer.state.global_step), **stats.as_dict()})
        if self.log_metrics:
            self._log_to_trainer(stats, trainer)
        if self.on_rollouts is not None:
            self.on_rollouts(rollouts, stats, trainer)
        return {
            "prompt_ids": [r.prompt_ids for r in rollouts],
            "completion_ids": [r.completion_ids for r in rollouts],
            "logprobs": [r.logprobs for r in rollouts],
            "dvi_alpha": [r.alpha for r in rollouts],
            "dvi_target_version": [r.target_version for r in rollouts],
            "dvi_drafter_version": [r.drafter_version for r in rollouts],
        }


def trl_rollout_func(engine: Any, **kwargs: Any) -> TRLRolloutFunc:
    """``GRPOTrainer(..., rollout_func=trl_rollout_func(engine))``: dvi as TRL's generator.

    `engine` is a `RolloutEngine` or a bare `SpeculativeEngine` (wrapped here); `kwargs` go to
    `TRLRolloutFunc` (``sync_weights``, ``sampling=SamplingOverrides(...)``, ``on_rollouts``, ``log_metrics``).
    """
    re = engine if isinstance(engine, RolloutEngine) else RolloutEngine(engine)
    return TRLRolloutFunc(re, **kwargs)
