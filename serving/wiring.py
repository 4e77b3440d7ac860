"""The server's wiring: `build_state` builds, once per server, what the endpoints share (`ServerState`): the engine
behind its scheduler, the feedback writer, the drafter wing behind its door, the trainer supervisor and the metrics,
and subscribes them to each finished request's one final record (`serving.finished`, published once on the engine
thread). Named `serving.state` before issue 58.

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
from dvi.feedback import FeedbackWriter, Retention
from dvi.memory import cap_onednn_cache
from dvi.rundir import RunDir

from .drafter.client import DrafterClient, Observed, VersionEvent
from .engine_build import groups_of, local_scheduler
from .finished import Finished
from .loading import load_serving_pair
from .protocol import RequestLimits
from .supervisor import TrainerSupervisor
from .telemetry import ServerMetrics
from .tokenize import PromptTokenizer

log = logging.getLogger("dvi.serving")

TRAINER_STOP_S = 3.0
"""After the drain, how long the trainer (told at the signal, `ServerState.begin_stop`) may still take before SIGKILL:
it has the whole drain plus this for its last round, checkpoint and publish; its state is crash-safe, so a kill costs
at most the rounds since its last checkpoint (trained again). Bounded so the process is gone within seconds of its
last answer, inside an orchestrator's grace period."""
AUX_STOP_S = 2.0
"""How long the drafter thread and the suffix tailer (daemon threads, told at the signal) are waited for: a
shadow check under way decides nothing once the stop began (`DrafterClient.stop`)."""


class FeedbackLog:
    """Engine thread, a subscriber of the scheduler's `FinishedFeed`: each finished request's feedback record
    (the final record's projection, `Finished.feedback_record`, with the finish reason as answered) to the
    writer. A record that cannot be built or written is counted and logged; it never costs the request."""

    def __init__(self, writer: FeedbackWriter | None) -> None:
        self.writer = writer
        self.errors = 0

    def __call__(self, fin: Finished) -> None:
        if fin.result is None or self.writer is None:  # the request never reached the engine / no log
            return
        try:
            self.writer.write(fin.feedback_record())
        except Exception:  # noqa: BLE001 - feedback must never cost a request
            self.errors += 1
            log.exception("feedback record for %s dropped", fin.request_id)


@dataclass
class ServerState:
    """Everything the endpoints need; built once per server."""

    cfg: DviConfig
    tokenizer: Any
    # the engine's one door (`serving.engine_client.EngineClient`): a `Scheduler` over an engine in this process, or
    # `serving.engine_process.EngineProcess` over one in its own; no field holds the engine itself
    scheduler: Any
    drafter: DrafterClient | None  # the drafter wing's one door (`serving.drafter.client`); None: speculation off
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
    stopping: bool = False  # `begin_stop` ran: the trainer, watcher and tailer were told to stop
    suffix_tailer: Any = None  # serving.suffix_tail.SuffixTailer (suffix / hybrid with a shared feedback dir)
    tokenizer_warnings: list[str] = field(default_factory=list)  # its eos / bos vs the model's configs (logged)
    control_share: float = 0.0  # of each traffic group's requests, drafted by the frozen base (`serving.control`)
    on_stop: list[Callable[[], Any]] = field(default_factory=list)  # after the engine loop: a vLLM child stopped

    @property
    def limits(self) -> RequestLimits:
        sv = self.cfg.serve
        return RequestLimits(max_prompt_chars=sv.max_prompt_chars, max_stop_strings=sv.max_stop_strings,
                             max_stop_chars=sv.max_stop_chars, max_choices=sv.max_choices,
                             vocab_size=self.vocab_size,
                             domains=tuple(sv.domains))

    def start(self) -> None:
        self.scheduler.start()
        if self.drafter is not None:
            self.drafter.start()
        self.supervisor.start()
        if self.suffix_tailer is not None:
            self.suffix_tailer.start()

    def begin_stop(self) -> None:
        """On the signal (`serving.drain`, before the drain): tell what runs beside the requests to stop, without
        waiting: the trainer gets SIGTERM (its last round, checkpoint and publish overlap the drain), the registry
        thread promotes, refuses and rolls back nothing more, the suffix tailer polls no more. `stop` waits."""
        if self.stopping:
            return
        self.stopping = True
        if self.suffix_tailer is not None:
            self.suffix_tailer.stop(timeout=0)
        if self.drafter is not None:
            self.drafter.stop(timeout=0)
        self.supervisor.request_stop()

    def stop(self) -> None:
        """After the drain: wait for the trainer (`TRAINER_STOP_S`, then SIGKILL), the drafter thread and the tailer (both
        told at the signal), stop the engine loop, then flush the feedback. Each wait is bounded."""
        if self.stopped:
            return
        self.stopped = True
        self.begin_stop()
        t0 = time.monotonic()
        took: dict[str, float] = {}

        def part(name: str, fn: Callable[[], Any]) -> None:
            t = time.monotonic()
            try:
                fn()
            except Exception:  # noqa: BLE001 - one part failing must not keep the rest (the feedback) from stopping
                log.exception("stopping the %s failed", name)
            took[name] = time.monotonic() - t

        if self.suffix_tailer is not None:
            part("suffix tailer", lambda: self.suffix_tailer.stop(timeout=AUX_STOP_S))
        part("trainer", lambda: self.supervisor.stop(timeout=TRAINER_STOP_S))
        if self.drafter is not None:
            part("drafter thread", lambda: self.drafter.stop(timeout=AUX_STOP_S))
        part("engine", self.scheduler.stop)
        for fn in self.on_stop:
            part("engine process", fn)
        self.prompts.close()
        if self.feedback is not None:
            part("feedback flush", self.feedback.close)
        self.metrics.close()
        log.info("stopped in %.2fs (%s)", time.monotonic() - t0, ", ".join(f"{k} {v:.2f}s" for k, v in took.items()))


def own_process(cfg: DviConfig) -> bool:
    """dvi's engine in a process of its own (`serve.engine_process`; vLLM is one already)."""
    return cfg.serve.engine == "dvi" and cfg.serve.engine_process


def build_state(cfg: DviConfig) -> ServerState:
    """Load the pair, build engine, scheduler, feedback writer, the drafter wing, supervisor, metrics."""
    torch.set_num_threads(cfg.serve.num_threads)
    cap_onednn_cache(cfg.serve.onednn_primitive_cache)  # before any forward: oneDNN reads it once
    rundir = RunDir.of(cfg)
    rundir.make_root()
    proc = None
    if own_process(cfg):  # it loads its pair while this process loads the tokenizer, the drafter wing's drafter and
        # the target's configs (no weights: `load_serving_pair`)
        from .engine_process import EngineProcess

        proc = EngineProcess(cfg)
    try:
        pair = load_serving_pair(cfg, target_weights=proc is None)
        scheduler, engine = _engine_door(cfg, pair, rundir, proc)
    except BaseException:
        if proc is not None:
            proc.stop(timeout=5)
        raise
    tokenizer = pair.tokenizer
    fb = cfg.feedback
    feedback = FeedbackWriter(fb.dir, shard_records=fb.shard_records, flush_seconds=fb.flush_seconds,
                              retention=Retention(fb.retention_bytes, fb.retention_shards, fb.retention_seconds),
                              background=True, max_pending_bytes=fb.max_buffer_bytes, access=cfg.files.access)
    groups = groups_of(cfg)
    control_share = cfg.control_share if groups and pair.drafter is not None else 0.0
    metrics = ServerMetrics(cfg, domains=cfg.serve.domains, max_versions=cfg.serve.metrics_versions,
                            control_share=control_share)
    supervisor = TrainerSupervisor(cfg)
    drafter = None
    if pair.drafter is not None:
        drafter = DrafterClient.of(cfg, scheduler, pair.drafter, lambda ev: _on_version_event(metrics, ev),
                                   rundir.log(rundir.swap_events_path), groups=groups)
    state = ServerState(
        cfg=cfg, tokenizer=tokenizer, scheduler=scheduler, drafter=drafter,
        supervisor=supervisor, feedback=feedback, feedback_log=FeedbackLog(feedback), metrics=metrics,
        model_name=cfg.serve.model_name,
        context_len=int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30),
        vocab_size=int(pair.target.get_output_embeddings().weight.shape[0]),
        prompts=PromptTokenizer(tokenizer, cfg.serve.tokenize_large_bytes),
        tokenizer_warnings=list(pair.warnings), control_share=control_share,
    )
    scheduler.finished.subscribe(metrics.observe_request)
    scheduler.finished.subscribe(state.feedback_log)
    if cfg.serve.engine == "vllm":
        state.on_stop.append(engine.close)
    if drafter is not None:
        scheduler.finished.subscribe(lambda fin: _to_drafter(drafter, fin))
    uses_history = scheduler.uses_history if proc is not None else cfg.serve.engine == "dvi" and engine.proposer.uses_history
    if uses_history and cfg.suffix.tail_seconds > 0:
        from .engine_client import AddHistory
        from .suffix_tail import SuffixTailer

        state.suffix_tailer = SuffixTailer(fb.dir, lambda items: scheduler.command(AddHistory(tuple(items))),
                                           cfg.suffix.tail_seconds, cfg.suffix.tail_records)
    return state


def _engine_door(cfg: DviConfig, pair: Any, rundir: RunDir, proc: Any) -> tuple[Any, Any]:
    """The engine's door (`serving.engine_client.EngineClient`) and, in this process, the engine behind it: the engine
    process's once it is ready (None: it is not here), or a scheduler over an engine built here."""
    if proc is not None:
        proc.wait_ready()
        return proc, None
    scheduler = local_scheduler(cfg, pair, rundir)
    return scheduler, scheduler.engine


def _to_drafter(drafter: DrafterClient, fin: Finished) -> None:
    """Engine thread: the drafter wing's one subscription to finished requests, one message to its door: the
    learned drafter's drafted / accepted counts (hybrid: not the suffix drafts) and the record its checks score."""
    if fin.result is None:
        return
    drafted, accepted = fin.result.model_counts()
    record = fin.feedback_record()
    drafter.observe(Observed(drafted, accepted, fin.result.drafter_version,
                             record if record is not None and record.token_ids else None))


def _on_version_event(metrics: ServerMetrics, ev: VersionEvent) -> None:
    metrics.observe_swap(ev.event, ev.version, ev.reason, category=ev.category, publish_to_verdict_s=ev.publish_to_verdict_s,
                         group=ev.group)
