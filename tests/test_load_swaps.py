"""Concurrent load on `dvi serve` while its drafter and its target change under it (issue 42): no 5xx, no SSE error
event, and greedy text equal to speculation off, for the drafter kinds `separate`, `suffix` and `hybrid`, in the
default and the exact mode.

The attack, on the tiny pair (K = 3, 8 rows): concurrent clients send greedy completions, a quarter of them streams
read to the end, a quarter streams cut after their first chunk, a quarter plain requests, a quarter abandoned (the
client gives up after a few ms); meanwhile the drafter is promoted (an identity LoRA published into the registry,
shadow-checked), rolled back (`/admin/drafter/rollback`) and the target's weights updated (`/admin/target`, the same
weights: greedy text must not move) in a loop. `suffix` has no learned drafter (no swapper): only target updates.
The exact mode runs at a forced matmul row floor of 4 (what the probe picks for fp32 on an AVX2 Zen3; on the
reporter's Xeon the load failed 56 requests with `shape '[9, 1]' is invalid for input of size 8`), so that the
padded path runs on any CPU. Before the fix a swap followed by a cut stream's abort put the engine's rows out of
step (`tests/test_swap_churn.py` reproduces it deterministically).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
import pytest
from registry_doors import publish_peft_adapter
from test_serving_helpers import (
    TEST_ADMIN_TOKEN,
    ServerThread,
    drafter_lane,
    drafter_view,
    engine_of,
    lora_copy,
    tiny_config,
    version_manifest,
)
from test_swap_churn import force_floor

PROMPTS = ["def parse_args(argv):\n    parser = ", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
           "for i in range(", "The quick brown fox", "SELECT name FROM users WHERE"]
MAX_TOKENS = 16
CLIENTS = 12
LOAD_S = 6.0


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    cut: int = 0
    abandoned: int = 0
    status_5xx: int = 0
    sse_errors: int = 0
    greedy_diffs: list = field(default_factory=list)
    other: list = field(default_factory=list)  # unexpected non-5xx statuses
    promoted: int = 0
    rolled_back: int = 0
    target_updates: int = 0


@pytest.fixture(scope="module")
def plain(tiny_pair_dir) -> dict[str, str]:
    """Each prompt's greedy text with speculation off (the same engine, one request at a time)."""
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", None, tiny_pair_dir / "tokenizer", device="cpu")
    eng = SpeculativeEngine(pair.target, None)
    out = {}
    for p in PROMPTS:
        ids = pair.tokenizer.encode(p, add_special_tokens=True)
        r = eng.generate([ids], MAX_TOKENS, stop_token_ids=list(pair.stop_ids))[0]
        out[p] = pair.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    return out


@pytest.fixture(scope="module")
def same_weights(tiny_pair_dir, tmp_path_factory):
    """The target's own weights, saved where the admin API may read them (a target update that changes nothing)."""
    from dvi.models.loading import load_causal_lm

    allowed = tmp_path_factory.mktemp("load-allowed")
    load_causal_lm(tiny_pair_dir / "target", device="cpu").save_pretrained(allowed / "same")
    return allowed


async def _client(url: str, i: int, deadline: float, plain: dict[str, str], t: Tally) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        n = 0
        while time.monotonic() < deadline:
            p = PROMPTS[(i + n) % len(PROMPTS)]
            mode = (i + 3 * n) % 4  # 0 stream, 1 stream cut after its first chunk, 2 plain, 3 abandoned
            n += 1
            body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": mode < 2}
            t.requests += 1
            if mode == 3:
                try:
                    r = await c.post("/v1/completions", json=body, timeout=0.005 + 0.01 * (n % 5))
                except httpx.TimeoutException:
                    t.abandoned += 1
                    continue
                _check_plain(r, p, plain, t)
            elif mode == 2:
                _check_plain(await c.post("/v1/completions", json=body), p, plain, t)
            else:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        _bad_status(r.status_code, (await r.aread()).decode(), t)
                        continue
                    text, done = "", False
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        ev = json.loads(line[len("data: "):])
                        if "error" in ev:
                            t.sse_errors += 1
                            t.other.append(ev["error"])
                            continue
                        text += ev["choices"][0]["text"]
                        if mode == 1:  # the client goes away mid-stream
                            t.cut += 1
                            break
                    if mode == 0 and done:
                        t.completed += 1
                        if text != plain[p]:
                            t.greedy_diffs.append((p, text, plain[p]))


def _bad_status(code: int, text: str, t: Tally) -> None:
    if code >= 500:
        t.status_5xx += 1
    t.other.append((code, text[:200]))


def _check_plain(r: httpx.Response, p: str, plain: dict[str, str], t: Tally) -> None:
    if r.status_code != 200:
        _bad_status(r.status_code, r.text, t)
        return
    t.completed += 1
    text = r.json()["choices"][0]["text"]
    if text != plain[p]:
        t.greedy_diffs.append((p, text, plain[p]))


async def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return False


async def _chaos(s: ServerThread, deadline: float, weights: str, t: Tally) -> None:
    """Until the deadline: publish an identity LoRA and wait for its promotion, roll it back, update the target."""
    from dvi.registry.store import DrafterRegistry

    sw = drafter_view(s)
    reg = DrafterRegistry(s.cfg.registry.dir)
    identity = lora_copy(drafter_lane(s).base) if s.state.drafter is not None else None
    async with httpx.AsyncClient(base_url=s.url, timeout=60,
                                 headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}) as admin:
        while time.monotonic() < deadline:
            if s.state.drafter is not None:
                v = await asyncio.to_thread(publish_peft_adapter, reg, identity, version_manifest())
                if await _wait(lambda v=v: sw.live_version == v or v in sw.refused,
                               max(0.5, deadline - time.monotonic())) and sw.live_version == v:
                    await asyncio.sleep(0.2)  # rows run on it a while
                    # (the watch replays 64 finished requests: it keeps the identity version after this rollback, not
                    # before it, as with 4 it did under a loaded machine's slower publishes, leaving no rollback)
                    r = await admin.post("/admin/drafter/rollback", json={"reason": "load test"})
                    assert r.status_code in (200, 409), r.text  # 409: its watch rolled it back or kept it first
            r = await admin.post("/admin/target", json={"path": weights})
            assert r.status_code == 200, r.text
            t.target_updates += 1
            await asyncio.sleep(0.2)


async def _attack(s: ServerThread, plain: dict[str, str], weights: str) -> Tally:
    t = Tally()
    deadline = time.monotonic() + LOAD_S
    await asyncio.gather(_chaos(s, deadline, weights, t),
                         *(_client(s.url, i, deadline, plain, t) for i in range(CLIENTS)))
    return t


def _variants():
    """(kind, exact): the reported case (exact, `separate`) and `hybrid` by default in the fast suite, the rest
    marked slow (`make test` runs them all: ~7 s each on the 2-core CPU)."""
    for exact in (False, True):
        for kind in ("separate", "suffix", "hybrid"):
            fast = (kind, exact) in (("separate", True), ("hybrid", False))
            yield pytest.param(kind, exact, id=f"{kind}-{'exact_floor4' if exact else 'default'}",
                               marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize(("kind", "exact"), list(_variants()))
def test_load_with_swaps_and_target_updates(kind, exact, tiny_pair_dir, tmp_path, plain, same_weights, monkeypatch):
    if exact:
        force_floor(monkeypatch, 4)
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"models.drafter_kind={kind}", f"models.exact_greedy={exact}",
                      "serve.max_batch_size=8", f"serve.allowed_dirs=[{same_weights}]", "serve.rollback_window=64",
                      "feedback.shard_records=8", f"sampling.max_new_tokens={MAX_TOKENS}")
    with ServerThread(cfg) as s:
        if exact:
            assert engine_of(s)._target.min_rows == 4 and engine_of(s).greedy_contract["batched"] == "bitwise"
        t = asyncio.run(_attack(s, plain, str(same_weights / "same")))
        sched, sw = s.state.scheduler, drafter_view(s)
        if s.state.drafter is not None:
            t.promoted, t.rolled_back = sw.counts["promoted"], sw.counts["rolled_back"]
        print(f"\n{kind} {'exact' if exact else 'default'}: {t.requests} requests ({t.completed} completed, {t.cut} cut, "
              f"{t.abandoned} abandoned), {t.status_5xx} 5xx, {t.sse_errors} SSE errors, {len(t.greedy_diffs)} greedy "
              f"diffs; {t.promoted} promotions, {t.rolled_back} rollbacks, {t.target_updates} target updates; "
              f"engine: {sched.steps} steps, {sched.step_errors} step errors, {sched.request_errors} request errors")
        assert (t.status_5xx, t.sse_errors, t.other) == (0, 0, [])
        assert t.greedy_diffs == []
        assert (sched.step_errors, sched.request_errors) == (0, 0)
        assert t.completed >= CLIENTS and t.cut >= 1 and t.target_updates >= 1
        if s.state.drafter is not None:
            assert t.promoted >= 1 and t.rolled_back >= 1
