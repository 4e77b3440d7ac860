"""`serve.prefix_cache_tokens`: prompts' leading keys and values kept by the target (`dvi.decode.prefix_cache`) and
copied into a later prompt that starts alike. Where dvi's kernels compute every position alone, a prompt served from
the cache holds the very bits a cold prefill writes, so its greedy text is the cold text token for token; elsewhere
the cache is refused, saying why."""

from __future__ import annotations

import time

import pytest
import torch
from tiny_models import tiny_llama

from dvi.decode import attention_kernel, rows_kernel
from dvi.decode.lean import LeanModel
from dvi.decode.lean_target import LeanTarget
from dvi.decode.prefix_cache import BLOCK, PrefixCache
from dvi.engine.options import EngineOptions
from dvi.engine.speculative import SpeculativeEngine

KW = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `dvi serve` runs: the batched contract is bitwise on one thread only
    yield
    torch.set_num_threads(threads)


def _kernels_or_skip(dtype: torch.dtype) -> None:
    if rows_kernel.load(dtype) is None or attention_kernel.load() is None:
        pytest.skip(f"kernels unavailable here: {rows_kernel.unavailable_reason(dtype)}, "
                    f"{attention_kernel.unavailable_reason()}")


def _lean(dtype: torch.dtype, kernels: bool = True) -> LeanModel:
    lean = LeanModel(tiny_llama(0, **KW).to(dtype))
    if kernels:
        lean.use_rows_kernel(rows_kernel.EVERY_ROW)
    return lean


def _store(blocks: int) -> PrefixCache:
    return PrefixCache(1, 1, 2, torch.float32, torch.device("cpu"), blocks * BLOCK)


def _row(ctx: list[int], width: int = 64) -> torch.Tensor:
    """A slot's [layers, columns, 2, kv_heads, head_dim] whose column j holds ctx[j] (what `keep` copies)."""
    row = torch.zeros(1, width, 2, 1, 2)
    row[0, : len(ctx)] = torch.tensor(ctx, dtype=torch.float32).view(-1, 1, 1, 1)
    return row


def test_blocks_are_found_by_their_exact_tokens_after_the_same_blocks():
    pc = _store(8)
    a = list(range(100, 124))  # three blocks
    pc.keep(a, _row(a))
    got = torch.zeros(1, 64, 2, 1, 2)
    assert pc.copy_into(a + [1, 2], got) == 24 and torch.equal(got[:, :24], _row(a)[:, :24])
    assert pc.copy_into(a[:8] + [0] * 16, got) == 8  # parts after the first block: only that block
    assert pc.copy_into([0] + a[1:], got) == 0  # one token apart in the first block: nothing
    assert pc.copy_into(a[8:], got) == 0  # the same tokens after other blocks are other keys
    assert pc.copy_into(a[:7], got) == 0  # less than a block
    assert (pc.hits, pc.reused_tokens) == (2, 32)


def test_the_least_recently_used_chain_is_evicted_from_its_end_with_what_follows():
    pc = _store(4)
    a, b = list(range(0, 24)), list(range(50, 66))
    pc.keep(a, _row(a))  # blocks a0 a1 a2
    pc.keep(b, _row(b))  # two blocks: the free one, then one evicted from the least recently used chain's end
    got = torch.zeros(1, 64, 2, 1, 2)
    assert pc.copy_into(b, got) == 16
    assert pc.copy_into(a, got) == 16  # a's first two blocks stayed
    pc.keep(a, _row(a))  # a again: b is now the least recently used, its end goes
    assert pc.copy_into(a, got) == 24 and pc.copy_into(b, got) == 8
    pc._evict(pc._chain(a)[0])  # a chain's first block goes with every block after it
    assert pc.copy_into(a, got) == 0 and pc.copy_into(b, got) == 8 and len(pc._free) == 3
    pc.clear()
    assert pc.copy_into(a, got) == 0 and len(pc._free) == 4


def test_a_cache_smaller_than_a_block_is_refused_by_name():
    with pytest.raises(ValueError, match="at least one block"):
        _store(0)


@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_a_prompt_from_the_cache_holds_what_a_cold_prefill_writes(one_thread, dtype):
    """Admitted alone (a forward of its own) and lazily (riding on a batch's step), a prompt that starts as an earlier
    one copies the cached blocks and prefills only the rest: its keys and values are the cold prefill's, bit for bit,
    and so are the next step's logits."""
    _kernels_or_skip(dtype)
    lean = _lean(dtype)
    warm, cold = LeanTarget(lean=lean), LeanTarget(lean=lean)
    assert warm.use_prefix_cache(256) is None and warm.contract["batched"] == "bitwise"
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 128, (27,), generator=g).tolist()
    first, second, third = (shared + torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 9, 3))
    warm.admit([first], False)
    warm.admit([second], False)  # alone: 24 columns copied, 12 prefilled
    assert (warm.prefix.hits, warm.prefix.reused_tokens) == (1, 24)
    warm.admit([third, shared[:16]], False, lazy=True)  # lazily: beside the batch's next step
    assert warm.prefix.reused_tokens == 24 + 24 + 16 and warm.cache.lengths[3] == 16  # wholly cached: no prefill
    cold.admit([first, second], False)
    cold.admit([third, shared[:16]], False, lazy=True)
    ids = torch.randint(0, 128, (4, 1), generator=g)
    assert torch.equal(warm.forward(ids, False), cold.forward(ids, False))
    assert warm.cache.lengths == cold.cache.lengths
    for i, n in enumerate(cold.cache.lengths):
        assert torch.equal(warm.cache.kv[:, i, :n], cold.cache.kv[:, i, :n]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_group_of_samples_of_one_prompt_decodes_as_without_the_cache(one_thread, dtype, monkeypatch):
    """GRPO-style: each prompt sampled four times in one batch, greedy; with the cache, every sample after the
    first copies its prompt's blocks, and the text is the text without it."""
    _kernels_or_skip(dtype)
    monkeypatch.setattr(rows_kernel, "kernel_rows_measured", lambda lean: rows_kernel.EVERY_ROW)
    target = tiny_llama(0, **KW).to(dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [p for p in (torch.randint(0, 128, (n,), generator=g).tolist() for n in (30, 41, 19)) for _ in range(4)]
    texts = {}
    for tokens in (0, 512):
        eng = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel="auto", prefix_cache_tokens=tokens))
        texts[tokens] = [r.token_ids for r in eng.generate(prompts, 12)]
        if tokens:
            assert eng._target.prefix.hits >= 9  # the 2nd-4th sample of each prompt, at least
    assert texts[0] == texts[512]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_groups_draw_the_same_tokens_with_the_cache(one_thread, monkeypatch, temperature):
    """Sampling (top-p 0.9, seeded): the cache hands a prompt the very keys and values a cold prefill writes, so every
    sample draws the same tokens with it as without it (the target's distribution is untouched)."""
    _kernels_or_skip(torch.float32)
    monkeypatch.setattr(rows_kernel, "kernel_rows_measured", lambda lean: rows_kernel.EVERY_ROW)
    target = tiny_llama(0, **KW)
    g = torch.Generator().manual_seed(7)
    prompts = [p for p in (torch.randint(0, 128, (n,), generator=g).tolist() for n in (26, 33)) for _ in range(3)]
    texts = {}
    for tokens in (0, 512):
        eng = SpeculativeEngine(target, None, options=EngineOptions(cpu_rows_kernel="auto", prefix_cache_tokens=tokens))
        texts[tokens] = [r.token_ids for r in eng.generate(prompts, 16, temperature=temperature, top_p=0.9, seed=11)]
        if tokens:
            assert eng._target.prefix.hits >= 4
    assert texts[0] == texts[512]


@torch.inference_mode()
def test_where_a_position_rounds_by_its_forward_the_cache_is_refused_saying_why(one_thread):
    plain = LeanTarget(lean=_lean(torch.float32, kernels=False))
    assert plain.contract["batched"] == "near-tie"
    assert "near-tie" in plain.use_prefix_cache(256) and plain.prefix is None
    assert LeanTarget(lean=_lean(torch.float32, kernels=False)).use_prefix_cache(0) == "no tokens to hold"


@torch.inference_mode()
def test_new_target_weights_empty_the_cache(one_thread):
    _kernels_or_skip(torch.float32)
    run = LeanTarget(lean=_lean(torch.float32))
    run.use_prefix_cache(64)
    ctx = list(range(20))
    run.admit([ctx], False)
    assert run.prefix.copy_into(ctx, torch.zeros_like(run.cache.kv[:, 0])) == 16
    run.rebuild([], False)
    assert run.prefix.copy_into(ctx, torch.zeros_like(run.cache.kv[:, 0])) == 0


def test_a_server_reports_its_prefix_cache_and_answers_alike(tiny_pair_dir, tmp_path, monkeypatch):
    """Through `dvi serve`: the same prompt twice, greedy, answers alike; the second's prompt comes from the cache,
    counted on /health and /metrics (vLLM's prefix_cache_queries / hits, as tokens)."""
    from test_serving_helpers import ServerThread, tiny_config

    from dvi.metrics import names as M

    _kernels_or_skip(torch.float32)
    monkeypatch.setattr(rows_kernel, "kernel_rows_measured", lambda lean: rows_kernel.EVERY_ROW)
    cfg = tiny_config(tiny_pair_dir, tmp_path / "run", "serve.prefix_cache_tokens=256", "models.dtype=float32")
    prompt = "def merge_sorted(left, right):\n    out = []\n    while left and right:\n"
    with ServerThread(cfg) as s, s.client() as c:
        contract = s.health()["greedy_contract"]
        if contract["batched"] != "bitwise":
            pytest.skip(f"the tiny pair's contract here: {contract}")
        texts = [c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
                 ["choices"][0]["text"] for _ in range(2)]
        assert texts[0] == texts[1]
        deadline = time.monotonic() + 30
        while (pc := s.health()["prefix_cache"])["hits"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)  # the engine publishes its counts between steps
        assert pc["tokens"] == 256 and pc["hits"] == 1 and pc["reused_tokens"] >= 8
        metrics = c.get("/metrics").text
        assert f"{M.PREFIX_CACHE_HITS} {float(pc['reused_tokens'])}" in metrics
        assert f"{M.PREFIX_CACHE_QUERIES} {float(pc['queried_tokens'])}" in metrics


@torch.inference_mode()
def test_more_threads_later_stop_the_cache_serving(one_thread):
    """torch on two threads splits elementwise ops at counts that part a row: a position then rounds by what its
    forward carries, so a cache made on one thread serves nothing until the threads are back to one."""
    _kernels_or_skip(torch.float32)
    run = LeanTarget(lean=_lean(torch.float32))
    assert run.use_prefix_cache(64) is None
    ctx = list(range(20))
    run.admit([ctx], False)
    torch.set_num_threads(2)
    run.admit([ctx], False)
    assert run.prefix.hits == 0
    torch.set_num_threads(1)
    run.admit([ctx], False)
    assert run.prefix.hits == 1
