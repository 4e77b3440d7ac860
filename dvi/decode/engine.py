"""Lossless batched speculative decoding engine with a step-level API for continuous batching.

One step for all active rows (`SpeculativeEngine._spec_step`, one method per phase):
  1. choose K (`_choose_k`: fixed, or `dvi.decode.adaptive.AdaptiveK` from calibrated costs; K = 0 is plain decoding);
  2. draft (`_draft`): K drafter forwards propose d_1..d_K per row (batch-wide K);
  3. verify (`_verify`): the target scores [last token, d_1..d_K] for every row in ONE forward (K + 1 positions);
  4. accept (`_accept`): per row, greedy exact match or Leviathan/Chen rejection sampling (lossless at any
     temperature, `dvi.decode.sampling`): n drafts kept and the target's token after them;
  5. roll back (`_roll_back`): both KV caches drop the rejected slots (`dvi.decode.kv.RaggedKV`: holes + per-row
     positions, compaction);
  6. emit (`_emit`, `dvi.decode.emit`): the n + 1 tokens onto each row's result; finished rows leave the batch.

Invariant between steps, per row: the target cache holds every token except the last emitted one
(`_last`). The draft state of a row (a drafter's cache and the tokens it lacks, eagle features, suffix match
state) belongs to the drafter kind's `dvi.drafters.proposers.Proposer`, which the engine asks for drafts and tells what
was accepted; the engine has no branch per kind. K = 0 is plain decoding through the same path. Elsewhere,
by job: results `dvi.decode.results`, rows `dvi.decode.seq`, calibration `dvi.decode.calibration_rows`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dvi.decode.acceptance import AcceptanceTracker
from dvi.decode.adaptive import AdaptiveK, CostModel, GoodputGuard, batch_bucket, choose_point_k
from dvi.decode.calibration_rows import CalibrationSetup, calibrate_bucket
from dvi.decode.emit import Emitted, append_tokens, count_drafts, emitted
from dvi.decode.request import (
    InvalidParam,
    Request,
    SamplingParams,
    is_int,
    validate_engine_limits,
    validate_params,
    validate_prompt,
)
from dvi.decode.results import GenerationResult, StepOutput, Versions
from dvi.decode.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    greedy_accept,
    point_mass_accept,
    rejection_accept,
    sample_from,
    warp_probs,
)
from dvi.decode.seq import BatchParams, Seq, g_rand, row_generator
from dvi.decode.target import TargetRunner, target_runner
from dvi.drafters.learned import Drafter
from dvi.drafters.proposers import Draft, NoProposer, Plan, Proposer, model_proposer
from dvi.drafters.vocab import fit_vocab
from dvi.models.loading import check_target_state_dict, load_state_dict

__all__ = ["SamplingParams", "Request", "GenerationResult", "StepOutput", "SpeculativeEngine", "InvalidParam", "Versions"]


class SpeculativeEngine:
    """Speculative decoding over HF causal LMs; see docs/contracts.md for the API."""

    def __init__(
        self,
        target: nn.Module,
        drafter: nn.Module | Drafter | Proposer | None = None,
        num_draft_tokens: int = 4,
        adaptive: bool = False,
        max_draft_tokens: int = 8,
        feedback_top_k: int = 0,
        versions: Versions = Versions(),
        greedy_below_temperature: float = GREEDY_BELOW_TEMPERATURE,
        cuda_graphs: bool = True,
        max_batch_size: int = 16,
    ):
        validate_engine_limits(num_draft_tokens, max_draft_tokens, feedback_top_k)
        self.target = target.eval()
        p0 = next(self.target.parameters())
        self.device, self.dtype = p0.device, p0.dtype
        self.vocab_size = int(self.target.get_output_embeddings().weight.shape[0])
        self.num_embeddings = int(self.target.get_input_embeddings().weight.shape[0])
        mp = getattr(self.target.config, "max_position_embeddings", None)
        self.max_context = int(mp) if mp else None
        self.num_draft_tokens = num_draft_tokens
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = bool(adaptive)
        self.feedback_top_k = feedback_top_k
        self.greedy_below_temperature = float(greedy_below_temperature)
        self.target_version, self.drafter_version = int(versions.target), int(versions.drafter)
        self._waiting: list[Seq] = []
        self._seqs: list[Seq] = []
        self.proposer: Proposer = model_proposer(None, self.vocab_size, self.device)
        self._set_drafter(drafter)
        # after the proposer: the widest verify (k_cap + 1) sizes the captured graphs
        self._target: TargetRunner = target_runner(self.target, max_width=self.k_cap + 1, graphs=cuda_graphs,
                                                   max_batch=max_batch_size, max_context=self.max_context)
        self._plan = Plan()
        self.controller = AdaptiveK(max_draft_tokens, num_draft_tokens)
        self.suffix_guard = GoodputGuard()  # suffix drafts' measured goodput vs plain steps (adaptive)
        self.costs = CostModel()  # online step timings (reporting); K is chosen from calibrated costs
        self.acceptance = AcceptanceTracker()
        # Adaptive K optimises the completion of the current batch (its slowest row) when True, plain
        # throughput when False (a server that backfills finished rows continuously may prefer False).
        self.drain_aware = True
        self.last_k = 0
        self.tokens_emitted = self.tokens_speculated = 0  # since construction (`_count_tokens`)
        self.suffix_step_seconds: list[float] = []  # the suffix tree's host work per step (drained by /metrics)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._outbox: list[StepOutput] = []
        self._target_dirty = self._drafter_dirty = False
        self._gen_calls = 0
        self._refresh_params()

    # ------------------------------------------------------------------ public API
    def add_request(self, request: Request) -> None:
        """Queue a request; it joins the batch (prefill) at the next step()."""
        validate_prompt(request.prompt_ids, "prompt_ids", self.vocab_size, self.num_embeddings)
        self._validate_params(request.params, len(request.prompt_ids))
        if any(s.req.request_id == request.request_id for s in self._waiting + self._seqs):
            raise ValueError(f"request_id {request.request_id!r} is already active")
        request = self._normalized(request)
        p = request.params
        res = GenerationResult(
            request_id=request.request_id,
            prompt_ids=list(request.prompt_ids),
            accepted_per_position=[0] * self.k_cap,
            drafted_per_position=[0] * self.k_cap,
            domain=request.domain,
            started_at=time.time(),
            temperature=float(p.temperature),
        )
        self._waiting.append(Seq(request, res, row_generator(p), self.acceptance.new_row()))

    def _normalized(self, request: Request) -> Request:
        """A temperature below the floor is served as greedy: logits / 1e-45 overflow to NaN."""
        t = request.params.temperature
        if 0 < t < self.greedy_below_temperature:
            return dataclasses.replace(request, params=dataclasses.replace(request.params, temperature=0.0))
        return request

    def abort(self, request_id: str) -> GenerationResult | None:
        """Remove a request between steps; its result (finish_reason 'abort') also comes out of the next step()."""
        for i, s in enumerate(self._waiting):
            if s.req.request_id == request_id:
                del self._waiting[i]
                return self._finish_aborted(s)
        for i, s in enumerate(self._seqs):
            if s.req.request_id == request_id:
                self.proposer.close_row(i, s, keep=False)
                self._remove_rows([i])
                return self._finish_aborted(s)
        return None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._seqs)

    def num_active(self) -> int:
        """Unfinished requests (running + waiting to join)."""
        return len(self._waiting) + len(self._seqs)

    @property
    def drafter(self) -> Drafter | None:
        """The learned drafter (None for `suffix` alone or speculation off)."""
        return self.proposer.drafter

    @property
    def k_cap(self) -> int:
        """The longest draft a step may carry: the learned drafter's max K, or a suffix proposal's."""
        return max(self.max_draft_tokens, self.proposer.max_tokens)

    def set_drafter(self, drafter: nn.Module | Drafter | Proposer | None, version: int) -> None:
        """Hot swap; in-flight rows get their drafter cache rebuilt at the next step() (`hybrid`: its learned part)."""
        self._set_drafter(drafter)
        self.drafter_version = int(version)
        self._drafter_dirty = True
        self.acceptance.reset()  # acceptance of the old drafter says little about the new one

    def update_target_weights(self, state_dict_or_path: dict | str | Path, version: int,
                              complete: bool = False) -> None:
        """Load new target weights in place (Parameter objects kept); in-flight target KV is recomputed.

        Refused (ValueError, nothing changed) for unknown keys, wrong shapes, non-finite values, and,
        with `complete=True` (the server's admin API), for a file lacking any of the target's
        tensors (weights tied to a present tensor excepted): half-updated weights serve garbage.
        """
        sd = load_state_dict(state_dict_or_path) if isinstance(state_dict_or_path, (str, Path)) else state_dict_or_path
        check_target_state_dict(sd, self.target.state_dict(), complete)
        with torch.no_grad():
            self.target.load_state_dict(sd, strict=False)
        self.target_version = int(version)
        self.proposer.target_updated(self.target_version)
        self._target_dirty = True
        self.acceptance.reset()
        if self.drafter is not None and self.drafter.shares_weights_with_target():
            self._drafter_dirty = True

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> list[GenerationResult]:
        """Decode a batch of prompts (different lengths); request i is seeded with seed + i."""
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if seed is not None and not is_int(seed):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        stops = tuple(stop_token_ids or ())
        params = [SamplingParams(max_new_tokens, temperature, top_k, top_p, None if seed is None else seed + i, stops)
                  for i in range(len(prompts))]
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):  # all checked before any is queued
            validate_prompt(p, f"prompts[{i}]", self.vocab_size, self.num_embeddings)
            self._validate_params(sp, len(p), f"prompts[{i}]")
        self._gen_calls += 1
        ids = [f"generate-{self._gen_calls}-{i}" for i in range(len(prompts))]
        for rid, p, sp in zip(ids, prompts, params, strict=True):
            self.add_request(Request(rid, list(p), sp))
        done: dict[str, GenerationResult] = {}
        mine = set(ids)
        while len(done) < len(ids):
            for o in self.step():
                if o.finished and o.request_id in mine:
                    done[o.request_id] = o.result
        return [done[r] for r in ids]

    def step(self) -> list[StepOutput]:
        """One draft + verify for all active rows (new requests are prefilled and joined first)."""
        outs, self._outbox = self._outbox, []
        with torch.inference_mode():
            if self._target_dirty:
                self._rebuild_target()
            if self._drafter_dirty:
                self._rebuild_drafter()
            if self._waiting:
                self._admit()
            if self._seqs:
                outs.extend(self._spec_step())
        return outs

    def _validate_params(self, p: SamplingParams, prompt_len: int, prompt_name: str = "prompt_ids") -> None:
        validate_params(p, prompt_len, self.vocab_size, self.max_context, prompt_name)

    def _set_drafter(self, drafter) -> None:
        """A Proposer replaces the current one; a drafter model (or None) goes to the current proposer's kind."""
        old, had = self.proposer, self.proposer.needs_features
        new = drafter if isinstance(drafter, Proposer) else old.with_drafter(drafter)
        d = new.drafter
        if d is not None and d.vocab_size < self.vocab_size:
            raise ValueError(
                f"drafter embeds {d.vocab_size} token ids but the target emits {self.vocab_size}: not the same tokenizer"
            )
        rows = self._seqs + self._waiting
        if rows and new.needs_features and (new is not old or not had):
            self._target_dirty = True  # in-flight rows have no features for it: recompute them
        if rows and new is not old:
            self._drafter_dirty = True
        self.proposer = new

    def _refresh_params(self) -> None:
        self._p = BatchParams.of(self._seqs, self.device, self.vocab_size)

    def _admit(self) -> None:
        new, self._waiting = self._waiting, []
        feats = self._target.admit([list(s.req.prompt_ids[:-1]) for s in new], self.proposer.needs_features)
        self.proposer.admit(new, feats)
        last = torch.tensor([int(s.req.prompt_ids[-1]) for s in new], dtype=torch.long, device=self.device)
        self._last = torch.cat([self._last, last])
        self._seqs.extend(new)
        self._refresh_params()

    def _remove_rows(self, rows: list[int]) -> None:
        drop = set(rows)
        keep = [i for i in range(len(self._seqs)) if i not in drop]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._target.select_rows(keep)
        self.proposer.select_rows(keep, idx)
        self._last = self._last.index_select(0, idx)
        self._seqs = [self._seqs[i] for i in keep]
        self._refresh_params()

    def _finish_aborted(self, s: Seq) -> GenerationResult:
        """An aborted row's result into the next step's outputs (its proposer row already closed)."""
        self._outbox.append(StepOutput(s.req.request_id, [], True, self._close(s, "abort")))
        return s.res

    def _close(self, s: Seq, reason: str) -> GenerationResult:
        return s.close(reason, Versions(self.target_version, self.drafter_version))

    def _rebuild_target(self) -> None:
        self._target_dirty = False
        feats = self._target.rebuild([s.tokens()[:-1] for s in self._seqs], self.proposer.needs_features)
        if feats is not None:
            self.proposer.set_features(feats)

    def _rebuild_drafter(self) -> None:
        self._drafter_dirty = False
        self.proposer.rebuild(self._seqs)

    # ------------------------------------------------------------------ the speculative step
    def _spec_step(self) -> list[StepOutput]:
        """choose K -> draft -> verify -> accept -> roll back -> emit, then timings and finished rows out."""
        b = len(self._seqs)
        k, k_model = self._choose_k(b)
        self.last_k = k
        t0 = time.perf_counter()
        u = self._uniforms(2 * k + 1)  # [B, 2K + 1]: K draft samples, K accept tests, 1 resample; None if greedy
        draft = self._draft(k_model, k, u) if k > 0 else None  # ids [B, K], q [B, K, V] or None
        t1 = time.perf_counter()
        logits, feats = self._verify(draft)  # [B, K + 1, V_head], features [B, K + 1, H] or None
        t_fwd = time.perf_counter()
        logits = fit_vocab(logits, self.vocab_size)  # [B, K + 1, V]
        n, nxt = self._accept(draft, self._p.transform(logits, draft and draft.ids), u)  # [B], [B]
        e = emitted(None if draft is None else draft.ids, n, nxt, logits, self._p.temp, self._p.all_t1,
                    self.feedback_top_k)  # the step's one device -> host transfer
        self._last = nxt
        self._target.keep(k + 1, [x + 1 for x in e.n])  # [last, d_1..d_n] of the K + 1 new entries stay
        outs, finished = self._emit(draft, e, feats)
        t2 = time.perf_counter()
        self._record_costs(b, k, k_model, t1 - t0, t2 - t1, t2 - t_fwd)
        n_new = sum(len(o.new_token_ids) for o in outs)
        self._count_tokens(k, n_new)
        if finished:
            self._remove_rows(finished)
        self._target.tidy(k > 0)
        self.proposer.maybe_compact()
        sec = self.proposer.step_seconds  # the suffix tree's host work this step, for /metrics (bounded)
        if sec is not None and len(self.suffix_step_seconds) < 4096:
            self.suffix_step_seconds.append(float(sec))
        dt = time.perf_counter() - t0
        if self.adaptive and not self._plan.suffix and not (k_model > 0 and self.proposer.last_catchup):
            self.controller.observe_step(b, k, n_new, dt)
        if self.adaptive and sec is not None and not k_model:
            self.suffix_guard.observe(b, k > 0, n_new, dt)
        return outs

    def _count_tokens(self, k: int, n: int) -> None:
        """Tokens emitted, and those emitted by steps that drafted (K > 0): the share of a workload speculated."""
        self.tokens_emitted += n
        if k > 0:
            self.tokens_speculated += n

    def _choose_k(self, batch: int) -> tuple[int, int]:
        """This step's verify width K (batch-wide) and the learned drafter's k_model <= K: the proposer plans
        which rows draft from where; model rows' K is fixed or adaptive (calibrated costs, row alphas), suffix
        rows' the length of their proposals (adaptive: priced at zero draft cost against the verify cost)."""
        cap = [s.remaining - 1 for s in self._seqs]  # drafts past a row's token budget would be thrown away
        # suffix drafts measured slower than plain steps at this batch size: no lookups either (hybrid: all model rows)
        lookups = not (self.adaptive and batch > 2 and self.proposer.step_seconds is not None
                       and not self.suffix_guard.allow(batch))
        plan = self._plan = self.proposer.plan(self._seqs, cap, suffix=lookups)
        k_model = self._model_k(batch, plan.model_rows) if plan.model_rows else 0
        k_suffix = self._suffix_k(batch, plan) if plan.suffix else 0
        k = max(0, min(max(k_model, k_suffix), max(cap)))
        return k, min(k_model, k)

    def _model_k(self, batch: int, rows: list[int]) -> int:
        if not self.adaptive:
            return self.num_draft_tokens
        if self.controller.needs_calibration(batch):
            self._calibrate(batch)
        est = self.acceptance.estimate
        seqs = [self._seqs[i] for i in rows]
        alphas = [est(s.acc, s.req.domain) for s in seqs]
        rem = [s.remaining for s in seqs] if self.drain_aware and batch > 1 else None
        return self.controller.choose(batch, alphas, rem, self.proposer.pending_tokens)

    def _suffix_k(self, batch: int, plan: Plan) -> int:
        longest = max(len(p.tokens) for p in plan.suffix.values())
        if not self.adaptive:
            return longest
        if self.controller.needs_calibration(batch):
            self._calibrate(batch)
        b = batch_bucket(batch)
        over = self.controller.step_overhead.get(b, 0.0)
        return choose_point_k([list(p.probs) for p in plan.suffix.values()], batch,
                              lambda k: self.controller.costs.verify_cost(b, k) + over, longest, self.controller.margin)

    def _uniforms(self, n: int) -> torch.Tensor | None:
        """Per-row uniforms [B, n] from each request's own generator (greedy rows: zeros, unused)."""
        if self._p.all_greedy:
            return None
        rows = [g_rand(g, n) for g in self._p.gens]
        return torch.stack(rows).to(self.device)

    def _draft(self, k_model: int, k: int, u: torch.Tensor | None) -> Draft:
        """The proposer's drafts for the plan: ids [B, K], q [B, K, V] (sampled model drafts) or None; u [B, 2K + 1]."""
        return self.proposer.propose(self._plan, k_model, k, u, self._p)

    def _verify(self, draft: Draft | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target scores [last token, d_1..d_K] of every row in one forward (K + 1 positions): logits
        [B, K + 1, V_head] and, when the proposer reads them (eagle), the features [B, K + 1, H]."""
        ids = self._last.unsqueeze(1)  # [B, 1]
        if draft is not None:
            ids = torch.cat([ids, draft.ids], 1)  # [B, K + 1]
        if self.proposer.needs_features:
            return self._target.forward(ids, True)
        return self._target.forward(ids, False), None

    def _accept(self, draft: Draft | None, logits: torch.Tensor, u: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the drafts kept (n [B]) and the target's token after them (nxt [B]), judged against the
        penalized `logits`: greedy exact match, or rejection sampling with u[:, K:2K] (tests) and u[:, 2K]
        (resample); suffix drafts are point masses (`point_mass_accept`); short rows get the bonus there."""
        k = 0 if draft is None else draft.ids.shape[1]
        lens = torch.tensor(draft.lens, device=self.device) if k and draft.ragged else None  # [B]
        if self._p.all_greedy:
            if k > 0:
                return greedy_accept(draft.ids, logits, lens)
            nxt = logits[:, 0].argmax(-1)  # [B]
            return torch.zeros_like(nxt), nxt
        p = warp_probs(logits, self._p.temp, self._p.top_k, self._p.top_p)  # [B, K + 1, V]
        if k > 0:
            ua, us = u[:, k : 2 * k], u[:, 2 * k]
            if draft.q is None:
                return point_mass_accept(draft.ids, p, ua, us, lens)
            if lens is None:
                return rejection_accept(draft.ids, draft.q, p, ua, us)
            return rejection_accept(draft.ids, draft.q, p, ua, us, lens)
        nxt = sample_from(p[:, 0], u[:, 0])  # [B]
        return torch.zeros_like(nxt), nxt

    def _emit(self, draft: Draft | None, e: Emitted, feats: torch.Tensor | None) -> tuple[list[StepOutput], list[int]]:
        """Emitted tokens onto each row's result and acceptance estimate, and to the proposer; rows that hit a
        stop token or their budget are closed. Returns the outputs and the finished rows."""
        outs: list[StepOutput] = []
        done: list[tuple[int, str]] = []
        news: list[list[int]] = []
        for i, s in enumerate(self._seqs):
            ni, ki = e.n[i], (draft.lens[i] if draft is not None else 0)
            src = draft.sources[i] if draft is not None else None
            s.res.num_steps += 1
            if ki > 0:
                count_drafts(s.res, ki, ni, src)
            model = src == "model"
            self.acceptance.update(s.acc, s.req.domain, ki if model else 0, ni if model else 0)
            new, reason = append_tokens(s.res, e, i, ki, s.stop, s.remaining, src)
            news.append(new)
            s.remaining -= len(new)
            if reason is not None:
                done.append((i, reason))
            outs.append(StepOutput(s.req.request_id, new, reason is not None, s.res if reason else None))
        self.acceptance.end_step(draft.ids.shape[1] if draft is not None else 0)
        self.proposer.observe(draft, e.n, news, feats)
        for i, reason in done:
            self.proposer.close_row(i, self._seqs[i], keep=True)
            self._close(self._seqs[i], reason)
        return outs, [i for i, _ in done]

    def _record_costs(self, b: int, k: int, k_model: int, t_draft: float, t_verify: float, t_host: float) -> None:
        """Online timings of the step (reporting) and, on CPU, the host work per step the controller adds;
        k the verify width, k_model the learned drafter's forwards (t_draft also holds suffix lookups: tiny)."""
        self.costs.record_verify(b, k, t_verify)
        if self.adaptive and self.device.type == "cpu":
            # On CPU the verify forward is synchronous, so t_host is the step's host work after it (on CUDA
            # it would include the kernels the first .tolist() waits for).
            self.controller.observe_host_work(b, t_host, self.costs)
        if k_model > 0 and not self.proposer.last_catchup:  # a drafter catch-up is not a typical draft cost
            self.costs.record_draft(b, t_draft / k_model)

    # ------------------------------------------------------------------ cost calibration (dvi.decode.adaptive.calibrate)
    def calibrate(self, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> None:
        """Measure verify costs for several K and a draft step, interleaved, per batch-size bucket, on dummy rows
        with their own caches (in-flight requests are untouched); adaptive K calls it lazily per new bucket."""
        if self.k_cap == 0 or isinstance(self.proposer, NoProposer):
            return
        with torch.inference_mode():
            for b in batch_sizes:
                self._calibrate(int(b), context, reps)

    def _calibrate(self, b: int, context: int = 128, reps: int = 3) -> None:
        setup = CalibrationSetup(self._target, self.proposer.needs_features, self.drafter, self.device, self.dtype,
                                 self.vocab_size, self.max_context, self.k_cap, self.max_draft_tokens)
        self.controller.set_costs(b, *calibrate_bucket(setup, b, context, reps))
