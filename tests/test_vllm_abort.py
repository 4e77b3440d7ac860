"""A request behind vLLM (`serve.engine: vllm`) that its client leaves: `VllmEngine.abort`'s result is a whole
feedback record (issue 60). Driven through the real `VllmEngine` (its streams' loop, `_take`, `step`, `abort`) and,
for the end-to-end case, the real `Scheduler` and `FeedbackLog` writing to a real `FeedbackWriter`; only vLLM's
HTTP server is stood in for (an `httpx.MockTransport` streaming `/v1/completions` chunks as vLLM writes them), so
no vLLM venv and no model are needed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from dvi.decode.request import Request, SamplingParams
from dvi.feedback import FeedbackReader, FeedbackRecord, FeedbackWriter
from serving.scheduler import Scheduler
from serving.vllm_engine import VllmEngine, steps_within
from serving.wiring import FeedbackLog

K = 3


def _chunk(ids: list[int], top: bool = True, finish: str | None = None) -> bytes:
    """One SSE line as vLLM streams it: token ids, their log-probs and the target's top-2 (token_id:N keys)."""
    lp = {"token_logprobs": [-0.1 * (i + 1) for i in range(len(ids))],
          "top_logprobs": [{f"token_id:{t}": -0.1, f"token_id:{t + 1}": -2.5} for t in ids] if top else None}
    choice = {"index": 0, "text": "", "token_ids": ids, "logprobs": lp, "finish_reason": finish}
    return f"data: {json.dumps({'choices': [choice]})}\n\n".encode()


class FakeVllm:
    """vLLM's `/v1/completions` stream for one request: the chunks queued with `send` are streamed as they come;
    the stream stays open (the request still decoding) until the client closes it (`closed` is then set)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue | None = None
        self.opened = threading.Event()
        self.closed = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None

    def send(self, data: bytes | None) -> None:
        assert self.opened.wait(10), "the engine never opened its stream to vLLM"
        self.loop.call_soon_threadsafe(self.queue.put_nowait, data)

    async def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/completions"
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.opened.set()

        async def body():
            try:
                while (data := await self.queue.get()) is not None:  # None: vLLM ends the stream
                    yield data
            finally:
                self.closed.set()

        return httpx.Response(200, content=body(), headers={"content-type": "text/event-stream"})


def _engine(fake: FakeVllm, top_k: int = 2) -> VllmEngine:
    process = SimpleNamespace(url="http://vllm.test", dtype="float32", served_name="m", ready=threading.Event(),
                              restarts=0, log_path="vllm.log", stop=lambda: None)
    engine = VllmEngine(process, vocab_size=100, max_context=None, num_draft_tokens=K, feedback_top_k=top_k,
                        greedy_below_temperature=1e-5, served=None, target_state={})
    old = engine._client
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handler))
    asyncio.run_coroutine_threadsafe(old.aclose(), engine._loop).result(5)
    return engine


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _step_until(engine: VllmEngine, n: int) -> list[int]:
    """Engine-thread `step`s until `n` tokens were handed out; the tokens."""
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {got} handed out"
        for out in engine.step(0.05):
            assert out.error is None and not out.finished
            got.extend(out.new_token_ids)
    return got


def test_an_aborted_vllm_request_is_a_valid_record_of_the_tokens_handed_out_with_the_served_versions():
    fake = FakeVllm()
    engine = _engine(fake)
    try:
        engine.drafter_version, engine.target_version = 4, 2
        engine.add_request(Request(request_id="r1", prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=32)))
        fake.send(_chunk([5, 6]))
        fake.send(_chunk([7]))
        assert _step_until(engine, 3) == [5, 6, 7]
        fake.send(_chunk([8, 9]))  # arrived from vLLM but not handed out (no step yet) when the client leaves
        _wait(lambda: len(engine._rows["r1"].fresh) == 2, "the unhanded tokens")
        t0 = time.time()
        res = engine.abort("r1")
        assert res is not None and res.finish_reason == "abort"
        assert res.token_ids == [5, 6, 7]
        assert res.drafted_ids == [-1, -1, -1] and res.accepted == [False, False, False]  # vLLM said nothing of them
        assert res.topk_ids == [[5, 6], [6, 7], [7, 8]] and len(res.topk_logprobs) == 3
        assert len(res.token_logprobs) == 3
        assert (res.num_steps, res.num_drafted, res.num_accepted) == (0, 0, 0) and res.alpha is None
        assert res.drafted_per_position == [0] * K and res.accepted_per_position == [0] * K
        assert (res.drafter_version, res.target_version) == (4, 2)
        assert res.started_at <= t0 <= res.finished_at
        assert fake.closed.wait(10), "vLLM's stream was not closed: vLLM would keep decoding the aborted request"
        rec = FeedbackRecord.from_result(res)
        assert rec.finish_reason == "abort" and rec.token_ids == [5, 6, 7] and rec.drafter_version == 4
        assert engine.abort("r1") is None and not engine.has_unfinished()
        assert engine.step(0.01) == []
    finally:
        engine.close()


def test_an_aborted_vllm_request_without_top_k_or_with_ragged_top_k_keeps_none():
    for top_k, top in ((0, False), (2, None)):
        fake = FakeVllm()
        engine = _engine(fake, top_k)
        try:
            engine.add_request(Request(request_id="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=8)))
            fake.send(_chunk([5, 6], top=top is not None and top))
            if top is None:  # a chunk whose log-probs cover fewer positions than its tokens: ragged, dropped
                line = json.loads(_chunk([7, 8])[6:])
                line["choices"][0]["logprobs"]["top_logprobs"] = line["choices"][0]["logprobs"]["top_logprobs"][:1]
                fake.send(f"data: {json.dumps(line)}\n\n".encode())
            _step_until(engine, 2 if top is not None else 4)
            res = engine.abort("r")
            FeedbackRecord.from_result(res)  # valid
            assert len(res.drafted_ids) == len(res.accepted) == len(res.token_ids)
            assert len(res.token_logprobs) in (0, len(res.token_ids))  # a ragged list is dropped, never padded
            if top is None:
                assert res.topk_ids == [] and res.topk_logprobs == []
        finally:
            engine.close()


def test_an_aborted_request_never_changes_after_abort_returned():
    fake = FakeVllm()
    engine = _engine(fake)
    try:
        engine.add_request(Request(request_id="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=8)))
        fake.send(_chunk([5]))
        _step_until(engine, 1)
        res = engine.abort("r")
        before = FeedbackRecord.from_result(res)
        fake.send(_chunk([6, 7]))  # still in flight on vLLM's side before the close lands: must not reach `res`
        time.sleep(0.2)
        assert FeedbackRecord.from_result(res) == before and res.token_ids == [5]
    finally:
        engine.close()


def test_a_vllm_request_aborted_after_vllms_last_chunk_keeps_the_counts_of_the_tokens_handed_out():
    """vLLM finished (its per-step counts in) before the engine thread handed the last tokens out: the abort keeps
    what the client got, with vLLM's counts of exactly those tokens (`steps_within`)."""
    fake = FakeVllm()
    engine = _engine(fake)
    try:
        engine.add_request(Request(request_id="r", prompt_ids=[1], params=SamplingParams(max_new_tokens=8)))
        fake.send(_chunk([5, 6, 7]))
        assert _step_until(engine, 3) == [5, 6, 7]
        fake.send(_chunk([8, 9], finish="length"))
        usage = {"choices": [], "metrics": {"speculative_decoding": {
            "num_drafts": 2, "num_draft_tokens": 6, "num_spec_tokens": K,
            "per_step_accepted": [2, 0], "per_step_drafted": [3, 3]}}}
        fake.send(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        fake.send(None)
        _wait(lambda: engine._rows["r"].finished, "vLLM's end of the stream")
        res = engine.abort("r")
        assert res.finish_reason == "abort" and res.token_ids == [5, 6, 7]
        # token 5 the prefill's; step 1 drafted 3, its first two (6, 7) accepted; its own token (8) and step 2 cut
        assert res.drafted_ids == [-1, 6, 7] and res.accepted == [False, True, True]
        assert (res.num_steps, res.num_drafted, res.num_accepted) == (1, 3, 2)
        assert res.drafted_per_position == [1, 1, 1] and res.accepted_per_position == [1, 1, 0]
        assert len(res.topk_ids) == 3
        FeedbackRecord.from_result(res)
        assert engine.step(0.01) == []  # handed out as the abort's result, never again as a finished row
    finally:
        engine.close()


def test_steps_within_cuts_vllms_step_counts_at_the_tokens_kept():
    assert steps_within([2, 0, 1], [3, 3, 3], 1) == ([], [])  # the prefill's token alone
    assert steps_within([2, 0, 1], [3, 3, 3], 3) == ([2], [3])
    assert steps_within([2, 0, 1], [3, 3, 3], 2) == ([1], [3])  # cut through step 1's accepted drafts
    assert steps_within([2, 0, 1], [3, 3, 3], 5) == ([2, 0], [3, 3])
    assert steps_within([2, 0, 1], [3, 3, 3], 99) == ([2, 0, 1], [3, 3, 3])


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def test_a_client_leaving_a_vllm_request_writes_its_abort_record_through_the_scheduler(tmp_path):
    """The path a soak run takes: the handle cancelled -> `Scheduler._reap_cancelled` -> `VllmEngine.abort` ->
    `Finished` published -> `FeedbackLog` -> the writer: one record, finish_reason "abort", the tokens so far."""
    fake = FakeVllm()
    engine = _engine(fake)
    engine.drafter_version, engine.target_version = 3, 1  # set before the engine thread owns it
    writer = FeedbackWriter(tmp_path / "fb", shard_records=1)
    sched = Scheduler(engine, _Tok(), max_batch_size=2, queue_limit=4)
    fb_log = FeedbackLog(writer)
    sched.finished.subscribe(fb_log)
    fins = []
    sched.finished.subscribe(fins.append)
    sched.start()

    async def go():
        h = sched.submit([1, 2], SamplingParams(max_new_tokens=64))
        fake.send(_chunk([5, 6]))
        fake.send(_chunk([7]))
        while len(h.token_ids) < 3:
            await asyncio.sleep(0.01)
        sched.cancel(h)  # the client went away
        while not fins:
            await asyncio.sleep(0.01)
        return h

    try:
        h = asyncio.run(asyncio.wait_for(go(), 20))
        assert fake.closed.wait(10)
    finally:
        sched.stop()
        engine.close()
        writer.close()
    assert fb_log.errors == 0, "the abort's feedback record was dropped"
    (fin,) = fins
    assert fin.finish_reason == "abort" and fin.result is not None and fin.token_ids == [5, 6, 7]
    reader = FeedbackReader(tmp_path / "fb")
    (rec,) = list(reader.iter_records(reader.poll()))
    assert rec.request_id == h.request_id and rec.finish_reason == "abort"
    assert rec.token_ids == [5, 6, 7] and rec.prompt_ids == [1, 2]
    assert rec.drafted_ids == [-1, -1, -1] and rec.accepted == [False] * 3 and len(rec.topk_ids) == 3
    assert (rec.drafter_version, rec.target_version) == (3, 1)
    assert 0 < rec.started_at <= rec.finished_at


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
