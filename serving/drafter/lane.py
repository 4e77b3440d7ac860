"""One registry's drafter versions on the server: a `Lane` does what its machine decides, one step at a time.

A lane is the shared drafter's (the registry's versions, served with `SetDrafter`) or a traffic group's (its
`GroupScope`: the group's registry, its records only, `SetAdapter`). It runs on the drafter thread alone
(`serving.drafter.client`, which claims it in debug runs: `dvi.decode.owner`), so it holds no lock. Each `step`
looks at `LATEST` and does one thing: restore (once), end a rollback watch that is due, validate a new version (load
it: `dvi.registry.codec.load_drafter_version`, the registry's one check then its format's codec; a bad one is
refused: logged, counted, recorded in REFUSED), judge it on the held-out set (`dvi.feedback.heldout.HeldOutSet`,
warmed from the feedback log at start) by THE comparison (`dvi.feedback.verdict.compare`, rule `promotion_rule`; it
waits for `trainer.shadow_min_positions` positions), or swap it in between two engine steps (the `Loaded` version's
engine command). Between two steps the drafter thread applies what waits on its inbox, so a pin issued while a
shadow check runs lands before the swap it would have lost to. A promoted version is watched
(`serving.drafter.lifecycle.Watch`): the next `serve.rollback_window` finished requests replayed through it and the
last good version (rule `watch_rule`); worse rolls back to the last version that passed its watch, not worse makes
it the last good one. A watch ends early, on the records it has, when a newer version waits and the server has been
idle `serve.watch_idle_s`. Under a pin a failed watch only alerts. Each version's time from publish to its first
verdict is a histogram on /metrics (`dvi_drafter_publish_to_verdict_seconds`).

What is served, the last good version and the pin are the registry's SERVING (`ServingState`), refusals its REFUSED:
this lane (this replica's drafter thread) is their one writer. The trainer judges against what is served; a
restarted server serves its pin, else its last good version. Version 0: the startup drafter.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import torch

from dvi.decode.results import acceptance_rate, fmt_rate
from dvi.feedback import FeedbackRecord
from dvi.feedback.heldout import HeldOutSet, newest_logged
from dvi.feedback.shadow import hf_logits_fn
from dvi.feedback.verdict import Rule, Scorer, Verdict, compare, scorer
from dvi.fsutil import AppendLog, append_jsonl
from dvi.memory import glibc_trim
from dvi.registry.codec import load_drafter_version, load_group_version, scoring_module
from dvi.registry.store import AdapterRejected, DrafterRegistry, ServingState

from ..engine_client import EngineClient, SetAdapter, SetDrafter
from .diagnosis import Diagnosis
from .lifecycle import Lifecycle
from .messages import LaneView, VersionEvent
from .policy import GroupScope, LifecyclePolicy

__all__ = ["Lane", "Loaded"]

log = logging.getLogger(__name__)

EVENTS_KEPT = 100  # events a lane keeps for /health and /admin/status (all of them are in the swap event log)


@dataclass(frozen=True)
class Loaded:
    """A version loaded, checked and ready to serve: the drafter the gates score, and the one engine command that
    serves it (the whole drafter, or a group's adapter factors), built once when the version is loaded."""

    version: int
    model: Any
    command: SetDrafter | SetAdapter

    @functools.cached_property
    def logits_fn(self) -> Any:
        """Its teacher-forced logits (`device`: where its inputs go)."""
        fn = hf_logits_fn(scoring_module(self.model))
        fn.device = next(self.model.parameters()).device
        return fn

    @functools.cached_property
    def scorer(self) -> Scorer:
        """Its teacher-forced scores, what every gate compares (`dvi.feedback.verdict.compare`)."""
        return scorer(self.logits_fn, next(self.model.parameters()).device)


class Lane:
    """One registry's versions: it loads, checks and swaps the versions its machine (`Lifecycle`, all of the promotion
    state) names, and keeps what it saw (events, counts, verdicts, live α, the held-out set). The drafter thread alone
    calls it (the door, `serving.drafter.client.DrafterClient`, sends everyone else's messages)."""

    _owned_parts = ("machine", "heldout")  # what the drafter thread's claim covers (`dvi.decode.owner`)

    def __init__(self, registry: DrafterRegistry, engine: EngineClient | None, base_drafter: torch.nn.Module,
                 policy: LifecyclePolicy, on_event: Callable[[VersionEvent], None] | None = None,
                 event_log: str | AppendLog | None = None, feedback_dir: str | None = None,
                 scope: GroupScope | None = None) -> None:
        self.registry = registry
        self.scope = scope  # a traffic group's lane (issue 40): its registry, records and engine command are that group's
        self.feedback_dir = feedback_dir  # the held-out set starts from its newest shards (`restore`)
        self.engine = engine
        self.base = base_drafter  # version 0; a LoRA version is merged into a copy of it (it stays pristine)
        self.policy = policy
        self.on_event = on_event or (lambda _e: None)
        self.event_log = event_log
        self.stopping = threading.Event()  # set once the server stops (the door's, shared by its lanes): no verdict after
        self.machine = Lifecycle(policy.rollback_window, self._load(0))  # every decision, and what it rests on
        self.events: collections.deque[VersionEvent] = collections.deque(maxlen=EVENTS_KEPT)
        self.counts = collections.Counter()
        self.heldout = HeldOutSet(policy.shadow_records, policy.heldout_fraction)  # what a promotion is judged on
        self.verdicts: dict[str, Verdict] = {}  # the last verdict of each gate ("promotion", "watch"), for /metrics
        self._windows: dict[int, collections.deque] = {}  # live α per kept version (bounded like `machine.loaded`)
        self.latest: int | None = None  # LATEST as the last step read it
        self._restored = False
        self._trim = glibc_trim()  # a promotion's loads and checks free whole drafters: hand them back to the OS
        self._freed = False  # a load, check or swap ran since the last trim
        # why live α moves (issue 59 §2): each window of records measured, the cause named
        self.diagnosis = Diagnosis(scope.group if scope else "", scope is not None)

    def for_group(self, scope: GroupScope, registry: DrafterRegistry) -> Lane:
        """A traffic group's lane, wired as this one (engine, startup drafter, policy, events, feedback log)."""
        lane = Lane(registry, self.engine, self.base, self.policy, on_event=self.on_event, event_log=self.event_log,
                    feedback_dir=self.feedback_dir, scope=scope)
        lane.stopping = self.stopping
        return lane

    # -- what finished requests tell it ---------------------------------------------------------
    def observe_record(self, record: FeedbackRecord, at: float | None = None,
                       counts: tuple[int, int] | None = None) -> None:
        """A finished request's record: held-out ones join the held-out set, all of them a running watch."""
        if self.scope is not None and not self.scope.accepts(record):
            return
        self.heldout.offer(record)
        self.diagnosis.add(record, counts)
        w = self.machine.watch
        if w is not None:
            w.add(record, at)

    def observe(self, drafted: int, accepted: int, drafter_version: int) -> None:
        window = self._windows.get(drafter_version)
        if window is None and drafter_version in self.machine.loaded:
            window = self._windows[drafter_version] = collections.deque(maxlen=self.policy.rollback_window)
        if window is not None:
            window.append((drafted, accepted))

    def live_alpha(self, version: int) -> float | None:
        window = self._windows.get(version, ())
        return acceptance_rate(sum(a for _, a in window), sum(d for d, _ in window))

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> bool:
        """One look at the registry, one action: restore (once), end a watch that is due, else validate, judge or
        swap in LATEST as the machine says. True when another step has work now (not a poll later)."""
        try:
            if not self._restored:
                self.restore()
                return True
            if self.check_rollback():
                return True  # the watch ended: a waiting version is checked now, not a poll later
            if self.diagnosis.due():
                self._diagnose()
                return True
            self.latest = self.registry.latest()
            return self._advance(self.latest)
        except Exception:  # noqa: BLE001 - the drafter thread must outlive any one bad version
            log.exception("drafter lane step failed%s", self._of_group())
            return False
        finally:
            self.release_memory()

    def _advance(self, latest: int | None) -> bool:
        """What the machine says for `latest` (LATEST as read now): validate, judge or swap it in (True: the next of
        those is due now)."""
        m = self.machine
        step = m.next_step(latest, self.heldout.positions(), self.policy.min_positions, self.stopping.is_set())
        if step.action == "validate":
            durable = self.registry.refusals().get(latest)
            if durable is not None:  # refused by this server (this replica) before
                m.remember_refusal(latest, durable)
                return False
            return self._validate(latest)
        if step.action == "judge":
            return self._judge(m.pending)
        if step.action == "swap":
            return self._promote(m.pending, m.passed.reason)
        if step.news:
            log.info("drafter v%d waits for a shadow check: %d held-out positions of %d", latest,
                     self.heldout.positions(), self.policy.min_positions)
        return False

    def _diagnose(self) -> None:
        """The next window of records measured through the loaded versions, and a move of live α explained."""
        self._freed = True  # a teacher-forced forward per loaded version, as a check's
        loaded = self.machine.loaded
        move = self.diagnosis.run({v: x.scorer for v, x in loaded.items()}, {v: x.logits_fn for v, x in loaded.items()})
        if move is not None:  # logged, in the events log and on /health, to wandb and metrics.jsonl like a verdict
            self._record(VersionEvent("alpha_move", self.machine.live, None, move.message, time.time(),
                                      category=move.cause))

    def _of_group(self) -> str:
        return f" (group {self.scope.group})" if self.scope else ""

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
        self._restored = True
        self._warm_heldout()
        self._retire_pinned()
        st = self.registry.serving()
        want = self.machine.restore(self.registry.refusals(), st.pinned, st.good)
        loaded = self.machine.loaded[0]
        if want:
            try:
                loaded = self._load(want)
            except AdapterRejected as exc:
                log.error("cannot restore drafter v%d (%s); serving the startup drafter", want, exc.reason)
                want = 0
        self.machine.restored(want, st.pinned)
        if want:
            self._swap(loaded, "restored", "pinned before the restart" if self.machine.pinned is not None
                       else "last good version before the restart")
        else:
            self._save_serving()

    def _retire_pinned(self) -> None:
        """An older registry's PINNED file (every server's pins), read once and removed: SERVING carries the pin."""
        try:
            held = self.registry.retire_pinned()
        except OSError:
            log.exception("cannot retire the registry's PINNED file")
            return
        if held is not None:
            log.warning("drafter registry%s: its PINNED file (%s) is retired: each server's pin is in its SERVING "
                        "(this server's: %s), which gc keeps", self._of_group(), ", ".join(f"v{v}" for v in held)
                        or "empty", self.registry.serving().pinned)

    def _warm_heldout(self) -> None:
        """The held-out records of the feedback log's newest shards (what the trainer judges on, it reads them
        too): a restarted server can check a version at once instead of waiting for new held-out traffic."""
        if not self.feedback_dir:
            return
        try:
            records = newest_logged(self.feedback_dir)
            if self.scope is not None:
                records = [r for r in records if self.scope.accepts(r)]
            held = self.heldout.split(records, lambda _r: None)
        except Exception:  # noqa: BLE001 - an unreadable log only means starting empty
            log.exception("cannot warm the held-out set from %s", self.feedback_dir)
            return
        log.info("held-out set warmed from the feedback log: %d held-out records, %d positions", held,
                 self.heldout.positions())

    def _load(self, version: int) -> Loaded:
        """THE load of a version (0: the startup drafter): the registry's one check, its format's codec, and the
        engine command that serves it (a group's LoRA as per-row factors); AdapterRejected if any of them fails."""
        self._freed = True
        if self.scope is None:
            model = self.base if version == 0 else load_drafter_version(self.registry, version, self.base)[0]
            return Loaded(version, model, SetDrafter(model, version))
        model, factors = ((self.base, None) if version == 0 else
                          load_group_version(self.registry, version, self.base, self.scope.sizes, self.scope.num_layers))
        return Loaded(version, model, SetAdapter(self.scope.group, factors, version))

    def _validate(self, version: int) -> bool:
        """Load and check `version`, kept for its shadow check (True); a broken one is refused."""
        try:
            loaded = self._load(version)
        except AdapterRejected as exc:
            self._refuse(version, exc.reason, category=exc.category, transient=exc.transient)
            return False
        self.machine.validated(version, loaded)
        return True

    def _judge(self, candidate: Loaded) -> bool:
        """Shadow-check a validated version (the held-out set, `promotion_rule`); True when it passed (its swap is
        the next step, once the inbox's pins and rollbacks are in)."""
        version, live_version = candidate.version, self.machine.live
        live = self.machine.loaded[live_version]
        verdict = self._compare(candidate.scorer, live.scorer, self.heldout.records(), self.policy.promotion)
        if verdict.outcome == "wait" or self.stopping.is_set():  # an eagle head scores only records with features
            log.info("drafter v%d: %s; waiting", version,
                     "the server stops" if self.stopping.is_set() else verdict.reason)
            self.machine.waits(version, verdict.positions)
            return False
        reason = (f"held-out shadow α {fmt_rate(verdict.new_alpha)} vs served v{live_version} "
                  f"{fmt_rate(verdict.old_alpha)} on {verdict.records} records ({verdict.positions} positions); "
                  f"{verdict.group_summary()}")
        self.machine.judged(version, verdict.passed, reason)
        if not verdict.passed:
            self._refuse(version, f"{reason}; {verdict.reason}", category="shadow")
        return verdict.passed

    def _promote(self, candidate: Loaded, reason: str) -> bool:
        """Swap in the version that passed its check (never under a pin: the machine's next step is idle then)."""
        try:
            self._swap(candidate, "promoted", reason)
        except AdapterRejected as exc:  # the engine could not load it (vLLM): it keeps the served drafter
            self._refuse(candidate.version, exc.reason, category=exc.category)
        return False

    def _compare(self, candidate: Scorer, incumbent: Scorer, records: list[FeedbackRecord], rule: Rule) -> Verdict:
        """THE comparison (`dvi.feedback.verdict.compare`) of two loaded versions; kept for /metrics."""
        self._freed = True
        verdict = compare(candidate, incumbent, records, rule)
        self.verdicts[rule.name] = verdict
        return verdict

    def _swap(self, loaded: Loaded, event: str, reason: str) -> None:
        """Serve `loaded` (`event`: promoted, rolled_back, pinned, restored): the engine command, then the machine's
        state, SERVING, and the event."""
        self._freed = True
        version, m = loaded.version, self.machine
        if self.engine is not None:
            self.engine.command(loaded.command).result(timeout=120)
        first = event == "promoted" and version not in m.verdict_seen
        prev = m.swapped(version, event, loaded)
        self._windows = {v: w for v, w in self._windows.items() if v in m.loaded}
        self._windows[version] = collections.deque(maxlen=self.policy.rollback_window)
        self._save_serving()
        self._record(VersionEvent(event, version, prev, reason, time.time()), first)

    def _save_serving(self) -> None:
        m = self.machine
        st = ServingState(version=m.live, good=m.good, pinned=m.pinned)
        try:
            self.registry.set_serving(st)
        except OSError:
            log.exception("cannot record the served drafter in the registry")

    def _refuse(self, version: int, reason: str, category: str = "other", transient: bool = False) -> None:
        """Refuse `version` (logged, counted once, durable unless transient: retried at every poll). Durable
        first, then counted, then the machine's: whoever sees it on /health finds it on /metrics and in REFUSED."""
        m = self.machine
        if not transient:
            try:
                self.registry.refuse(version, reason)
            except OSError:
                log.exception("cannot record the refusal of v%d in the registry", version)
        if not (transient and version in m.retry):  # a transient refusal repeated is not reported again
            self._record(VersionEvent("refused", version, m.live, reason, time.time(), category=category),
                         first=version not in m.verdict_seen)
        m.refuse(version, reason, transient)

    def _record(self, ev: VersionEvent, first: bool = False) -> None:
        """Report `ev` (its version's first verdict when `first`: timed from its publish): kept, counted, logged,
        appended to the event log, handed to the observer (/metrics)."""
        if first:
            published = self.registry.published_at(ev.version)
            ev = replace(ev, publish_to_verdict_s=None if published is None else max(0.0, ev.at - published))
        if self.scope is not None:
            ev = replace(ev, group=self.scope.group)
        self.events.append(ev)
        self.counts[ev.event] += 1
        level = logging.WARNING if ev.event in ("refused", "rolled_back", "alert") or ev.category in (
            "serving_disagrees", "unexplained") else logging.INFO
        log.log(level, "drafter%s %s v%d (previous %s): %s", self._of_group(), ev.event, ev.version, ev.previous,
                ev.reason)
        if self.event_log:
            try:
                append_jsonl(self.event_log, ev.as_dict(), fsync=False)
            except OSError:
                log.exception("cannot append to %s", self.event_log)
        try:
            self.on_event(ev)
        except Exception:  # noqa: BLE001
            log.exception("version event observer failed")

    # -- the rollback watch --------------------------------------------------------------------------
    def check_rollback(self) -> bool:
        """End a full watch (or an idle one a newer version waits behind, `Watch.ends_early`): replay its records
        through the watched and the last good version (`watch_rule`); roll back when worse, else make it the
        last good one. True if the watch ended."""
        if self.stopping.is_set():
            return False
        busy = self.engine is not None and self.engine.busy()
        ends = self.machine.watch_ends(self.policy.watch_idle_s, busy)
        if ends is None:
            return False
        w, early = ends
        new, old = self.machine.loaded.get(w.version), self.machine.loaded.get(w.good)
        if old is None:  # not kept between promotions (memory: issue 36 §9)
            old = self._load_quietly(w.good)
        if new is None or old is None:
            self.machine.drop_watch()
            return True
        verdict = self._compare(new.scorer, old.scorer, w.snapshot(), self.policy.watch)
        if self.stopping.is_set():  # no verdict once the server stops: the watched version is not yet the last good one
            return False
        reason = w.describe(verdict, early)
        outcome = self.machine.watch_judged(w, verdict.failed)
        if outcome == "kept":
            self._save_serving()
            self._record(VersionEvent("kept", w.version, w.good, reason, time.time()))
        elif outcome == "alert":
            self._record(VersionEvent("alert", w.version, w.good, f"pinned, not rolled back: {reason}", time.time()))
        else:
            self.rollback(reason, old)
        return True

    def _load_quietly(self, version: int) -> Loaded | None:
        """A version the lane once served, loaded again (None, logged, if it no longer loads)."""
        try:
            return self._load(version)
        except AdapterRejected as exc:
            log.error("cannot load v%d again (%s)", version, exc.reason)
            return None

    # -- the admin's commands (`serving.drafter.messages`: Pin, Rollback) --------------------------------
    def rollback(self, reason: str, have: Loaded | None = None) -> int:
        """Back to the last version that passed its watch (from a good version: the one before it); the
        version left is refused for good, by this server: LATEST is the trainer's and stays where it is. Refused
        under a pin (ValueError: unpin first). `have`: the target, loaded already (a failed watch's)."""
        bad, target = self.machine.rollback_plan()
        loaded = (have if have is not None and have.version == target
                  else self.machine.loaded.get(target) or self._load(target))
        self.registry.refuse(bad, f"rolled back: {reason}")
        self.machine.rolled_back(bad, target, reason)
        self._swap(loaded, "rolled_back", reason + f" (from v{bad})")
        return target

    def pin(self, version: int | None) -> int:
        """Serve exactly `version` (0 = the startup drafter) until unpinned (None); durable in SERVING. No
        automatic promotion or rollback overrides a pin: a failed watch under it only alerts, and a version that
        passed its check meanwhile is judged again once unpinned."""
        m = self.machine
        if version is None:
            m.pin(None)
            self._save_serving()
            return m.live
        loaded = m.loaded.get(version) or self._load(version)
        m.pin(version)
        if version != m.live:
            self._swap(loaded, "pinned", "pinned by admin")
        else:
            self._save_serving()
        return version

    # -- what the door publishes -----------------------------------------------------------------------
    def view(self) -> LaneView:
        """This lane now, for the drafter snapshot (`serving.drafter.messages.LaneView`)."""
        m, positions = self.machine, self.heldout.positions()
        w = m.watch
        return LaneView(
            group=self.scope.group if self.scope else "", live_version=m.live,
            serving=self.engine.snapshot.served(self.scope) if self.engine is not None else m.live,
            good=m.good, pinned=m.pinned, latest=self.latest, heldout_positions=positions,
            watch=None if w is None else _ro({"version": w.version, "against": w.good, "records": len(w.records),
                                              "of": self.policy.rollback_window}),
            waiting=None if m.waiting is None else _ro({  # a verdict waiting for held-out evidence
                "version": m.waiting, "of": self.policy.min_positions,
                "heldout_positions": positions if m.waiting_scored is None else m.waiting_scored}),
            heldout=_ro(self.heldout.info()), verdicts=_ro(self.verdicts), refused=_ro(m.refused),
            counts=MappingProxyType(collections.Counter(self.counts)), versions=_ro(dict(list(m.state.items())[-16:])),  # their lifecycle states
            live_alpha=_ro({v: self.live_alpha(v) for v in self._windows}), events=tuple(self.events),
            diagnosis=_ro(self.diagnosis.info()))


def _ro(d: dict) -> MappingProxyType:
    """A read-only copy (what a snapshot holds)."""
    return MappingProxyType(dict(d))
