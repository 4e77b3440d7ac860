"""One front door to the engine (issue 39): only the engine thread touches the engine, its proposer and its suffix
cache; /metrics, /health, /admin/status and the swapper read the snapshot it publishes (`serving.engine_client`), and
what changes the engine is a typed command (`serving.engine_client`).

- the ownership check itself (`dvi.decode.owner`): a foreign thread's touch raises and is recorded;
- a server with the check on, under concurrent load with /metrics, /health and /admin/status scraped all the
  time, a promotion and a target update: no foreign touch, no error, greedy text unchanged;
- /metrics at ~50 Hz during a C=16 load on the `suffix` kind (before: a scrape during load could raise "dictionary
  changed size during iteration" in `SuffixCache.stats` -> a 500): no scrape error, no request error, greedy text
  equal to rounds without scraping, every suffix step sample observed exactly once; tokens/s with and without
  scraping, interleaved, printed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from registry_doors import publish_peft_adapter
from test_serving_helpers import (
    TEST_ADMIN_TOKEN,
    ServerThread,
    drafter_view,
    lora_copy,
    tiny_config,
    version_manifest,
)

from dvi.decode import owner

PROMPTS = ["def parse_args(argv):\n    parser = ", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
           "for i in range(", "The quick brown fox", "SELECT name FROM users WHERE"]
MAX_TOKENS = 16
ADMIN = {"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}


def test_the_owner_check_fires_for_a_foreign_thread(tiny_pair_dir, tmp_path, owner_check):
    from serving.engine_build import serving_engine
    from serving.loading import load_serving_pair

    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=hybrid")
    eng = serving_engine(cfg, load_serving_pair(cfg))
    ids = [[1, 2, 3, 4]]
    ran: list = []
    t = threading.Thread(target=lambda: (owner.claim(eng), ran.append(eng.generate(ids, 4))), name="the-owner")
    t.start()
    t.join()
    assert len(ran) == 1 and owner_check == []  # the owner itself steps, drafts and reads freely
    hybrid = eng.__dict__["proposer"]
    cache = hybrid.__dict__["suffix"].__dict__["cache"]
    touches = [lambda: eng.step(), lambda: eng.proposer, lambda: eng.greedy_contract, lambda: eng.drafter_version,
               lambda: hybrid.stats(), lambda: cache.stats(), lambda: eng.suffix_step_seconds]
    for touch in touches:
        with pytest.raises(owner.OwnershipError, match="owned by another thread"):
            touch()
    assert len(owner_check) == len(touches) and "MainThread" in owner_check[0]
    owner.release(eng)  # no owner: anyone may use it again
    assert eng.generate(ids, 4)[0].token_ids == ran[0][0].token_ids


@dataclass
class Tally:
    requests: int = 0
    tokens: int = 0
    errors: list = field(default_factory=list)
    texts: dict = field(default_factory=dict)  # prompt -> the greedy texts it got
    scrapes: int = 0
    scrape_s: float = 0.0  # summed latency
    scrape_errors: list = field(default_factory=list)


async def _client(c: httpx.AsyncClient, i: int, n: int, t: Tally) -> None:
    for j in range(n):
        p = PROMPTS[(i + j) % len(PROMPTS)]
        r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
        t.requests += 1
        if r.status_code != 200:
            t.errors.append((r.status_code, r.text[:200]))
            continue
        body = r.json()
        t.tokens += body["usage"]["completion_tokens"]
        t.texts.setdefault(p, set()).add(body["choices"][0]["text"])


async def _scrape(c: httpx.AsyncClient, paths: list[str], hz: float, done: asyncio.Event, t: Tally) -> None:
    """A scrape every 1/hz seconds (on a fixed schedule, up to 4 in flight), until `done`."""
    period, k, flying = 1.0 / hz, 0, set()
    next_at = time.monotonic()

    async def one(path: str) -> None:
        t0 = time.monotonic()
        try:
            r = await c.get(path, headers=ADMIN)
            if r.status_code != 200:
                t.scrape_errors.append((path, r.status_code, r.text[:200]))
        except httpx.HTTPError as exc:
            t.scrape_errors.append((path, repr(exc)))
        t.scrapes += 1
        t.scrape_s += time.monotonic() - t0

    while not done.is_set():
        if len(flying) < 4:
            task = asyncio.create_task(one(paths[k % len(paths)]))
            flying.add(task)
            task.add_done_callback(flying.discard)
            k += 1
        next_at += period
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.gather(*flying)


async def _load(url: str, clients: int, per_client: int, scrape: list[str] | None, hz: float = 50.0,
                extra=None) -> tuple[Tally, float]:
    """`clients` concurrent greedy clients, `per_client` requests each, while `scrape` paths are read at `hz`;
    returns the tally and the load's wall seconds."""
    t, done = Tally(), asyncio.Event()
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        side = [asyncio.create_task(_scrape(c, scrape, hz, done, t))] if scrape else []
        if extra is not None:
            side.append(asyncio.create_task(extra(c)))
        t0 = time.perf_counter()
        await asyncio.gather(*(_client(c, i, per_client, t) for i in range(clients)))
        wall = time.perf_counter() - t0
        done.set()
        await asyncio.gather(*side)
    return t, wall


def test_no_thread_but_the_engines_touches_it_under_load(tiny_pair_dir, tmp_path, owner_check, tmp_path_factory):
    """hybrid (the suffix cache and a learned drafter), check on: load, scrapes of all three documents, a promotion
    and a target update; no foreign touch, no error, greedy text the same for every request of a prompt."""
    from dvi.models.loading import load_causal_lm
    from dvi.registry.store import DrafterRegistry

    allowed = tmp_path_factory.mktemp("door-allowed")
    load_causal_lm(tiny_pair_dir / "target", device="cpu").save_pretrained(allowed / "same")
    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=hybrid", "serve.max_batch_size=8",
                      f"serve.allowed_dirs=[{allowed}]", f"sampling.max_new_tokens={MAX_TOKENS}")
    with ServerThread(cfg) as s:
        sw, reg = drafter_view(s), DrafterRegistry(cfg.registry.dir)
        identity = lora_copy(load_causal_lm(cfg.models.drafter, "cpu", "float32"))  # the lane's is the drafter thread's

        async def chaos(c: httpx.AsyncClient) -> None:
            v = await asyncio.to_thread(publish_peft_adapter, reg, identity, version_manifest())
            end = time.monotonic() + 30
            while sw.live_version != v and v not in sw.refused and time.monotonic() < end:
                await asyncio.sleep(0.05)
            r = await c.post("/admin/target", json={"path": str(allowed / "same")}, headers=ADMIN)
            assert r.status_code == 200, r.text

        t, _ = asyncio.run(_load(s.url, 8, 12, ["/metrics", "/health", "/admin/status"], 30.0, chaos))
        with s.client(token=TEST_ADMIN_TOKEN) as c:
            st = c.get("/admin/status").json()
        sched = s.state.scheduler
        print(f"\nowner check: {t.requests} requests, {t.scrapes} scrapes, promoted {sw.counts['promoted']}, "
              f"foreign touches {len(owner_check)}: {owner_check[:3]}")
        assert owner_check == []
        assert (t.errors, t.scrape_errors) == ([], [])
        assert (sched.step_errors, sched.request_errors) == (0, 0)
        assert sw.counts["promoted"] == 1 and st["drafter"]["serving"] == sw.live_version == st["drafter_version"]
        assert st["target_version"] == 1 and st["engine"]["completed"] >= t.requests
        assert all(len(texts) == 1 for texts in t.texts.values()), t.texts


def test_metrics_scraped_at_50hz_under_c16_load(tiny_pair_dir, tmp_path):
    """suffix kind, 16 clients: rounds with and without /metrics at 50 Hz, interleaved (A B B A A B); every request
    and scrape answered, greedy text equal across rounds, each suffix step sample in the histogram exactly once."""
    from dvi import metrics as M

    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=suffix", "serve.max_batch_size=16",
                      f"sampling.max_new_tokens={MAX_TOKENS}")
    rates: dict[bool, list[float]] = {False: [], True: []}
    texts: dict[str, set] = {}
    scrapes, scrape_s, scraped_s, scrape_errors, errors = 0, 0.0, 0.0, [], []
    with ServerThread(cfg) as s:
        asyncio.run(_load(s.url, 16, 2, ["/metrics"]))  # warm-up: the first batch sizes, the first scrapes
        for scraping in (False, True, True, False, False, True):
            t, wall = asyncio.run(_load(s.url, 16, 4, ["/metrics"] if scraping else None))
            rates[scraping].append(t.tokens / wall)
            scrapes, scrape_s, errors = scrapes + t.scrapes, scrape_s + t.scrape_s, errors + t.errors
            scraped_s += wall if scraping else 0.0
            scrape_errors += t.scrape_errors
            for p, got in t.texts.items():
                texts.setdefault(p, set()).update(got)
        with s.client() as c:
            text = c.get("/metrics").text
        steps = s.state.scheduler.snapshot.steps
    observed = next(float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(f"{M.SUFFIX_STEP_SECONDS}_count"))
    off, on = (sum(rates[k]) / len(rates[k]) for k in (False, True))
    print(f"\n/metrics at 50 Hz, C=16 suffix: {scrapes} scrapes in {scraped_s:.1f}s ({scrapes / scraped_s:.0f}/s, "
          f"{1e3 * scrape_s / max(scrapes, 1):.0f} ms each), {len(scrape_errors)} scrape errors, {len(errors)} "
          f"request errors; tokens/s {off:.0f} without, {on:.0f} with scraping (ratio {on / off:.3f}); "
          f"rounds {[round(x) for x in rates[False]]} / {[round(x) for x in rates[True]]}; "
          f"{int(observed)} step samples for {steps} steps")
    assert (scrape_errors, errors) == ([], [])
    assert scrapes >= 10 * scraped_s  # 50 Hz asked; >= 10 Hz came through even on a loaded 2-core CPU (25-32 seen)
    assert all(len(v) == 1 for v in texts.values()), texts  # greedy: the same text scraped or not
    assert observed == steps  # every step's sample observed once: none lost, none counted twice
