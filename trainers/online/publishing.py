"""The publish gate of the online trainer (`Publisher`, an object the `OnlineTrainer` owns and hands what it needs): every
`trainer.publish_every_steps` steps the current weights are compared with the version the server SERVES now (the
registry's SERVING; 0 = the bootstrap drafter) on the held-out set, by THE comparison the server also promotes and
rolls back with (`dvi.feedback.verdict.compare`, rule `gates(cfg).publish`: better by `trainer.publish_margin` on at
least `trainer.shadow_min_positions` positions, and no group with enough records worse by more than
`trainer.gate_group_margin`); only a candidate that passes is published. Every decision is logged with its reason.

What the gate remembers between checks (the last check's step, the last version published and its weights, its
held-out α, the retry backoff) is the publisher's own; the trainer's loop and checkpoint reach it only
through its methods. Each check is one `PublishDecision`.

A publish the registry cannot take (an OSError: disk full, quota, read-only, I/O; issue 36 §6, where ENOSPC killed
the trainer at every publish) is logged and counted, and the same candidate is tried again after `first_s`, doubling
up to `max_s` (`PublishBackoff`) while training goes on. The registry renames a version in whole, so a failed
publish leaves no version behind.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dvi import metrics as M
from dvi.decode.results import fmt_rate
from dvi.feedback.heldout import HeldOutSet
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.shadow import (
    SHADOW_MAX_POSITIONS,
    ShadowEstimate,
    hf_logits_fn,
    record_scores,
    shadow_alpha,
)
from dvi.feedback.verdict import Rule, Scorer, Verdict, compare
from dvi.registry.store import AdapterRejected, DrafterRegistry

log = logging.getLogger("dvi.trainer")


@dataclass
class PublishDecision:
    """One publish check at `step`: the held-out shadow α of the candidate and of the served `parent_version`
    (None when the check could not run), on how many records and positions, why (`reason`, logged) and the
    version published (None: not published)."""

    step: int
    parent_version: int
    time: float
    reason: str = ""
    heldout_alpha: float | None = None
    parent_heldout_alpha: float | None = None
    heldout_records: int = 0
    heldout_positions: int = 0
    published: int | None = None
    verdict: Verdict | None = None  # the comparison behind it (per group); None when it could not run


class PublishBackoff:
    """Failed publishes: how many (`failures`), whether one is still owed (`pending`) and when it may run."""

    def __init__(self, first_s: float = 5.0, max_s: float = 300.0) -> None:
        self.first_s, self.max_s = first_s, max_s
        self.failures = 0  # every failed publish (a gauge on /metrics)
        self.consecutive = 0
        self.retry_at = 0.0  # monotonic
        self.last_error: str | None = None

    @property
    def pending(self) -> bool:
        """The last publish failed and has not been retried successfully yet."""
        return self.consecutive > 0

    def waiting(self) -> bool:
        """Too early to try again."""
        return self.pending and time.monotonic() < self.retry_at

    def failed(self, exc: OSError, step: int) -> str:
        """Count a failed publish and schedule the retry; returns the reason for the publish decision."""
        self.failures += 1
        self.consecutive += 1
        delay = min(self.max_s, self.first_s * 2 ** (self.consecutive - 1))
        self.retry_at = time.monotonic() + delay
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.error("trainer: publishing at step %d failed (%s); training on, retrying in %.0f s (failure %d in a row)",
                  step, self.last_error, delay, self.consecutive)
        return f"the registry refused the write ({self.last_error}); retrying in {delay:.0f} s"

    def succeeded(self) -> None:
        if self.pending:
            log.info("trainer: publishing works again after %d failed attempt(s)", self.consecutive)
        self.consecutive, self.retry_at, self.last_error = 0, 0.0, None


class Publisher:
    """Shadow estimates and the publish gate over a trainer's trainable, held-out set and registry.

    `accelerator`: the trainer's (its device, and `unwrap_model` for the plain module to score); `publish_every`:
    steps between checks; `log_row(values, drafter_version=)`: the trainer's metrics row."""

    def __init__(self, trainable: Any, module: nn.Module, accelerator: Any, heldout: HeldOutSet,
                 registry: DrafterRegistry | None, gate: Rule, publish_every: int, log_row: Callable[..., None]) -> None:
        self.trainable, self.module, self.unwrap = trainable, module, accelerator.unwrap_model
        self.device = accelerator.device
        self.heldout, self.registry, self.gate = heldout, registry, gate
        self.publish_every, self.log_row = publish_every, log_row
        self.base_state = trainable.state()  # version 0: the drafter as loaded (no updates)
        self.last_step = 0  # the step of the last check
        self.published: int | None = None  # the version the current weights descend from, when it was published
        self.published_state: dict[str, torch.Tensor] | None = None  # its weights (the gate's incumbent when served)
        self.heldout_alpha: float | None = None  # the last check's held-out α of the current weights
        self.backoff = PublishBackoff()  # a registry that cannot take a version: retried, never fatal

    def adopt(self, version: int | None) -> None:
        """The current weights are `version`'s (a resume from a checkpoint, or the served version at start; None:
        none published)."""
        self.published = version
        self.published_state = self.trainable.state() if version is not None else None

    def reset(self) -> None:
        """As a fresh process has it (a rewind)."""
        self.last_step, self.published, self.published_state = 0, None, None

    @contextlib.contextmanager
    def _weights(self, state: Mapping[str, torch.Tensor] | None) -> Iterator[nn.Module]:
        """The module in eval mode holding `state` (None: the current weights), restored afterwards."""
        saved = None
        self.trainable.activate()
        if state is not None:
            saved = self.trainable.state()
            self.trainable.load_state(state)
        was = self.module.training
        self.module.eval()
        try:
            yield self.unwrap(self.module)
        finally:
            if saved is not None:
                self.trainable.load_state(saved)
            self.module.train(was)

    def scorer(self, state: Mapping[str, torch.Tensor] | None = None) -> Scorer:
        """A `dvi.feedback.verdict.Scorer` of the current weights, or of `state`."""
        def score(records: Sequence[FeedbackRecord]) -> list:
            with self._weights(state) as module:
                return record_scores(hf_logits_fn(module), records, self.device)
        return score

    def shadow(self, records: Sequence[FeedbackRecord] | None = None,
               state: Mapping[str, torch.Tensor] | None = None) -> ShadowEstimate:
        """Shadow α (teacher-forced, `dvi.feedback.shadow`) of the current weights, or of `state`, on held-out records."""
        recs = self.heldout.records() if records is None else [r.compact() for r in records]
        with self._weights(state) as module:
            return shadow_alpha(hf_logits_fn(module), recs, device=self.device, max_positions=SHADOW_MAX_POSITIONS)

    def _served_state(self, served: int) -> tuple[dict[str, torch.Tensor] | None, str]:
        """Weights of the version the server serves now (0: the bootstrap drafter), or (None, why not)."""
        if served == 0:
            return self.base_state, ""
        if served == self.published and self.published_state is not None:
            return self.published_state, ""
        try:
            return self.trainable.load_version(self.registry, served), ""
        except (AdapterRejected, OSError, ValueError) as exc:
            return None, f"the served v{served} does not load here ({exc})"

    def served_version(self) -> int:
        """What the server serves now, as it recorded in the registry's SERVING (0 = the bootstrap drafter); with
        replicas, the newest version any of them serves."""
        if self.registry is None:
            return 0
        return max(s.version for s in self.registry.served_everywhere().values())

    def maybe_publish(self, step: int, manifest: Callable[[], dict[str, Any]], is_main: bool = True,
                      force: bool = False) -> PublishDecision | None:
        """Every `publish_every` steps: compare with the SERVED version on the held-out set; publish only a
        candidate that is better by `publish_margin` on at least `shadow_min_positions` positions and worse by no
        more than `gate_group_margin` in any group with enough records (`_publish_check`). `manifest()`: the
        trainer's facts for a published version's manifest (asked only when one is published).

        Returns the decision (published version, or why not: logged), or None when not due. Only the main
        process publishes; other ranks return None.
        """
        if not force and step - self.last_step < self.publish_every:
            return None
        if step == self.last_step and not force or self.backoff.waiting() and not force:
            return None
        due_since, self.last_step = self.last_step, step
        if not is_main:
            return None
        served = self.served_version()
        decision = PublishDecision(step=step, parent_version=served, time=time.time())
        ok = self._publish_check(served, decision)
        if self.registry is None or not ok:
            log.info("trainer: not publishing at step %d: %s", step, decision.reason)
        else:
            try:
                decision.published = self._publish(served, decision, manifest())
            except OSError as exc:  # disk full, read-only: keep training, retry the same candidate later
                decision.reason = self.backoff.failed(exc, step)
                self.last_step = due_since  # still due
            else:
                self.backoff.succeeded()
                log.info("trainer: published v%d at step %d: %s", decision.published, step, decision.reason)
        if decision.heldout_alpha is not None:
            self.heldout_alpha = decision.heldout_alpha
        self.log_row({M.TRAINER_HELDOUT_ALPHA: decision.heldout_alpha,
                      "parent_heldout_alpha": decision.parent_heldout_alpha,
                      "published": decision.published is not None, M.TRAINER_STEP: step},
                     drafter_version=decision.published)
        return decision

    def _publish_check(self, served: int, decision: PublishDecision) -> bool:
        """The publish gate (`dvi.feedback.verdict.compare`, rule `gates(cfg).publish`): the current weights against
        the served version's on the held-out set, into `decision`; True to publish."""
        served_state, why = self._served_state(served)
        if served_state is None:
            decision.reason = why + "; not published"
            return False
        verdict = compare(self.scorer(), self.scorer(served_state), self.heldout.records(), self.gate)
        decision.verdict = verdict
        if verdict.outcome == "wait":
            decision.reason = verdict.reason + "; not published"
            return False
        decision.heldout_alpha, decision.parent_heldout_alpha = verdict.new_alpha, verdict.old_alpha
        decision.heldout_records, decision.heldout_positions = verdict.records, verdict.positions
        decision.reason = (f"held-out shadow α {fmt_rate(verdict.new_alpha, 4)} vs served v{served} "
                           f"{fmt_rate(verdict.old_alpha, 4)} on {verdict.records} records ({verdict.positions} "
                           f"positions); {verdict.group_summary()}"
                           + ("" if verdict.passed else f"; {verdict.reason}, not published"))
        return verdict.passed

    def _publish(self, parent: int | None, decision: PublishDecision, facts: Mapping[str, Any]) -> int:
        """Write the current weights to the registry as a child of `parent`; returns the new version."""
        manifest = {
            "parent_version": parent,
            **facts,  # target_version, steps, records_seen, drafter_kind, trainer_mode, draft_vocab_size
            "heldout_alpha": decision.heldout_alpha,
            "parent_heldout_alpha": decision.parent_heldout_alpha,
            "heldout_records": decision.heldout_records,
            "created_at": time.time(),
        }
        version = self.trainable.publish(self.registry, manifest)
        self.adopt(version)
        return version
