"""Fault injection (issue 17): hostile clients, broken storage, bad weights, stopped trainers.

One real server on loopback (uvicorn thread, real engine, tiny pair) serves every request-level
attack; a second one supervises the real `dvi train --online` process for the trainer faults.
Each test names the issue item it proves (1-16); every one failed on the code before the fix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import httpx
import pytest
import torch
from registry_doors import publish_files, publish_peft_adapter
from test_serving_helpers import (
    ServerThread,
    drafter_lane,
    drafter_view,
    engine_of,
    guarded_config,
    lora_copy,
    tiny_config,
    version_manifest,
    wait_for,
)

from dvi import metrics as M
from dvi.feedback import QUARANTINE_DIR, FeedbackReader, record_nbytes
from dvi.registry.store import DrafterRegistry, vname

pytestmark = pytest.mark.slow

API_KEY = "fault-api-key-0123456789"
ADMIN = "fault-admin-token-9876543210"
PROMPT = "def main(argv):\n"


def _samples(text: str, name: str) -> dict[str, float]:
    """{label part: value} of one metric in a Prometheus text page ('' for an unlabelled one)."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


def _total(text: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in _samples(text, name).items() if all(w in k for w in want))


def _lora(drafter, scale: float = 0.0, seed: int = 0):
    return lora_copy(drafter, scale, seed)


# -- the request-level server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tiny_pair_dir, tmp_path_factory, allowed_dir):
    run = tmp_path_factory.mktemp("faults-run")
    cfg = guarded_config(tiny_pair_dir, run, API_KEY, ADMIN, allowed_dir, "serve.max_body_bytes=3000000",
                         "serve.max_prompt_chars=1200000", "serve.max_stop_chars=64", "feedback.shard_records=4",
                         "feedback.max_buffer_bytes=123456789")
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client(token=API_KEY) as c:
        yield c


@pytest.fixture(scope="module")
def admin(srv):
    with srv.client(token=ADMIN) as c:
        yield c


def _text(client, **body) -> str:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_01_top_k_above_vocabulary_is_a_400_and_bystanders_are_unharmed(srv, client) -> None:
    vocab = srv.state.vocab_size

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            good = [c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12}) for _ in range(3)]
            bad = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "top_k": 10**6,
                                                  "temperature": 1.0})
            edge = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "top_k": vocab,
                                                   "temperature": 1.0, "seed": 1})
            return await asyncio.gather(bad, edge, *good)

    bad, edge, *good = asyncio.run(burst())
    err = _error(bad)
    assert err["param"] == "top_k" and str(vocab) in err["message"]
    assert edge.status_code == 200, edge.text  # top_k == vocabulary: allowed, keeps everything
    assert [r.status_code for r in good] == [200] * 3
    assert srv.state.scheduler.step_errors == 0


def test_01_engine_refuses_and_sampling_clamps_top_k(srv) -> None:
    from dvi.decode.sampling import warp_probs
    from dvi.engine.speculative import InvalidParam, SamplingParams

    with pytest.raises(InvalidParam) as exc:
        engine_of(srv)._validate_params(SamplingParams(4, temperature=1.0, top_k=10**6), 3)
    assert exc.value.param == "top_k"
    logits = torch.randn(2, 7)
    probs = warp_probs(logits, torch.ones(2), torch.tensor([10**6, 3]))
    assert torch.allclose(probs[0], torch.softmax(logits[0], -1)) and int((probs[1] > 0).sum()) == 3


def test_02_body_limit_and_tokenising_off_the_event_loop(srv, client) -> None:
    # a 10 MB body is refused before it is buffered or parsed
    t0 = time.perf_counter()
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * 10_000_000 + b'"}',
                    headers={"Content-Type": "application/json"})
    err = _error(r, 413)
    assert err["code"] == "body_too_large" and time.perf_counter() - t0 < 10
    # the prompt-character limit (config) is checked before tokenising
    r = client.post("/v1/completions", json={"prompt": "a" * 1_300_000, "max_tokens": 4})
    assert _error(r)["param"] == "prompt" and "1200000" in r.json()["error"]["message"]
    # a long prompt inside the limits that cannot fit the context is refused before any tokenising
    # (issue 27 §2; prompts that are tokenised run on workers: tests/test_tokenize_queue.py)
    big = ("def f(x):\n    return x + 1\n" * 40_000)[:1_000_000]
    t_big = time.perf_counter()
    r = client.post("/v1/completions", json={"prompt": big})
    elapsed = time.perf_counter() - t_big
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "at least" in r.json()["error"]["message"] and elapsed < 2.0, elapsed
    text = client.get("/metrics").text
    assert _total(text, M.REQUESTS_REJECTED, reason="body_too_large") >= 1


def test_05_nan_shadow_alpha_never_promotes_a_worse_drafter(srv, client) -> None:
    from serving.drafter.client import Observed

    sw = drafter_view(srv)
    for i in range(20):  # half the records are held out (tiny_config), the only ones a shadow check reads
        _text(client, prompt=PROMPT + " " * i)
    wait_for(lambda: sw.heldout["records"] >= 4, 10, what="shadow records")
    # records logged at a temperature of 1e-45 (what an older server or any client could log)
    live = sw.live_version
    for rec in list(drafter_lane(srv).heldout)[-4:]:
        srv.state.drafter.observe(Observed(0, 0, live, dataclasses.replace(rec, temperature=1e-45)))
    reg = DrafterRegistry(srv.cfg.registry.dir)
    bad = publish_peft_adapter(reg, _lora(drafter_lane(srv).base, scale=2.0), version_manifest())
    wait_for(lambda: str(bad) in sw.info()["refused"], 30, what="the worse drafter refused")
    assert sw.live_version == live
    reason = sw.info()["refused"][str(bad)]
    assert "nan" not in reason.lower() and "shadow" in reason


def _records(srv) -> list:
    """Every feedback record the server finishes from now on (a subscriber of its final records, as the feedback
    log and the swapper are)."""
    seen: list = []
    srv.state.scheduler.finished.subscribe(lambda fin: seen.append(fin.feedback_record()) if fin.result else None)
    return seen


def test_06_tiny_temperature_is_served_greedy(srv, client) -> None:
    prompt = "import sys\n"
    seen = _records(srv)
    greedy = _text(client, prompt=prompt)
    assert _text(client, prompt=prompt, temperature=1e-45, seed=3) == greedy
    assert _text(client, prompt=prompt, temperature=5e-4) == greedy
    ids = srv.state.tokenizer.encode(prompt, add_special_tokens=True)
    recs = wait_for(lambda: (lambda rs: rs if len(rs) == 3 else None)(
        [r for r in seen if list(r.prompt_ids) == ids]), 10, what="the three records")
    assert [r.temperature for r in recs] == [0.0] * 3, "the feedback records say how they were served"


def test_07_metric_labels_are_bounded(srv, client) -> None:
    _text(client, metadata={"domain": "code"})
    for i in range(40):
        r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                 "metadata": {"domain": f"tenant-{i}"}})
        assert r.status_code == 200

    def domains() -> set[str]:
        text = client.get("/metrics").text
        return {line.split('domain="')[1].split('"')[0] for line in text.splitlines()
                if 'domain="' in line and not line.startswith("#")}

    # metrics are observed just after the response is sent: wait for the last one to land
    seen = wait_for(lambda: (lambda d: d if {"other", "code"} <= d else None)(domains()), 10,
                    what="the code and other series")
    assert seen <= set(srv.cfg.serve.domains) | {"other"}, seen


def test_08_feedback_dir_unwritable_then_writable(srv, client) -> None:
    fb = srv.state.feedback
    fb_dir = Path(srv.cfg.feedback.dir)
    assert fb.max_pending_bytes == srv.cfg.feedback.max_buffer_bytes
    def settled() -> int:  # records that reached a shard or were dropped (none left in the buffer)
        return fb.records_written + fb.dropped_records if fb.pending() == 0 else -1

    wait_for(lambda: settled() >= 0 and not fb.failing, 20, what="the buffer to drain")
    before = settled()
    seen = _records(srv)
    _text(client, max_tokens=8)  # the record is buffered just after the response: wait for it
    wait_for(lambda: settled() == before + 1, 20, what="the record to be written")
    size = record_nbytes(seen[-1])
    fb.max_pending_bytes = int(3.5 * size)  # room for 3 of the records below, so the 4th+ drop
    w0, d0, e0 = fb.records_written, fb.dropped_records, fb.flush_errors
    # root ignores chmod, so make the dir unwritable by putting a plain file in its place
    aside = fb_dir.with_name("feedback.aside")
    fb_dir.rename(aside)
    fb_dir.write_text("not a directory")
    n = 6
    try:
        for i in range(n):
            _text(client, prompt=PROMPT + "#" * i, max_tokens=8)  # serving continues
        h = wait_for(lambda: (lambda j: j if j["status"] == "degraded" else None)(srv.health()),
                     20, what="/health degraded")
        assert any("feedback writes failing" in r for r in h["reasons"]), h["reasons"]
        metrics = client.get("/metrics").text
        assert _total(metrics, M.FEEDBACK_FAILING) == 1 and _total(metrics, M.FEEDBACK_WRITE_ERRORS) > e0
    finally:
        fb_dir.unlink()
        aside.rename(fb_dir)
    wait_for(lambda: client.get("/health").json()["status"] == "ok", 20, what="/health ok again")
    wait_for(lambda: settled() - w0 - d0 >= n, 20, what="the buffered records to be written")
    written, dropped = fb.records_written - w0, fb.dropped_records - d0
    assert dropped > 0 and written + dropped == n, (written, dropped)
    reader = FeedbackReader(fb_dir)
    ids = reader.read(reader.list_shards()).column("request_id").to_pylist()
    assert len(ids) == len(set(ids)) == fb.records_written, "a record was lost or written twice"
    metrics = client.get("/metrics").text
    assert _total(metrics, M.FEEDBACK_DROPPED_RECORDS) == fb.dropped_records
    assert _total(metrics, M.FEEDBACK_FAILING) == 0
    fb.max_pending_bytes = srv.cfg.feedback.max_buffer_bytes


def test_09_target_update_refuses_nan_inf_and_partial_weights(srv, client, admin, allowed_dir) -> None:
    from safetensors.torch import save_file

    before = _text(client)
    sd = {k: v.detach().clone().contiguous() for k, v in engine_of(srv).target.state_dict().items()}
    name = next(k for k in sd if k.endswith("q_proj.weight"))
    for tag, bad in (("nan", float("nan")), ("inf", float("inf"))):
        broken = dict(sd)
        broken[name] = sd[name].clone()
        broken[name][0, 0] = bad
        save_file(broken, str(allowed_dir / f"{tag}.safetensors"))
    save_file({k: v for k, v in sd.items() if k != name}, str(allowed_dir / "partial.safetensors"))
    for tag in ("nan", "inf", "partial"):
        r = admin.post("/admin/target", json={"path": str(allowed_dir / f"{tag}.safetensors"), "version": 3})
        err = _error(r)
        assert err["param"] == "path" and ("non-finite" in err["message"] or "partial" in err["message"]), err
    assert client.get("/health").json()["target_version"] == 0
    assert _text(client) == before, "a refused update changed the target"


def test_11_deep_json_lone_surrogate_nul_path_are_400s(srv, client, admin) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    r = client.post("/v1/completions", content=deep, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    r = client.post("/v1/completions", content='{"prompt": "a\\ud800b", "max_tokens": 2}',
                    headers={"Content-Type": "application/json"})
    assert _error(r)["param"] == "prompt"
    r = client.post("/v1/chat/completions", content='{"messages": [{"role": "user", "content": "\\udfff"}]}',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["param"]
    r = admin.post("/admin/target", json={"path": "/tmp/a\u0000b"})
    assert _error(r)["param"] == "path"


def _wait_refused(sw, version: int, what: str) -> str:
    return wait_for(lambda: sw.info()["refused"].get(str(version)), 30, what=what)


def test_12_version_missing_at_first_is_retried(srv, client) -> None:
    sw = drafter_view(srv)
    for i in range(8):  # held-out records for the shadow check of the version below
        _text(client, prompt=PROMPT + "\t" * i)
    reg = DrafterRegistry(srv.cfg.registry.dir)
    nxt = max(reg.list_versions(), default=0) + 1
    (reg.dir / "LATEST").write_text(vname(nxt) + "\n")  # LATEST seen before its version dir
    assert "will retry" in _wait_refused(sw, nxt, "the missing version refused")
    v = publish_peft_adapter(reg, _lora(drafter_lane(srv).base), version_manifest())
    assert v == nxt
    wait_for(lambda: sw.live_version == v, 30, what="the version promoted once it exists")
    assert str(v) not in sw.info()["refused"]
    assert _total(client.get("/metrics").text, M.DRAFTER_REFUSALS, reason="missing") == 1


def test_13_registry_does_not_follow_a_symlinked_version(srv, client, tmp_path) -> None:
    sw = drafter_view(srv)
    reg = DrafterRegistry(srv.cfg.registry.dir)
    live = sw.live_version
    elsewhere = DrafterRegistry(tmp_path / "elsewhere")
    src = elsewhere.version_dir(publish_peft_adapter(elsewhere, _lora(drafter_lane(srv).base), version_manifest()))
    nxt = max(reg.list_versions()) + 1
    man = json.loads((src / "manifest.json").read_text())
    (src / "manifest.json").write_text(json.dumps({**man, "version": nxt}))
    os.symlink(src, reg.version_dir(nxt))
    (reg.dir / "LATEST").write_text(vname(nxt) + "\n")
    assert "outside the registry" in _wait_refused(sw, nxt, "the symlinked version refused")
    assert sw.live_version == live
    assert _total(client.get("/metrics").text, M.DRAFTER_REFUSALS, reason="symlink") == 1
    (reg.dir / "LATEST").write_text(vname(live) + "\n")


def test_14_full_drafter_config_checked_before_instantiation(srv, client) -> None:
    from safetensors.torch import save_file

    sw = drafter_view(srv)
    reg = DrafterRegistry(srv.cfg.registry.dir)
    live = sw.live_version
    sd = {k: v.detach().clone().contiguous() for k, v in drafter_lane(srv).base.state_dict().items()}
    path = srv.cfg.registry.dir + "/../full.safetensors"
    save_file(sd, path)
    base_cfg = drafter_lane(srv).base.config.to_dict()
    # the same tensors under another architecture (Mistral names its weights as Llama does)
    mistral = {**base_cfg, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    v1 = publish_files(reg, {"model.safetensors": path, "config.json": json.dumps(mistral).encode()}, version_manifest(format="full"))
    assert "model_type" in _wait_refused(sw, v1, "the other architecture refused")
    # a config that would take seconds and gigabytes to instantiate
    huge = {**base_cfg, "hidden_size": 8192, "num_hidden_layers": 80, "intermediate_size": 28672}
    t0 = time.perf_counter()
    v2 = publish_files(reg, {"model.safetensors": path, "config.json": json.dumps(huge).encode()}, version_manifest(format="full"))
    assert "hidden_size" in _wait_refused(sw, v2, "the huge config refused")
    assert time.perf_counter() - t0 < 10
    assert sw.live_version == live
    assert _total(client.get("/metrics").text, M.DRAFTER_REFUSALS, reason="architecture") == 2
    (reg.dir / "LATEST").write_text(vname(live) + "\n")


def test_15_unbounded_strings_are_refused(srv, client, admin) -> None:
    r = client.post("/v1/completions", json={"prompt": PROMPT, "stop": ["x" * 200_000]})
    assert _error(r)["param"] == "stop"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "stop": [f"s{i}" for i in range(17)]})
    assert _error(r)["param"] == "stop"
    r = admin.post("/admin/drafter/rollback", json={"reason": "r" * 100_000})
    assert _error(r)["param"] == "reason"


def test_16_api_key_compared_in_constant_time_and_params_named(srv, client, monkeypatch) -> None:
    import hmac

    import dvi.config_base  # where Secret compares

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(dvi.config_base.hmac, "compare_digest", spy)
    with srv.client(token=API_KEY[:-1] + "x") as wrong:
        assert wrong.post("/v1/completions", json={"prompt": PROMPT}).status_code == 401
    assert calls, "the API key must be compared with hmac.compare_digest"
    monkeypatch.undo()
    for raw, param in (('{"prompt": "x", "temperature": Infinity}', "temperature"),
                       ('{"prompt": "x", "temperature": NaN}', "temperature"),
                       ('{"prompt": "x", "seed": 1180591620717411303424}', "seed"),
                       ('{"prompt": "x", "top_p": NaN}', "top_p")):
        r = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
        assert _error(r)["param"] == param, (raw, r.text)
    assert repr(srv.cfg.serve.api_key) == "Secret('**********')" and srv.cfg.serve.api_key == API_KEY
    assert srv.state.scheduler.step_errors == 0


# -- the trainer server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_srv(tiny_pair_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("faults-trainer-run")
    cfg = tiny_config(tiny_pair_dir, run, "serve.trainer=supervised", f"serve.api_key={API_KEY}",
                      f"serve.admin_token={ADMIN}", "serve.trainer_stale_s=5", "serve.trainer_start_grace_s=90",
                      "serve.trainer_restart_backoff_s=1.0", "wandb.mode=offline", "feedback.shard_records=2",
                      "trainer.min_new_records=1", "trainer.poll_seconds=0.5", "trainer.batch_size=2",
                      "trainer.publish_every_steps=1000000", "models.device=cpu")
    with ServerThread(cfg) as s:
        yield s


def _status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "trainer" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_04_10_03_trainer_faults_and_secrets(trainer_srv, caplog) -> None:
    s = trainer_srv
    run = Path(s.cfg.run_dir)
    sup = s.state.supervisor
    pid = wait_for(lambda: sup.pid, 30, what="the trainer to start")
    wait_for(lambda: _status(run).get("pid") == pid, 90, what="the trainer's first heartbeat")
    # 4: a corrupt file named like a shard is quarantined and counted; the trainer keeps going
    fb = Path(s.cfg.feedback.dir)
    fb.mkdir(parents=True, exist_ok=True)
    corrupt = fb / f"shard-{time.time_ns():020d}-1-000001.parquet"
    corrupt.write_bytes(b"PAR1 this is not parquet" * 10)
    with s.client(token=API_KEY) as c:
        for i in range(4):
            assert c.post("/v1/completions", json={"prompt": PROMPT + " " * i, "max_tokens": 6}).status_code == 200
        wait_for(lambda: (fb / QUARANTINE_DIR / corrupt.name).exists(), 30, what="the corrupt shard quarantined")
        consumed = run / "trainer" / "consumed.jsonl"
        wait_for(lambda: consumed.exists() and consumed.read_text().strip(), 60, what="the real shards trained")
        assert sup.pid == pid and sup.restarts == 0, "the corrupt shard must not crash the trainer"
        text = wait_for(lambda: (lambda t: t if _total(t, M.TRAINER_QUARANTINED_SHARDS) == 1 else None)(
            c.get("/metrics").text), 10, what="the quarantine gauge")
        assert _total(text, M.TRAINER_HEARTBEAT_AGE) < s.cfg.serve.trainer_stale_s
        # 10: a SIGSTOPped trainer is detected within the staleness limit, killed, restarted, reported
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        seen, detected = set(), None
        while sup.pid in (None, pid):
            h = s.health()
            seen.add((h["status"], tuple(h["reasons"])))
            if detected is None and sup.stale_restarts:
                detected = time.monotonic() - t0
            assert time.monotonic() - t0 < 30, "the stopped trainer was not detected and restarted"
            time.sleep(0.05)
        stale = s.cfg.serve.trainer_stale_s
        assert detected is not None and stale - 1.0 <= detected < stale + 3.0, detected
        assert any(st == "degraded" and any("trainer" in r for r in rs) for st, rs in seen), seen
        h = s.health()
        assert h["trainer"]["stale_restarts"] == 1 and h["trainer"]["restarts"] >= 1
        assert _total(c.get("/metrics").text, M.TRAINER_STALE_RESTARTS) == 1
        assert any("no heartbeat" in rec.getMessage() for rec in caplog.records)
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)
        new = sup.pid
        wait_for(lambda: _status(run).get("pid") == new, 90, what="the restarted trainer's heartbeat")
    # 3: secrets never reach the trainer's config, the run files or wandb; the config is owner-only
    cfg_file = run / "trainer_config.yaml"
    assert stat.S_IMODE(cfg_file.stat().st_mode) == 0o600
    assert list(run.rglob("wandb/*")), "wandb (offline) wrote no run files"
    for p in run.rglob("*"):
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            assert API_KEY.encode() not in data and ADMIN.encode() not in data, f"a secret leaked into {p}"


def test_13_gc_removes_temp_symlinks_without_following_them(tmp_path) -> None:
    reg = DrafterRegistry(tmp_path / "reg")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("x")
    link = reg.dir / ".tmp-gc-v000001-1"
    os.symlink(outside, link)
    dangling = reg.dir / ".tmp-123-456"
    os.symlink(tmp_path / "gone", dangling)
    reg.gc()
    assert not link.is_symlink() and not dangling.is_symlink()
    assert (outside / "keep.txt").exists(), "gc followed a symlink"
    shutil.rmtree(outside)
