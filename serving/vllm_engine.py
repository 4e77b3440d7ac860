"""vLLM behind dvi's front door (`serve.engine: vllm`): the engine the scheduler drives, speaking to a vLLM
OpenAI server (`serving.vllm_process`) instead of decoding itself.

The scheduler, the HTTP API, the feedback log, the swapper and its gates stay as they are: they see `add_request`,
`step`, `abort`, `set_drafter` and the versions, as with dvi's own engine. Each request is one streamed
`/v1/completions` call on token ids (dvi tokenizes, applies chat templates, stop strings and detokenizes as it
always does); vLLM returns the tokens, the target's top-k log-probs of each (what the trainer distils from) and,
at the end, its per-step accepted and drafted counts, from which the request's `GenerationResult` is built
(`step_feedback`). The HTTP streams live on one asyncio loop of their own; `step` hands what arrived to the engine
thread. A new drafter goes in through vLLM's `/collective_rpc` and dvi's worker extension (`serving.vllm_worker`),
between vLLM's steps: requests in flight keep streaming.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch

from dvi.decode.request import InvalidParam, Request, validate_params, validate_prompt
from dvi.decode.results import GenerationResult, StepOutput
from dvi.engine.report import EngineReport
from dvi.registry.base import AdapterRejected

from .vllm_drafter import ServedDrafter
from .vllm_process import TARGET_FILE, VllmProcess, owned_tensors, write_tensors

log = logging.getLogger("dvi.vllm")

RETRY_WAIT_S = 600.0
"""How long a request that has no token yet waits for a restarting vLLM before it fails."""


def step_feedback(per_step_accepted: list[int], per_step_drafted: list[int], token_ids: list[int],
                  k: int) -> dict[str, Any]:
    """The result's per-token feedback from vLLM's per-step counts: the first token is the prefill's (undrafted);
    each step then emits its accepted drafts (drafted = the token, accepted) and one token of the target's (its
    draft, if any, was rejected and vLLM does not say which id it was: -1, not accepted, so the trainer's reward
    term skips it and its KL term still learns the target's token)."""
    n = len(token_ids)
    drafted_ids, accepted = [-1] * n, [False] * n
    pos = 1
    for a, d in zip(per_step_accepted, per_step_drafted, strict=False):
        for j in range(min(a, d)):
            if pos + j < n:
                drafted_ids[pos + j], accepted[pos + j] = token_ids[pos + j], True
        pos += min(a, d) + 1
    steps = len(per_step_drafted)
    return {
        "drafted_ids": drafted_ids, "accepted": accepted, "num_steps": steps,
        "num_drafted": int(sum(per_step_drafted)), "num_accepted": int(sum(per_step_accepted)),
        "drafted_per_position": [sum(1 for d in per_step_drafted if d > j) for j in range(k)],
        "accepted_per_position": [sum(1 for a in per_step_accepted if a > j) for j in range(k)],
    }


def steps_within(per_step_accepted: list[int], per_step_drafted: list[int], n: int) -> tuple[list[int], list[int]]:
    """vLLM's per-step (accepted, drafted) counts cut to the steps that emitted one of the first `n` tokens (the
    first token is the prefill's; a step cut through keeps the accepted drafts it emitted before the cut)."""
    acc: list[int] = []
    dra: list[int] = []
    pos = 1
    for a, d in zip(per_step_accepted, per_step_drafted, strict=False):
        if pos >= n:
            break
        acc.append(min(a, d, n - pos))
        dra.append(d)
        pos += min(a, d) + 1
    return acc, dra


def _topk(entry: dict[str, float] | None) -> tuple[list[int], list[float]]:
    """vLLM's top log-probs of one position ({"token_id:N": lp}, `return_tokens_as_token_ids`), best first."""
    items = sorted((entry or {}).items(), key=lambda kv: -kv[1])
    return [int(key.rsplit(":", 1)[1]) for key, _ in items], [float(v) for _, v in items]


@dataclass
class _Row:
    """One request in flight: its result as it grows; `fresh` holds the tokens the engine thread has not handed
    out yet. Written by the stream's task, read by the engine thread, under the engine's lock."""

    request: Request
    result: GenerationResult
    fresh: list[int] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # vLLM failed this request (answered an error, or died after its first token)
    task: Any = None
    steps: tuple[list[int], list[int]] = ([], [])  # vLLM's per-step (accepted, drafted), from the last chunk
    aborted: bool = False  # `abort` sealed its result: what the stream still brings is dropped


class VllmEngine:
    """The scheduler's engine over one vLLM server (module docstring)."""

    def __init__(self, process: VllmProcess, vocab_size: int, max_context: int | None, num_draft_tokens: int,
                 feedback_top_k: int, greedy_below_temperature: float,
                 served: ServedDrafter, target_state: dict[str, torch.Tensor]) -> None:
        self.process = process
        self.served = served  # the drafter vLLM serves: what every later version is checked and diffed against
        self.target_state = target_state  # dvi's copy of the served target: what an update is checked against
        self.vocab_size, self.max_context = int(vocab_size), max_context
        self.k = int(num_draft_tokens)
        self.feedback_top_k = int(feedback_top_k)
        self.greedy_below_temperature = float(greedy_below_temperature)
        self.drafter_version = 0
        self.target_version = 0
        self.adapter_versions: dict[str, int] = {}
        # what greedy guarantees behind this vLLM: measured at start-up (`serving.vllm_greedy.contract`), on /health
        self.greedy_contract: dict[str, Any] = {"engine": "vllm", "dtype": process.dtype}
        self.swap_seconds: list[float] = []
        self._rows: dict[str, _Row] = {}
        self._url = process.url  # what the streams' thread reads: never the engine's public state (dvi.decode.owner)
        self._k = self.k
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._client: httpx.AsyncClient | None = None
        self._loop_ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, name="dvi-vllm-streams", daemon=True)
        self._thread.start()
        self._loop_ready.wait(10)

    # -- the engine interface (engine thread) ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        validate_prompt(request.prompt_ids, "prompt_ids", self.vocab_size, self.vocab_size)
        p = request.params
        validate_params(p, len(request.prompt_ids), self.vocab_size, self.max_context)
        if p.logit_bias:
            raise InvalidParam("logit_bias", "logit_bias is not served with serve.engine 'vllm': vLLM ignores it "
                                             "under speculative decoding")
        if request.request_id in self._rows:
            raise ValueError(f"request_id {request.request_id!r} is already active")
        greedy = p.temperature < self.greedy_below_temperature
        res = GenerationResult(request_id=request.request_id, prompt_ids=list(request.prompt_ids),
                               domain=request.domain, started_at=time.time(),
                               temperature=0.0 if greedy else float(p.temperature),
                               accepted_per_position=[0] * self.k, drafted_per_position=[0] * self.k)
        row = _Row(request, res)
        with self._lock:
            self._rows[request.request_id] = row
        row.task = asyncio.run_coroutine_threadsafe(self._stream(row, self._body(request, greedy)), self._loop)

    def step(self, wait_s: float = 0.05) -> list[StepOutput]:
        """What arrived since the last call, one output per row with news (waits up to `wait_s` for some)."""
        self._arrived.wait(wait_s)
        self._arrived.clear()
        outs: list[StepOutput] = []
        with self._lock:
            for rid, row in list(self._rows.items()):
                if row.error is not None:
                    del self._rows[rid]
                    outs.append(StepOutput(rid, [], True, None, error=row.error))
                    continue
                if not row.fresh and not row.finished:
                    continue
                new, row.fresh = row.fresh, []
                if row.finished:
                    del self._rows[rid]
                    row.result.drafter_version, row.result.target_version = self.drafter_version, self.target_version
                outs.append(StepOutput(rid, new, row.finished, row.result if row.finished else None))
        return outs

    def abort(self, request_id: str) -> GenerationResult | None:
        """The request ended by the server (its client left, a stop string, a cut): its stream closed (vLLM aborts
        it) and its result sealed as dvi's engine seals an aborted row (`Seq.close`): the tokens handed out so far
        (`step`; those vLLM sent since never reached the client), per-token feedback of exactly those tokens, the
        served versions, finish_reason "abort". Sealed under the lock: the stream, still running until the close
        lands, never changes it after (`_Row.aborted`)."""
        with self._lock:
            row = self._rows.pop(request_id, None)
            if row is None:
                return None
            row.aborted = True
            res = self._seal_aborted(row)
        if row.task is not None:
            row.task.cancel()  # closes the stream: vLLM aborts the request
        return res

    def info(self) -> dict[str, Any]:
        """What /health shows of the engine (read into the snapshot on the engine thread)."""
        p = self.process
        return {"kind": "vllm", "url": p.url, "ready": p.ready.is_set(), "restarts": p.restarts, "dtype": p.dtype,
                "num_speculative_tokens": self.k, "feedback_top_k": self.feedback_top_k, "swaps": len(self.swap_seconds),
                "swap_s": [round(x, 3) for x in self.swap_seconds[-16:]], "log": str(p.log_path)}

    def report(self) -> EngineReport:
        """For the server's snapshot: vLLM's own state (`info`); no dvi proposer runs here."""
        return EngineReport(info=self.info())

    def take_suffix_step_seconds(self) -> list[float]:
        """No suffix index runs in dvi's process behind vLLM."""
        return []

    def has_unfinished(self) -> bool:
        return bool(self._rows)

    def num_active(self) -> int:
        return len(self._rows)

    def set_drafter(self, drafter: Any, version: int) -> None:
        """Serve `drafter` as `version` in the running vLLM, between its steps: only the decoder layers that differ
        from the served ones are loaded (`ServedDrafter.diff`, which refuses a version vLLM could not take before
        vLLM sees it). Refused (raised, the served drafter kept and reloaded) when vLLM cannot load it."""
        served = self.served
        candidate = served.dir / f"candidate-v{int(version)}.safetensors"  # not in the index: a restart skips it
        t0 = time.perf_counter()
        changed = served.diff(drafter.state_dict(), int(version))
        try:
            if changed:  # a version equal to the served one (an identity LoRA) needs no load
                write_tensors(changed, candidate)
                self._rpc("dvi_reload_drafter", candidate)
        except Exception as exc:
            # a failed in-place load leaves vLLM's loader holding part of it: vLLM starts again on the served files
            log.error("vLLM could not load drafter v%d (%s); restarting it on the served drafter", version, exc)
            self.process.restart()
            raise AdapterRejected(f"vLLM could not load it: {exc}", int(version), category="load") from exc
        finally:
            candidate.unlink(missing_ok=True)
        self.swap_seconds.append(time.perf_counter() - t0)
        served.commit(changed)  # its shards rewritten: a restarted vLLM comes back with what it served
        self.drafter_version = int(version)

    def set_adapter(self, group: str, factors: Any, version: int | None) -> None:
        raise ValueError("per-group drafter adapters are not served with serve.engine 'vllm' (trainer.adapter_key)")

    def update_target_weights(self, weights: Any, version: int, complete: bool = True) -> None:
        """New target weights (checked as dvi's engine checks them) into the running vLLM: dvi's copy of the target
        is updated, written whole to vLLM's target dir (a restart serves it) and loaded in place; vLLM's prefix
        cache is reset. Requests in flight keep the keys and values they computed with the old weights."""
        from dvi.models.loading import check_target_state_dict

        own = self.target_state
        check_target_state_dict(weights, own, complete)
        with torch.no_grad():
            for k, v in weights.items():
                own[k].copy_(v)
        path = self.process.target_dir / TARGET_FILE
        write_tensors(owned_tensors(own), path)
        self._rpc("dvi_reload_target", path)
        r = httpx.post(self.process.url + "/reset_prefix_cache", timeout=60.0)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM did not reset its prefix cache: HTTP {r.status_code}")
        self.target_version = int(version)

    def add_history(self, seq_id: str, tokens: list[int]) -> None:
        raise ValueError("history drafting (suffix, hybrid) is not served with serve.engine 'vllm'")

    def close(self) -> None:
        """Stop the streams and vLLM itself (after the scheduler's loop ended)."""
        for row in list(self._rows.values()):
            if row.task is not None:
                row.task.cancel()
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self.process.stop()

    # -- vLLM ------------------------------------------------------------------------------------------------
    def _rpc(self, method: str, path) -> None:
        """One call of dvi's worker extension (`serving.vllm_worker`) in every vLLM worker."""
        r = httpx.post(self.process.url + "/collective_rpc", timeout=300.0, json={"method": method, "args": [str(path)]})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")

    def _body(self, request: Request, greedy: bool) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.process.served_name, "prompt": list(request.prompt_ids), "max_tokens": p.max_new_tokens,
            "temperature": 0.0 if greedy else p.temperature, "top_p": p.top_p, "top_k": p.top_k or -1,
            # the ids that end it are dvi's (the model's eos unless the client asked `ignore_eos`, and its
            # `stop_token_ids`): vLLM's own eos check off, so it stops exactly there
            "stop_token_ids": list(p.stop_token_ids), "ignore_eos": True, "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty, "repetition_penalty": p.repetition_penalty,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if self.feedback_top_k:
            body["logprobs"] = self.feedback_top_k
        return body

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._loop.call_soon(self._loop_ready.set)
        self._loop.run_forever()

    async def _stream(self, row: _Row, body: dict[str, Any]) -> None:
        deadline = time.monotonic() + RETRY_WAIT_S
        while True:
            got_token = False
            try:
                async with self._client.stream("POST", self._url + "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        text = (await resp.aread()).decode(errors="replace")
                        return self._fail(row, f"vLLM answered {resp.status_code}: {text[:300]}")
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            got_token |= self._take(row, json.loads(line[6:]))
                return self._finish(row)
            except (httpx.TransportError, httpx.RemoteProtocolError) as exc:
                if got_token or row.result.token_ids or time.monotonic() > deadline:
                    return self._fail(row, f"vLLM went away mid-request ({exc}); retry the request")
                await asyncio.sleep(0.5)  # vLLM (re)starting: a request with no token yet waits and is sent again
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one stream's failure is its request's alone
                log.exception("vLLM stream for %s failed", row.request.request_id)
                return self._fail(row, f"vLLM stream failed: {exc}")

    def _take(self, row: _Row, chunk: dict[str, Any]) -> bool:
        """One streamed chunk into the row's result; every list of it grows under the lock, together (the engine
        thread's `abort` may seal the result between two chunks)."""
        res = row.result
        metrics = (chunk.get("metrics") or {}).get("speculative_decoding")
        new: list[int] = []
        topk_ids: list[list[int]] = []
        topk_lps: list[list[float]] = []
        token_lps: list[float] = []
        reason = None
        for choice in chunk.get("choices") or ():
            ids = [int(t) for t in choice.get("token_ids") or ()]
            new.extend(ids)
            lp = choice.get("logprobs") or {}
            for entry, token_lp in zip(lp.get("top_logprobs") or [None] * len(ids),
                                       lp.get("token_logprobs") or [0.0] * len(ids), strict=False):
                top_ids, top_lps = _topk(entry)
                topk_ids.append(top_ids)
                topk_lps.append(top_lps)
                token_lps.append(float(token_lp or 0.0))
            if choice.get("finish_reason"):
                reason = "length" if choice["finish_reason"] == "length" else "stop"
        with self._lock:
            if row.aborted:
                return False
            if metrics is not None:
                row.steps = (metrics.get("per_step_accepted") or [], metrics.get("per_step_drafted") or [])
            res.topk_ids.extend(topk_ids)
            res.topk_logprobs.extend(topk_lps)
            res.token_logprobs.extend(token_lps)
            res.finish_reason = reason or res.finish_reason
            res.token_ids.extend(new)
            row.fresh.extend(new)
        if new:
            self._arrived.set()
        return bool(new)

    def _seal_aborted(self, row: _Row) -> GenerationResult:
        """Under the lock: the aborted row's result cut to the tokens handed out, every per-token list the same
        length (top-k: none when vLLM's were ragged, as `_finish` keeps them), its counts from vLLM's per-step
        counts of those tokens (none before vLLM's last chunk: undrafted, -1 and not accepted, as `step_feedback`
        writes a draft vLLM does not name; α has no data), the versions `step` gives a finished one."""
        res = row.result
        total = len(res.token_ids)
        n = total - len(row.fresh)
        row.fresh = []
        tokens = res.token_ids[:n]
        fb = step_feedback(*steps_within(list(row.steps[0]), list(row.steps[1]), n), tokens, self._k)
        for key, value in fb.items():
            setattr(res, key, value)
        res.token_ids = tokens
        whole = len(res.topk_ids) == len(res.topk_logprobs) == total
        res.topk_ids, res.topk_logprobs = (res.topk_ids[:n], res.topk_logprobs[:n]) if whole else ([], [])
        res.token_logprobs = res.token_logprobs[:n] if len(res.token_logprobs) == total else []
        res.finish_reason = "abort"
        res.finished_at = time.time()
        res.drafter_version, res.target_version = self.drafter_version, self.target_version
        return res

    def _finish(self, row: _Row) -> None:
        res = row.result
        with self._lock:
            if row.aborted:
                return
            accepted, drafted = row.steps
            fb = step_feedback(list(accepted), list(drafted), res.token_ids, self._k)
            for key, value in fb.items():
                setattr(res, key, value)
            if len(res.topk_ids) != len(res.token_ids):  # no log-probs asked for, or a short list: none kept
                res.topk_ids, res.topk_logprobs = [], []
            res.finish_reason = res.finish_reason or "length"
            res.finished_at = time.time()
            row.finished = True
        self._arrived.set()

    def _fail(self, row: _Row, why: str) -> None:
        with self._lock:
            row.error = why
        self._arrived.set()


def start_vllm_engine(cfg: Any, pair: Any, rundir: Any) -> VllmEngine:
    """Export the loaded pair, start vLLM on it (`serving.vllm_process`) and return the engine that drives it."""
    from .vllm_greedy import contract as greedy_contract
    from .vllm_process import export_pair

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request to vLLM is noise in the server log

    if pair.drafter is None:
        raise ValueError("serve.engine 'vllm' needs a drafter model (models.drafter_kind 'separate')")
    root = rundir.root / "vllm"
    tdir, ddir = export_pair(pair.target, pair.drafter, pair.tokenizer, root)
    served = ServedDrafter.of_model(ddir, pair.drafter)
    served.write_all()
    spec = cfg.speculation
    process = VllmProcess(cfg.serve.vllm, tdir, ddir, cfg.serve.model_name, spec.num_draft_tokens,
                          cfg.feedback.top_k, root / "vllm.log")
    process.start()
    contract = greedy_contract(process, pair.target, pair.tokenizer, cfg.serve.vllm.greedy_probe_tokens)
    context = int(getattr(pair.target.config, "max_position_embeddings", 0) or 0) or None
    context = min(context or cfg.serve.vllm.max_model_len, cfg.serve.vllm.max_model_len)
    engine = VllmEngine(process, int(pair.target.get_output_embeddings().weight.shape[0]), context,
                        spec.num_draft_tokens, cfg.feedback.top_k, cfg.sampling.greedy_below_temperature, served,
                        pair.target.state_dict())
    engine.greedy_contract = contract
    return engine
