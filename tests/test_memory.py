"""A long-serving process keeps its memory flat (issue 25): nothing per request stays behind in the engine, and
the server hands freed heap memory back to the OS (`dvi.memory`)."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from registry_doors import publish_peft_adapter

from dvi.memory import glibc_trim


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def test_engine_keeps_no_tensor_per_prompt_length(tiny_pair_dir):
    """Prompts of ever new lengths (each a new prefill / drafter catch-up width) leave no tensor behind: a mask
    helper once kept a [q, q] identity per width on the drafter's long-lived cache (a 4k prompt: 16 MiB)."""
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")
    engine = SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=3)
    rng = random.Random(0)

    def serve(lengths: list[int]) -> None:
        for n in lengths:  # two rows of different lengths: a padded prefill, holes in the caches
            engine.generate([[rng.randrange(3, 60) for _ in range(n)], [rng.randrange(3, 60) for _ in range(n // 2)]],
                            max_new_tokens=6)

    serve([70, 80])  # warm-up: the engine's lasting state exists
    before = _live_tensors()
    serve(list(range(90, 150, 6)))
    assert _live_tensors() - before <= 2


_FRAGMENT = """
import sys
from dvi.memory import glibc_trim
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) >> 10
trim = glibc_trim()
blocks = [bytearray(1000) for _ in range(150_000)]  # ~150 MiB of heap blocks (over pymalloc's 512 B: malloc)
pin = bytearray(1000)  # a live block above them: free() alone cannot shrink the heap
del blocks
before = rss()
trim()
print(before, rss())
"""


@pytest.mark.skipif(glibc_trim() is None, reason="needs glibc")
def test_trim_returns_freed_heap_that_free_alone_keeps():
    """The mechanism `dvi.memory` relies on: memory freed below a live block stays resident until trimmed."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _FRAGMENT], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert before - after >= 100, (before, after)


FREEZE_CHILD = """
import gc, time
from dvi.memory import freeze_long_lived
import torch, transformers  # a server's imports: tens of thousands of tracked objects
n = freeze_long_lived()
assert n == gc.get_freeze_count() > 10_000, n
t = time.perf_counter(); gc.collect(); walk = time.perf_counter() - t
a, b = [], []
a.append(b); b.append(a)  # a cycle made after the freeze
del a, b
assert gc.collect() >= 2  # still collected
gc.unfreeze(); t = time.perf_counter(); gc.collect(); full = time.perf_counter() - t
print(n, walk, full)
assert walk < full, (walk, full)
"""


def test_frozen_start_up_objects_are_not_walked_and_later_cycles_still_collected():
    """`freeze_long_lived` (what `dvi serve` does once started): a full collection no longer walks what start-up
    built, and garbage made later is still collected. In its own process: a freeze is process-wide."""
    out = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_server_trims_when_idle_and_not_when_off(tiny_pair_dir, tmp_path, monkeypatch):
    """The engine thread trims once requests stop (and never with `serve.malloc_trim_seconds=0`), counting them;
    the server bounds oneDNN's primitive cache unless the environment already does."""
    from test_serving_helpers import TEST_ADMIN_TOKEN, ServerThread, tiny_config, wait_for

    from dvi.memory import ONEDNN_CACHE_ENV

    for every, want, env in ((30.0, glibc_trim() is not None, None), (0.0, False, "77")):
        if env is None:
            monkeypatch.delenv(ONEDNN_CACHE_ENV, raising=False)
        else:
            monkeypatch.setenv(ONEDNN_CACHE_ENV, env)
        cfg = tiny_config(tiny_pair_dir, tmp_path / f"run{every}", f"serve.malloc_trim_seconds={every}")
        with ServerThread(cfg) as srv, srv.client() as c:
            assert os.environ[ONEDNN_CACHE_ENV] == (env or str(cfg.serve.onednn_primitive_cache))
            heap = srv.state.scheduler.heap
            assert heap.trims == 0
            for n in (4, 9, 14):
                r = c.post("/v1/completions", json={"model": "dvi", "prompt": "def f(x):\n" * n, "max_tokens": 8})
                assert r.status_code == 200, r.text
            if want:
                wait_for(lambda h=heap: h.trims >= 1, timeout=10, what="a trim once idle")
            n = heap.trims
            time.sleep(0.6)  # idle: no steps since, so no further trim
            assert heap.trims == n and (n >= 1) == want
            status = c.get("/admin/status", headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}).json()
            shown = status["engine"]["heap"]  # an SRE reads the trims where the trainer's are
            assert shown["trims"] == n and (shown["rss_bytes"] is not None) == want


def _modules_of(cls: type) -> tuple[int, int]:
    """(live instances of `cls`, bytes of all live tensor storages, each counted once)."""
    gc.collect()
    objs = gc.get_objects()
    storages = {}
    for o in objs:
        if isinstance(o, torch.Tensor) and o.device.type == "cpu":
            if o.is_mkldnn:  # oneDNN-packed weights (serve.cpu_packed_weights) have no storage to share: own bytes
                storages[("mkldnn", id(o))] = o.numel() * o.element_size()
                continue
            st = o.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(1 for o in objs if type(o) is cls), sum(storages.values())


@pytest.mark.slow
def test_promoted_drafters_are_freed_once_replaced(tiny_pair_dir, tmp_path):
    """A chain of promotions keeps a fixed number of drafter models alive (the startup one, its pristine copy,
    the last good one, the served one): each replaced version is freed, whatever steps it served."""
    from test_serving_e2e import _lora, _traffic
    from test_serving_helpers import (
        ServerThread,
        drafter_lane,
        drafter_view,
        tiny_config,
        version_manifest,
        wait_for,
    )

    from dvi.registry.store import DrafterRegistry

    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.rollback_window=2")
    with ServerThread(cfg) as s:
        reg, sw, base = DrafterRegistry(cfg.registry.dir), drafter_view(s), drafter_lane(s).base
        while sw.heldout_positions < cfg.trainer.shadow_min_positions:
            _traffic(s.url, 2, [], stream=False)
        counts = []
        for _ in range(5):
            v = publish_peft_adapter(reg, _lora(base), version_manifest())
            wait_for(lambda v=v: sw.live_version == v, 30, what=f"v{v} promoted")
            _traffic(s.url, 3, [], stream=False)  # served by v; its watch ends and it becomes the last good one
            wait_for(lambda v=v: sw.good == v, 30, what=f"v{v} kept")
            counts.append(_settled(lambda: _modules_of(type(base))))
        assert counts[-1][0] == counts[1][0] and counts[-1][1] <= counts[1][1] * 1.02, counts


def _settled(sample, tries: int = 20, pause_s: float = 0.25):
    """`sample()` once two consecutive samples agree: the swapper's watcher thread may still be dropping the
    version it loaded to judge the last one (a loaded machine delays it past the verdict)."""
    import time

    last = sample()
    for _ in range(tries):
        time.sleep(pause_s)
        now = sample()
        if now == last:
            return now
        last = now
    return last


def _drafter_sized_pair(tiny_pair_dir: Path, out: Path) -> Path:
    """The tiny pair with a drafter of the real one's size (34M parameters, 136 MB in fp32; random weights: memory
    does not care what it drafts), so that a drafter copy shows in the server's RSS."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True)
    for part in ("target", "tokenizer"):
        (out / part).symlink_to(tiny_pair_dir / part)
    cfg = json.loads((tiny_pair_dir / "drafter" / "config.json").read_text())
    cfg.update(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16,
               num_key_value_heads=16, head_dim=64)
    torch.manual_seed(0)
    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version", "dtype")}
    LlamaForCausalLM(LlamaConfig(**keep)).save_pretrained(out / "drafter")
    return out


def _rss_mib(pid: int) -> float:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")).split()[1]) / 1024


@pytest.mark.slow
def test_server_rss_stays_flat_across_six_promotions(tiny_pair_dir, tmp_path):
    """Issue 36 §9 through a real `dvi serve` with a drafter-sized drafter: RSS over 6 promotions (each
    watched and kept) flat within 5% (median of the last three against the first three). Before: +12% (946 -> 1063 MiB), the swapper holding four drafter copies
    (the startup one, a pristine copy of it, the last good, the served) and the freed blocks of each promotion's
    loads and checks staying in glibc's heaps; now two (the startup one, the served) and a trim after each."""
    import json

    import httpx
    import yaml
    from test_serving_helpers import lora_copy, tiny_config, version_manifest, wait_for

    from dvi.config import dump_config
    from dvi.models.loading import load_causal_lm
    from dvi.registry.store import DrafterRegistry
    from serving.server_process import ServerProcess

    pair = _drafter_sized_pair(tiny_pair_dir, tmp_path / "pair")
    cfg = tiny_config(pair, tmp_path / "run", "serve.rollback_window=4")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    base = load_causal_lm(pair / "drafter", "cpu", "float32")
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    events = tmp_path / "run" / "swap_events.jsonl"

    def verdicts(v: int, kinds: tuple[str, ...]) -> bool:
        return events.exists() and any(json.loads(line)["version"] == v and json.loads(line)["kind"] in kinds
                                       for line in events.read_text().splitlines())

    rss = []
    with ServerProcess(["--config", str(path)], tmp_path / "server.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        n = 0

        def traffic(k: int) -> None:
            nonlocal n
            for _ in range(k):
                n += 1
                r = c.post("/v1/completions", json={"prompt": "def main(argv):\n" + " " * (n % 7), "max_tokens": 16})
                assert r.status_code == 200, r.text

        traffic(24)
        reg = DrafterRegistry(cfg.registry.dir)
        for i in range(6):  # a drafter copy (136 MB, ~14%) kept per promotion adds 3 between the medians compared
            v = publish_peft_adapter(reg, lora_copy(base, 0.0, i, targets), version_manifest())
            wait_for(lambda v=v: verdicts(v, ("promoted", "refused")), 120, what=f"v{v}'s verdict")
            traffic(5)  # its watch (4 requests) ends: kept
            wait_for(lambda v=v: verdicts(v, ("kept", "rolled_back")), 120, what=f"v{v}'s watch")
            time.sleep(1.0)  # idle: the engine's trim has run
            rss.append(_rss_mib(srv.proc.pid))
    # glibc's heaps swing a reading by ~5% either way from one promotion to the next (CI: 997, 1030, 1010, 1044, ...);
    # a leak is a trend, so the last three readings' median is held against the first three's
    first, last = sorted(rss[:3])[1], sorted(rss[-3:])[1]
    assert last <= 1.05 * first, rss


def test_the_engine_thread_keeps_no_command_after_running_it():
    """A command's payload (an admin target update's state dict: 513 MiB for SmolLM2 in fp32) is freed once the
    command ran: the engine loop held the last one in a loop variable until the next command (the soak, issue 60
    §2, saw the server's RSS 520 MiB up after every target update)."""
    import weakref

    from test_detok import ScriptedEngine

    from serving.engine_client import UpdateTarget
    from serving.scheduler import Scheduler

    class Weights(dict):
        pass

    class Engine(ScriptedEngine):
        def update_target_weights(self, weights, version, complete=False) -> None:
            self.target_version = version

    sched = Scheduler(Engine([1, 2]), None, max_batch_size=2, queue_limit=4)
    sched.start()
    try:
        w = Weights(x=torch.zeros(4))
        ref = weakref.ref(w)
        sched.command(UpdateTarget(w, 1)).result(30)
        del w
        deadline = time.monotonic() + 5
        while ref() is not None and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert ref() is None, "the engine thread still holds the target update's weights"
    finally:
        sched.stop()


_TRAINER_HEAP = """
import time
from dvi.memory import HeapTrimmer
heap = HeapTrimmer(1e-6)  # what the trainer loop holds (`trainer.malloc_trim_seconds`)
blocks = [bytearray(1000) for _ in range(150_000)]  # ~150 MiB of heap blocks, freed below a live one
pin = bytearray(1000)
del blocks
time.sleep(0.01)
heap.after_step()
s = heap.status()
print(s["trims"], s["released_bytes"], s["rss_before_trim_bytes"] - s["rss_bytes"])
off = HeapTrimmer(0)
off.after_step()
print(off.status()["trims"])
"""


@pytest.mark.skipif(glibc_trim() is None, reason="needs glibc")
def test_trainer_trims_between_rounds_and_reports_what_each_trim_gave_back():
    """The trainer's `HeapTrimmer` (`trainer.malloc_trim_seconds`, after every round): a trim gives freed heap back and its status
    says how much (what separates memory glibc held freed from memory in use); 0 never trims."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", _TRAINER_HEAP], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    trims, released, diff, off = (int(x) for x in out)
    assert trims == 1 and released == diff and released >= 100 << 20, out
    assert off == 0


def test_a_reserved_kv_cache_serves_its_rows_without_growing_and_decodes_alike(tiny_pair_dir):
    """`SpeculativeEngine.reserve` (`serve.kv_cache_tokens`): the target's cache allocated once up front, a batch that
    fits it never reallocates it (a growth is a zeroed allocation and a copy inside a step), one that does not fit
    still grows, and the tokens are those of an engine left to grow on demand."""
    from dvi.decode.request import Request, SamplingParams
    from dvi.drafters.factory import proposer_for
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 60) for _ in range(n)] for n in (30, 9, 41, 17)]

    def serve(engine) -> list[list[int]]:  # as the server does: requests queued, then steps
        for i, p in enumerate(prompts):
            engine.add_request(Request(f"r{i}", p, SamplingParams(max_new_tokens=12)))
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.result.token_ids for o in engine.step() if o.finished})
        return [done[f"r{i}"] for i in range(len(prompts))]

    def engine():
        return SpeculativeEngine(pair.target, proposer_for(pair.target, pair.drafter), num_draft_tokens=3)

    reserved, grown = engine(), engine()
    held = reserved.reserve(4, 300)
    cache = reserved._target.cache
    assert (cache.slots, cache.capacity) == (4, 512) and held == cache.kv.numel() * cache.kv.element_size()
    kv, on_demand = cache.kv.data_ptr(), grown._target.cache.kv.data_ptr()
    assert serve(reserved) == serve(grown)
    assert cache.kv.data_ptr() == kv  # four rows of 41 + 12 + 4 positions at most: they fit, nothing reallocated
    assert grown._target.cache.kv.data_ptr() != on_demand  # the same rows grew a cache allocated for one
    prompts.append([5] * 20)  # a fifth row: past the reservation, so it grows
    serve(reserved)
    assert (cache.slots, cache.capacity) == (8, 512)


def test_the_server_allocates_its_kv_cache_at_start(tiny_pair_dir, tmp_path):
    """`serve.kv_cache_tokens` through a real server: max_batch_size rows of that many tokens before the first
    request, and a burst of max_batch_size requests that fit it leaves the cache where it was."""
    import concurrent.futures

    from test_serving_helpers import ServerThread, engine_of, tiny_config

    cfg = tiny_config(tiny_pair_dir, tmp_path / "run", "serve.max_batch_size=4", "serve.kv_cache_tokens=300")
    with ServerThread(cfg) as s:
        cache = engine_of(s)._target.cache
        assert (cache.slots, cache.capacity) == (4, 512)  # capacity doubles from 256
        kv = cache.kv.data_ptr()
        with s.client() as c, concurrent.futures.ThreadPoolExecutor(4) as pool:
            posts = [pool.submit(c.post, "/v1/completions", json={"prompt": f"def f{i}(x):", "max_tokens": 16})
                     for i in range(4)]
            assert all(p.result().status_code == 200 for p in posts)
        assert cache.kv.data_ptr() == kv and (cache.slots, cache.capacity) == (4, 512)
    with ServerThread(tiny_config(tiny_pair_dir, tmp_path / "run0", "serve.kv_cache_tokens=0")) as s:
        assert engine_of(s)._target.cache.slots == 1  # 0: nothing held ahead, the cache grows on demand
