"""One tokenizer queue for everyone (issue 27 §2).

Before: every prompt was tokenised on one worker, one at a time, so five legal 3 MB CJK prompts
(each refused with a 400 only after seconds of tokenising) delayed an 8-token bystander by as long
as all their encodes. Now a prompt that cannot fit the context is refused from a sound lower bound
on its token count before any encode, and large prompts are tokenised on their own worker, so a
small prompt never queues behind them.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from test_serving_helpers import ServerThread, tiny_config

CJK = "漢字かな交じり文"


@pytest.fixture(scope="module")
def tok(tiny_pair_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair_dir / "tokenizer")


def test_the_bound_never_refuses_a_prompt_that_fits(tok) -> None:
    """min_tokens(text) <= the real token count, on texts built to tokenise densely: decoded runs of the
    tokens holding the most bytes, decoded random ids, vocabulary strings, and mixed scripts."""
    from serving.tokenize import PromptTokenizer

    pt = PromptTokenizer(tok)
    try:
        assert pt.bound_is_sound and pt.max_nonascii < pt.max_bytes
        rng = random.Random(0)
        vocab = list(tok.get_vocab())
        ids = list(range(len(tok)))
        longest = sorted(ids, key=lambda i: -len(tok.decode([i]).encode()))[:20]
        alphabet = [" ", "  ", "\n", "a", "the ", "def ", "0", "é", "漢", "😀", "<|", "|>", "\t", "ab" * 20]
        for i in range(400):
            n = rng.randint(1, 300)
            pool = [longest, ids, vocab, alphabet][i % 4]
            picked = [rng.choice(pool) for _ in range(n)]
            text = tok.decode(picked) if i % 4 < 2 else "".join(picked)
            assert pt.min_tokens(text) <= len(tok.encode(text, add_special_tokens=False)), text
        assert pt.min_tokens(" " * 5000) <= len(tok.encode(" " * 5000))
        assert pt.min_tokens(CJK * 1000) > len(CJK * 1000) / 3  # CJK text: a tight bound, not bytes / longest
    finally:
        pt.close()


def test_big_prompts_do_not_delay_a_bystander(tiny_pair_dir, tmp_path) -> None:
    big = CJK * 125_000  # 1M characters, 3 MB of UTF-8, legal under the limits below
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.max_body_bytes=4000000", "serve.max_prompt_chars=1200000")
    with ServerThread(cfg) as srv:
        async def run() -> tuple[list[httpx.Response], list[httpx.Response], float]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                bigs = [asyncio.create_task(c.post("/v1/completions", json={"prompt": big, "max_tokens": 8}))
                        for _ in range(3)]
                bigs += [asyncio.create_task(c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": big}], "max_tokens": 8})) for _ in range(2)]
                await asyncio.sleep(1.0)  # the big bodies are read and queued for tokenising
                t0 = time.perf_counter()
                small = await c.post("/v1/completions", json={"prompt": "def main(argv):\n", "max_tokens": 8})
                bystander_s = time.perf_counter() - t0
                return await asyncio.gather(*bigs), [small], bystander_s

        bigs, (small,), bystander_s = asyncio.run(run())
    assert small.status_code == 200, small.text
    for r in bigs:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["param"], err["code"]) in (("prompt", "context_length_exceeded"),
                                                ("messages", "context_length_exceeded")), err
    print(f"bystander latency with 5 big prompts in flight: {bystander_s:.3f}s")
    assert bystander_s < 1.0, bystander_s


def test_a_large_prompt_that_fits_is_served(tiny_pair_dir, tmp_path) -> None:
    """Large (own worker) but within the context: encoded and answered, not refused by the bound."""
    prompt = "x " * 400  # ~800 tokens of a 1024 context, over the small-prompt size set here
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.tokenize_large_bytes=256")
    with ServerThread(cfg) as srv, srv.client() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_prompts_under_the_bound_queue_apart_from_small_ones(tiny_pair_dir, tmp_path) -> None:
    """16 KB prompts of short ASCII words pass the bound (16,000 bytes / 17 per token < the 1024-token context)
    but hold ~16,000 tokens, so each is encoded (~20-30 ms) before its 400: on the large-prompt worker they do
    not delay a small request (one worker for all, as before: 1.5-1.8 s)."""
    rng = random.Random(0)
    medium = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 .,;()") for _ in range(16_000))
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.tokenize_large_bytes=4096")
    with ServerThread(cfg) as srv:
        assert srv.state.prompts.min_tokens(medium) <= srv.state.context_len

        async def run() -> tuple[list[httpx.Response], httpx.Response, float]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                meds = [asyncio.create_task(c.post("/v1/completions", json={"prompt": medium, "max_tokens": 8}))
                        for _ in range(80)]
                await asyncio.sleep(0.5)
                async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c2:  # not behind c's pool limit
                    t0 = time.perf_counter()
                    small = await c2.post("/v1/completions", json={"prompt": "def main(argv):\n", "max_tokens": 8})
                    took = time.perf_counter() - t0
                return await asyncio.gather(*meds), small, took

        meds, small, bystander_s = asyncio.run(run())
    assert small.status_code == 200, small.text
    assert all(r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" for r in meds)
    print(f"bystander latency with 80 medium prompts in flight: {bystander_s:.3f}s")
    assert bystander_s < 0.5, bystander_s
