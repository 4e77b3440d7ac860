"""Drafter hot-swap: watch the registry, validate, shadow-check, swap between steps, roll back.

The watcher thread polls `LATEST` every `serve.registry_poll_seconds`. A new version is

1. loaded and validated by `DrafterRegistry` (shapes, dtypes, finiteness; a bad one raises
   `AdapterRejected` and is *refused*: logged, counted, never retried);
2. shadow-checked: the most recent finished requests (held back from this decision: kept in
   memory by the server, possibly not yet trained on) are replayed through the candidate and the
   live drafter with `dvi.shadow.shadow_alpha` (teacher-forced, no target run); if the
   candidate's α is below the live one's by more than `trainer.shadow_margin` it is refused;
3. swapped in between two engine steps (`engine.set_drafter` via the scheduler), so sequences in
   flight continue with the new drafter and nothing waits on the load;
4. watched: once `serve.rollback_window` requests finished on the new version, its live α is
   compared with its predecessor's over that predecessor's last window; if it is lower by more
   than `serve.rollback_margin`, the registry is rolled back and the predecessor (kept in
   memory) is swapped back in.

LoRA versions are applied to a pristine copy of the base drafter and merged
(`merge_and_unload`), so a served LoRA drafter costs exactly what the base drafter costs.
Version 0 is the drafter the server started with (not in the registry).

Early-exit drafters (`dvi.drafters.EarlyExitDrafter`): a version is its LoRA + exit head, rebuilt on
the live target (the drafter shares the target's Parameters, so it is never deep-copied and its
LoRA is never merged: that would write into the target). Target weight updates load in place, so
every kept early-exit version reads the new weights at once; the engine rebuilds its drafter cache.

A reduced draft vocabulary (`dvi.vocab`) is the live drafter's: every version is loaded with the
same subset, and a version whose manifest says it was trained for another size is refused.
"""

from __future__ import annotations

import collections
import copy
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dvi.config import DviConfig
from dvi.drafters import ADAPTER_CONFIG, Drafter, SharedTargetDrafter
from dvi.feedback import FeedbackRecord
from dvi.fsutil import AppendLog, append_jsonl
from dvi.registry import AdapterRejected, DrafterRegistry, check_state_dict
from dvi.results import acceptance_rate, fmt_rate
from dvi.shadow import SHADOW_MAX_POSITIONS, hf_logits_fn, shadow_alpha, shadow_failure, shadow_passes
from dvi.vocab import apply_draft_vocab, find_subset_head

if TYPE_CHECKING:
    from .scheduler import Scheduler

log = logging.getLogger(__name__)

SHADOW_MIN_RECORDS = 4


@dataclass
class SwapEvent:
    """One promotion / refusal / rollback, as logged, counted and shown on /health."""

    kind: str  # "promoted" | "refused" | "rolled_back" | "pinned"
    version: int
    previous: int | None
    reason: str
    at: float
    category: str = ""  # refusals: one of dvi.registry.REFUSAL_KINDS (a bounded metrics label)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "version": self.version, "previous": self.previous,
                "reason": self.reason, "at": self.at, "category": self.category}


MAX_CONFIG_BYTES = 1 << 20
# config keys that fix a drafter's architecture and size; a `full` version must match the live one
ARCH_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "intermediate_size", "head_dim", "tie_word_embeddings")


def check_full_config(d: Any, version: int, base: torch.nn.Module) -> None:
    """Compare a `full` version's config.json with the live drafter's before anything is built:
    instantiating a config first costs seconds (and memory) for a huge one, and a drafter of
    another architecture would otherwise be promoted."""
    path = d / "config.json"
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRejected(f"config.json is {path.stat().st_size} bytes (> {MAX_CONFIG_BYTES})", version,
                              kind="architecture")
    cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict):
        raise AdapterRejected("config.json is not a JSON object", version, kind="architecture")
    live = base.config.to_dict()
    for key in ARCH_KEYS:
        if key in live and cfg.get(key, live[key]) != live[key]:
            raise AdapterRejected(f"config.json {key}={cfg.get(key)!r}, the live drafter has {live[key]!r}",
                                  version, kind="architecture")


def _module(drafter: Any) -> torch.nn.Module:
    """The HF-style module whose `.logits` are the drafter's (for shadow checks)."""
    return drafter.model if isinstance(drafter, Drafter) else drafter


def _check_vocab(man: dict, base: Any, version: int) -> None:
    head = find_subset_head(_module(base))
    live = None if head is None else head.num_ids
    trained = man.get("draft_vocab_size", live)
    if trained != live:
        raise AdapterRejected(f"trained for a draft vocabulary of {trained or 'all'} ids, the server drafts over "
                              f"{live or 'all'}", version, kind="architecture")


def load_shared_target_version(registry: DrafterRegistry, version: int, base: Any) -> tuple[Any, dict]:
    """Validated drafter of `version` of the live drafter's kind (early_exit: LoRA + exit head, unmerged;
    eagle: fc + layer + norm), built on the live drafter's target."""
    kind = base.kind
    sd, man = registry.validate(version)
    _check_vocab(man, base, version)
    d = registry.version_dir(version)
    if man.get("drafter_kind", kind) != kind:
        raise AdapterRejected(f"published by a {man.get('drafter_kind')!r} trainer, the server drafts {kind}",
                              version, kind="architecture")
    try:
        cfg = json.loads((d / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterRejected(f"{ADAPTER_CONFIG} does not load: {exc}", version, kind="files") from None
    if not isinstance(cfg, dict) or cfg.get("dvi_kind") != kind:
        raise AdapterRejected(f"not an {kind} drafter (adapter_config.json lacks dvi_kind {kind!r})", version,
                              kind="architecture")
    live = base.trainable_state_dict()
    check_state_dict(sd, {k: (tuple(v.shape), None) for k, v in live.items()}, version)
    head = find_subset_head(base.model)
    try:
        drafter = type(base).load(base.target_ref, d, vocab_ids=head.token_ids.cpu() if head is not None else None)
    except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
        raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, kind="load") from None
    for name, p in drafter.trainable_state_dict().items():
        if not bool(torch.isfinite(p).all()):
            raise AdapterRejected(f"parameter {name} is not finite after loading", version, kind="nonfinite")
    return drafter, man


def load_drafter_version(registry: DrafterRegistry, version: int, base: Any) -> tuple[Any, dict]:
    """Validated drafter of `version`: base + merged LoRA, a full model, or an early-exit drafter.

    Raises AdapterRejected with the reason for anything that does not load or fit.
    """
    if isinstance(base, SharedTargetDrafter):
        return load_shared_target_version(registry, version, base)
    sd, man = registry.validate(version)
    _check_vocab(man, base, version)
    d = registry.version_dir(version)
    ref = next(base.parameters())
    try:
        if man["kind"] == "lora":
            from peft import PeftModel, get_peft_model_state_dict

            pm = PeftModel.from_pretrained(copy.deepcopy(base), str(d), is_trainable=False)
            live = get_peft_model_state_dict(pm)
            check_state_dict(sd, {k: (tuple(v.shape), None) for k, v in live.items()}, version)
            model = pm.merge_and_unload()
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            check_full_config(d, version, base)
            config = AutoConfig.from_pretrained(str(d))
            model = AutoModelForCausalLM.from_config(config)
            expected = {k: (tuple(v.shape), None) for k, v in model.state_dict().items()}
            tied = {k for k in expected if k not in sd and k.endswith("lm_head.weight")}
            check_state_dict(sd, {k: v for k, v in expected.items() if k not in tied}, version)
            model.load_state_dict(sd, strict=not tied)
            if tied:
                model.tie_weights()
    except AdapterRejected:
        raise
    except Exception as exc:  # noqa: BLE001 - anything that does not load is a refusal
        raise AdapterRejected(f"does not load: {type(exc).__name__}: {exc}", version, kind="load") from None
    base_rows = base.get_output_embeddings().weight.shape[0]
    rows = model.get_output_embeddings().weight.shape[0]
    if rows != base_rows:
        raise AdapterRejected(f"vocabulary has {rows} rows, the live drafter {base_rows}", version, kind="shape")
    head = find_subset_head(base)
    if head is not None and find_subset_head(model) is None:  # a full version: same draft vocabulary as live
        apply_draft_vocab(model, head.token_ids.cpu())
    model = model.to(device=ref.device, dtype=ref.dtype).eval()
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise AdapterRejected(f"parameter {name} is not finite after loading", version, kind="nonfinite")
    return model, man


@dataclass(frozen=True)
class SwapPolicy:
    """When the swapper looks, promotes and rolls back (module docstring): poll LATEST every
    `poll_seconds`; refuse a candidate whose shadow α on the last `shadow_records` finished requests
    is below the live one's by more than `shadow_margin`; roll back when live α over
    `rollback_window` requests falls by more than `rollback_margin`."""

    poll_seconds: float
    shadow_margin: float
    rollback_window: int
    rollback_margin: float
    shadow_records: int = 64

    @classmethod
    def of(cls, cfg: DviConfig) -> SwapPolicy:
        """From a `DviConfig` (serve.registry_poll_seconds, serve.rollback_*, trainer.shadow_margin)."""
        return cls(poll_seconds=cfg.serve.registry_poll_seconds, shadow_margin=cfg.trainer.shadow_margin,
                   rollback_window=cfg.serve.rollback_window, rollback_margin=cfg.serve.rollback_margin)


class DrafterSwapper:
    """Owns the live drafter version; the registry watcher thread and the admin API use it."""

    def __init__(self, registry: DrafterRegistry, scheduler: Scheduler, base_drafter: torch.nn.Module, policy: SwapPolicy,
                 on_event: Callable[[SwapEvent], None] | None = None, event_log: str | AppendLog | None = None) -> None:
        self.registry = registry
        self.scheduler = scheduler
        # An early-exit drafter shares the target's weights: keep it as is (a deep copy would copy the target).
        self.base = base_drafter if isinstance(base_drafter, Drafter) else copy.deepcopy(base_drafter).eval()
        self.policy = policy
        self.on_event = on_event or (lambda _e: None)
        self.event_log = event_log
        self.live_version = 0
        self.models: dict[int, Any] = {0: base_drafter}
        self.predecessor: int | None = None
        self.pinned: int | None = None
        self.refused: dict[int, str] = {}
        self.retry: set[int] = set()  # refused for a reason that may pass later (dir not there yet)
        self.events: collections.deque[SwapEvent] = collections.deque(maxlen=100)
        self.counts = collections.Counter()
        self.recent: collections.deque = collections.deque(maxlen=policy.shadow_records)
        self._per_version: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=policy.rollback_window))
        self._since_swap = 0
        self._watching = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- observers (engine thread; cheap) ------------------------------------------------------
    def observe_record(self, record: FeedbackRecord) -> None:
        self.recent.append(record)

    def observe(self, drafted: int, accepted: int, drafter_version: int) -> None:
        self._per_version[drafter_version].append((drafted, accepted))
        if drafter_version == self.live_version and self._watching:
            self._since_swap += 1

    def live_alpha(self, version: int) -> float | None:
        window = list(self._per_version.get(version, ()))
        return acceptance_rate(sum(a for _, a in window), sum(d for d, _ in window))

    # -- watcher thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dvi-registry-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            try:
                self.poll_once()
                self.check_rollback()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad version
                log.exception("registry watcher iteration failed")
            self._stop.wait(self.policy.poll_seconds)

    def poll_once(self) -> None:
        latest = self.registry.latest()
        with self._lock:
            if (latest is None or latest == self.live_version or self.pinned is not None
                    or (latest in self.refused and latest not in self.retry)):
                return
        self.consider(latest)

    def consider(self, version: int) -> bool:
        """Validate, shadow-check and promote `version`; False if refused."""
        try:
            model, _man = load_drafter_version(self.registry, version, self.base)
        except AdapterRejected as exc:
            self._refuse(version, exc.reason, kind=exc.kind, transient=exc.transient)
            return False
        records = list(self.recent)
        reason = "no recent feedback to shadow-check; validated only"
        if len(records) >= SHADOW_MIN_RECORDS:
            with self._lock:
                live_model = self.models[self.live_version]
            new = shadow_alpha(hf_logits_fn(_module(model)), records, device=self._device(model),
                               max_positions=SHADOW_MAX_POSITIONS)
            old = shadow_alpha(hf_logits_fn(_module(live_model)), records, device=self._device(model),
                               max_positions=SHADOW_MAX_POSITIONS)
            reason = (f"shadow α {fmt_rate(new.alpha)} vs live {fmt_rate(old.alpha)} on {new.records} records "
                      f"({new.positions} positions)")
            if not shadow_passes(new.alpha, old.alpha, self.policy.shadow_margin):
                self._refuse(version, reason + f"; {shadow_failure(new.alpha, self.policy.shadow_margin)}", kind="shadow")
                return False
        self._swap(model, version, "promoted", reason)
        return True

    @staticmethod
    def _device(model: Any) -> torch.device:
        return next(model.parameters()).device

    def _swap(self, model: Any, version: int, kind: str, reason: str) -> None:
        engine = self.scheduler.engine
        fut = self.scheduler.call_between_steps(lambda: engine.set_drafter(model, version))
        fut.result(timeout=120)
        with self._lock:
            prev = self.live_version
            if version in self.retry:  # a retried version made it after all
                self.retry.discard(version)
                self.refused.pop(version, None)
            self.models[version] = model
            if kind != "rolled_back":
                self.predecessor = prev
            self.live_version = version
            keep = {version, 0}
            if self.predecessor is not None:
                keep.add(self.predecessor)
            self.models = {v: m for v, m in self.models.items() if v in keep}
            self._per_version[version].clear()
            self._since_swap = 0
            self._watching = kind == "promoted" and prev is not None
        self._record(SwapEvent(kind, version, prev, reason, time.time()))

    def _refuse(self, version: int, reason: str, kind: str = "other", transient: bool = False) -> None:
        """Refuse `version` (logged, counted once); a transient refusal is retried at every poll."""
        with self._lock:
            again = transient and version in self.retry
            self.refused[version] = reason + (" (will retry)" if transient else "")
            if transient:
                self.retry.add(version)
            else:
                self.retry.discard(version)
        if not again:
            self._record(SwapEvent("refused", version, self.live_version, reason, time.time(), category=kind))

    def _record(self, ev: SwapEvent) -> None:
        self.events.append(ev)
        self.counts[ev.kind] += 1
        level = logging.WARNING if ev.kind in ("refused", "rolled_back") else logging.INFO
        log.log(level, "drafter %s v%d (previous %s): %s", ev.kind, ev.version, ev.previous, ev.reason)
        if self.event_log:
            try:
                append_jsonl(self.event_log, ev.as_dict(), fsync=False)
            except OSError:
                log.exception("cannot append to %s", self.event_log)
        try:
            self.on_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("swap event observer failed")

    # -- rollback ----------------------------------------------------------------------------------
    def check_rollback(self) -> bool:
        """Roll back if the live version's α over its window fell below its predecessor's."""
        with self._lock:
            if not self._watching or self._since_swap < self.policy.rollback_window or self.predecessor is None:
                return False
            self._watching = False
            live, prev = self.live_version, self.predecessor
        a_new, a_old = self.live_alpha(live), self.live_alpha(prev)
        if a_new is None or a_old is None:
            return False
        if a_new < a_old - self.policy.rollback_margin:
            self.rollback(f"live α {a_new:.3f} < predecessor v{prev} {a_old:.3f} - {self.policy.rollback_margin} "
                          f"over {self.policy.rollback_window} requests")
            return True
        log.info("drafter v%d kept: live α %.3f vs predecessor %.3f", live, a_new, a_old)
        return False

    def rollback(self, reason: str) -> int:
        """Swap back to the predecessor (in memory) and move the registry's LATEST back."""
        with self._lock:
            bad, target = self.live_version, self.predecessor
        if target is None or target == bad:
            try:
                target = self.registry.rollback(None, reason=reason)
            except AdapterRejected as exc:
                raise ValueError(f"nothing to roll back to: {exc.reason}") from None
        elif target != 0:
            try:
                self.registry.rollback(target, reason=reason)
            except AdapterRejected as exc:
                log.warning("registry rollback to v%d failed (%s); swapping back in memory only",
                            target, exc.reason)
        if target in self.models:
            model = self.models[target]
        else:
            model, _ = load_drafter_version(self.registry, target, self.base)
        with self._lock:
            self.refused[bad] = f"rolled back: {reason}"
            self.predecessor = None
        self._swap(model, target, "rolled_back", reason + f" (from v{bad})")
        return target

    def pin(self, version: int | None) -> int:
        """Serve exactly `version` (0 = the startup drafter) and stop auto-promotion; None unpins."""
        if version is None:
            with self._lock:
                old, self.pinned = self.pinned, None
            if old:
                try:
                    self.registry.unpin(old)
                except (OSError, ValueError):
                    pass
            return self.live_version
        if version == 0:
            model = self.models.get(0) or self.base
        else:
            model, _ = load_drafter_version(self.registry, version, self.base)
            self.registry.pin(version)
        with self._lock:
            self.pinned = version
        if version != self.live_version:
            self._swap(model, version, "pinned", "pinned by admin")
        return version

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "live_version": self.live_version,
                "predecessor": self.predecessor,
                "pinned": self.pinned,
                "latest": self.registry.latest(),
                "refused": {str(k): v for k, v in self.refused.items()},
                "counts": dict(self.counts),
                "live_alpha": self.live_alpha(self.live_version),
                "events": [e.as_dict() for e in list(self.events)[-10:]],
            }
