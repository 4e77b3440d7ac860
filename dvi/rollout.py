"""Rollouts for RL trainers: n speculative samples per prompt, with the target's log-probs.

An RL trainer (GRPO, REINFORCE, PPO) needs, for every sampled completion, the token ids and
the log-probability the *current policy* gave each sampled token. `RolloutEngine` gets both
from one `SpeculativeEngine.generate` call: rejection sampling keeps every emitted token
distributed exactly as the target's (warped) distribution, so speculation changes speed, not
the samples. Between rollout batches the trainer pushes its new weights with
`update_target_weights(state_dict_or_path, version)`; every result and feedback record then
carries that target version, so the online drafter trainer learns the current policy rather
than an old one.

Log-prob convention (the same as TRL's GRPO loss and the engine's `token_logprobs`):
``log_softmax(logits / T)[token]`` of the target, with ``T`` the sampling temperature (``T=1``
when greedy). top-k / top-p truncation is *not* applied to the reported value, so it can be
compared with a plain forward pass of the policy at the same temperature.

Speed: the engine prices every step (adaptive K, `SpeculativeEngine(adaptive=True)`; off in the engine's own
default, on in `RolloutEngine.speculative` and `trainers.rl`): a full batch decodes plainly where drafts would not
pay, so speculation never costs more than the calibrated costs allow, and the goodput guard switches history
lookups off where drafting measured slower. The drafts that pay in RL are a prompt's own history
(`dvi.rollout_history`, kind `history`): its earlier rollouts (previous steps or epochs, SPEC-RL's draft) and its
GRPO siblings while they run, as point masses (docs/design.md says why not SPEC-RL's rule); with trees (the
default, `rollout_options`) the row's own text and the other rows' (siblings, earlier rollouts) each propose and
the runner-up joins the best as a second branch, with chains each row's draft positions are priced one by one;
`add_history` feeds rollouts made elsewhere (another worker, an earlier run) into the same index.

TRL's ``GRPOTrainer(rollout_func=...)`` adapter over a `RolloutEngine` is `dvi.rollout_trl`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dvi.decode.results import DraftCounts, GenerationResult
from dvi.feedback import FeedbackRecord, FeedbackWriter

if TYPE_CHECKING:
    from dvi.drafters.learned import Drafter
    from dvi.engine.options import EngineOptions
    from dvi.engine.speculative import SpeculativeEngine

__all__ = [
    "Rollout",
    "RolloutStats",
    "RolloutEngine",
    "policy_state_dict",
    "rollout_options",
    "validate_prompts",
]


@dataclass(kw_only=True)
class Rollout(GenerationResult):
    """One sampled completion of one prompt: the engine's record of it, plus its place in the batch.

    `completion_ids` and `logprobs` are the record's `token_ids` and `token_logprobs` under the names RL
    trainers use; `logprobs[j]` is the target's ``log_softmax(logits / T)`` of `completion_ids[j]` (see the
    module docstring).
    """

    prompt_index: int
    sample_index: int

    @classmethod
    def of(cls, result: GenerationResult, prompt_index: int, sample_index: int) -> Rollout:
        """The result's fields shared, not copied (the engine is done with them)."""
        return cls(prompt_index=prompt_index, sample_index=sample_index,
                   **{f.name: getattr(result, f.name) for f in fields(GenerationResult)})

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.token_logprobs


@dataclass
class RolloutStats(DraftCounts):
    """Aggregates of one `generate_rollouts` call (what an RL dashboard plots per step): its `DraftCounts`
    (α, mean accepted length) summed over the batch; every rate is None when it has no data (`dvi.decode.results`)."""

    num_sequences: int
    num_tokens: int
    seconds: float
    target_version: int
    drafter_version: int
    num_speculated_tokens: int = 0  # tokens emitted by engine steps that drafted (K > 0)

    @property
    def speculated_share(self) -> float | None:
        """Share of the batch's tokens generated with speculation on (adaptive K > 0)."""
        return self.num_speculated_tokens / self.num_tokens if self.num_tokens else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.num_tokens / self.seconds if self.seconds > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "seconds": self.seconds,
            "num_steps": self.num_steps,
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "alpha": self.alpha,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "target_version": self.target_version,
            "drafter_version": self.drafter_version,
            "num_speculated_tokens": self.num_speculated_tokens,
            "speculated_share": self.speculated_share,
        }


def _check_sampling(n: int, max_new_tokens: int, temperature: float) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")


def validate_prompts(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
            raise TypeError(f"prompts[{i}] must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty")
        out.append([int(t) for t in p])
    return out


class RolloutEngine:
    """Batched speculative rollouts over a `dvi.engine.speculative.SpeculativeEngine`.

    Owns no decoding: it replicates prompts `n` times, calls `engine.generate`, regroups the
    results and (optionally) writes one feedback record per sequence. Build the engine with
    ``feedback_top_k > 0`` when records feed the online drafter trainer (its KL loss needs the
    target's top-k).
    """

    def __init__(
        self,
        engine: SpeculativeEngine,
        feedback_writer: FeedbackWriter | None = None,
        domain: str = "rl",
        stop_token_ids: Sequence[int] | None = None,
        max_batch_size: int | None = None,
    ) -> None:
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.engine = engine
        self.feedback_writer = feedback_writer
        self.domain = domain
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else None
        self.max_batch_size = max_batch_size
        self.last_stats: RolloutStats | None = None
        self.last_results: list[GenerationResult] = []  # the engine's results of the last batch
        self._last_records: list[FeedbackRecord] | None = None  # their records, once asked for
        self._calls = 0
        self._history = 0  # rollouts added with `add_history`

    @classmethod
    def speculative(cls, target: torch.nn.Module, kind: str = "history", drafter: Any = None, *,
                    adaptive: bool = True, num_draft_tokens: int = 3, max_draft_tokens: int = 4,
                    suffix_settings: Any = None, engine_options: Any = None, **kwargs: Any) -> RolloutEngine:
        """A `RolloutEngine` over a new `SpeculativeEngine` on `target`, priced per step (adaptive K) by default.

        `kind`: ``history`` (a prompt's earlier rollouts and live siblings, `dvi.rollout_history`), ``history_hybrid``
        (that index, else `drafter` where no proposal clears the bar), or any `dvi.drafters.factory` kind
        (``none``, ``suffix``, ``hybrid``, a learned kind with `drafter`). `kwargs` go to `RolloutEngine`.
        `engine_options` default: `rollout_options(target, adaptive)`."""
        from dvi.drafters.factory import make_proposer, proposer_for_drafter
        from dvi.engine.speculative import SpeculativeEngine
        from dvi.rollout_history import history_proposer

        vocab = int(target.get_output_embeddings().weight.shape[0])
        device = next(target.parameters()).device
        if kind in ("history", "history_hybrid"):
            proposer = history_proposer(vocab, device, settings=suffix_settings)
            if kind == "history_hybrid":
                from dvi.drafters.hybrid_proposer import HybridProposer

                if drafter is None:
                    raise ValueError("kind history_hybrid needs a drafter")
                threshold = getattr(suffix_settings, "threshold", 1.0)
                proposer = HybridProposer(proposer_for_drafter(drafter, vocab, device), proposer, threshold)
        else:
            proposer = make_proposer(kind, drafter, vocab, device, settings=suffix_settings)
        engine = SpeculativeEngine(target, proposer, num_draft_tokens=num_draft_tokens, adaptive=adaptive,
                                   max_draft_tokens=max_draft_tokens,
                                   options=engine_options or rollout_options(target, adaptive))
        return cls(engine, **kwargs)

    # -- versions -------------------------------------------------------------------------
    @property
    def target_version(self) -> int:
        return int(getattr(self.engine, "target_version", 0))

    @property
    def drafter_version(self) -> int:
        return int(getattr(self.engine, "drafter_version", 0))

    @property
    def target(self) -> torch.nn.Module:
        return self.engine.target

    # -- weights --------------------------------------------------------------------------
    def update_target_weights(
        self, state_dict_or_path: Mapping[str, torch.Tensor] | str | Path, version: int | None = None
    ) -> int:
        """Swap the target's weights in place (between rollout batches); returns the new version.

        `version` defaults to the current one + 1, so a trainer that does not track versions
        still gets records tagged with distinct policies.
        """
        if version is None:
            version = self.target_version + 1
        self.engine.update_target_weights(state_dict_or_path, int(version))
        return int(version)

    def set_drafter(self, drafter: torch.nn.Module | Drafter | None, version: int) -> None:
        """Hot-swap the drafter (e.g. a new adapter from the online trainer); next batch uses it."""
        self.engine.set_drafter(drafter, int(version))

    # -- history --------------------------------------------------------------------------
    def add_history(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], seq_id: str | None = None) -> None:
        """A rollout of `prompt_ids` made elsewhere (another worker, an earlier run or epoch) joins the history index,
        as a finished row of this engine would (its prompt's tail in front, so a later sample of the same prompt
        drafts its first tokens from it); a no-op for kinds without history."""
        from dvi.drafters.suffix_proposer import finished_entry

        self._history += 1
        self.engine.add_history(seq_id or f"rollout-history-{self._history}",
                                finished_entry(list(prompt_ids), [int(t) for t in completion_ids]))

    # -- rollouts -------------------------------------------------------------------------
    def generate_rollouts(
        self,
        prompts: Sequence[Sequence[int]],
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[Rollout]:
        """`n` samples for each prompt, ordered prompt-major (all of prompt 0's samples first).

        The batch of ``len(prompts) * n`` sequences decodes together (in chunks of
        `max_batch_size` if set). `seed` makes the batch reproducible: sequence `i` of the
        flattened batch is seeded with ``seed + i`` (the engine's convention), whatever the chunking.
        """
        plist = validate_prompts(prompts)
        _check_sampling(n, max_new_tokens, temperature)
        stops = list(stop_token_ids) if stop_token_ids is not None else self.stop_token_ids
        flat = [(i, s, p) for i, p in enumerate(plist) for s in range(n)]
        spec0 = int(getattr(self.engine, "tokens_speculated", 0))
        t0 = time.perf_counter()
        results = self._generate_chunks([p for _, _, p in flat], dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            stop_token_ids=stops), seed)
        seconds = time.perf_counter() - t0
        self._calls += 1
        self.last_results, self._last_records = results, None
        out = [Rollout.of(r, i, s) for (i, s, _), r in zip(flat, results, strict=True)]
        if self.feedback_writer is not None:
            for rec in self.last_records():
                self.feedback_writer.write(rec)
        speculated = int(getattr(self.engine, "tokens_speculated", 0)) - spec0
        self.last_stats = self._stats(out, seconds, speculated)
        return out

    def _generate_chunks(self, prompts: list[list[int]], sampling: dict[str, Any],
                         seed: int | None) -> list[GenerationResult]:
        """`engine.generate` over `max_batch_size` chunks; row i keeps seed + i whatever the chunking."""
        chunk = self.max_batch_size or len(prompts) or 1
        results: list[GenerationResult] = []
        for start in range(0, len(prompts), chunk):
            results.extend(self.engine.generate(prompts[start: start + chunk],
                                                seed=None if seed is None else seed + start, **sampling))
        return results

    def _stats(self, out: list[Rollout], seconds: float, speculated: int) -> RolloutStats:
        return RolloutStats(
            num_sequences=len(out),
            num_tokens=sum(len(r.completion_ids) for r in out),
            seconds=seconds,
            num_steps=sum(r.num_steps for r in out),
            num_drafted=sum(r.num_drafted for r in out),
            num_accepted=sum(r.num_accepted for r in out),
            target_version=self.target_version,
            drafter_version=self.drafter_version,
            num_speculated_tokens=speculated,
        )

    def last_records(self) -> list[FeedbackRecord]:
        """FeedbackRecords of the last batch (what the feedback log and an in-process drafter trainer consume),
        built once per batch."""
        if self._last_records is None:
            self._last_records = [FeedbackRecord.from_result(r, domain=self.domain) for r in self.last_results]
        return self._last_records

    def flush_feedback(self) -> str | None:
        """Write buffered records now (so a trainer tailing the log sees this batch)."""
        if self.feedback_writer is None:
            return None
        return self.feedback_writer.flush()


# -- policy weights ---------------------------------------------------------------------------


def rollout_options(target: torch.nn.Module, adaptive: bool = True, tree_width: int | None = None) -> EngineOptions:
    """How rollouts run the engine, as `dvi serve` runs it by default: on a CPU dvi's kernels and oneDNN's packs where
    they win (`serve.cpu_rows_kernel`, `serve.cpu_packed_weights`), a prefix cache (`serve.prefix_cache_tokens`: a
    GRPO group's samples of one prompt prefilled once), and draft trees where adaptive K prices their siblings
    (`tree_width` None: `speculation.tree_width`'s default). `RolloutEngine.speculative` and `trainers.rl` read it."""
    from dvi.config_serve import DEFAULT_PREFIX_CACHE_TOKENS
    from dvi.engine.options import EngineOptions, default_tree_width, packed_weights

    return EngineOptions(cpu_rows_kernel="auto", cpu_packed_weights=packed_weights("auto", target),
                         prefix_cache_tokens=DEFAULT_PREFIX_CACHE_TOKENS,
                         tree_width=default_tree_width(adaptive) if tree_width is None else int(tree_width))


def policy_state_dict(model: torch.nn.Module, adapted_only: bool = False) -> dict[str, torch.Tensor]:
    """Plain (un-wrapped, LoRA-merged) state dict of a policy, keyed like its base HF model.

    A peft-wrapped policy's LoRA layers are merged out of place (W + ΔW, computed in float32 and
    stored in W's dtype), so the policy itself is never touched: merging and unmerging a bf16 base
    in place would drift its weights by a rounding error every step. With `adapted_only`, only
    the LoRA-merged weights are returned: all a target that started from the same base needs
    each step (`update_target_weights` takes partial state dicts), at a fraction of the copy.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {k: v.detach() for k, v in model.state_dict().items()}
    merged = _merged_lora_weights(model)
    if adapted_only:
        return merged
    saved = f".modules_to_save.{getattr(model, 'active_adapter', 'default')}."
    out = {}
    for k, v in model.get_base_model().state_dict().items():
        if "lora_" in k or ".original_module." in k or (".modules_to_save." in k and saved not in k):
            continue
        out[k.replace(saved, ".").replace(".base_layer.", ".")] = v.detach().clone()
    out.update(merged)
    return out


def _merged_lora_weights(model: Any) -> dict[str, torch.Tensor]:
    """``{"<module>.weight": W + ΔW}`` for every LoRA layer of a peft model's active adapter."""
    from peft.tuners.lora import LoraLayer

    active = getattr(model, "active_adapter", "default")
    out = {}
    with torch.no_grad():
        for name, module in model.get_base_model().named_modules():
            if not isinstance(module, LoraLayer) or active not in module.scaling:
                continue
            w = module.get_base_layer().weight
            merged = w.detach().float()
            if not getattr(module, "merged", False) and not getattr(module, "disable_adapters", False):
                merged = merged + module.get_delta_weight(active).float()
            out[f"{name}.weight"] = merged.to(w.dtype)
    return out
