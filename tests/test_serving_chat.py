"""`/v1/chat/completions` renders messages with the tokenizer's own chat template.

The tiny tokenizer gets SmolLM2-135M-Instruct's ChatML template; the server's rendering must equal
`apply_chat_template(..., add_generation_prompt=True)` token for token (system message, multi-turn,
the template's default system prompt), and bad messages get a 400 that names the field.
"""

from __future__ import annotations

import pytest
from test_serving_helpers import ServerThread, templated_tokenizer_dir, tiny_config

from dvi.models.loading import load_tokenizer
from serving.completions import _chat_prompt
from serving.protocol import ChatCompletionRequest

# SmolLM2-135M-Instruct's chat template (ChatML, with a default system prompt when none is given).
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "def f(x):"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Write a loop."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": "An ordered sequence."},
        {"role": "user", "content": "And a tuple?"},
    ],
]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tiny_pair_dir, tmp_path_factory):
    """The tiny tokenizer with the ChatML template, saved as a tokenizer dir the server loads."""
    d = templated_tokenizer_dir(tiny_pair_dir, tmp_path_factory.mktemp("chat-tokenizer"), CHATML)
    assert load_tokenizer(d).chat_template == CHATML
    return d


def _template_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _server_render(tok, messages: list[dict]) -> list[int]:
    return _chat_prompt(tok, ChatCompletionRequest.model_validate({"messages": messages}).messages)


@pytest.mark.parametrize("conv", CONVERSATIONS, ids=["user_only", "system", "multi_turn"])
def test_rendering_equals_apply_chat_template(chat_tokenizer_dir, conv) -> None:
    tok = load_tokenizer(chat_tokenizer_dir)
    assert _server_render(tok, conv) == _template_ids(tok, conv)
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>") == len(conv) + 1 + (
        conv[0]["role"] != "system")
    # as in SmolLM2's real tokenizer, the ChatML markers are special tokens: still the same ids
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    ids = _server_render(tok, conv)
    assert ids == _template_ids(tok, conv)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")


@pytest.fixture(scope="module")
def chat_server(tiny_pair_dir, chat_tokenizer_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("chat-run")
    cfg = tiny_config(tiny_pair_dir, run, f"models.tokenizer={chat_tokenizer_dir}")
    with ServerThread(cfg) as s:
        yield s


def test_server_serves_the_templated_prompt(tiny_pair_dir, chat_tokenizer_dir, chat_server) -> None:
    """Prompt tokens and the greedy answer are those of the template-rendered ids."""
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", chat_tokenizer_dir, device="cpu")
    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=3)
    tok = pair.tokenizer
    with chat_server.client() as c:
        for conv in CONVERSATIONS:
            ids = _template_ids(tok, conv)
            r = c.post("/v1/chat/completions", json={"messages": conv, "max_tokens": 12})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == len(ids)
            want = engine.generate([ids], 12, stop_token_ids=[tok.eos_token_id])[0].token_ids
            assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)


BAD_MESSAGES = [
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": None}]}, "content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": ["a"]}]}, "messages.1.content"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages.0"),
]


@pytest.mark.parametrize("body, field", BAD_MESSAGES, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_MESSAGES)])
def test_bad_messages_get_400_naming_the_field(chat_server, body, field) -> None:
    with chat_server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and field in (err.get("param") or ""), err
