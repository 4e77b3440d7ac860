"""Streaming text through the incremental detokenizer (`serving.detok.TextStream`).

A scripted engine emits fixed token ids (multi-byte characters split across tokens and steps)
to the real scheduler with the tiny pair's tokenizer: streamed chunks concatenate to the
non-streamed text, stop strings cut at the same place, and a step's decode work does not grow
with the stream's length (only the final full decode touches every token).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from dvi.engine.report import EngineReport
from dvi.engine.speculative import GenerationResult, SamplingParams, StepOutput
from serving.detok import TextStream
from serving.logprobs import token_bytes, token_logprobs
from serving.scheduler import Delta, Finished, Scheduler

TEXT = "héllo wörld 日本語 🙂 naïve café — ok. Ünïcödé ∑ 𝔘 end"


class ScriptedEngine:
    """Emits each request's scripted ids in chunks of 1, 2, 3, 1, 2, 3, ... tokens per step (what the scheduler's
    declared `serving.engine_client.Engine` reads between steps: nothing drafted, nothing to report)."""

    drafter_version = target_version = 0
    adapter_versions: dict[str, int] = {}
    greedy_contract: dict[str, str] = {}

    def report(self) -> EngineReport:
        return EngineReport()

    def take_suffix_step_seconds(self) -> list[float]:
        return []

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.rows: dict[str, list[int]] = {}
        self.sizes = itertools.cycle([1, 2, 3])

    def add_request(self, req: Any) -> None:
        self.rows[req.request_id] = list(self.ids)

    def step(self) -> list[StepOutput]:
        outs = []
        for rid, left in list(self.rows.items()):
            n = next(self.sizes)
            new, self.rows[rid] = left[:n], left[n:]
            finished = not self.rows[rid]
            n_all = len(self.ids)
            res = GenerationResult(request_id=rid, prompt_ids=[1], token_ids=list(self.ids),
                                   finish_reason="length", drafted_ids=[-1] * n_all,
                                   accepted=[False] * n_all) if finished else None
            if finished:
                del self.rows[rid]
            outs.append(StepOutput(rid, new, finished, res))
        return outs

    def abort(self, rid: str) -> GenerationResult:
        self.rows.pop(rid, None)
        return GenerationResult(request_id=rid, prompt_ids=[1], finish_reason="abort")


def _run(tokenizer: Any, ids: list[int], stream: bool, stop: list[str] | None = None) -> tuple[list[str], Any]:
    """Serve one scripted request; returns (streamed deltas, Finished)."""

    async def go() -> tuple[list[str], Any]:
        sched = Scheduler(ScriptedEngine(ids), tokenizer, max_batch_size=2, queue_limit=4)
        sched.start()
        try:
            h = sched.submit([1], SamplingParams(max_new_tokens=len(ids)), stop=stop, stream=stream)
            deltas = []
            while True:
                _, ev = await asyncio.wait_for(h.queue.get(), 30)
                if isinstance(ev, Delta):
                    deltas.append(ev.text)
                elif isinstance(ev, Finished):
                    return deltas, ev
                else:
                    raise ev
        finally:
            sched.stop()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(tiny_pair_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair_dir / "tokenizer")


def test_text_stream_equals_full_decode(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    ts = TextStream(tokenizer)
    for i in ids:
        ts.add([i])
        assert tokenizer.decode(ts.token_ids, skip_special_tokens=True).startswith(ts.text)
    assert ts.text == ts.final_text() == tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_streamed_chunks_concatenate_to_plain_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(len(tokenizer.decode([i])) == 1 and tokenizer.decode([i]) == "\ufffd" for i in ids), \
        "the text must split a character across tokens"
    deltas, fin = _run(tokenizer, ids, stream=True)
    _, plain = _run(tokenizer, ids, stream=False)
    assert len(deltas) > 5 and "".join(deltas) == fin.text == plain.text == TEXT
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["日本", "🙂", "é —", "Ü"])
def test_multibyte_stop_strings_cut_the_same(tokenizer, stop: str) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    want = TEXT[:TEXT.index(stop)]
    deltas, fin = _run(tokenizer, ids, stream=True, stop=[stop, "@@@"])
    _, plain = _run(tokenizer, ids, stream=False, stop=[stop])
    assert "".join(deltas) == fin.text == plain.text == want
    assert fin.finish_reason == plain.finish_reason == "stop"


def test_decode_work_per_step_does_not_grow(tokenizer, monkeypatch) -> None:
    """400 tokens streamed a few per step: full decodes touch each token once (the final text),
    not 1 + 2 + ... + n times as re-decoding the whole stream every step did."""
    ids = tokenizer.encode(TEXT * 12, add_special_tokens=False)[:400]
    decoded: list[int] = []
    real = tokenizer.decode

    def counting(token_ids, *a, **kw):
        decoded.append(len(token_ids))
        return real(token_ids, *a, **kw)

    monkeypatch.setattr(tokenizer, "decode", counting)
    for stop in (None, ["@@@"]):
        decoded.clear()
        deltas, fin = _run(tokenizer, ids, stream=True, stop=stop)
        assert "".join(deltas) == fin.text == real(ids, skip_special_tokens=True)
        assert sum(decoded) == len(ids), decoded


def test_logprob_tokens_carry_their_bytes_and_offsets(tokenizer) -> None:
    """Multi-byte characters split across tokens: the bytes concatenate to the text, offsets are
    character offsets into it, and tokens starting after a stop-string cut are left out."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    items = token_logprobs(tokenizer, ids + [tokenizer.eos_token_id], [-0.5] * (len(ids) + 1))
    assert len(items) == len(ids)
    assert b"".join(token_bytes(tokenizer, i) for i in ids) == b"".join(t.raw for t in items) == TEXT.encode()
    offsets = [t.offset for t in items]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(TEXT)
    cut = TEXT.index("日本")
    kept = token_logprobs(tokenizer, ids, [-0.5] * len(ids), cut_at=cut)
    assert all(t.offset < cut for t in kept) and len(kept) < len(items)


def test_tokenizers_decode_stream_cannot_copy_fall_back_to_full_decodes(tokenizer, monkeypatch) -> None:
    """transformers' space clean-up rewrites text across tokens: the full decode every step (exact)."""
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True, raising=False)
    ids = tokenizer.encode("a , b . c 日本", add_special_tokens=False)
    ts = TextStream(tokenizer)
    for i in ids:
        ts.add([i])
    assert ts.text == ts.final_text() == tokenizer.decode(ids, skip_special_tokens=True)
    deltas, fin = _run(tokenizer, ids, stream=True)
    assert "".join(deltas) == fin.text == tokenizer.decode(ids, skip_special_tokens=True)
