"""Lossless batched speculative decoding engine with a step-level API for continuous batching.

One step for all active rows (`SpeculativeEngine._spec_step`, one method per phase):
  1. choose K (`_choose_k`: fixed, or `dvi.adaptive.AdaptiveK` from calibrated costs; K = 0 is plain decoding);
  2. draft (`_draft`): K drafter forwards propose d_1..d_K per row (batch-wide K);
  3. verify (`_verify`): the target scores [last token, d_1..d_K] for every row in ONE forward (K + 1 positions);
  4. accept (`_accept`): per row, greedy exact match or Leviathan/Chen rejection sampling (lossless at any
     temperature, `dvi.sampling`): n drafts kept and the target's token after them;
  5. roll back (`_roll_back`): both KV caches drop the rejected slots (`dvi.kv.RaggedKV`: holes + per-row
     positions, compaction);
  6. emit (`_emit`, `dvi.emit`): the n + 1 tokens onto each row's result; finished rows leave the batch.

Invariant between steps, per row: the target cache holds every token except the last emitted one
(`_last`); the drafter cache holds every token except `pending` (1 token, 2 after a fully accepted step
since d_K was never fed to it, more after K=0 steps, the whole prompt until the row's first draft:
the drafter cache is filled lazily). K = 0 is plain decoding through the same path.
Elsewhere, by job: result types `dvi.results` (re-exported here), row state `dvi.seq`, calibration rows
`dvi.calibration_rows`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dvi.acceptance import AcceptanceTracker
from dvi.adaptive import AdaptiveK, CostModel
from dvi.calibration_rows import calibrate_bucket
from dvi.drafters import Drafter, as_drafter, model_forward
from dvi.emit import append_tokens, count_drafts, emitted
from dvi.kv import RaggedKV, prefill
from dvi.models import check_target_state_dict, load_state_dict
from dvi.request import (
    InvalidParam,
    Request,
    SamplingParams,
    is_int,
    validate_engine_limits,
    validate_params,
    validate_prompt,
)
from dvi.results import GenerationResult, StepOutput, Versions
from dvi.sampling import GREEDY_BELOW_TEMPERATURE, greedy_accept, rejection_accept, sample_from, warp_probs
from dvi.seq import BatchParams, Seq, g_rand, pending_features, pending_ids, row_generator
from dvi.vocab import fit_vocab

__all__ = ["SamplingParams", "Request", "GenerationResult", "StepOutput", "SpeculativeEngine", "InvalidParam", "Versions"]


class SpeculativeEngine:
    """Speculative decoding over HF causal LMs; see docs/contracts.md for the API."""

    def __init__(
        self,
        target: nn.Module,
        drafter: nn.Module | Drafter | None = None,
        num_draft_tokens: int = 4,
        adaptive: bool = False,
        max_draft_tokens: int = 8,
        feedback_top_k: int = 0,
        versions: Versions = Versions(),
        greedy_below_temperature: float = GREEDY_BELOW_TEMPERATURE,
    ):
        validate_engine_limits(num_draft_tokens, max_draft_tokens, feedback_top_k)
        self.target = target.eval()
        self._tfn = model_forward(self.target)
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
        self.drafter: Drafter | None = None
        self._waiting: list[Seq] = []
        self._seqs: list[Seq] = []
        self._features = False  # the drafter reads the target's features (eagle): rows keep them
        self._tfn_f = None  # the target callable that also returns them
        self._set_drafter(drafter)
        self.controller = AdaptiveK(max_draft_tokens, num_draft_tokens)
        self.costs = CostModel()  # online step timings (reporting); K is chosen from calibrated costs
        self.acceptance = AcceptanceTracker()
        # Adaptive K optimises the completion of the current batch (its slowest row) when True, plain
        # throughput when False (a server that backfills finished rows continuously may prefer False).
        self.drain_aware = True
        self.last_k = 0
        self.tokens_emitted = self.tokens_speculated = 0  # since construction (`_count_tokens`)
        self._tkv = RaggedKV(self.target.config, 0, self.device, self.dtype)
        self._dkv = self._new_dkv()
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._outbox: list[StepOutput] = []
        self._target_dirty = self._drafter_dirty = False
        self._gen_calls = 0
        self._catchup = False
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
            accepted_per_position=[0] * self.max_draft_tokens,
            drafted_per_position=[0] * self.max_draft_tokens,
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
                self._remove_rows([i])
                return self._finish_aborted(s)
        return None

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._seqs)

    def num_active(self) -> int:
        """Unfinished requests (running + waiting to join)."""
        return len(self._waiting) + len(self._seqs)

    def set_drafter(self, drafter: nn.Module | Drafter | None, version: int) -> None:
        """Hot swap; in-flight rows get their drafter cache rebuilt at the next step()."""
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

    # ------------------------------------------------------------------ validation
    def _validate_params(self, p: SamplingParams, prompt_len: int, prompt_name: str = "prompt_ids") -> None:
        validate_params(p, prompt_len, self.vocab_size, self.max_context, prompt_name)

    def _set_drafter(self, drafter) -> None:
        d = as_drafter(drafter)
        if d is not None and d.vocab_size < self.vocab_size:
            raise ValueError(
                f"drafter embeds {d.vocab_size} token ids but the target emits {self.vocab_size}: not the same tokenizer"
            )
        self.drafter = d
        features = bool(getattr(d, "needs_features", False))
        if features and self._tfn_f is None:
            self._tfn_f = model_forward(self.target, with_features=True)
        rows = self._seqs + self._waiting
        if features and not self._features and rows:
            self._target_dirty = True  # in-flight rows were admitted without features: recompute them
        if self._features and not features:
            for s in rows:  # a drafter without features: the history would only grow stale (and mislead the record)
                s.feats = []
        self._features = features

    # ------------------------------------------------------------------ batch membership
    def _new_dkv(self) -> RaggedKV:
        if self.drafter is None:
            return RaggedKV(self.target.config, 0, self.device, self.dtype)
        return RaggedKV(self.drafter.config, 0, self.device, self.drafter.dtype)

    def _refresh_params(self) -> None:
        self._p = BatchParams.of(self._seqs, self.device, self.vocab_size)

    def _admit(self) -> None:
        new, self._waiting = self._waiting, []
        ctx = [list(s.req.prompt_ids[:-1]) for s in new]
        self._tkv.merge(self._target_prefill(ctx, new))
        if self.drafter is not None:
            # The drafter cache is filled lazily: the whole prompt is pending and goes through the drafter
            # in the row's first draft forward (no drafter prefill at all while adaptive K stays at 0).
            self._dkv.merge(RaggedKV(self.drafter.config, len(new), self.device, self.drafter.dtype))
        for s in new:
            s.pending = [int(t) for t in s.req.prompt_ids] if self.drafter is not None else [int(s.req.prompt_ids[-1])]
        last = torch.tensor([int(s.req.prompt_ids[-1]) for s in new], dtype=torch.long, device=self.device)
        self._last = torch.cat([self._last, last])
        self._seqs.extend(new)
        self._refresh_params()

    def _remove_rows(self, rows: list[int]) -> None:
        drop = set(rows)
        keep = [i for i in range(len(self._seqs)) if i not in drop]
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._tkv.select_rows(idx)
        if self.drafter is not None:
            self._dkv.select_rows(idx)
        self._last = self._last.index_select(0, idx)
        self._seqs = [self._seqs[i] for i in keep]
        self._refresh_params()

    def _finish_aborted(self, s: Seq) -> GenerationResult:
        self._outbox.append(StepOutput(s.req.request_id, [], True, self._close(s, "abort")))
        return s.res

    def _close(self, s: Seq, reason: str) -> GenerationResult:
        return s.close(reason, Versions(self.target_version, self.drafter_version))

    def _target_prefill(self, ctx: list[list[int]], seqs: list[Seq]) -> RaggedKV:
        """The target's cache of `ctx` (one list per row); with an eagle drafter each row's features too."""
        if not self._features:
            return prefill(self.target.config, self._tfn, ctx, self.device, self.dtype)
        kv, out = prefill(self.target.config, self._tfn_f, ctx, self.device, self.dtype, return_output=True)
        for i, (s, c) in enumerate(zip(seqs, ctx, strict=True)):
            f = out[1][i, out[1].shape[1] - len(c):] if out is not None else None  # [len(c), H], left padding cut
            s.feats = [f.clone()] if f is not None and len(c) else []
        return kv

    def _rebuild_target(self) -> None:
        self._target_dirty = False
        ctx = [s.tokens()[:-1] for s in self._seqs]
        self._tkv = self._target_prefill(ctx, self._seqs)

    def _rebuild_drafter(self) -> None:
        self._drafter_dirty = False
        self._dkv = self._new_dkv()
        if self.drafter is None:
            return
        if self._features:  # filled lazily, as at admission: every token pending, fed with its true feature
            self._dkv = RaggedKV(self.drafter.config, len(self._seqs), self.device, self.drafter.dtype)
            for s in self._seqs:
                s.pending = s.tokens()
            return
        ctx = [s.tokens()[:-1] for s in self._seqs]
        self._dkv = prefill(self.drafter.config, self.drafter, ctx, self.device, self.drafter.dtype)
        for s in self._seqs:
            s.pending = [s.tokens()[-1]]

    # ------------------------------------------------------------------ the speculative step
    def _spec_step(self) -> list[StepOutput]:
        """choose K -> draft -> verify -> accept -> roll back -> emit, then timings and finished rows out."""
        b = len(self._seqs)
        k = self.last_k = self._choose_k(b)
        t0 = time.perf_counter()
        u = self._uniforms(2 * k + 1)  # [B, 2K + 1]: K draft samples, K accept tests, 1 resample; None if greedy
        draft_ids = q = None
        if k > 0:
            draft_ids, q = self._draft(k, u)  # [B, K], [B, K, V] (q None if greedy)
        t1 = time.perf_counter()
        logits = self._verify(draft_ids)  # [B, K + 1, V_head]
        t_fwd = time.perf_counter()
        logits = fit_vocab(logits, self.vocab_size)  # [B, K + 1, V]
        n, nxt = self._accept(k, draft_ids, q, self._p.transform(logits, self._seqs, draft_ids), u)  # penalized p
        self._roll_back(k, n)
        outs, finished = self._emit(k, draft_ids, logits, n, nxt)
        t2 = time.perf_counter()
        self._record_costs(b, k, t1 - t0, t2 - t1, t2 - t_fwd)
        n_new = sum(len(o.new_token_ids) for o in outs)
        self._count_tokens(k, n_new)
        if finished:
            self._remove_rows(finished)
        # While speculation is off (K = 0) holes left by earlier steps are pure overhead on every plain step.
        self._tkv.maybe_compact(0.3 if k else 0.1)
        self._dkv.maybe_compact()
        if self.adaptive and not (k > 0 and self._catchup):
            self.controller.observe_step(b, k, n_new, time.perf_counter() - t0)
        return outs

    def _count_tokens(self, k: int, n: int) -> None:
        """Tokens emitted, and those emitted by steps that drafted (K > 0): the share of a workload speculated."""
        self.tokens_emitted += n
        if k > 0:
            self.tokens_speculated += n

    def _choose_k(self, batch: int) -> int:
        """Drafts per row this step (batch-wide): fixed, or adaptive from calibrated costs and row alphas."""
        if self.drafter is None:
            return 0
        if self.adaptive:
            if self.controller.needs_calibration(batch):
                self._calibrate(batch)
            est = self.acceptance.estimate
            alphas = [est(s.acc, s.req.domain) for s in self._seqs]
            rem = [s.remaining for s in self._seqs] if self.drain_aware and batch > 1 else None
            k = self.controller.choose(batch, alphas, rem, lambda: sum(len(s.pending) for s in self._seqs))
        else:
            k = self.num_draft_tokens
        # Drafts past every row's token budget would be thrown away.
        return max(0, min(k, max(s.remaining for s in self._seqs) - 1))

    def _uniforms(self, n: int) -> torch.Tensor | None:
        """Per-row uniforms [B, n] from each request's own generator (greedy rows: zeros, unused)."""
        if self._p.all_greedy:
            return None
        rows = [g_rand(g, n) for g in self._p.gens]
        return torch.stack(rows).to(self.device)

    def _draft(self, k: int, u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafter forwards: the first feeds every row's pending tokens, the others the previous draft.
        Returns draft ids [B, K] and, when sampling, the drafter's warped probabilities q [B, K, V]."""
        ids, valid = pending_ids(self._seqs, self.device)  # [B, M], [B, M] (None when M = 1)
        self._catchup = ids.shape[1] > 2
        feats = None
        if self._features:
            feats = pending_features(self._seqs, ids.shape[1], int(self.target.config.hidden_size),
                                     self.dtype, self.device)  # [B, M, H]
        drafts, qs = [], []
        for j in range(k):
            if feats is None:
                logits = self._dkv.forward(self.drafter, ids, valid, logits_to_keep=1)[:, -1]  # [B, V_draft]
            else:  # eagle: later drafts read the head's own predicted feature of the previous position
                logits, feats = self._dkv.forward(self.drafter.with_features(feats), ids, valid, logits_to_keep=1)
                logits = logits[:, -1]  # [B, V_draft]; feats [B, 1, H]
            logits = self._p.transform(fit_vocab(logits, self.vocab_size), self._seqs, drafts)  # [B, V], as p
            if self._p.all_greedy:
                d = logits.argmax(-1)  # [B]
            else:
                q = warp_probs(logits, self._p.temp, self._p.top_k, self._p.top_p)  # [B, V]
                d = sample_from(q, u[:, j])
                qs.append(q)
            drafts.append(d)
            ids, valid = d.unsqueeze(1), None  # [B, 1]
        return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)

    def _verify(self, draft_ids: torch.Tensor | None) -> torch.Tensor:
        """The target scores [last token, d_1..d_K] of every row in one forward (K + 1 positions);
        with an eagle drafter it also leaves their features in `_step_feats` [B, K + 1, H]."""
        ids = self._last.unsqueeze(1)  # [B, 1]
        if draft_ids is not None:
            ids = torch.cat([ids, draft_ids], 1)  # [B, K + 1]
        if self._features:
            logits, self._step_feats = self._tkv.forward(self._tfn_f, ids)
            return logits  # [B, K + 1, V_head]
        return self._tkv.forward(self._tfn, ids)  # [B, K + 1, V_head]

    def _accept(self, k: int, draft_ids: torch.Tensor | None, q: torch.Tensor | None, logits: torch.Tensor,
                u: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, how many drafts the target keeps (n [B]) and its token after them (nxt [B]): greedy exact
        match, or rejection sampling with the row's uniforms u[:, K:2K] (tests) and u[:, 2K] (resample)."""
        if self._p.all_greedy:
            if k > 0:
                return greedy_accept(draft_ids, logits)
            nxt = logits[:, 0].argmax(-1)  # [B]
            return torch.zeros_like(nxt), nxt
        p = warp_probs(logits, self._p.temp, self._p.top_k, self._p.top_p)  # [B, K + 1, V]
        if k > 0:
            return rejection_accept(draft_ids, q, p, u[:, k : 2 * k], u[:, 2 * k])
        nxt = sample_from(p[:, 0], u[:, 0])  # [B]
        return torch.zeros_like(nxt), nxt

    def _roll_back(self, k: int, n: torch.Tensor) -> None:
        """Drop the rejected slots: the target keeps [last, d_1..d_n] of its K + 1 new entries, the drafter
        d_1..d_n of the K - 1 drafts it was fed (d_K never was)."""
        self._tkv.rollback(k + 1, n + 1)
        if k > 1:  # eagle: the drafts were fed predicted features; accepted ones are re-fed with true ones
            self._dkv.rollback(k - 1, torch.zeros_like(n) if self._features else n.clamp(max=k - 1))

    def _emit(self, k: int, draft_ids: torch.Tensor | None, logits: torch.Tensor, n: torch.Tensor,
              nxt: torch.Tensor) -> tuple[list[StepOutput], list[int]]:
        """Emitted tokens onto each row's result, its pending drafter tokens and acceptance estimate; rows
        that hit a stop token or their budget are closed. Returns the outputs and the finished rows."""
        e = emitted(draft_ids, n, nxt, logits, self._p.temp, self._p.all_t1, self.feedback_top_k)
        self._last = nxt
        outs: list[StepOutput] = []
        finished: list[int] = []
        have_drafter = self.drafter is not None
        for i, s in enumerate(self._seqs):
            ni = e.n[i]
            s.res.num_steps += 1
            if k > 0:
                count_drafts(s.res, k, ni)
                self.acceptance.update(s.acc, s.req.domain, k, ni)
                if self._features:
                    s.pending = e.tokens[i][: ni + 1]
                else:
                    s.pending = [e.drafts[i][k - 1], e.tokens[i][ni]] if ni == k else [e.tokens[i][ni]]
            elif have_drafter:
                s.pending.append(e.tokens[i][0])
                self.acceptance.update(s.acc, s.req.domain, 0, 0)
            new, reason = append_tokens(s.res, e, i, k, s.stop, s.remaining)
            if self._features:
                self._keep_features(s, i, len(new))
            s.remaining -= len(new)
            if reason is not None:
                self._close(s, reason)
                finished.append(i)
            outs.append(StepOutput(s.req.request_id, new, reason is not None, s.res if reason else None))
        self.acceptance.end_step(k)
        return outs, finished

    def _keep_features(self, s: Seq, i: int, n: int) -> None:
        """Row i's target features of its n emitted positions onto its history (eagle)."""
        s.feats.append(self._step_feats[i, :n].clone())  # [n, H]

    def _record_costs(self, b: int, k: int, t_draft: float, t_verify: float, t_host: float) -> None:
        """Online timings of the step (reporting) and, on CPU, the host work per step the controller adds."""
        self.costs.record_verify(b, k, t_verify)
        if self.adaptive and self.device.type == "cpu":
            # On CPU the verify forward is synchronous, so t_host is the step's host work after it (on CUDA
            # it would include the kernels the first .tolist() waits for).
            self.controller.observe_host_work(b, t_host, self.costs)
        if k > 0 and not self._catchup:  # a drafter catch-up after K=0 steps is not a typical draft cost
            self.costs.record_draft(b, t_draft / k)

    # ------------------------------------------------------------------ cost calibration (dvi.adaptive.calibrate)
    def calibrate(self, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> None:
        """Measure verify costs for several K and a draft step, interleaved, per batch-size bucket.

        Runs on dummy rows with their own caches (in-flight requests are untouched); adaptive K calls it
        lazily the first time a bucket is seen.
        """
        if self.drafter is None or self.max_draft_tokens == 0:
            return
        with torch.inference_mode():
            for b in batch_sizes:
                self._calibrate(int(b), context, reps)

    def _calibrate(self, b: int, context: int = 128, reps: int = 3) -> None:
        self.controller.set_costs(b, *calibrate_bucket(self, b, context, reps))
