"""What the endpoints share, built once per server (`build_state`): the engine behind its scheduler, the
feedback writer, the swapper, the trainer supervisor and the metrics, and the observers that run on the
engine thread when a request finishes.

Its own module so the endpoints (`serving.completions`, `serving.health`, `serving.admin`, `serving.drain`)
import the state without importing the app that routes to them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dvi.config import DviConfig
from dvi.decode.adaptive import batch_bucket
from dvi.decode.engine import SpeculativeEngine
from dvi.feedback import FeedbackRecord, FeedbackWriter, Retention
from dvi.registry.store import DrafterRegistry
from dvi.rundir import RunDir

from .loading import load_serving_pair, serving_proposer
from .memory import HeapTrimmer, cap_onednn_cache
from .protocol import RequestLimits
from .scheduler import Finished, Scheduler
from .supervisor import TrainerSupervisor
from .swap import DrafterSwapper, SwapEvent, SwapPolicy
from .telemetry import ServerMetrics
from .tokenize import PromptTokenizer

log = logging.getLogger("dvi.serving")


class FeedbackLog:
    """Engine thread, a scheduler observer: each finished request's feedback record (the stored projection of
    the engine's result, `FeedbackRecord.from_result`, with the finish reason as answered: a stop string is
    "stop", not the engine's "abort") to the writer, then to `consumers` (the swapper's shadow records).
    A record that cannot be built or written is counted and logged; it never costs the request."""

    def __init__(self, writer: FeedbackWriter | None) -> None:
        self.writer = writer
        self.consumers: list[Callable[[FeedbackRecord], None]] = []
        self.errors = 0

    def __call__(self, fin: Finished) -> None:
        if fin.result is None:  # the request never reached the engine
            return
        try:
            record = FeedbackRecord.from_result(fin.result)  # the result carries the request's prompt and domain
            record.finish_reason = fin.finish_reason
            record.client, record.transformed = fin.client, fin.transformed
        except Exception:  # noqa: BLE001 - feedback must never cost a request
            self.errors += 1
            log.exception("feedback record for %s dropped", fin.request_id)
            return
        if self.writer is not None:
            try:
                self.writer.write(record)
            except Exception:  # noqa: BLE001
                self.errors += 1
                log.exception("feedback record for %s dropped", fin.request_id)
        for consume in self.consumers:
            consume(record)


@dataclass
class ServerState:
    """Everything the endpoints need; built once per server."""

    cfg: DviConfig
    tokenizer: Any
    engine: Any
    scheduler: Scheduler
    swapper: DrafterSwapper | None
    supervisor: TrainerSupervisor
    feedback: FeedbackWriter | None
    feedback_log: FeedbackLog
    metrics: ServerMetrics
    model_name: str
    context_len: int
    vocab_size: int
    # tokenising off the event loop: an early context check, and large prompts on their own worker
    prompts: PromptTokenizer
    started_at: float = field(default_factory=time.time)
    target_version: int = 0
    stopped: bool = False
    draining: bool = False  # a stop was asked for (`serving.drain`): new requests get a 503
    suffix_tailer: Any = None  # serving.suffix_tail.SuffixTailer (suffix / hybrid with a shared feedback dir)

    @property
    def limits(self) -> RequestLimits:
        sv = self.cfg.serve
        return RequestLimits(max_prompt_chars=sv.max_prompt_chars, max_stop_strings=sv.max_stop_strings,
                             max_stop_chars=sv.max_stop_chars, vocab_size=self.vocab_size,
                             domains=tuple(sv.domains))

    def start(self) -> None:
        self.scheduler.start()
        if self.swapper is not None:
            self.swapper.start()
        self.supervisor.start()
        if self.suffix_tailer is not None:
            self.suffix_tailer.start()

    def stop(self) -> None:
        """Stop in dependency order: trainer, watcher, engine loop, then flush the feedback."""
        if self.stopped:
            return
        self.stopped = True
        if self.suffix_tailer is not None:
            self.suffix_tailer.stop()
        self.supervisor.stop()
        if self.swapper is not None:
            self.swapper.stop()
        self.scheduler.stop()
        self.prompts.close()
        if self.feedback is not None:
            try:
                self.feedback.close()
            except Exception:  # noqa: BLE001
                log.exception("final feedback flush failed")
        self.metrics.close()


def serving_engine(cfg: DviConfig, pair: Any) -> SpeculativeEngine:
    """The engine a server decodes with (its proposer, K rule, feedback top-k): also what the demo's frozen
    reference decodes with, so the served α and that reference are read the same way."""
    spec = cfg.speculation
    return SpeculativeEngine(
        pair.target, serving_proposer(cfg, pair), num_draft_tokens=spec.num_draft_tokens, adaptive=spec.adaptive,
        max_draft_tokens=spec.max_draft_tokens, feedback_top_k=cfg.feedback.top_k,
        greedy_below_temperature=cfg.sampling.greedy_below_temperature,
    )


def build_state(cfg: DviConfig) -> ServerState:
    """Load the pair, build engine, scheduler, feedback writer, swapper, supervisor, metrics."""
    torch.set_num_threads(cfg.serve.num_threads)
    cap_onednn_cache(cfg.serve.onednn_primitive_cache)  # before any forward: oneDNN reads it once
    pair = load_serving_pair(cfg)
    tokenizer = pair.tokenizer
    spec = cfg.speculation
    engine = serving_engine(cfg, pair)
    if spec.adaptive and engine.proposer.kind != "none":
        # Measure draft/verify costs for every batch bucket now, so no request pays for a
        # calibration the first time the running batch reaches a new size.
        buckets = sorted({batch_bucket(n) for n in range(1, cfg.serve.max_batch_size + 1)})
        t0 = time.perf_counter()
        engine.calibrate(buckets)
        log.info("adaptive K calibrated for batch sizes %s in %.1fs", buckets, time.perf_counter() - t0)
    rundir = RunDir.of(cfg)
    rundir.make_root()
    fb = cfg.feedback
    feedback = FeedbackWriter(fb.dir, shard_records=fb.shard_records, flush_seconds=fb.flush_seconds,
                              retention=Retention(fb.retention_bytes, fb.retention_shards, fb.retention_seconds),
                              background=True, max_pending_bytes=fb.max_buffer_bytes, access=cfg.files.access)
    metrics = ServerMetrics(cfg, domains=cfg.serve.domains, max_versions=cfg.serve.metrics_versions)
    scheduler = Scheduler(engine, tokenizer, cfg.serve.max_batch_size, cfg.serve.queue_limit,
                          num_threads=cfg.serve.num_threads, heap=HeapTrimmer(cfg.serve.malloc_trim_seconds))
    supervisor = TrainerSupervisor(cfg)
    swapper = None
    if pair.drafter is not None:
        swapper = DrafterSwapper(
            DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last), scheduler, pair.drafter,
            SwapPolicy.of(cfg), on_event=lambda ev: _on_swap_event(metrics, ev), event_log=rundir.log(rundir.swap_events_path),
            feedback_dir=fb.dir,
        )
    state = ServerState(
        cfg=cfg, tokenizer=tokenizer, engine=engine, scheduler=scheduler, swapper=swapper,
        supervisor=supervisor, feedback=feedback, feedback_log=FeedbackLog(feedback), metrics=metrics,
        model_name=cfg.serve.model_name,
        context_len=int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30),
        vocab_size=int(pair.target.get_output_embeddings().weight.shape[0]),
        prompts=PromptTokenizer(tokenizer, cfg.serve.tokenize_large_bytes),
    )
    scheduler.observers += [lambda fin: _on_finished(state, fin), state.feedback_log]
    if swapper is not None:  # the held-out records a shadow check scores
        state.feedback_log.consumers.append(lambda rec: swapper.observe_record(rec) if rec.token_ids else None)
    cache = getattr(getattr(engine.proposer, "suffix", engine.proposer), "cache", None)
    if cache is not None and cfg.suffix.tail_seconds > 0:
        from .suffix_tail import SuffixTailer

        state.suffix_tailer = SuffixTailer(fb.dir, cache, scheduler.call_between_steps, cfg.suffix.tail_seconds,
                                           cfg.suffix.tail_records)
    return state


def _on_finished(state: ServerState, fin: Finished) -> None:
    """Engine thread: per-request metrics and the swapper's live-α window."""
    state.metrics.observe_request(fin)
    if state.swapper is not None and fin.result is not None:
        r = fin.result
        drafted, accepted = r.model_counts()  # the learned drafter's own drafts (hybrid: not the suffix ones)
        state.swapper.observe(drafted, accepted, r.drafter_version)


def _on_swap_event(metrics: ServerMetrics, ev: SwapEvent) -> None:
    metrics.observe_swap(ev.kind, ev.version, ev.reason, category=ev.category, publish_to_verdict_s=ev.publish_to_verdict_s)
