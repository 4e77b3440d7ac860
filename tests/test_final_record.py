"""Issue 35 item 5: a finished request is one final record, its finish reason decided once, published once.

The endpoint's answer, the record each subscriber gets (telemetry, feedback log, swapper), the engine result
it carries, the feedback record on disk and /metrics say the same finish reason; every subscriber sees each
request once, and the swapper gets the very record the feedback log wrote (its one subscription, not a second
path through the feedback log's consumers).
"""

from __future__ import annotations

import collections
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_serving_helpers import ServerThread, tiny_config, wait_for

from dvi import metrics as M
from serving.finished import final_reason

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory):
    with ServerThread(tiny_config(tiny_pair_dir, tmp_path_factory.mktemp("final-run"))) as s:
        yield s


class Spies:
    """What each consumer of finished requests received, per request id."""

    def __init__(self, server, monkeypatch) -> None:
        st = server.state
        self.published: dict[str, list] = collections.defaultdict(list)
        self.written: dict[str, list] = collections.defaultdict(list)
        self.swapper_records: dict[str, list] = collections.defaultdict(list)
        self.live_alpha_calls = 0
        st.scheduler.finished.subscribe(lambda fin: self.published[fin.request_id].append(fin))
        write, observe = st.feedback.write, st.drafter.observe

        def spy_write(record):
            self.written[record.request_id].append(record)
            return write(record)

        def spy_observe(msg):  # the drafter wing's one message per finished request
            self.live_alpha_calls += 1
            if msg.record is not None:
                self.swapper_records[msg.record.request_id].append(msg.record)
            return observe(msg)

        monkeypatch.setattr(st.feedback, "write", spy_write)
        monkeypatch.setattr(st.drafter, "observe", spy_observe)


def _finished_total(text: str, reason: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith(M.REQUESTS + "{") and f'finish_reason="{reason}"' in ln)


def _stored_reasons(feedback_dir: str) -> dict[str, str]:
    rows = {}
    for shard in Path(feedback_dir).glob("shard-*.parquet"):
        t = pq.read_table(shard, columns=["request_id", "finish_reason"]).to_pylist()
        rows.update({r["request_id"]: r["finish_reason"] for r in t})
    return rows


def test_one_final_record_with_one_reason_everywhere(server, monkeypatch) -> None:
    spies = Spies(server, monkeypatch)
    tok = server.state.tokenizer
    cases = {  # body -> the reason every consumer must report
        "length": {"prompt": PROMPT, "max_tokens": 3},
        "stop": {"prompt": PROMPT, "max_tokens": 8, "logit_bias": {str(tok.eos_token_id): 100}},  # the engine's stop
    }
    with server.client() as c:
        before = c.get("/metrics").text
        greedy = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}).json()["choices"][0]["text"]
        assert len(greedy) > 2
        answers = {}
        for want, body in cases.items():
            answers[want] = c.post("/v1/completions", json=body).json()
        stop_string = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "stop": [greedy[1:3]]})
        answers["stop_string"] = stop_string.json()
        wait_for(lambda: _finished_total(c.get("/metrics").text, "stop") - _finished_total(before, "stop") >= 2,
                 10, what="the metrics")
        after = c.get("/metrics").text
    expected = {"length": "length", "stop": "stop", "stop_string": "stop"}
    rid = {case: body["dvi"]["request_id"] for case, body in answers.items()}
    stored = wait_for(lambda: (lambda rows: rows if all(r in rows for r in rid.values()) else None)(
        _stored_reasons(server.cfg.feedback.dir)), 15, what="the feedback records on disk")
    for case, want in expected.items():
        r = rid[case]
        assert answers[case]["choices"][0]["finish_reason"] == want, case
        [fin] = spies.published[r]  # published once
        assert fin.finish_reason == want and fin.result.finish_reason == want, (case, fin.result.finish_reason)
        [written] = spies.written[r]
        [kept] = spies.swapper_records[r]
        assert kept is written, "the swapper keeps the record the feedback log wrote"
        assert written.finish_reason == want and stored[r] == want, case
    assert spies.live_alpha_calls == 1 + len(answers)  # the greedy reference too: once per request
    assert _finished_total(after, "length") - _finished_total(before, "length") == 2  # the reference, "length"
    assert _finished_total(after, "stop") - _finished_total(before, "stop") == 2


def test_final_reason_is_decided_in_one_place() -> None:
    assert [final_reason("engine", r) for r in ("stop", "length", None)] == ["stop", "length", "length"]
    assert final_reason("stop_string", "abort") == final_reason("stop_string", "length") == "stop"
    assert final_reason("cancelled", "abort") == "abort" and final_reason("cut", "abort") == "shutdown"
