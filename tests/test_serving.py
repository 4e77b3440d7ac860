"""The HTTP API against a real server (uvicorn thread, real engine, tiny pair, loopback HTTP).

Output equality: the server's greedy completions (plain, streamed, 16 concurrent clients in one
continuous batch) equal `SpeculativeEngine.generate` on the same prompt. Bad requests: every one
gets a 4xx with an OpenAI-style error naming the field, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
from test_serving_helpers import ServerThread, engine_of, guarded_config, sse_events, tiny_config, wait_for

from dvi import metrics as M

API_KEY = "test-key"
ADMIN = "admin-secret"
PROMPTS = ["def main(argv):\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self", "The "]


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory, allowed_dir):
    run = tmp_path_factory.mktemp("serve-run")
    cfg = guarded_config(tiny_pair_dir, run, API_KEY, ADMIN, allowed_dir, "serve.max_tokens_limit=64",
                         "serve.max_batch_size=8")
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with server.client(token=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_pair_dir):
    """Greedy output of `engine.generate` on the same pair (fresh engine, batch of one)."""
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer",
                     device="cpu")
    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=3)
    tok = pair.tokenizer
    cache: dict = {}

    def ref(prompt: str | list[int], max_tokens: int, stops: list[int] | None = None) -> tuple[list[int], str]:
        """(tokens, text) ended by `stops` (None: the end-of-sequence id)."""
        ids = tok.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)
        stops = [tok.eos_token_id] if stops is None else list(stops)
        key = (tuple(ids), max_tokens, tuple(stops))
        if key not in cache:
            res = engine.generate([ids], max_new_tokens=max_tokens, stop_token_ids=stops)[0]
            cache[key] = (res.token_ids, tok.decode(res.token_ids, skip_special_tokens=True))
        return cache[key]

    ref.tokenizer = tok
    return ref


def test_completion_matches_engine_generate(client, reference) -> None:
    for prompt in PROMPTS:
        r = client.post("/v1/completions", json={"model": "dvi", "prompt": prompt, "max_tokens": 20})
        assert r.status_code == 200, r.text
        body = r.json()
        ids, text = reference(prompt, 20)
        assert body["choices"][0]["text"] == text
        assert body["object"] == "text_completion"
        assert body["usage"]["completion_tokens"] == len(ids)
        assert body["usage"]["prompt_tokens"] == len(reference.tokenizer.encode(prompt))
        dvi = body["dvi"]
        assert dvi["drafted"] >= dvi["accepted"] >= 0 and dvi["steps"] > 0
        assert dvi["drafter_version"] == 0 and dvi["target_version"] == 0
        assert dvi["mean_accepted_length"] == pytest.approx(1 + dvi["accepted"] / dvi["steps"])
    # a prompt given as token ids
    ids = reference.tokenizer.encode(PROMPTS[0])
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12})
    assert r.json()["choices"][0]["text"] == reference(ids, 12)[1]


def test_dvi_block_names_the_feedback_record_of_the_response(client, server) -> None:
    """A client finds its own response in the feedback log by the `dvi` block's `request_id` (the demo replays
    each window's responses that way), streamed or not."""
    from dvi.feedback import FeedbackReader

    blocks = [client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12}).json()]
    events = sse_events(client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 12,
                                                              "stream": True}).text)
    blocks.append(events[-2])
    server.state.feedback.flush()
    reader = FeedbackReader(server.state.cfg.feedback.dir)
    records = {r.request_id: r for r in reader.iter_records(reader.list_shards())}
    for body in blocks:
        rec = records[body["dvi"]["request_id"]]
        assert len(rec.token_ids) == body["usage"]["completion_tokens"] == 12
        assert rec.drafter_version == body["dvi"]["drafter_version"]


def test_streaming_matches_engine_generate(client, reference) -> None:
    for prompt in PROMPTS[:2]:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 20, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len(chunks) >= 2, "tokens must arrive in several chunks"
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == reference(prompt, 20)[1]
        last = chunks[-1]
        assert last["choices"][0]["finish_reason"] in ("length", "stop")
        assert last["usage"]["completion_tokens"] == len(reference(prompt, 20)[0])
        assert "drafted" in last["dvi"]


def test_chat_completion_and_stream(client, reference) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    r2 = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 16, "stream": True})
    events = sse_events(r2.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant"}
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events[1:-1])
    assert streamed == body["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_stop_strings_trim_and_finish(client, reference) -> None:
    prompt = PROMPTS[0]
    _, full = reference(prompt, 24)
    stop = next((full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip()), None)
    assert stop, f"greedy text too short to pick a stop string: {full!r}"
    cut = full.index(stop)
    for stream in (False, True):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "stop": [stop, "@@@"],
                                                 "stream": stream})
        assert r.status_code == 200
        if stream:
            ev = sse_events(r.text)[:-1]
            text, reason = "".join(e["choices"][0]["text"] for e in ev), ev[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == full[:cut], (stream, text, full, stop)
        assert reason == "stop"


def _target_logprobs(tiny_pair_dir, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """log_softmax of the target's own logits at each generated token (greedy: T=1)."""
    import torch

    from dvi.models.loading import load_causal_lm

    target = load_causal_lm(tiny_pair_dir / "target", device="cpu", dtype=torch.float32)
    with torch.no_grad():
        logits = target(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
    lp = torch.log_softmax(logits.float(), -1)
    return [float(lp[i, t]) for i, t in enumerate(ids)]


def test_completion_logprobs_are_the_targets(client, reference, tiny_pair_dir) -> None:
    prompt = PROMPTS[1]
    ids, text = reference(prompt, 16)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text
    lp = choice["logprobs"]
    assert lp["top_logprobs"] is None
    special = set(reference.tokenizer.all_special_ids)
    kept = [t for t in ids if t not in special]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(kept)
    assert "".join(lp["tokens"]) == text
    assert [text[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"], strict=True)] == lp["tokens"]
    want = _target_logprobs(tiny_pair_dir, reference.tokenizer.encode(prompt), ids)
    want = [w for w, t in zip(want, ids, strict=True) if t not in special]
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-3)
    # not asked for: null, as before
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape(client) -> None:
    msgs = [{"role": "user", "content": "def f(x):"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 12, "logprobs": True,
                                                  "top_logprobs": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert content and all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} for c in content)
    assert all(c["top_logprobs"] == [] and c["logprob"] <= 0.0 for c in content)
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == choice["message"]["content"]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4})
    assert r.json()["choices"][0]["logprobs"] is None


def test_echo_returns_the_prompt_first(client, reference) -> None:
    prompt = PROMPTS[2]
    _, text = reference(prompt, 10)
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == prompt + text
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "echo": True, "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert chunks[0]["choices"][0]["text"] == prompt
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt + text
    ids = reference.tokenizer.encode(prompt)
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 10, "echo": True})
    assert r.json()["choices"][0]["text"] == reference.tokenizer.decode(ids, skip_special_tokens=True) + text


def test_sixteen_concurrent_clients(server, reference) -> None:
    """16 clients at once (more than max_batch_size=8): all succeed, each equals its greedy reference."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str, str]:
        prompt = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        body = {"prompt": prompt, "max_tokens": 8 + i, "stream": i % 2 == 1, "metadata": {"domain": "code"}}
        r = await c.post("/v1/completions", json=body)
        if body["stream"]:
            text = "".join(e["choices"][0]["text"] for e in sse_events(r.text)[:-1])
        else:
            text = r.json()["choices"][0]["text"]
        return r.status_code, text, reference(prompt, 8 + i)[1]

    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16)))

    results = asyncio.run(run())
    assert [s for s, _, _ in results] == [200] * 16
    for _, got, want in results:
        assert got == want
    assert server.state.scheduler.request_errors == 0


def test_models_health_metrics(client, server) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "dvi"
    client.post("/v1/completions", json={"prompt": "x = 1\n", "max_tokens": 4, "metadata": {"domain": "prose"}})
    h = server.health()
    assert h["status"] == "ok" and h["engine"]["alive"]
    assert h["drafter_version"] == 0 and h["target_version"] == 0
    assert h["trainer"]["state"] == "off"
    text = client.get("/metrics").text
    for name in (M.NUM_DRAFT_TOKENS, M.NUM_ACCEPTED_TOKENS, M.ACCEPTANCE_RATE, M.REQUEST_LATENCY,
                 M.TIME_TO_FIRST_TOKEN, M.QUEUE_DEPTH, M.DRAFTER_VERSION, M.TARGET_VERSION, M.TRAINER_STATE):
        assert name in text, name
    assert 'domain="prose"' in text
    for name in M.VLLM_METRICS:  # vLLM's names of the spec-decode counters, labelled by the served model
        assert f'{name}{{model_name="dvi"' in text, name
    # feedback records reach parquet shards with the domain tag
    fb = Path(server.cfg.feedback.dir)
    wait_for(lambda: list(fb.glob("shard-*.parquet")), 10, what="a feedback shard")


def test_client_disconnect_frees_slot(server) -> None:
    s = server.state
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions",
                      json={"prompt": "def f():\n", "max_tokens": 64, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    wait_for(lambda: s.scheduler.num_running() == 0 and not engine_of(server).has_unfinished(), 10,
             what="the aborted request to leave the batch")


BAD = [
    # (path, body (dict or raw str), expected status, text the message must contain)
    ("/v1/completions", {"max_tokens": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"max_tokens": 5}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "five"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 17}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 65}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 22}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 65}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": [1, 2, 999999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "metadata": {"domain": 3}}, 400, "metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 0, "stream": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 3}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 0, "echo": True}, 400, "echo"),
    ("/v1/completions", "{not json", 400, "JSON"),
    ("/v1/completions", "[1, 2]", 400, "object"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_4xx_naming_the_field(client, path, body, status, needle) -> None:
    if isinstance(body, str):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] or needle == err.get("param"), err


def test_prompt_over_context(client, server) -> None:
    ctx = server.state.context_len
    r = client.post("/v1/completions", json={"prompt": [5] * (ctx + 1), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"prompt": [5] * (ctx - 2), "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "context" in r.json()["error"]["message"]


def test_auth(server) -> None:
    with server.client() as anon, server.client(token="wrong") as wrong:
        for c in (anon, wrong):
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            assert c.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200  # probes need no key
    with server.client(token=API_KEY) as user:
        # the API key is not the admin token
        for path in ("/admin/trainer/pause", "/admin/drafter/rollback", "/admin/target"):
            r = user.post(path, json={})
            assert r.status_code == 403 and r.json()["error"]["message"]
        with server.client() as anon:
            assert anon.post("/admin/drafter/pin", json={"version": 0}).status_code == 401
        assert user.post("/v1/nope", json={}).status_code == 404


def test_admin_target_update_and_path_confinement(server, client, allowed_dir, tmp_path, reference) -> None:
    from safetensors.torch import save_file

    admin = server.client(token=ADMIN)
    target = engine_of(server).target
    sd = {k: v.detach().clone().contiguous() for k, v in target.state_dict().items()}
    good = allowed_dir / "target_v1.safetensors"
    save_file(sd, str(good))
    outside = tmp_path / "outside.safetensors"
    save_file(sd, str(outside))
    link = allowed_dir / "sneaky.safetensors"
    if not link.exists():
        os.symlink(outside, link)

    r = admin.post("/admin/target", json={"path": str(outside), "version": 1})
    assert r.status_code == 403 and r.json()["error"]["param"] == "path"
    r = admin.post("/admin/target", json={"path": str(link), "version": 1})
    assert r.status_code == 403, "a symlink out of the allowed dir must be refused"
    r = admin.post("/admin/target", json={"path": str(allowed_dir / "../" / outside.name), "version": 1})
    assert r.status_code in (400, 403)
    r = admin.post("/admin/target", json={"path": str(allowed_dir / "missing.safetensors")})
    assert r.status_code == 400
    bad = allowed_dir / "garbage.safetensors"
    bad.write_bytes(b"not a safetensors file")
    r = admin.post("/admin/target", json={"path": str(bad)})
    assert r.status_code == 400, r.text
    r = admin.post("/admin/target", json={"path": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"

    r = admin.post("/admin/target", json={"path": str(good), "version": 7})
    assert r.status_code == 200, r.text
    assert r.json()["target_version"] == 7
    out = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 20}).json()
    assert out["dvi"]["target_version"] == 7
    assert out["choices"][0]["text"] == reference(PROMPTS[1], 20)[1]  # same weights, same output
    assert client.get("/health").json()["target_version"] == 7
    assert f"{M.TARGET_VERSION} 7.0" in client.get("/metrics").text

    r = admin.post("/admin/trainer/pause")
    assert r.status_code == 409  # trainer is off
    r = admin.post("/admin/drafter/pin", json={"version": 0})
    assert r.status_code == 200 and r.json()["pinned"] == 0
    r = admin.post("/admin/drafter/pin", json={"version": 42})
    assert r.status_code == 400 and r.json()["error"]["param"] == "version"
    assert admin.post("/admin/drafter/pin", json={"version": None}).status_code == 200
    assert admin.get("/admin/status").status_code == 200
    admin.close()


def test_queue_limit_answers_429(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.max_batch_size=1", "serve.queue_limit=1")

    async def run(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 24})
                                        for _ in range(8)))
            return [r.status_code for r in rs]

    with ServerThread(cfg) as s:
        codes = asyncio.run(run(s.url))
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
        with s.client() as c:
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 200  # the server recovered
            assert json.loads(r.text)["usage"]["completion_tokens"] >= 1
            rejected = [ln for ln in c.get("/metrics").text.splitlines()
                        if ln.startswith(M.REQUESTS_REJECTED + "{")]
            assert rejected and float(rejected[0].split()[-1]) == codes.count(429), rejected
