"""`n` choices, batches of prompts, and vLLM's `ignore_eos` and `stop_token_ids` through a real server (uvicorn thread, real engine, tiny pair, loopback HTTP).

Greedy, every choice of every prompt equals `SpeculativeEngine.generate` on that prompt (each choice is a row of its
own, batched with the others); sampled, a seeded request's choices differ and each follows the target (the engine's
chi-square tests cover the law; here the HTTP shape: indices, usage, the `dvi` blocks, streaming, admission whole or
not at all, a disconnect freeing every choice's slot).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from test_detok import ScriptedEngine
from test_serving import reference  # noqa: F401  (the fixture)
from test_serving_helpers import ServerThread, engine_of, sse_events, tiny_config, wait_for


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory):
    cfg = tiny_config(tiny_pair_dir, tmp_path_factory.mktemp("serve-choices"), "serve.max_tokens_limit=64",
                      "serve.max_batch_size=8", "serve.max_choices=12")
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_greedy_choices_of_every_prompt_equal_the_engine(client, reference) -> None:  # noqa: F811
    prompts = ["def main(argv):\n", "import os\n"]
    r = client.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 12, "echo": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for c in body["choices"]:
        p = prompts[c["index"] // 3]
        assert c["text"] == p + reference(p, 12)[1], c
        assert c["dvi"]["request_id"].startswith("req-")
    refs = [reference(p, 12)[0] for p in prompts]
    ids = [len(reference.tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    assert body["usage"] == {"prompt_tokens": sum(ids), "completion_tokens": 3 * sum(len(t) for t in refs),
                             "total_tokens": sum(ids) + 3 * sum(len(t) for t in refs)}
    assert body["dvi"]["choices"] == 6 and len(set(body["dvi"]["request_ids"])) == 6


def test_token_id_batches_and_a_batch_of_one(client, reference) -> None:  # noqa: F811
    ids = reference.tokenizer.encode("class Foo:\n", add_special_tokens=True)
    r = client.post("/v1/completions", json={"prompt": [ids, ids[:3]], "max_tokens": 8}).json()
    assert [c["text"] for c in r["choices"]] == [reference(ids, 8)[1], reference(ids[:3], 8)[1]]
    one = client.post("/v1/completions", json={"prompt": [ids], "max_tokens": 8}).json()
    assert one["choices"][0]["text"] == reference(ids, 8)[1] and "request_id" in one["dvi"]  # n = 1: as before


def test_seeded_choices_differ_and_sample(client) -> None:
    body = {"messages": [{"role": "user", "content": "Write a word."}], "n": 6, "max_tokens": 16,
            "temperature": 1.0, "seed": 11}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(texts) == 6 and len(set(texts)) >= 4, texts  # tiny pair at T = 1: distinct samples
    assert [c["index"] for c in r.json()["choices"]] == list(range(6))


def test_streamed_choices_carry_their_index(client, reference) -> None:  # noqa: F811
    r = client.post("/v1/completions", json={"prompt": "The ", "n": 3, "max_tokens": 10, "stream": True})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    text, finished = {0: "", 1: "", 2: ""}, []
    for e in events[:-1]:
        (c,) = e["choices"]
        text[c["index"]] += c["text"]
        if c["finish_reason"]:
            finished.append(c["index"])
            assert e["dvi"]["request_id"].startswith("req-")
    assert sorted(finished) == [0, 1, 2] and "usage" in events[-2]
    assert events[-2]["usage"]["completion_tokens"] == 3 * len(reference("The ", 10)[0])
    assert all(t == reference("The ", 10)[1] for t in text.values()), text


def test_choices_are_queued_whole_or_refused_whole() -> None:
    from dvi.engine.speculative import SamplingParams
    from serving.scheduler import QueueFull, Scheduler

    async def go() -> None:
        sched = Scheduler(ScriptedEngine([7]), None, max_batch_size=1, queue_limit=3)  # not started: none leave
        p = SamplingParams(max_new_tokens=4)
        two = sched.submit_choices([([1], p), ([2], p)])
        assert [h.choice for h in two] == [0, 1]
        assert two[0].cohort == two[1].cohort == two[0].request_id  # they join the batch in one step
        with pytest.raises(QueueFull, match="no room for 2 choices"):
            sched.submit_choices([([3], p), ([4], p)])
        assert sched.queue_depth() == 2  # nothing of the refused request was queued
        (h,) = sched.submit_choices([([5], p)])
        assert sched.queue_depth() == 3 and h.queue is not sched._waiting[0].queue and h.cohort == ""

    asyncio.run(go())


def test_a_request_over_the_queue_is_a_429_and_the_server_goes_on(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.max_batch_size=1", "serve.queue_limit=3")
    with ServerThread(cfg) as s, s.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 4})
        assert r.status_code == 429 and "no room for 4 choices" in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_disconnect_frees_every_choice(server) -> None:
    s = server.state
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "def f():\n", "max_tokens": 64, "n": 4, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    wait_for(lambda: s.scheduler.num_running() == 0 and s.scheduler.queue_depth() == 0
             and not engine_of(server).has_unfinished(), 10, what="the aborted choices to leave the batch")


def test_ignore_eos_runs_to_the_limit_and_stop_token_ids_end_the_answer(client, reference) -> None:  # noqa: F811
    tok = reference.tokenizer
    for prompt in ("def main(argv):\n", "The ", "import os\n"):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True}).json()
        want = reference(prompt, 40, stops=[])[0]  # no id ends it
        assert r["usage"]["completion_tokens"] == 40 and r["choices"][0]["finish_reason"] == "length"
        assert r["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        stop = want[5]
        cut = want[: want.index(stop) + 1]
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "ignore_eos": True,
                                                 "stop_token_ids": [stop]}).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == len(cut)
        assert r["choices"][0]["text"] == tok.decode(cut, skip_special_tokens=True)  # the stop id kept
    for body, needle in (({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [10**9]}, "token id"),
                         ({"stop_token_ids": list(range(17))}, "at most"), ({"ignore_eos": "yes"}, "ignore_eos")):
        r = client.post("/v1/completions", json={"prompt": "x", **body})
        assert r.status_code == 400 and needle in r.json()["error"]["message"] + str(r.json()["error"]["param"])
