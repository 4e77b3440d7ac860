"""How a server builds its engine, wherever it runs (`serving.wiring` in the server's process, `serving.engine_core`
in the engine's own): the engine a server decodes with (`serving_engine`), made ready to serve (`ready_to_serve`:
adaptive K calibrated, the KV cache allocated) or, behind vLLM, vLLM started (`start_engine`), and the scheduler over
it (`local_scheduler`)."""

from __future__ import annotations

import logging
import time
from typing import Any

from dvi.config import DviConfig
from dvi.decode.step_costs import batch_bucket
from dvi.engine.options import packed_weights
from dvi.engine.speculative import EngineOptions, SpeculativeEngine
from dvi.memory import HeapTrimmer
from dvi.rundir import RunDir

from .loading import serving_proposer
from .scheduler import Scheduler

log = logging.getLogger("dvi.serving")


def serving_engine(cfg: DviConfig, pair: Any) -> SpeculativeEngine:
    """The engine a server decodes with (its proposer, K rule, feedback top-k): also what the demo's frozen
    reference decodes with, so the served α and that reference are read the same way."""
    spec = cfg.speculation
    return SpeculativeEngine(
        pair.target, serving_proposer(cfg, pair), num_draft_tokens=spec.num_draft_tokens, adaptive=spec.adaptive,
        max_draft_tokens=spec.max_draft_tokens, feedback_top_k=cfg.feedback.top_k,
        options=EngineOptions(cfg.sampling.greedy_below_temperature, cfg.serve.cuda_graphs, cfg.serve.max_batch_size,
                              packed_weights(cfg.serve.cpu_packed_weights, pair.target), spec.tree_width,
                              drain_aware=False,  # rows are backfilled as they finish: throughput is the goal
                              cpu_rows_kernel=cfg.serve.cpu_rows_kernel,
                              max_prefill_tokens=prefill_budget(cfg.serve.max_prefill_tokens, pair.target),
                              prefix_cache_tokens=cfg.serve.prefix_cache_tokens),
    )


PREFILL_TOKENS = {"cpu": 64, "cuda": 8192}  # `serve.max_prefill_tokens: null` per device type (else: no limit)


def prefill_budget(setting: int | None, target) -> int:
    """`serve.max_prefill_tokens` resolved for the target's device (0: no limit)."""
    if setting is not None:
        return int(setting)
    return PREFILL_TOKENS.get(next(target.parameters()).device.type, 0)


def ready_to_serve(engine: SpeculativeEngine, cfg: DviConfig) -> None:
    """What a server does to its engine before the first request: adaptive K's costs measured for every batch bucket
    (so no request pays for a calibration the first time the running batch reaches a new size) and the target's KV
    cache allocated for `serve.kv_cache_tokens`. Also what `benchmarks/field_engine.py` does to its engines."""
    if cfg.speculation.adaptive and engine.proposer.name != "none":
        buckets = sorted({batch_bucket(n) for n in range(1, cfg.serve.max_batch_size + 1)})
        t0 = time.perf_counter()
        engine.calibrate(buckets)
        log.info("adaptive K calibrated for batch sizes %s in %.1fs", buckets, time.perf_counter() - t0)
    if cfg.serve.kv_cache_tokens:
        t0 = time.perf_counter()
        held = engine.reserve(cfg.serve.max_batch_size, cfg.serve.kv_cache_tokens)
        log.info("target KV cache: %d rows x %d tokens allocated in %.1fs (%.0f MiB; serve.kv_cache_tokens, "
                 "serve.max_batch_size)", cfg.serve.max_batch_size, cfg.serve.kv_cache_tokens,
                 time.perf_counter() - t0, held / 2**20)


def start_engine(cfg: DviConfig, pair: Any, rundir: RunDir) -> Any:
    """dvi's engine, its adaptive K calibrated; or, with `serve.engine: vllm`, vLLM started and driven
    (`serving.vllm_engine`)."""
    if cfg.serve.engine == "vllm":
        from .vllm_engine import start_vllm_engine

        return start_vllm_engine(cfg, pair, rundir)
    engine = serving_engine(cfg, pair)
    log.info("greedy speculation on this device: %s (README \"Greedy in bf16\"; models.exact_greedy: every row "
             "bitwise)", engine.greedy_contract)
    ready_to_serve(engine, cfg)
    return engine


def groups_of(cfg: DviConfig) -> bool:
    """One drafter adapter per traffic group (`trainer.adapter_key`; dvi's engine only)."""
    return cfg.serve.engine != "vllm" and cfg.trainer.adapter_key != "none"


def local_scheduler(cfg: DviConfig, pair: Any, rundir: RunDir) -> Scheduler:
    """The engine built and started here, behind its scheduler (not yet running)."""
    engine = start_engine(cfg, pair, rundir)
    if pair.drafter is not None and groups_of(cfg):  # the shared drafter stays as started: the adapters sit on it
        engine.proposer.set_adapter("", None)  # refuses a drafter that cannot serve per-row adapters, now
    return Scheduler(engine, pair.tokenizer, cfg.serve.max_batch_size, cfg.serve.queue_limit,
                     num_threads=cfg.serve.num_threads, heap=HeapTrimmer(cfg.serve.malloc_trim_seconds),
                     eos_ids=pair.stop_ids)
