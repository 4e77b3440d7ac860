"""The publish gate of the online trainer (`Publishing`, mixed into `OnlineTrainer`): every
`trainer.publish_every_steps` steps the current weights are compared with the version the server SERVES now (the
registry's SERVING; 0 = the bootstrap drafter) on the held-out set, by THE comparison the server also promotes and
rolls back with (`dvi.feedback.verdict.compare`, rule `gates(cfg).publish`: better by `trainer.publish_margin` on at
least `trainer.shadow_min_positions` positions, and no group with enough records worse by more than
`trainer.gate_group_margin`); only a candidate that passes is published. Every decision is logged with its reason.

Its own module so the trainer's core reads as training.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn

from dvi import metrics as M
from dvi.decode.results import fmt_rate
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.shadow import (
    SHADOW_MAX_POSITIONS,
    ShadowEstimate,
    hf_logits_fn,
    record_scores,
    shadow_alpha,
)
from dvi.feedback.verdict import Scorer, compare
from dvi.registry.store import AdapterRejected
from trainers.online.decisions import PublishDecision

log = logging.getLogger("dvi.trainer")


class Publishing:
    """Shadow estimates and the publish gate over an `OnlineTrainer`'s trainable, held-out set and registry."""

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
            yield self.accelerator.unwrap_model(self.module)
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
        if served == self.last_published and self.last_published_state is not None:
            return self.last_published_state, ""
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

    def maybe_publish(self, force: bool = False) -> PublishDecision | None:
        """Every `publish_every_steps` steps: compare with the SERVED version on the held-out set; publish only a
        candidate that is better by `publish_margin` on at least `shadow_min_positions` positions and worse by no
        more than `gate_group_margin` in any group with enough records (`_publish_check`).

        Returns the decision (published version, or why not: logged), or None when not due. Only the main
        process publishes; other ranks return None.
        """
        if not force and self.step - self.last_publish_step < self.tc.publish_every_steps:
            return None
        if self.step == self.last_publish_step and not force or self.publish_backoff.waiting() and not force:
            return None
        due_since, self.last_publish_step = self.last_publish_step, self.step
        if not self.is_main:
            return None
        served = self.served_version()
        decision = PublishDecision(step=self.step, parent_version=served, time=time.time())
        ok = self._publish_check(served, decision)
        if self.registry is None or not ok:
            log.info("trainer: not publishing at step %d: %s", self.step, decision.reason)
        else:
            try:
                decision.published = self._publish(served, decision)
            except OSError as exc:  # disk full, read-only: keep training, retry the same candidate later
                decision.reason = self.publish_backoff.failed(exc, self.step)
                self.last_publish_step = due_since  # still due
            else:
                self.publish_backoff.succeeded()
                log.info("trainer: published v%d at step %d: %s", decision.published, self.step, decision.reason)
        if decision.heldout_alpha is not None:
            self.last_heldout_alpha = decision.heldout_alpha
        self.publish_log.append(decision)
        self._log({M.TRAINER_HELDOUT_ALPHA: decision.heldout_alpha,
                   "parent_heldout_alpha": decision.parent_heldout_alpha,
                   "published": decision.published is not None, M.TRAINER_STEP: self.step},
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

    def _publish(self, parent: int | None, decision: PublishDecision) -> int:
        """Write the current weights to the registry as a child of `parent`; returns the new version."""
        manifest = {
            "parent_version": parent,
            "target_version": self.current_target_version(),
            "steps": self.step,
            "records_seen": self.records_seen,
            "heldout_alpha": decision.heldout_alpha,
            "parent_heldout_alpha": decision.parent_heldout_alpha,
            "heldout_records": decision.heldout_records,
            "created_at": time.time(),
            "drafter_kind": self.trainable.kind,
            "trainer_mode": self.tc.mode,
            "draft_vocab_size": self.draft_vocab_size,
        }
        version = self.trainable.publish(self.registry, manifest)
        self.last_published = version
        self.last_published_state = self.trainable.state()
        return version

