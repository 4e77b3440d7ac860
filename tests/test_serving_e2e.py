"""End-to-end: the registry loop (hot-swap while streaming, refusals, rollback) and trainer supervision.

Real server in a thread, real engine and tiny pair, real registry on disk, real HTTP; the trainer
test runs the real `dvi train --online` subprocess and SIGKILLs it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import threading
import time

import httpx
import pytest
import torch
from registry_doors import publish_files, publish_peft_adapter
from test_serving_helpers import (
    PROMPTS,
    TEST_ADMIN_TOKEN,
    ServerThread,
    drafter_lane,
    drafter_view,
    engine_of,
    lora_copy,
    sse_events,
    tiny_config,
    version_manifest,
    wait_for,
)

from dvi import metrics as M
from dvi.registry.store import DrafterRegistry

pytestmark = pytest.mark.slow



def _lora(drafter, scale: float = 0.0, seed: int = 0):
    return lora_copy(drafter, scale, seed, ("q_proj", "v_proj", "up_proj"))




def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _traffic(url: str, n: int, results: list, stream: bool = True, max_tokens: int = 16) -> None:
    with httpx.Client(base_url=url, timeout=120) as c:
        for i in range(n):
            prompt = PROMPTS[i % len(PROMPTS)]
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "stream": stream})
            if r.status_code != 200:
                results.append((prompt, r.status_code, r.text, None))
                continue
            if stream:
                ev = sse_events(r.text)
                ok = ev[-1] == "[DONE]" and "error" not in ev[-2]
                text = "".join(e["choices"][0]["text"] for e in ev[:-1] if "choices" in e)
                results.append((prompt, 200 if ok else 500, text, ev[-2].get("dvi", {}).get("drafter_version")))
            else:
                b = r.json()
                results.append((prompt, 200, b["choices"][0]["text"], b["dvi"]["drafter_version"]))


@pytest.mark.parametrize("engine_process", [False, True])
def test_hot_swap_while_streaming_and_refusals(tiny_pair_dir, tmp_path, engine_process) -> None:
    """A promoted version (a module with LoRA layers) reaches the engine, in this process or its own."""
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.rollback_window=2",  # v1's watch ends within `after`
                      f"serve.engine_process={str(engine_process).lower()}")
    started = time.monotonic()
    with ServerThread(cfg) as s:
        reg = DrafterRegistry(cfg.registry.dir)
        base = drafter_lane(s).base
        # greedy reference before any swap (an identity LoRA must not change a single token)
        ref: dict[str, str] = {}
        with s.client() as c:
            for p in PROMPTS:
                ref[p] = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16}).json()["choices"][0]["text"]

        results: list = []
        workers = [threading.Thread(target=_traffic, args=(s.url, 12, results)) for _ in range(3)]
        for w in workers:
            w.start()
        time.sleep(0.5)  # requests are streaming now
        v1 = publish_peft_adapter(reg, _lora(base), version_manifest())
        wait_for(lambda: drafter_view(s).live_version == v1, 30, what="v1 to be promoted")
        for w in workers:
            w.join(120)
        assert len(results) == 36
        assert all(code == 200 for _, code, _, _ in results), [r for r in results if r[1] != 200]
        assert all(text == ref[p] for p, _, text, _ in results), "a swap changed greedy output"
        # traffic sent after the promotion runs on v1 (the streams above may all finish before it)
        after: list = []
        _traffic(s.url, 2, after)
        assert [(code, text == ref[p], v) for p, code, text, v in after] == [(200, True, v1)] * 2, after
        with s.client() as c:
            h = s.health()
            assert h["drafter_version"] == v1 and h["drafter"]["counts"]["promoted"] == 1

            # a corrupted adapter (garbage bytes) is refused, counted, and the live drafter keeps serving
            cfg_json = (reg.version_dir(v1) / "adapter_config.json").read_bytes()
            v2 = publish_files(reg, {"adapter_model.safetensors": b"\x00garbage" * 64, "adapter_config.json": cfg_json},
                             version_manifest(format="lora"))
            wait_for(lambda: str(v2) in s.health()["drafter"]["refused"], 30, what="v2 refused")
            # a wrongly shaped one (LoRA made for another model) too
            other = copy.deepcopy(base)
            other.resize_token_embeddings(base.config.vocab_size + 8)
            v3 = publish_peft_adapter(reg, _lora(other), version_manifest())
            wait_for(lambda: str(v3) in s.health()["drafter"]["refused"], 30, what="v3 refused")
            # a valid but much worse drafter fails the shadow check
            v4 = publish_peft_adapter(reg, _lora(base, scale=2.0), version_manifest())
            h = wait_for(lambda: (lambda j: j if str(v4) in j["drafter"]["refused"] else None)(
                s.health()), 30, what="v4 refused by the shadow check")
            assert "shadow" in h["drafter"]["refused"][str(v4)]
            assert h["drafter_version"] == v1
            metrics = c.get("/metrics").text
            assert _counter(metrics, M.DRAFTER_REFUSALS + "{") == 3
            assert _counter(metrics, M.DRAFTER_PROMOTIONS + " ") == 1
            # the engine's busy time: what it stepped, in seconds no more than the server has run
            steps, busy = _counter(metrics, M.ENGINE_STEPS + " "), _counter(metrics, M.ENGINE_BUSY_SECONDS + " ")
            assert steps > 0 and 0 < busy < time.monotonic() - started
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16})
            assert r.status_code == 200 and r.json()["dvi"]["drafter_version"] == v1
            assert r.json()["choices"][0]["text"] == ref[PROMPTS[0]]
        events = [json.loads(line) for line in open(tmp_path / "swap_events.jsonl")]
        assert [e["kind"] for e in events if e["kind"] != "kept"] == ["promoted", "refused", "refused", "refused"]


@pytest.mark.parametrize("kind", ["separate", "early_exit"])
def test_live_alpha_drop_rolls_back(tiny_pair_dir, tmp_path, kind) -> None:
    # shadow margin 1.0 lets a bad drafter through, so the live check must catch it
    extra = ["models.drafter_kind=early_exit", "models.drafter=null", "trainer.lora_rank=4"] if kind == "early_exit" else []
    cfg = tiny_config(tiny_pair_dir, tmp_path, "trainer.shadow_margin=1.0", "serve.rollback_window=6",
                      "serve.rollback_margin=0.05", *extra)
    with ServerThread(cfg) as s:
        reg = DrafterRegistry(cfg.registry.dir)
        results: list = []
        _traffic(s.url, 8, results, stream=False)
        for _ in range(40):  # the shadow check's evidence first: without it the version would wait for traffic
            if drafter_view(s).heldout_positions >= cfg.trainer.shadow_min_positions:  # that comes only after it
                break
            _traffic(s.url, 2, results, stream=False)
        if kind == "early_exit":
            bad = _publish_dir(reg, _early_exit_version(drafter_lane(s).base, tmp_path / "bad", scale=3.0)[0])
        else:
            bad = publish_peft_adapter(reg, _lora(drafter_lane(s).base, scale=2.0, seed=1), version_manifest())
        wait_for(lambda: drafter_view(s).live_version == bad, 30, what="the bad version to be promoted")
        _traffic(s.url, 10, results, stream=False)
        wait_for(lambda: drafter_view(s).counts["rolled_back"] == 1, 30, what="the rollback")
        assert drafter_view(s).live_version == 0
        assert all(code == 200 for _, code, _, _ in results)
        with s.client() as c:
            h = s.health()
            assert h["drafter_version"] == 0 and str(bad) in h["drafter"]["refused"]
            assert _counter(c.get("/metrics").text, M.DRAFTER_ROLLBACKS + " ") == 1
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8})
            assert r.json()["dvi"]["drafter_version"] == 0
        time.sleep(3 * cfg.serve.registry_poll_seconds)
        assert drafter_view(s).live_version == 0, "a rolled-back version must not be re-promoted"


def test_admin_rollback_and_pin(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.admin_token=tok", "serve.rollback_window=2")
    with ServerThread(cfg) as s, s.client(token="tok") as admin:
        reg = DrafterRegistry(cfg.registry.dir)
        sw = drafter_view(s)
        while sw.heldout_positions < cfg.trainer.shadow_min_positions:  # held-out records for the shadow checks
            _traffic(s.url, 2, [], stream=False)
        v1 = publish_peft_adapter(reg, _lora(drafter_lane(s).base), version_manifest())
        wait_for(lambda: sw.live_version == v1, 30, what="v1")
        _traffic(s.url, 3, [], stream=False)  # v1's watch (2 requests) ends: v1 is the last good version
        wait_for(lambda: sw.good == v1, 30, what="v1 kept")
        v2 = publish_peft_adapter(reg, _lora(drafter_lane(s).base), version_manifest())
        wait_for(lambda: sw.live_version == v2, 30, what="v2")
        _traffic(s.url, 3, [], stream=False)
        wait_for(lambda: sw.good == v2, 30, what="v2 kept")
        r = admin.post("/admin/drafter/rollback", json={"reason": "test"})
        assert r.status_code == 200 and r.json()["drafter_version"] == v1
        assert reg.latest() == v2 and v2 in reg.refusals(), "a rollback refuses; LATEST stays the trainer's"
        r = admin.post("/admin/drafter/pin", json={"version": v2})
        assert r.status_code == 200 and drafter_view(s).live_version == v2
        v3 = publish_peft_adapter(reg, _lora(drafter_lane(s).base), version_manifest())
        time.sleep(4 * cfg.serve.registry_poll_seconds)
        assert drafter_view(s).live_version == v2, "a pinned server must not auto-promote"
        assert admin.post("/admin/drafter/pin", json={"version": None}).status_code == 200
        wait_for(lambda: drafter_view(s).live_version == v3, 30, what="v3 after unpin")


def test_trainer_sigkill_is_restarted_without_failing_requests(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.trainer=supervised", "serve.trainer_restart_backoff_s=0.2",
                      "serve.admin_token=tok")
    with ServerThread(cfg) as s:
        sup = s.state.supervisor
        pid = wait_for(lambda: sup.pid, 30, what="the trainer to start")
        assert (tmp_path / "trainer_config.yaml").is_file()

        async def load(url: str) -> list[int]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                codes = []
                for _ in range(6):
                    rs = await asyncio.gather(*(c.post("/v1/completions", json={"prompt": p, "max_tokens": 12})
                                                for p in PROMPTS))
                    codes += [r.status_code for r in rs]
                return codes

        box: list = []
        t = threading.Thread(target=lambda: box.append(asyncio.run(load(s.url))))
        t.start()
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: sup.restarts >= 1 and sup.pid not in (None, pid), 30, what="the trainer restart")
        t.join(120)
        assert box and box[0] == [200] * len(box[0])
        with s.client() as c:
            h = s.health()
            assert h["trainer"]["restarts"] >= 1 and h["trainer"]["state"] == "running"
            text = c.get("/metrics").text
            assert f'{M.TRAINER_STATE} {float(M.TRAINER_STATES["running"])}' in text
            restarts = [ln for ln in text.splitlines() if ln.startswith(M.TRAINER_RESTARTS + " ")]
            assert restarts and float(restarts[0].split()[1]) >= 1, restarts
        with s.client(token="tok") as admin:
            r = admin.post("/admin/trainer/pause")
            assert r.status_code == 200 and r.json()["state"] == "paused"
            assert (tmp_path / "trainer.pause").exists()
            r = admin.post("/admin/trainer/resume")
            assert r.status_code == 200 and r.json()["state"] == "running"
        child = sup.pid
    # server stopped: no orphan trainer
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_dvi_serve_process_serves_and_stops_cleanly(tiny_pair_dir, tmp_path) -> None:
    """`dvi serve` as its own process (port 0 on loopback), with its trainer and its engine's process (the default);
    SIGTERM stops all three."""
    import yaml

    from dvi.config import dump_config
    from serving.server_process import ServerProcess

    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.trainer=supervised", "serve.engine_process=true")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    with ServerProcess(["--config", str(path), f"serve.admin_token={TEST_ADMIN_TOKEN}"],
                       tmp_path / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}) as c:
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 8})
            assert r.status_code == 200, r.text
            trainer_pid = wait_for(lambda: c.get("/health").json()["trainer"]["pid"], 30, what="trainer pid")
            engine_pid = c.get("/health").json()["engine"]["pid"]
            assert engine_pid != srv.proc.pid
        proc = srv.proc
    log = (tmp_path / "server.log").read_text()
    # a drained stop is a clean exit (uvicorn alone re-raised the signal: -SIGTERM)
    assert proc.returncode == 0, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    assert "start-up objects frozen out of garbage collection" in log, log[-2000:]  # `dvi.memory.freeze_long_lived`
    for pid in (trainer_pid, engine_pid):
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(pid, 0)
                time.sleep(0.1)


# -- early-exit drafter ------------------------------------------------------------------------------
def _early_exit_version(live, out_dir, scale: float = 0.0, seed: int = 0):
    """A publishable early-exit version dir: the live drafter's LoRA + exit head, perturbed by `scale`."""
    from dvi.drafters.learned import EarlyExitDrafter

    d = EarlyExitDrafter(copy.deepcopy(live.target_ref), live.num_layers, lora_rank=live.lora_rank,
                         lora_alpha=live.lora_alpha, target_modules=live.target_modules, exit_rank=live.exit_rank)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return d.save(out_dir), d.trainable_state_dict()


def _publish_dir(reg, path, drafter_kind: str = "early_exit", **manifest) -> int:
    return publish_files(reg, {f.name: f for f in path.iterdir()}, version_manifest(format="lora", drafter_kind=drafter_kind,
                                                                       **manifest))


def _hf_greedy(model, tok, prompt: str, n: int) -> str:
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=True)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _saved_new_target(target, out_dir):
    """New target weights for an admin update: a copy of `target` with noise of half each tensor's mean
    magnitude (its greedy output differs), saved at `out_dir`."""
    new = copy.deepcopy(target)
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for prm in new.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.5 * prm.abs().mean())
    new.save_pretrained(out_dir)
    return new


def test_early_exit_drafter_served_swapped_and_rebuilt_on_target_update(tiny_pair_dir, tmp_path) -> None:
    """`dvi serve` with models.drafter_kind=early_exit: lossless, a published version promoted, bad ones refused,
    and after an admin target update the drafter reads the new weights and output equals the new target's."""
    from dvi.drafters.learned import EarlyExitDrafter
    from dvi.models.loading import load_causal_lm, load_tokenizer

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=early_exit", "models.drafter=null",
                      "models.early_exit_layers=1", "trainer.lora_rank=4", "serve.admin_token=tok",
                      f"serve.allowed_dirs=[{allowed}]", "trainer.shadow_margin=0.05",
                      "serve.rollback_window=4")  # v1's watch ends within the 4 requests after its promotion
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    target = load_causal_lm(tiny_pair_dir / "target", "cpu")
    ref = {p: _hf_greedy(target, tok, p, 16) for p in PROMPTS}
    with ServerThread(cfg) as s, s.client() as c, s.client(token="tok") as admin:
        live = engine_of(s).drafter
        assert isinstance(live, EarlyExitDrafter) and drafter_lane(s).base is live
        assert live.target_ref is engine_of(s).target  # no second target in memory

        def served(prompt: str) -> tuple[str, int]:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["dvi"]["drafter_version"]

        for p in PROMPTS:
            assert served(p) == (ref[p], 0)
        h = s.health()
        assert h["drafter_kind"] == "early_exit" and h["draft_vocab_size"] is None
        reg = DrafterRegistry(cfg.registry.dir)
        while drafter_view(s).heldout_positions < cfg.trainer.shadow_min_positions:  # for the shadow check
            _traffic(s.url, 2, [], stream=False)
        # a trained-looking version (small perturbation) is validated, shadow-checked and promoted
        vdir, sd = _early_exit_version(live, tmp_path / "ee-v1", scale=1e-3, seed=1)
        v1 = _publish_dir(reg, vdir)
        wait_for(lambda: drafter_view(s).live_version == v1, 30, what="the early-exit version to be promoted")
        now = engine_of(s).drafter
        assert isinstance(now, EarlyExitDrafter) and now.target_ref is engine_of(s).target
        for k, v in now.trainable_state_dict().items():
            torch.testing.assert_close(v, sd[k])
        for p in PROMPTS:
            assert served(p) == (ref[p], v1)
        # a separate drafter's LoRA is not an early-exit version; a garbage one fails the shadow check
        v2 = publish_peft_adapter(reg, _lora(load_causal_lm(tiny_pair_dir / "drafter", "cpu")), version_manifest())
        wait_for(lambda: v2 in drafter_view(s).refused, 30, what="the separate LoRA to be refused")
        vdir3, _ = _early_exit_version(live, tmp_path / "ee-v3", scale=3.0, seed=3)
        v3 = _publish_dir(reg, vdir3)
        wait_for(lambda: str(v3) in s.health()["drafter"]["refused"], 30, what="v3 refused")
        assert "shadow" in drafter_view(s).refused[v3] and drafter_view(s).live_version == v1
        # new target weights through the admin API: the drafter shares them, output follows the new target
        new = _saved_new_target(target, allowed / "t2")
        r = admin.post("/admin/target", json={"path": str(allowed / "t2")})
        assert r.status_code == 200, r.text
        layer = engine_of(s).drafter.shallow.model.layers[0].mlp.down_proj
        w = getattr(layer, "base_layer", layer).weight
        assert torch.equal(w, new.model.layers[0].mlp.down_proj.weight)
        new_ref = {p: _hf_greedy(new, tok, p, 16) for p in PROMPTS}
        assert new_ref != ref
        for p in PROMPTS:
            assert served(p) == (new_ref[p], v1)


def test_reduced_vocab_drafter_served_and_lora_promoted(tiny_pair_dir, tmp_path) -> None:
    """A drafter dir with draft_vocab.safetensors is served reduced (N from the config), losslessly, and a
    published LoRA for it keeps the same subset."""
    import shutil

    from dvi.drafters.vocab import find_subset_head, frequent_token_ids, save_draft_vocab

    d = tmp_path / "drafter"
    shutil.copytree(tiny_pair_dir / "drafter", d)
    save_draft_vocab(d, frequent_token_ids([[1, 2, 3]], 512, vocab_size=512), vocab_size=512)
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"models.drafter={d}", "models.draft_vocab_size=64")
    with ServerThread(cfg) as s, s.client() as c:
        ref = {}
        for p in PROMPTS:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16})
            ref[p] = r.json()["choices"][0]["text"]
        base = _target_greedy_fn(tiny_pair_dir)
        assert ref == {p: base(p, 16) for p in PROMPTS}
        assert s.health()["draft_vocab_size"] == 64
        reg = DrafterRegistry(cfg.registry.dir)
        # records are held out by a hash of their random request ids: the four above may hold too few positions
        while drafter_view(s).heldout_positions < cfg.trainer.shadow_min_positions:  # for the shadow check
            _traffic(s.url, 2, [], stream=False)
        v1 = publish_peft_adapter(reg, _lora(drafter_lane(s).base), version_manifest(draft_vocab_size=64))
        wait_for(lambda: drafter_view(s).live_version == v1, 30, what="the LoRA version to be promoted")
        assert find_subset_head(engine_of(s).drafter.model).num_ids == 64
        for p in PROMPTS:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16}).json()
            assert (r["choices"][0]["text"], r["dvi"]["drafter_version"]) == (ref[p], v1)
        v2 = publish_peft_adapter(reg, _lora(drafter_lane(s).base), version_manifest(draft_vocab_size=None))
        wait_for(lambda: v2 in drafter_view(s).refused, 30, what="a full-vocab version to be refused")
        assert "draft vocabulary" in drafter_view(s).refused[v2]


def _target_greedy_fn(pair_dir):
    """Greedy text of the target alone (HF generate), stopping at EOS, as the server decodes it."""
    from dvi.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(pair_dir / "tokenizer")
    target = load_causal_lm(pair_dir / "target", "cpu")
    return lambda prompt, n: _hf_greedy(target, tok, prompt, n)


# -- eagle head -------------------------------------------------------------------------------------------
def _eagle_version(live, out_dir, scale: float, seed: int):
    """A publishable eagle version dir: the live head's weights perturbed by `scale` (relative)."""
    from dvi.drafters.eagle import EagleDrafter

    d = EagleDrafter(live.target_ref)
    d.load_trainable_state_dict(live.trainable_state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean().clamp_min(0.05))
    return d.save(out_dir)


def test_eagle_head_served_logs_features_swapped_and_follows_a_target_update(tiny_pair_dir, tmp_path) -> None:
    """`dvi serve` with models.drafter_kind=eagle: lossless, feedback shards carry the target's features,
    a published version is shadow-checked on them and promoted, a garbage one refused, and after an admin
    target update the features (and output) are the new target's."""
    from dvi.drafters.eagle import EagleDrafter
    from dvi.feedback import FeedbackReader
    from dvi.models.loading import load_causal_lm, load_tokenizer

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    cfg = tiny_config(tiny_pair_dir, tmp_path, "models.drafter_kind=eagle", "models.drafter=null",
                      "serve.admin_token=tok", f"serve.allowed_dirs=[{allowed}]", "trainer.shadow_margin=0.05",
                      "serve.rollback_window=4")  # v1's watch ends within the 4 requests after its promotion
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    target = load_causal_lm(tiny_pair_dir / "target", "cpu")
    ref = {p: _hf_greedy(target, tok, p, 16) for p in PROMPTS}
    with ServerThread(cfg) as s, s.client() as c, s.client(token="tok") as admin:
        live = engine_of(s).drafter
        assert isinstance(live, EagleDrafter) and live.target_ref is engine_of(s).target

        def served(prompt: str) -> tuple[str, int]:
            r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["dvi"]["drafter_version"]

        for _ in range(3):
            for p in PROMPTS:
                assert served(p) == (ref[p], 0)
        assert s.health()["drafter_kind"] == "eagle"
        s.state.feedback.flush()
        reader = FeedbackReader(cfg.feedback.dir)
        recs = list(reader.iter_records(reader.poll()))
        assert recs and all(r.hidden_dim == target.config.hidden_size and r.features() is not None for r in recs)
        reg = DrafterRegistry(cfg.registry.dir)
        v1 = _publish_dir(reg, _eagle_version(live, tmp_path / "e1", 1e-3, 1), drafter_kind="eagle")
        wait_for(lambda: drafter_view(s).live_version == v1, 30, what="the eagle version to be promoted")
        promoted = [e for e in drafter_view(s).events if e.event == "promoted" and e.version == v1]
        assert promoted and "shadow α" in promoted[0].reason  # checked on the logged features, not skipped
        for p in PROMPTS:
            assert served(p) == (ref[p], v1)
        v2 = _publish_dir(reg, _eagle_version(live, tmp_path / "e2", 3.0, 2), drafter_kind="eagle")
        wait_for(lambda: v2 in drafter_view(s).refused, 30, what="the garbage eagle version to be refused")
        assert "shadow" in drafter_view(s).refused[v2] and drafter_view(s).live_version == v1
        new = _saved_new_target(target, allowed / "t2")
        assert admin.post("/admin/target", json={"path": str(allowed / "t2")}).status_code == 200
        new_ref = {p: _hf_greedy(new, tok, p, 16) for p in PROMPTS}
        assert new_ref != ref
        for p in PROMPTS:
            assert served(p) == (new_ref[p], v1)


@pytest.mark.parametrize("budget", [0, 1, None])
def test_every_prefill_budget_starts_dvi_serve_and_answers_alike(tiny_pair_dir, tmp_path, budget):
    """`serve.max_prefill_tokens` (0: no limit; 1: one request joins a step; null, the default: the device's):
    concurrent requests all answered, each with the greedy text a lone request gets; a negative budget is refused
    naming the field."""
    from concurrent.futures import ThreadPoolExecutor

    from dvi.config import ConfigError

    with pytest.raises(ConfigError, match="serve.max_prefill_tokens"):
        tiny_config(tiny_pair_dir, tmp_path, "serve.max_prefill_tokens=-1")
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"serve.max_prefill_tokens={'null' if budget is None else budget}")
    assert cfg.serve.max_prefill_tokens == budget
    body = [{"prompt": p, "max_tokens": 12, "temperature": 0} for p in PROMPTS]
    with ServerThread(cfg) as s, s.client() as c:
        alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in body]
        with ThreadPoolExecutor(len(body)) as pool:
            rs = list(pool.map(lambda b: c.post("/v1/completions", json=b), body))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert [r.json()["choices"][0]["text"] for r in rs] == alone
    from test_serving_helpers import engine_of

    from serving.engine_build import PREFILL_TOKENS

    assert engine_of(s).max_prefill_tokens == (PREFILL_TOKENS["cpu"] if budget is None else budget)  # a CPU here


def test_a_requests_choices_join_in_one_step_under_the_prefill_budget(tiny_pair_dir, tmp_path, monkeypatch):
    """An `n` = 3 request through `dvi serve` with a budget of one token a step: its three rows join the batch in the
    same step (its answer waits for its last row), and each is the greedy text."""
    import dvi.engine.speculative as speculative

    shares = []

    def recorded(prompts, budget):
        take = real(prompts, budget)
        shares.append(([c for _, c in prompts], take))
        return take

    real = speculative.prefill_share
    monkeypatch.setattr(speculative, "prefill_share", recorded)
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.max_prefill_tokens=1")
    with ServerThread(cfg) as s, s.client() as c:
        alone = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).json()
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "n": 3})
    assert r.status_code == 200, r.text
    assert [ch["text"] for ch in r.json()["choices"]] == [alone["choices"][0]["text"]] * 3
    cohorts = [(cs, take) for cs, take in shares if cs and cs[0]]
    assert cohorts and cohorts[0][1] == 3 and len(set(cohorts[0][0])) == 1, shares
