"""Parameters that change the answer are honoured or refused (issue 27 §3).

Before: `max_completion_tokens: 3` on chat returned the default length; logit_bias, the penalties,
best_of, suffix, response_format and tools with tool_choice "required" were accepted and ignored;
chat content as a list of text parts, or null with tool_calls, was refused.
"""

from __future__ import annotations

import pytest
from test_serving_helpers import ServerThread, tiny_config

PROMPT = "def main(argv):\n"
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def srv(tiny_pair_dir, tmp_path_factory):
    cfg = tiny_config(tiny_pair_dir, tmp_path_factory.mktemp("params-run"))
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client() as c:
        yield c


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": CHAT, "temperature": 0, **body})


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _refused(r, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_max_completion_tokens_is_honoured_and_wins_over_max_tokens(client) -> None:
    assert _ok(_chat(client, max_completion_tokens=3))["usage"]["completion_tokens"] == 3
    assert _ok(_chat(client, max_completion_tokens=5, max_tokens=2))["usage"]["completion_tokens"] == 5
    assert _ok(_chat(client, max_tokens=2))["usage"]["completion_tokens"] == 2
    _refused(_chat(client, max_completion_tokens=0), "max_completion_tokens")
    _refused(_chat(client, max_completion_tokens=10**6), "max_completion_tokens")


def test_content_parts_and_tool_call_messages_are_accepted(client) -> None:
    plain = _ok(_chat(client, max_tokens=6))["choices"][0]["message"]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]
    as_parts = _ok(client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 6, "temperature": 0}))
    assert as_parts["choices"][0]["message"]["content"] == plain  # one part: the same prompt
    history = CHAT + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    _ok(client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4}))
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]
    assert "text" in _refused(client.post("/v1/chat/completions", json={"messages": image}), "messages.0.content")
    _refused(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]}),
             "messages.0.content")


def test_logit_bias_and_penalties_change_the_answer(client) -> None:
    base = _ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}))
    forced = _ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                      "logit_bias": {"65": 100}}))
    assert forced["usage"]["completion_tokens"] == 6
    assert forced["choices"][0]["text"] != base["choices"][0]["text"]
    pen = _ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                   "frequency_penalty": 2.0, "presence_penalty": 2.0,
                                                   "repetition_penalty": 2.0}))
    base24 = _ok(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0}))
    assert pen["choices"][0]["text"] != base24["choices"][0]["text"]


@pytest.mark.parametrize("field,value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("logit_bias", {"99999": 1}),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"3": 200}),
])
def test_bad_penalties_are_400s_naming_the_field(client, field, value) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, field: value})
    assert _refused(r, field)


@pytest.mark.parametrize("endpoint,field,value", [
    ("completions", "best_of", 2), ("completions", "suffix", "}"), ("chat", "response_format", {"type": "json_object"}),
    ("chat", "tool_choice", "required"), ("chat", "tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}]), ("chat", "n", 10_000),
    ("completions", "min_p", 0.1), ("completions", "min_tokens", 3), ("chat", "functions", [{"name": "f"}]),
    ("chat", "modalities", ["text", "audio"]),
])
def test_unsupported_parameters_are_refused_naming_the_field(client, endpoint, field, value) -> None:
    body = {"max_tokens": 4, field: value}
    if endpoint == "chat":
        body["messages"] = CHAT
        if field == "tool_choice":
            body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    else:
        body["prompt"] = PROMPT
    r = client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", json=body)
    _refused(r, field)


@pytest.mark.parametrize("field,value", [
    ("best_of", 1), ("suffix", ""), ("response_format", {"type": "text"}), ("tool_choice", "none"),
    ("stream_options", {"include_usage": True}), ("parallel_tool_calls", False), ("service_tier", "auto"),
    ("store", False), ("modalities", ["text"]),
])
def test_neutral_values_are_accepted(client, field, value) -> None:
    body = {"max_tokens": 2, field: value, "messages": CHAT}
    if field in ("best_of", "suffix"):
        body = {"max_tokens": 2, field: value, "prompt": PROMPT}
        _ok(client.post("/v1/completions", json=body))
    else:
        if field == "tool_choice":
            body["tools"] = [{"type": "function", "function": {"name": "f"}}]
        _ok(client.post("/v1/chat/completions", json=body))
