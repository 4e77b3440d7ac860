"""Drafter hot-swap: watch the registry, validate, shadow-check, swap between steps, watch, roll back.

The watcher thread polls `LATEST` every `serve.registry_poll_seconds`. A new version is skipped while a pin holds,
while the live version's rollback watch runs, and for good when the registry's REFUSED lists it; else it is loaded
and validated (`dvi.registry.codec.load_drafter_version`: the registry's one check, then its format's codec; a bad
one is refused: logged, counted, recorded in REFUSED), shadow-checked on the held-out set
(`dvi.feedback.heldout.HeldOutSet`, warmed from the feedback log at start) by THE comparison
(`dvi.feedback.verdict.compare`, rule `promotion_rule`; it waits for `trainer.shadow_min_positions` positions),
swapped in between two engine steps (a `SetDrafter` command; a group's lane, `SwapLane`, sends `SetAdapter`), and
watched (`serving.drafter.lifecycle.Watch`): the next `serve.rollback_window` finished requests replayed through it and the last
good version (rule `watch_rule`); worse rolls back to the last version that passed its watch, not worse makes it
the last good one. A watch ends early, on the records it has, when a newer version waits and the server has been
idle `serve.watch_idle_s`. Under a pin a failed watch only alerts. Each version's time from publish to its first
verdict is a histogram on /metrics (`dvi_drafter_publish_to_verdict_seconds`).

What is served, the last good version and the pin are in the registry's SERVING (`ServingState`): the trainer
judges against what is served; a restarted server serves its pin, else its last good version. Version 0: the startup drafter.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dvi.decode.results import acceptance_rate, fmt_rate
from dvi.feedback import FeedbackRecord
from dvi.feedback.heldout import HeldOutSet, newest_logged
from dvi.feedback.shadow import hf_logits_fn
from dvi.feedback.verdict import Rule, Scorer, Verdict, compare, scorer
from dvi.fsutil import AppendLog, append_jsonl
from dvi.registry.codec import load_drafter_version, load_group_version, scoring_module
from dvi.registry.store import AdapterRejected, DrafterRegistry, ServingState

from ..engine_client import EngineClient, SetAdapter, SetDrafter
from ..memory import glibc_trim
from .lifecycle import MAX_REFUSED_SHOWN, Promotion, Step
from .policy import SwapEvent, SwapLane, SwapPolicy

__all__ = ["DrafterSwapper", "Loaded"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loaded:
    """A version loaded, checked and ready to serve: the drafter the gates score, and the one engine command that
    serves it (the whole drafter, or a group's adapter factors), built once when the version is loaded."""

    version: int
    model: Any
    command: SetDrafter | SetAdapter

    @functools.cached_property
    def scorer(self) -> Scorer:
        """Its teacher-forced scores, what every gate compares (`dvi.feedback.verdict.compare`)."""
        return scorer(hf_logits_fn(scoring_module(self.model)), next(self.model.parameters()).device)


class DrafterSwapper:
    """The thin watcher around `Promotion` (what is decided): it loads, checks and swaps the versions the machine
    names, and keeps the loaded ones (`loaded`). The registry watcher thread and the admin API use it."""

    def __init__(self, registry: DrafterRegistry, scheduler: EngineClient, base_drafter: torch.nn.Module, policy: SwapPolicy,
                 on_event: Callable[[SwapEvent], None] | None = None, event_log: str | AppendLog | None = None,
                 feedback_dir: str | None = None, lane: SwapLane | None = None) -> None:
        self.registry = registry
        self.lane = lane  # a traffic group's swapper (issue 40): its registry, records and engine command are that group's
        self.feedback_dir = feedback_dir  # the held-out set starts from its newest shards (`restore`)
        self.scheduler = scheduler
        self.base = base_drafter  # version 0; a LoRA version is merged into a copy of it (it stays pristine)
        self.policy = policy
        self.on_event = on_event or (lambda _e: None)
        self.event_log = event_log
        self.promotion = Promotion(policy.rollback_window)  # every decision; guarded by `_lock`
        self.loaded: dict[int, Loaded] = {0: self._load(0)}  # the served version and the startup one
        self.waiting, self.waiting_scored = None, None  # the version waiting for held-out evidence; positions its check scored
        self._pending: Loaded | None = None  # LATEST, validated and loaded, waiting for its check
        self.events: collections.deque[SwapEvent] = collections.deque(maxlen=100)
        self.counts = collections.Counter()
        self.heldout = HeldOutSet(policy.shadow_records, policy.heldout_fraction)  # what a promotion is judged on
        self.verdicts: dict[str, Verdict] = {}  # the last verdict of each gate ("promotion", "watch"), for /metrics
        self._verdict_seen: collections.OrderedDict[int, None] = collections.OrderedDict()  # versions with a verdict
        self._windows: dict[int, collections.deque] = {}  # live α per kept version (bounded like `loaded`)
        self._restored = False
        self._trim = glibc_trim()  # a promotion's loads and checks free whole drafters: hand them back to the OS
        self._freed = False  # a load, check or swap ran since the last trim
        self._lock = threading.RLock()
        # one swap at a time, from its pin check through the engine command to the state it leaves (an admin pin runs
        # on another thread than the watcher's promotion): what the engine serves and what the machine says agree
        self._swaps = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # what the machine decided, read by /health, /metrics and the admin API
    live_version = property(lambda self: self.promotion.live)
    good = property(lambda self: self.promotion.good)
    pinned = property(lambda self: self.promotion.pinned)
    watch = property(lambda self: self.promotion.watch)
    refused = property(lambda self: self.promotion.refused)
    retry = property(lambda self: self.promotion.retry)

    # -- observers (engine thread; cheap) ------------------------------------------------------
    def observe_record(self, record: FeedbackRecord) -> None:
        """A finished request's record: held-out ones join the held-out set, all of them a running watch."""
        if self.lane is not None and not self.lane.accepts(record):
            return
        self.heldout.offer(record)
        with self._lock:
            w = self.watch
        if w is not None:
            w.add(record)

    def observe(self, drafted: int, accepted: int, drafter_version: int) -> None:
        window = self._windows.get(drafter_version)
        if window is None and drafter_version in self.loaded:
            window = self._windows[drafter_version] = collections.deque(maxlen=self.policy.rollback_window)
        if window is not None:
            window.append((drafted, accepted))

    def live_alpha(self, version: int) -> float | None:
        window = list(self._windows.get(version, ()))
        return acceptance_rate(sum(a for _, a in window), sum(d for d, _ in window))

    def heldout_positions(self) -> int:
        return self.heldout.positions()

    # -- watcher thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dvi-registry-watcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """No more verdicts (a check under way ends without one); wait up to `timeout` for the thread (0: do not)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        torch.set_num_threads(1)
        while not self._stop.is_set():
            self.tick()
            self._stop.wait(self.policy.poll_seconds)

    def tick(self) -> None:
        """One look at the registry: restore (once), a new version's checks, a watch's end."""
        try:
            self.restore()
            self.poll_once()
            watched = self.watch
            self.check_rollback()
            if watched is not None and self.watch is None:
                self.poll_once()  # the watch ended: a waiting version is checked now, not a poll later
        except Exception:  # noqa: BLE001 - the watcher must outlive any one bad version
            log.exception("registry watcher iteration failed%s", self._of_group())
        self.release_memory()

    def _of_group(self) -> str:
        return f" (group {self.lane.group})" if self.lane else ""

    def release_memory(self) -> None:
        """After a load, a check or a swap: glibc's `malloc_trim`, from this thread (issue 36 §9): loads and checks
        free drafter-sized blocks in this thread's heap, which glibc keeps; the engine thread's trim runs too early."""
        if self._freed and self._trim is not None:
            self._freed = False
            try:
                self._trim()
            except Exception:  # noqa: BLE001 - releasing memory must never cost a version
                log.exception("malloc_trim failed")

    def restore(self) -> None:
        """Once, at start: the durable refusals, then serve the pin, else the last good version (each passed
        its check before the restart); anything newer waits for a check like any candidate."""
        if self._restored:
            return
        self._restored = True
        self._warm_heldout()
        st = self.registry.serving()
        with self._lock:
            want = self.promotion.restore(self.registry.refusals(), st.pinned, st.good)
        loaded = self.loaded[0]
        if want:
            try:
                loaded = self._load(want)
            except AdapterRejected as exc:
                log.error("cannot restore drafter v%d (%s); serving the startup drafter", want, exc.reason)
                want = 0
        with self._lock:
            self.promotion.restored(want, st.pinned)
        if want:
            self._swap(loaded, "restored", "pinned before the restart" if self.pinned is not None
                       else "last good version before the restart")
        else:
            self._save_serving()

    def _warm_heldout(self) -> None:
        """The held-out records of the feedback log's newest shards (what the trainer judges on, it reads them
        too): a restarted server can check a version at once instead of waiting for new held-out traffic."""
        if not self.feedback_dir:
            return
        try:
            records = newest_logged(self.feedback_dir)
            if self.lane is not None:
                records = [r for r in records if self.lane.accepts(r)]
            held = self.heldout.split(records, lambda _r: None)
        except Exception:  # noqa: BLE001 - an unreadable log only means starting empty
            log.exception("cannot warm the held-out set from %s", self.feedback_dir)
            return
        log.info("held-out set warmed from the feedback log: %d held-out records, %d positions", held,
                 self.heldout_positions())

    def poll_once(self) -> None:
        """Validate a new LATEST at once (a broken one is refused even while a watch runs); promote it only
        when no watch runs and the held-out records hold enough positions for its shadow check."""
        latest = self.registry.latest()
        step = self._next_step(latest)
        if step.action == "validate":
            durable = self.registry.refusals().get(latest)
            if durable is not None:  # refused by this server (this replica) before
                with self._lock:
                    self.promotion.remember_refusal(latest, durable)
                return
            if not self._validate(latest):
                return
            step = self._next_step(latest)
        if step.action in ("idle", "hold"):
            if step.action == "idle":
                self.waiting = None
            return
        if step.action == "wait":
            if self.waiting != latest:
                log.info("drafter v%d waits for a shadow check: %d held-out positions of %d", latest,
                         self.heldout_positions(), self.policy.min_positions)
            self.waiting, self.waiting_scored = latest, None
            return
        self.waiting = None
        candidate, self._pending = self._pending, None
        self._judge(candidate)

    def _next_step(self, latest: int | None) -> Step:
        have = self.heldout_positions()
        with self._lock:
            loaded = self._pending is not None and self._pending.version == latest
            return self.promotion.next_step(latest, loaded, have, self.policy.min_positions, self._stop.is_set())

    def _load(self, version: int) -> Loaded:
        """THE load of a version (0: the startup drafter): the registry's one check, its format's codec, and the
        engine command that serves it (a group's LoRA as per-row factors); AdapterRejected if any of them fails."""
        self._freed = True
        if self.lane is None:
            model = self.base if version == 0 else load_drafter_version(self.registry, version, self.base)[0]
            return Loaded(version, model, SetDrafter(model, version))
        model, factors = ((self.base, None) if version == 0 else
                          load_group_version(self.registry, version, self.base, self.lane.sizes, self.lane.num_layers))
        return Loaded(version, model, SetAdapter(self.lane.group, factors, version))

    def _validate(self, version: int) -> bool:
        """Load and check `version`, kept for its shadow check; a broken one is refused."""
        self._pending = None
        try:
            self._pending = self._load(version)
        except AdapterRejected as exc:
            self._refuse(version, exc.reason, kind=exc.kind, transient=exc.transient)
            return False
        with self._lock:
            self.promotion.validated(version)
        return True

    def _judge(self, candidate: Loaded) -> bool:
        """Shadow-check a validated version (the held-out set, `promotion_rule`) and promote it; False if refused or
        waiting."""
        version = candidate.version
        with self._lock:
            live_version = self.live_version
            live = self.loaded[live_version]
        verdict = self._compare(candidate.scorer, live.scorer, self.heldout.records(), self.policy.promotion)
        if verdict.outcome == "wait" or self._stop.is_set():  # an eagle head scores only records with features
            log.info("drafter v%d: %s; waiting", version, "the server stops" if self._stop.is_set() else verdict.reason)
            self.waiting, self.waiting_scored = version, verdict.positions
            self._pending = candidate
            return False
        reason = (f"held-out shadow α {fmt_rate(verdict.new_alpha)} vs served v{live_version} "
                  f"{fmt_rate(verdict.old_alpha)} on {verdict.records} records ({verdict.positions} positions); "
                  f"{verdict.group_summary()}")
        with self._lock:
            self.promotion.judged(version, verdict.passed)
        if not verdict.passed:
            self._refuse(version, f"{reason}; {verdict.reason}", kind="shadow")
            return False
        try:
            return self._swap(candidate, "promoted", reason)
        except AdapterRejected as exc:  # the engine could not load it (vLLM): it keeps the served drafter
            self._refuse(version, exc.reason, kind=exc.kind)
            return False

    def _compare(self, candidate: Scorer, incumbent: Scorer, records: list[FeedbackRecord], rule: Rule) -> Verdict:
        """THE comparison (`dvi.feedback.verdict.compare`) of two loaded versions; kept for /metrics."""
        self._freed = True
        verdict = compare(candidate, incumbent, records, rule)
        self.verdicts[rule.name] = verdict
        return verdict

    def _swap(self, loaded: Loaded, kind: str, reason: str) -> bool:
        """Serve `loaded` (`kind`: promoted, rolled_back, pinned, restored); False where a pin stands against a
        promotion (a pin issued while its shadow check ran wins: the version is judged again once unpinned)."""
        self._freed = True
        version = loaded.version
        with self._swaps:
            with self._lock:
                pin = self.promotion.pinned if kind == "promoted" else None
            if pin is not None:
                log.info("drafter v%d passed its shadow check, but the drafter is pinned to v%d: not promoted",
                         version, pin)
                return False
            self.scheduler.command(loaded.command).result(timeout=120)
            with self._lock:
                prev = self.promotion.swapped(version, kind)
                self.loaded[version] = loaded
                keep = {version, 0}  # the last good version is loaded again when a watch or a rollback needs it
                self.loaded = {v: m for v, m in self.loaded.items() if v in keep}
                self._windows = {v: w for v, w in self._windows.items() if v in keep}
                self._windows[version] = collections.deque(maxlen=self.policy.rollback_window)
            self._save_serving()
        self._record(SwapEvent(kind, version, prev, reason, time.time()))
        return True

    def _save_serving(self) -> None:
        with self._lock:
            st = ServingState(version=self.live_version, good=self.good, pinned=self.pinned)
        try:
            self.registry.set_serving(st)
        except OSError:
            log.exception("cannot record the served drafter in the registry")

    def _refuse(self, version: int, reason: str, kind: str = "other", transient: bool = False) -> None:
        """Refuse `version` (logged, counted once, durable unless transient: retried at every poll). Durable
        first, then counted, then shown: whoever sees it on /health finds it on /metrics and in REFUSED."""
        if not transient:
            try:
                self.registry.refuse(version, reason)
            except OSError:
                log.exception("cannot record the refusal of v%d in the registry", version)
        with self._lock:
            again = transient and version in self.promotion.retry
        if not again:
            self._record(SwapEvent("refused", version, self.live_version, reason, time.time(), category=kind))
        with self._lock:
            self.promotion.refuse(version, reason, transient)

    def _record(self, ev: SwapEvent) -> None:
        if ev.kind in ("promoted", "refused") and ev.version not in self._verdict_seen:
            self._verdict_seen[ev.version] = None
            while len(self._verdict_seen) > MAX_REFUSED_SHOWN:
                self._verdict_seen.popitem(last=False)
            published = self.registry.published_at(ev.version)
            ev.publish_to_verdict_s = None if published is None else max(0.0, ev.at - published)
        if self.lane is not None:
            ev.group = self.lane.group
        self.events.append(ev)
        self.counts[ev.kind] += 1
        level = logging.WARNING if ev.kind in ("refused", "rolled_back", "alert") else logging.INFO
        log.log(level, "drafter%s %s v%d (previous %s): %s", self._of_group(), ev.kind, ev.version, ev.previous,
                ev.reason)
        if self.event_log:
            try:
                append_jsonl(self.event_log, ev.as_dict(), fsync=False)
            except OSError:
                log.exception("cannot append to %s", self.event_log)
        try:
            self.on_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("swap event observer failed")

    # -- the rollback watch --------------------------------------------------------------------------
    def check_rollback(self) -> bool:
        """End a full watch (or an idle one a newer version waits behind, `Watch.ends_early`): replay its records
        through the watched and the last good version (`watch_rule`); roll back when worse, else make it the
        last good one. True if it rolled back."""
        with self._lock:
            if self._stop.is_set():
                return False
            busy = self.scheduler is not None and self.scheduler.busy()
            pending = self._pending.version if self._pending is not None else None
            ends = self.promotion.watch_ends(pending, self.policy.watch_idle_s, busy)
            if ends is None:
                return False
            w, early = ends
            new, old = self.loaded.get(w.version), self.loaded.get(w.good)
        if old is None:  # not kept between promotions (memory: issue 36 §9)
            old = self._load_quietly(w.good)
        if new is None or old is None:
            with self._lock:
                self.promotion.drop_watch()
            return False
        verdict = self._compare(new.scorer, old.scorer, w.snapshot(), self.policy.watch)
        if self._stop.is_set():  # no verdict once the server stops: the watched version is not yet the last good one
            return False
        reason = w.describe(verdict, early)
        with self._lock:
            outcome = self.promotion.watch_judged(w, verdict.failed)
        if outcome == "kept":
            self._save_serving()
            self._record(SwapEvent("kept", w.version, w.good, reason, time.time()))
            return False
        if outcome == "alert":
            self._record(SwapEvent("alert", w.version, w.good, f"pinned, not rolled back: {reason}", time.time()))
            return False
        with self._lock:
            self.loaded.setdefault(w.good, old)  # what the rollback swaps in
        self.rollback(reason)
        return True

    def _load_quietly(self, version: int) -> Loaded | None:
        """A version the swapper once served, loaded again (None, logged, if it no longer loads)."""
        try:
            return self._load(version)
        except AdapterRejected as exc:
            log.error("cannot load v%d again (%s)", version, exc.reason)
            return None

    def rollback(self, reason: str) -> int:
        """Back to the last version that passed its watch (from a good version: the one before it); the
        version left is refused for good, by this server: LATEST is the trainer's and stays where it is. Refused
        under a pin (ValueError: unpin first)."""
        with self._lock:
            bad, target = self.promotion.rollback_plan()
        loaded = self.loaded.get(target) or self._load(target)
        self.registry.refuse(bad, f"rolled back: {reason}")
        with self._lock:
            self.promotion.rolled_back(bad, target, reason)
        self._swap(loaded, "rolled_back", reason + f" (from v{bad})")
        return target

    def pin(self, version: int | None) -> int:
        """Serve exactly `version` (0 = the startup drafter) until unpinned (None); durable in the registry.
        No automatic promotion or rollback overrides a pin: a failed watch under it only alerts."""
        if version is None:
            with self._lock:
                old = self.promotion.pin(None)
            if old:
                try:
                    self.registry.unpin(old)
                except (OSError, ValueError):
                    pass
            self._save_serving()
            return self.live_version
        loaded = self.loaded[0] if version == 0 else self._load(version)
        if version:
            self.registry.pin(version)
        with self._swaps:  # a promotion under way finishes first, then the pin serves its version
            with self._lock:
                self.promotion.pin(version)
            if version != self.live_version:
                self._swap(loaded, "pinned", "pinned by admin")
            else:
                self._save_serving()
        return version

    def info(self) -> dict[str, Any]:
        latest, positions = self.registry.latest(), self.heldout_positions()  # no file read under the lock
        with self._lock:
            w = self.watch
            return {
                "live_version": self.live_version,
                "serving": self.scheduler.snapshot.served(self.lane) if self.scheduler is not None else self.live_version,
                "good": self.good,
                "pinned": self.pinned,
                "watch": None if w is None else {"version": w.version, "against": w.good, "records": len(w.records),
                                                 "of": self.policy.rollback_window},
                "latest": latest,
                "heldout_positions": positions,
                "waiting": None if self.waiting is None else {  # a verdict waiting for held-out evidence
                    "version": self.waiting, "of": self.policy.min_positions,
                    "heldout_positions": positions if self.waiting_scored is None else self.waiting_scored},
                "heldout": self.heldout.info(),
                "gates": {name: {"outcome": v.outcome, "groups": v.group_summary()} for name, v in self.verdicts.items()},
                "refused": {str(k): v for k, v in self.refused.items()},
                "counts": dict(self.counts),
                "versions": {str(v): s for v, s in list(self.promotion.state.items())[-16:]},  # their lifecycle states
                "live_alpha": self.live_alpha(self.live_version),
                "events": [e.as_dict() for e in list(self.events)[-10:]],
            }
