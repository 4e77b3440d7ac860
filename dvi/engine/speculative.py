"""Lossless batched speculative decoding engine with a step-level API for continuous batching.

One step for all active rows (`SpeculativeEngine._spec_step`, one method per phase):
  1. draft (`proposer.propose`): the drafter kind's `dvi.drafters.proposer.Proposer` proposes each row's drafts and
     prices their number itself (`dvi.decode.pricing`: fixed K, or adaptive K from calibrated costs); a draft of
     width 0 is a plain step;
  2. verify (`_verify`): the target scores [last token, d_1..d_K] for every row in ONE forward (K + 1 positions,
     `dvi.decode.target`);
  3. accept (`_accept`): per row, greedy exact match or Leviathan/Chen rejection sampling (lossless at any
     temperature, `dvi.decode.sampling`): n drafts kept and the target's token after them;
  4. the step's one device -> host transfer (`dvi.decode.emit.emitted`), then the target keeps [last, d_1..d_n];
  5. emit (`_emit`): the n + 1 tokens onto each row's result; finished rows leave the batch.

Invariant between steps, per row: the target cache holds every token except the last emitted one (`_last`).
A row's draft state (a drafter's cache and the tokens it lacks, eagle features, suffix match state) belongs
to its proposer, which the engine asks for drafts and tells what was accepted; the engine has no branch per
kind. Elsewhere, by job: results `dvi.decode.results`, rows `dvi.decode.seq`, calibration
`dvi.engine.calibration`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from dvi.decode.emit import Emitted, append_tokens, count_drafts, emitted
from dvi.decode.pricing import KPolicy, StepTimes
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
from dvi.decode.seq import BatchParams, Seq, fill_order, g_rand, row_generator
from dvi.decode.target import CpuMatmuls, TargetRunner, target_runner, with_prefix_cache
from dvi.drafters.factory import proposer_for_drafter
from dvi.drafters.learned import Drafter
from dvi.drafters.proposer import Draft, Proposer
from dvi.drafters.vocab import fit_vocab
from dvi.engine.accept import accept_chain, accept_tree, chain_evidence
from dvi.engine.calibration import CalibrationSetup, calibrate_bucket
from dvi.engine.options import EngineOptions, prefill_share
from dvi.engine.report import EngineReport
from dvi.models.loading import check_target_state_dict, load_state_dict

__all__ = ["SamplingParams", "Request", "GenerationResult", "StepOutput", "SpeculativeEngine", "EngineOptions",
           "InvalidParam", "Versions"]


class SpeculativeEngine:
    """Speculative decoding over HF causal LMs; see docs/contracts.md for the API. Not thread-safe: one thread
    owns it (a server's engine thread, `serving.scheduler`; `dvi.decode.owner` checks that in debug runs)."""

    _owned_parts = ("proposer",)  # claimed with it (`dvi.decode.owner`)

    def __init__(
        self,
        target: nn.Module,
        proposer: Proposer | None = None,
        num_draft_tokens: int = 4,
        adaptive: bool = False,
        max_draft_tokens: int = 8,
        feedback_top_k: int = 0,
        versions: Versions = Versions(),
        options: EngineOptions = EngineOptions(),
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
        self.greedy_below_temperature = float(options.greedy_below_temperature)
        self.max_prefill_tokens = int(options.max_prefill_tokens)
        self.cpu_rows_kernel = options.cpu_rows_kernel  # the target's and the learned drafter's (`_install`)
        self.target_version, self.drafter_version = int(versions.target), int(versions.drafter)
        self.adapter_versions: dict[str, int] = {}  # per traffic group, the adapter version its rows draft with
        self._waiting: list[Seq] = []
        self._seqs: list[Seq] = []
        self.proposer: Proposer = Proposer(self.vocab_size, self.device)
        if proposer is not None and not isinstance(proposer, Proposer):
            raise TypeError(f"SpeculativeEngine takes a Proposer, got {type(proposer).__name__}: build one with "
                            "dvi.drafters.factory.proposer_for(target, drafter) or make_proposer(kind, ...)")
        self._install(proposer or self.proposer)
        # after the proposer: the widest chain verify (k_cap + 1) sizes the captured graphs; the widest tree's (the
        # learned chain with its siblings and two history branches) is probed for the greedy contract too
        widest_tree = self.k_cap + 1 + self.max_draft_tokens * options.tree_width + self.proposer.max_tokens \
            if options.tree_width else 0
        self._target: TargetRunner = with_prefix_cache(target_runner(
            self.target, max_width=self.k_cap + 1, graphs=options.cuda_graphs, max_batch=options.max_batch_size,
            max_context=self.max_context, cpu=CpuMatmuls(options.cpu_packed_weights, options.cpu_rows_kernel),
            tree_width=widest_tree), options.prefix_cache_tokens)
        self._sync_feature_layers()
        self.k_policy = KPolicy(adaptive, num_draft_tokens, max_draft_tokens, self._calibrate,
                                options.tree_width if self._target.trees else 0)
        self.k_policy.controller.ragged = self._target.ragged  # K priced with the rows that pay for it
        self.k_policy.drain_aware = options.drain_aware
        self.last_k = 0
        self.tokens_emitted = self.tokens_speculated = 0  # since construction (`_count_tokens`)
        self.suffix_step_seconds: list[float] = []  # the suffix tree's host work per step (`take_suffix_step_seconds`)
        self._last = torch.zeros(0, dtype=torch.long, device=self.device)
        self._outbox: list[StepOutput] = []
        self._target_dirty = self._drafter_dirty = False
        self._gen_calls = 0
        self._refresh_params()

    # the K policy's parts, for callers that read or tune them
    controller = property(lambda self: self.k_policy.controller)
    costs = property(lambda self: self.k_policy.costs)
    suffix_guard = property(lambda self: self.k_policy.suffix_guard)
    acceptance = property(lambda self: self.k_policy.acceptance)
    drain_aware = property(lambda self: self.k_policy.drain_aware,
                           lambda self, on: setattr(self.k_policy, "drain_aware", bool(on)))

    # ------------------------------------------------------------------ public API
    def add_request(self, request: Request) -> None:
        """Queue a request; it joins the batch (prefill) at the next step()."""
        validate_prompt(request.prompt_ids, "prompt_ids", self.vocab_size, self.num_embeddings)
        self._validate_params(request.params, len(request.prompt_ids))
        if any(s.req.request_id == request.request_id for s in self._waiting + self._seqs):
            raise ValueError(f"request_id {request.request_id!r} is already active")
        request = self._normalized(request)
        p = request.params
        res = GenerationResult(request_id=request.request_id, prompt_ids=list(request.prompt_ids),
                               accepted_per_position=[0] * self.k_cap, drafted_per_position=[0] * self.k_cap,
                               domain=request.domain, started_at=time.time(), temperature=float(p.temperature))
        self._waiting.append(Seq(request, res, row_generator(p), self.acceptance.new_row(), self._pool(request)))

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
                self._remove_rows([(i, s, False)])
                return self._finish_aborted(s)
        return None

    def report(self) -> EngineReport:
        """For the server's snapshot: the proposer's counters, draft vocabulary size (read when its drafter was
        installed), prefix cache counts, what real steps measured against adaptive K's prices."""
        pc, measured = self._target.prefix, self.k_policy.controller.measured
        return EngineReport(self.proposer.stats(), self._draft_vocab_size, prefix_cache=pc.stats() if pc else {},
                            step_costs=measured.values() if self.adaptive else {})

    def take_suffix_step_seconds(self) -> list[float]:
        """The suffix lookups' host seconds per step since the last call (handed over: the engine starts a new list)."""
        secs, self.suffix_step_seconds = self.suffix_step_seconds, []
        return secs

    def add_history(self, seq_id: str, tokens: list[int]) -> None:
        """An output finished elsewhere (another replica) for history drafting; a no-op for kinds without it."""
        self.proposer.add_history(seq_id, tokens)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._seqs)

    def num_active(self) -> int:
        """Unfinished requests (running + waiting to join)."""
        return len(self._waiting) + len(self._seqs)

    def reserve(self, rows: int, positions: int) -> int:
        """The target's KV cache sized for `rows` rows of `positions` tokens now (past them it still doubles), so no
        step pays for its growth (`serve.kv_cache_tokens`); the bytes it holds."""
        return self._target.reserve(rows, positions)

    @property
    def greedy_contract(self) -> dict[str, str]:
        """What greedy speculation guarantees on this device ('bitwise' or 'near-tie', one request at a time and in
        batches): measured at start-up (`dvi.decode.invariance`), on /health."""
        return dict(self._target.contract)

    @property
    def drafter(self) -> Drafter | None:
        """The learned drafter (None for `suffix` alone or speculation off)."""
        return self.proposer.drafter

    @property
    def k_cap(self) -> int:
        """The longest draft a step may carry: the learned drafter's max K, or a suffix proposal's."""
        return max(self.max_draft_tokens, self.proposer.max_tokens)

    def set_drafter(self, drafter: nn.Module | Drafter | None, version: int) -> None:
        """Hot swap between steps to `drafter` (a learned drafter or an HF causal LM) through the proposer's
        `with_drafter` (same kind, new drafter); in-flight rows get their draft state rebuilt at once, not at the next
        step(): a row leaving before that step (a cut stream's abort, run right after the swap) would fail in a
        proposer that never held it and put the engine's rows out of step (issue 42)."""
        self._install(self.proposer.with_drafter(drafter, proposer_for_drafter))
        self.drafter_version = int(version)
        self._drafter_dirty = True
        self.acceptance.reset()  # acceptance of the old drafter says little about the new one
        self.k_policy.drafter_changed()
        with torch.inference_mode():
            self._rebuild()

    def set_adapter(self, group: str, factors, version: int | None) -> None:
        """Between steps: `group`'s rows draft through the LoRA `factors` as adapter version `version` (None, None:
        the base drafter again); the rows' draft caches are rebuilt at once, as a hot swap's are."""
        self.proposer.set_adapter(group, factors)
        self.acceptance.reset(group)  # the old adapter's acceptance says little about the new one
        self.k_policy.drafter_changed()
        if factors is None:
            self.adapter_versions.pop(group, None)
        else:
            self.adapter_versions[group] = int(version or 0)
        for s in (*self._seqs, *self._waiting):
            s.pool = self._pool(s.req)
        self._drafter_dirty = True
        with torch.inference_mode():
            self._rebuild()

    def update_target_weights(self, state_dict_or_path: dict | str | Path, version: int,
                              complete: bool = False) -> None:
        """Load new target weights in place (Parameter objects kept); in-flight target KV is recomputed (and the
        prefix cache emptied).

        Refused (ValueError, nothing changed) for unknown keys, wrong shapes, non-finite values, and, with
        `complete=True` (the server's admin API), for a file lacking any of the target's tensors (weights tied to a
        present tensor excepted): half-updated weights serve garbage."""
        sd = load_state_dict(state_dict_or_path) if isinstance(state_dict_or_path, (str, Path)) else state_dict_or_path
        check_target_state_dict(sd, self.target.state_dict(), complete)
        with torch.no_grad():
            self.target.load_state_dict(sd, strict=False)
        self.target_version = int(version)
        self._target_dirty = True
        # acceptance estimates stay: the same drafter's α on the last version is the best guess (docs/design.md)
        with torch.inference_mode():  # between steps: in-flight rows' target cache and the proposer now
            self._rebuild()

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
        self.reserve(len(self._seqs) + len(prompts), max(map(len, prompts)) + self.k_cap + 1)  # answers: grown as they go
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
            if self._target_dirty or self._drafter_dirty:
                self._rebuild()
            joined = bool(self._waiting) and self._admit()
            if self._seqs:
                outs.extend(self._spec_step(joined))
        return outs

    def _validate_params(self, p: SamplingParams, prompt_len: int, prompt_name: str = "prompt_ids") -> None:
        validate_params(p, prompt_len, self.vocab_size, self.max_context, prompt_name)

    def _install(self, new: Proposer) -> None:
        """`new` drafts from now on (the constructor's proposer, or what a hot swap made of the current one)."""
        old, had = self.proposer, self.proposer.needs_features
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
        new.use_rows_kernel(self.cpu_rows_kernel)
        self.proposer = new
        self._draft_vocab_size = None if getattr(d, "draft_vocab", None) is None else int(d.draft_vocab.numel())
        if hasattr(self, "_target") and self._sync_feature_layers() and rows:
            self._target_dirty = True  # the head reads other target layers: recompute the rows' features

    def _sync_feature_layers(self) -> bool:
        """The verify returns the features the proposer's head reads: the residual streams after its
        `feature_layers` (a fused eagle head) or the final normed state. True when that changed."""
        d = self.proposer.drafter if self.proposer.needs_features else None
        layers = getattr(d, "feature_layers", None)
        lean = getattr(self._target, "lean", None)
        if lean is None:
            if layers:
                raise ValueError("an eagle head on fused target layers needs a Llama-family target (the lean forward)")
            return False
        changed = lean.feature_layers != layers
        lean.feature_layers = layers
        return changed

    def _refresh_params(self) -> None:
        self.params = BatchParams.of(self._seqs, self.device, self.vocab_size)

    def _admit(self) -> bool:
        """Waiting requests join the batch; whether any did (their prefills ride on this step's verify)."""
        room = self._target.max_rows
        take = prefill_share([(len(s.req.prompt_ids), s.req.cohort) for s in self._waiting], self.max_prefill_tokens)
        take = take if room is None else min(take, max(0, room - len(self._seqs)))
        new, self._waiting = self._waiting[:take], self._waiting[take:]
        if not new:  # a fixed-size cache (CUDA graphs) is full: they join as rows leave
            return False
        feats = self._target.admit([list(s.req.prompt_ids[:-1]) for s in new], self.proposer.needs_features,
                                   lazy=True)  # their prefills may ride on this step's verify
        self.proposer.join(new, feats)
        last = torch.tensor([int(s.req.prompt_ids[-1]) for s in new], dtype=torch.long, device=self.device)
        self._last = torch.cat([self._last, last])
        self._seqs.extend(new)
        self._refresh_params()
        return True

    def _remove_rows(self, leaving: list[tuple[int, Seq, bool]]) -> None:
        """Rows (i, seq, learn) leave: learn, they finished (their output may be learned from); else aborted."""
        keep = fill_order(len(self._seqs), {i for i, _, _ in leaving})
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._target.select_rows(keep)
        self.proposer.release(leaving, keep)
        self._last = self._last.index_select(0, idx)
        self._seqs = [self._seqs[i] for i in keep]
        self._refresh_params()

    def _pool(self, req: Request) -> str:
        """A row's acceptance pool: its domain, and its group's adapter where one drafts for it."""
        return f"{req.domain}/{req.group}" if req.group in self.adapter_versions else req.domain

    def _finish_aborted(self, s: Seq) -> GenerationResult:
        """An aborted row's result into the next step's outputs (its proposer row already released)."""
        self._outbox.append(StepOutput(s.req.request_id, [], True, self._close(s, "abort")))
        return s.res

    def _close(self, s: Seq, reason: str) -> GenerationResult:
        return s.close(reason, Versions(self.target_version, self.drafter_version,
                                        self.adapter_versions.get(s.req.group, 0)))

    def _rebuild(self) -> None:
        """New target weights (the target's cache recomputed) and / or a new drafter: the proposer catches up."""
        feats, version = None, None
        if self._target_dirty:
            feats = self._target.rebuild([s.tokens()[:-1] for s in self._seqs], self.proposer.needs_features)
            version = self.target_version
        self.proposer.rebuild(self._seqs, feats, version, drafter_changed=self._drafter_dirty)
        self._target_dirty = self._drafter_dirty = False

    # ------------------------------------------------------------------ the speculative step
    def _spec_step(self, joined: bool = False) -> list[StepOutput]:
        """draft -> verify -> accept -> one transfer -> keep -> emit, then timings and finished rows out (`joined`:
        rows joined this step, their prefills in its verify)."""
        b = len(self._seqs)
        if self._target.batch_size != b or self._last.shape[0] != b:  # a bug, said plainly (not a shape error)
            raise RuntimeError(f"engine rows out of step: {b} rows, the target's cache holds "
                               f"{self._target.batch_size}, {self._last.shape[0]} last tokens")
        t0 = time.perf_counter()
        caps = [s.remaining - 1 for s in self._seqs]  # drafts past a row's token budget would be thrown away
        draft = self.proposer.propose(self._seqs, caps, self.k_policy.for_step(self._seqs), self._uniforms,
                                      self.params)
        k = self.last_k = draft.width
        t1 = time.perf_counter()
        logits, feats = self._verify(draft)  # [B, K + 1, V_head], features [B, K + 1, H] or None
        t_fwd = time.perf_counter()
        logits = fit_vocab(logits, self.vocab_size)  # [B, K + 1, V]
        view = draft
        if draft.tree:  # the accepted path, read from here on as a chain
            t = accept_tree(draft, logits, feats, self.params)
            n, nxt, logits, feats, view = t.n, t.nxt, t.logits, t.feats, t.view
        else:
            n, nxt = accept_chain(draft, self.params.transform(logits, draft.ids if k else None), self.params)
        e = emitted(view.ids if view.width else None, n, nxt, logits, self.params.temp, self.params.all_t1,
                    self.feedback_top_k)  # the step's one device -> host transfer
        self._last = nxt
        if draft.tree:
            self._target.keep_path(t.paths)  # [last, the accepted path] of the tree's entries stay, in order
        else:
            self._target.keep(k + 1, [x + 1 for x in e.n])  # [last, d_1..d_n] of the K + 1 new entries stay
        outs, finished = self._emit(view, e, feats)
        self.k_policy.observe_tree(draft, view)
        t2 = time.perf_counter()
        n_new = sum(len(o.new_token_ids) for o in outs)
        self._count_tokens(k, n_new)
        if finished:
            self._remove_rows(finished)
        self._target.tidy(k > 0)
        sec = draft.lookup_seconds  # history lookups' host work this step, for /metrics (bounded)
        if sec is not None and len(self.suffix_step_seconds) < 4096:
            self.suffix_step_seconds.append(float(sec))
        self.k_policy.observe(draft, b, StepTimes(t1 - t0, t2 - t1, t2 - t_fwd, time.perf_counter() - t0), n_new,
                              self.device.type == "cpu", joined)
        return outs

    def _count_tokens(self, k: int, n: int) -> None:
        """Tokens emitted, and those emitted by steps that drafted (K > 0): the share of a workload speculated."""
        self.tokens_emitted += n
        if k > 0:
            self.tokens_speculated += n

    def _uniforms(self, n: int) -> torch.Tensor | None:
        """Per-row uniforms [B, n] from each request's own generator (greedy rows: zeros, unused)."""
        if self.params.all_greedy:
            return None
        rows = [g_rand(g, n) for g in self.params.gens]
        return torch.stack(rows).to(self.device)

    def _verify(self, draft: Draft) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target scores [last token, d_1..d_K] of every row in one forward (K + 1 positions): logits
        [B, K + 1, V_head] and, when the proposer reads them (eagle), the features [B, K + 1, H]."""
        ids = self._last.unsqueeze(1)  # [B, 1]
        if draft.width:
            ids = torch.cat([ids, draft.ids], 1)  # [B, K + 1]
        if draft.tree:
            how = {"tree": draft.parents}
        else:  # a ragged draft's padding goes unscored where the runner can skip it
            how = {"lens": draft.lens} if draft.width and draft.ragged else {}
        if self.proposer.needs_features:
            return self._target.forward(ids, True, **how)
        return self._target.forward(ids, False, **how), None

    def _emit(self, draft: Draft, e: Emitted, feats: torch.Tensor | None,
              ) -> tuple[list[StepOutput], list[tuple[int, Seq, bool]]]:
        """Emitted tokens onto each row's result and acceptance estimate, and to the proposer; rows that hit a
        stop token or their budget are closed. Returns the outputs and the finished rows (i, seq, True)."""
        outs: list[StepOutput] = []
        done: list[tuple[int, str]] = []
        news: list[list[int]] = []
        for i, s in enumerate(self._seqs):
            ni, ki, src = e.n[i], draft.lens[i], draft.sources[i]
            srcs = draft.node_sources[i] if draft.node_sources else None  # a tree path through several proposers
            s.res.num_steps += 1
            if ki > 0:
                count_drafts(s.res, ki, ni, src, draft.ranks[i] if draft.ranks else None, srcs)
            self.acceptance.update(s.acc, s.pool, *chain_evidence(draft, i, ki, ni, src))
            new, reason = append_tokens(s.res, e, i, ki, s.stop, s.remaining, srcs or src)
            news.append(new)
            s.remaining -= len(new)
            if reason is not None:
                done.append((i, reason))
            outs.append(StepOutput(s.req.request_id, new, reason is not None, s.res if reason else None))
        self.acceptance.end_step(draft.width)
        self.proposer.observe(draft, e.n, news, feats)
        for i, reason in done:
            self._close(self._seqs[i], reason)
        return outs, [(i, self._seqs[i], True) for i, _ in done]

    # ------------------------------------------------------------------ cost calibration (dvi.engine.calibration.calibrate)
    def calibrate(self, batch_sizes: Sequence[int], context: int = 128, reps: int = 3) -> None:
        """Measure verify costs for several K and a draft step, interleaved, per batch-size bucket, on dummy rows
        with their own caches (in-flight requests are untouched); adaptive K calls it lazily per new bucket."""
        if self.k_cap == 0 or self.proposer.name == "none":
            return
        with torch.inference_mode():
            for b in batch_sizes:
                self._calibrate(int(b), context, reps)

    def _calibrate(self, b: int, context: int = 128, reps: int = 3) -> None:
        setup = CalibrationSetup(self._target, self.proposer.needs_features, self.drafter, self.device, self.dtype,
                                 self.vocab_size, self.max_context, self.k_cap, self.max_draft_tokens,
                                 self.cpu_rows_kernel)
        self.controller.set_costs(b, *calibrate_bucket(setup, b, context, reps))

