"""How a server runs the engine (`EngineOptions`): the settings a deployment chooses, apart from the engine's code,
so a caller builds them without the engine's imports."""

from __future__ import annotations

import dataclasses

from dvi.decode.sampling import GREEDY_BELOW_TEMPERATURE

__all__ = ["PACKED_AUTO_BYTES", "EngineOptions", "default_tree_width", "packed_weights", "prefill_share"]


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How a server runs the engine: temperatures below `greedy_below_temperature` are served as greedy (logits /
    1e-45 overflow); on CUDA the target's forwards replay graphs captured for up to `max_batch_size` rows."""

    greedy_below_temperature: float = GREEDY_BELOW_TEMPERATURE
    cuda_graphs: bool = True
    max_batch_size: int = 16
    cpu_packed_weights: bool = False  # forwards on oneDNN-prepacked weights (CPU: fp32, bf16 on AMX; `target_runner`)
    tree_width: int = 0  # at most this many siblings per drafted depth (draft trees, `dvi.decode.tree_pricing`)
    # adaptive K minimises the time until the batch's slowest row finishes (a fixed batch: `generate`, RL rollouts)
    # when True; a server that backfills finished rows maximises tokens per second instead (False)
    drain_aware: bool = True
    # the target's and the learned drafter's forwards (steps, verifies, prefills) through dvi's rows kernel (CPU, fp32
    # or bf16; `target_runner`, `draft_cache`): True for up to 16 rows, "auto" for as many as it is timed faster for
    # at start-up, False never
    cpu_rows_kernel: bool | str = False
    # prompt tokens that may join the batch in one step (at least one request joins a step with room, with the rest
    # of its cohort; 0: no limit): where answers of one length make rows finish together, a wave of joiners prefilled
    # in one step makes every one of them wait for all their prompts, and finish together again
    max_prefill_tokens: int = 0
    # prompts' leading tokens whose keys and values the target keeps for a later prompt that starts alike (a
    # template's system prompt, a GRPO group's samples of one prompt): `dvi.decode.prefix_cache`; 0: none
    prefix_cache_tokens: int = 0


def default_tree_width(adaptive: bool) -> int:
    """`speculation.tree_width: null` (a server, RL rollouts): 3 siblings a depth at most where adaptive K prices how
    many pay, chains with a fixed K (which would verify every sibling every step)."""
    return 3 if adaptive else 0


def prefill_share(prompts: list[tuple[int, str]], budget: int) -> int:
    """How many of the waiting prompts ((length, cohort), in order) join the batch this step under
    `EngineOptions.max_prefill_tokens`: as many as fit `budget` prompt tokens, at least one, and the rest of a cohort
    whose first joins (0: all)."""
    if budget <= 0:
        return len(prompts)
    n, total = 0, 0
    for length, cohort in prompts:
        total += length
        if n and total > budget and not (cohort and cohort == prompts[n - 1][1]):
            break
        n += 1
    return n


PACKED_AUTO_BYTES = 2 << 30  # `serve.cpu_packed_weights: auto` packs a target whose fp32 copy fits this


def packed_weights(setting: bool | str, target) -> bool:
    """`serve.cpu_packed_weights` resolved (`dvi serve`, and RL rollouts as it runs them): auto asks for a packed copy
    of a target of at most 2 GiB in fp32, since on a CPU whose BLAS runs few-row fp32 GEMMs slowly a verify is what
    decides whether drafting pays, and bf16 on AMX runs every forward on it (`dvi.decode.cpu_paths.pack_plan`; where
    no plan packs, the setting is a no-op)."""
    from dvi.models.loading import num_params

    if setting != "auto":
        return bool(setting)
    return num_params(target) * 4 <= PACKED_AUTO_BYTES
