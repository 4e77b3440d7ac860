"""dvi in front of a real vLLM (`serve.engine: vllm`, issue 41): vLLM's CPU build in its own venv (`make vllm-venv`)
serving the real embedded pair, started and supervised by dvi; the same API, feedback log, registry and swapper.

One vLLM server for the module (about a minute to start on a 2-core CPU). Where the venv could not be built, the
tests skip with the reason `scripts/install_vllm.sh` wrote; in CI a venv missing without a reason fails.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from registry_doors import publish_peft_adapter

from dvi.config import ConfigError, load_config
from serving.server_process import ServerProcess
from serving.vllm_engine import step_feedback
from serving.vllm_process import REPO_ROOT
from tests.test_serving_helpers import (
    ServerThread,
    drafter_lane,
    engine_of,
    lora_copy,
    version_manifest,
    wait_for,
)

PROMPTS = ["def merge_sorted(a, b):\n", "SELECT customer_id, SUM(amount) FROM payments", "The lighthouse keeper",
           "Explain recursion to a child:"]


def test_step_feedback_rebuilds_each_tokens_acceptance_from_vllms_step_counts():
    # prefill token, then steps (accepted, drafted): (0, 3) (3, 3) (1, 3), then a step cut by max_tokens
    tokens = list(range(100, 110))
    fb = step_feedback([0, 3, 1, 2], [3, 3, 3, 3], tokens, k=3)
    assert fb["accepted"] == [False, False, True, True, True, False, True, False, True, True]
    assert fb["drafted_ids"] == [-1, -1, 102, 103, 104, -1, 106, -1, 108, 109]
    assert (fb["num_steps"], fb["num_drafted"], fb["num_accepted"]) == (4, 12, 6)
    assert fb["drafted_per_position"] == [4, 4, 4] and fb["accepted_per_position"] == [3, 2, 1]
    none = step_feedback([], [], tokens[:3], k=3)  # no counts (an aborted stream): nothing drafted
    assert none["accepted"] == [False] * 3 and none["num_drafted"] == 0


def test_vllm_engine_refuses_drafters_it_cannot_serve_naming_the_keys():
    with pytest.raises(ConfigError, match="models.drafter_kind 'suffix'"):
        load_config(None, ["serve.engine=vllm", "models.drafter_kind=suffix"])
    with pytest.raises(ConfigError, match="trainer.adapter_key 'domain'"):
        load_config(None, ["serve.engine=vllm", "trainer.adapter_key=domain"])


def test_vllm_cpu_refuses_the_dtypes_that_answer_wrong_text():
    from serving.vllm_process import VllmProcess, VllmUnavailable

    if torch.cuda.is_available():
        pytest.skip("CUDA: bf16 is vLLM's own")
    assert VllmProcess.resolve_dtype("auto") == "float32" == VllmProcess.resolve_dtype("float32")
    for dtype in ("bfloat16", "float16"):
        with pytest.raises(VllmUnavailable, match=f"serve.vllm.dtype '{dtype}'"):
            VllmProcess.resolve_dtype(dtype)


def test_vllm_serves_the_checkpoints_float32_weights_in_strict_math_on_a_bf16_native_cpu(tmp_path, monkeypatch):
    """Issue 60, on the forced paths a bf16-native CPU (AVX512-BF16, Intel AMX) takes, whatever CPU runs this:
    `models.dtype auto` loads the real pair in bf16 there, which vLLM served in float32 from bf16-rounded weights
    (greedy tokens changed against the checkpoint's); behind vLLM the pair is loaded in vLLM's dtype. And an
    inherited ONEDNN_DEFAULT_FPMATH_MODE=BF16 (which lets oneDNN multiply float32 in bf16 on AMX) is overridden."""
    import sys

    import dvi.models.loading as loading
    from serving.loading import load_serving_pair
    from serving.vllm_process import FP32_EXACT_ENV, VllmProcess

    if torch.cuda.is_available():
        pytest.skip("CUDA: vLLM serves bf16 there")
    monkeypatch.setenv("DVI_CPU_BF16", "1")
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    asked = []
    monkeypatch.setattr(loading, "load_pair", lambda *a, dtype, **k: asked.append(dtype) or SimpleNamespace(
        target=None, drafter=None))
    monkeypatch.setattr("dvi.decode.numerics.set_exact_greedy", lambda *a: None)
    for engine, want in (("dvi", "bfloat16"), ("vllm", "float32")):
        load_serving_pair(load_config(None, ["models.preset=smollm2", f"serve.engine={engine}"]))
        assert asked[-1] == want, engine
    vcfg = load_config(None, ["serve.engine=vllm", f"serve.vllm.python={sys.executable}"]).serve.vllm
    p = VllmProcess(vcfg, tmp_path, tmp_path, "dvi", 3, 0, tmp_path / "log")
    env = p.env()
    assert p.dtype == "float32" and {k: env[k] for k in FP32_EXACT_ENV} == FP32_EXACT_ENV
    assert env["ONEDNN_DEFAULT_FPMATH_MODE"] == "STRICT"
    assert "--speculative-config" in p.argv() and int(p.argv()[p.argv().index("--max-logprobs") + 1]) >= 5
    plain = VllmProcess(vcfg, tmp_path, tmp_path, "dvi", 0, 0, tmp_path / "log").argv()
    assert "--speculative-config" not in plain and "--per-request-spec-decode-metrics" not in plain


def test_a_swap_loads_and_rewrites_only_the_decoder_layers_that_changed(tmp_path, monkeypatch):
    import json

    import serving.vllm_drafter as vd
    from dvi.registry.base import AdapterRejected
    from serving.vllm_drafter import INDEX_FILE, ServedDrafter
    from tests.tiny_models import tiny_llama

    model = tiny_llama(num_hidden_layers=2)
    served = ServedDrafter.of_model(tmp_path, model)
    served.write_all()
    index = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"]
    assert set(index) == set(model.state_dict()) and set(index.values()) == {
        "drafter-rest.safetensors", "drafter-layer-0.safetensors", "drafter-layer-1.safetensors"}
    assert served.diff(model.state_dict(), 1) == {}  # an identity version loads nothing
    new = {k: v.clone() for k, v in model.state_dict().items()}
    new["model.layers.1.self_attn.q_proj.weight"] += 0.5
    changed = served.diff(new, 2)
    assert set(changed) == {k for k in new if k.startswith("model.layers.1.")}  # the whole layer, nothing else
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.safetensors")}
    time.sleep(0.01)
    served.commit(changed)
    after = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.safetensors")}
    assert [n for n in after if after[n] != before[n]] == ["drafter-layer-1.safetensors"]
    assert served.diff(new, 3) == {}  # what was committed is what is served
    # the served version's own tensors are not compared byte by byte again; one written in place since is
    shared, compared, same = dict(new), [], vd._same
    monkeypatch.setattr(vd, "_same", lambda a, b: compared.append(a) or same(a, b))
    assert served.diff(shared, 5) == {} and not compared
    with torch.no_grad():
        shared["model.norm.weight"].mul_(2.0)
    assert set(served.diff(shared, 6)) == {k for k in new if vd.shard_of(k) == "rest"} and len(compared) == 1
    for bad, why in (({**new, "model.norm.weight": torch.full_like(new["model.norm.weight"], float("inf"))},
                      "non-finite"),
                     ({**new, "model.norm.weight": torch.ones(3)}, "has shape"),
                     ({k: v for k, v in new.items() if k != "model.norm.weight"}, "missing")):
        with pytest.raises(AdapterRejected, match=why):
            served.diff(bad, 4)


def _vllm_or_skip() -> None:
    venv = REPO_ROOT / ".venv-vllm"
    if (venv / ".dvi-installed").is_file():
        return
    reason = Path(str(venv) + ".unavailable")
    if reason.is_file():
        pytest.skip(reason.read_text().strip())
    if os.environ.get("CI"):
        pytest.fail("CI runs `make test`, which builds vLLM's venv first (`make vllm-venv`)")
    pytest.skip("vLLM's venv is not built (make vllm-venv)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from dvi.models.embedded import embedded_paths, is_built

    _vllm_or_skip()
    paths = embedded_paths("smollm2")
    if not is_built(paths.root, "smollm2"):
        pytest.skip("the smollm2 pair is not installed (make pair)")
    run = tmp_path_factory.mktemp("vllm")
    cfg = load_config(None, [
        "models.preset=smollm2", f"run_dir={run}", f"feedback.dir={run / 'feedback'}", f"registry.dir={run / 'registry'}",
        "feedback.flush_seconds=0.2", "serve.trainer='off'", "serve.registry_poll_seconds=0.2", "wandb.mode=disabled",
        "serve.engine=vllm", "speculation.num_draft_tokens=3", "serve.admin_token=adm", "feedback.top_k=8",
        "serve.vllm.max_model_len=1024", "serve.replica=a", "trainer.shadow_margin=1.0",
        "trainer.shadow_min_positions=16", "trainer.heldout_fraction=0.5"])
    # replica b (a `dvi serve` process with its own vLLM, sharing the feedback log and the registry) starts beside
    # replica a: the two vLLM starts overlap, each on its own core
    # both replicas act as a bf16-native CPU (AVX512-BF16, Intel AMX: the pair's `auto` dtype there is bf16) whatever
    # CPU runs this, and replica b inherits a bf16 oneDNN math mode, which dvi overrides for vLLM (issue 60)
    forced = {"DVI_CPU_BF16": os.environ.get("DVI_CPU_BF16")}
    os.environ["DVI_CPU_BF16"] = "1"
    b = ServerProcess(["--config", str(_replica_config(cfg, run / "replica-b")), "serve.admin_token=adm"],
                      run / "replica-b.log",
                      env={"VLLM_CPU_OMP_THREADS_BIND": "1",  # replica a's vLLM holds core 0
                           "ONEDNN_DEFAULT_FPMATH_MODE": "BF16"})
    b_start = concurrent.futures.ThreadPoolExecutor(1).submit(b.__enter__)
    try:
        with ServerThread(cfg, start_timeout_s=600) as s:
            s.replica_b = b_start
            yield s
    finally:
        concurrent.futures.wait([b_start], timeout=600)
        b.__exit__()
        for key, value in forced.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)


def _replica_config(cfg, run_dir: Path) -> Path:
    """Replica b's config: replica a's, with its own name and run dir (the feedback log and registry shared)."""
    import yaml

    from dvi.config import dump_config

    data = dump_config(cfg)
    data["run_dir"] = str(run_dir)
    data["serve"]["replica"] = "b"
    path = run_dir.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def _complete(s, prompt: str, n: int = 24, **body) -> dict:
    with s.client() as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _records(s) -> list:
    from dvi.feedback.reader import FeedbackReader

    s.state.feedback.flush()
    reader = FeedbackReader(s.cfg.feedback.dir)
    return reader.read_records(reader.list_shards(), unread=False)


def _alpha(s, prompts=PROMPTS[:2]) -> float:
    a = d = 0
    for p in prompts:
        info = _complete(s, p, 16)["dvi"]
        a, d = a + info["accepted"], d + info["drafted"]
    return a / d


@pytest.mark.slow
def test_greedy_through_vllm_is_the_targets_own_text_and_every_request_is_logged_once(served):
    from dvi.decode.target import plain_greedy
    from dvi.models.loading import load_pair_from_config
    from serving.vllm_process import VllmProcess

    assert engine_of(served).greedy_contract["engine"] == "vllm"
    # the reference: the target's own greedy text, in dvi, in the dtype vLLM serves (float32 on a CPU, where dvi's own
    # `auto` is bfloat16 on a bf16-native CPU: the two dtypes part at near-ties, Intel AMX)
    dtype = VllmProcess.resolve_dtype(served.cfg.serve.vllm.dtype)
    pair = load_pair_from_config(served.cfg.models.model_copy(update={"dtype": dtype}))
    tok = served.state.tokenizer
    ids = []
    for p in PROMPTS:
        out = _complete(served, p)
        prompt_ids = tok(p, add_special_tokens=False)["input_ids"]
        with torch.inference_mode():
            want, _ = plain_greedy(pair.target, prompt_ids, 24)
        assert out["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True), p
        assert out["dvi"]["drafted"] > 0 and out["dvi"]["steps"] > 0
        ids.append(out["dvi"]["request_id"])
    with served.client() as c:  # n choices: each a request of its own to vLLM, each logged
        two = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                                              "n": 2}).json()
    assert [ch["text"] for ch in two["choices"]] == [_complete(served, PROMPTS[0])["choices"][0]["text"]] * 2
    ids += two["dvi"]["request_ids"]
    prompt_ids = tok(PROMPTS[1], add_special_tokens=False)["input_ids"]
    with torch.inference_mode():  # the end-of-sequence ids are dvi's to apply: ignore_eos runs to the limit
        want, _ = plain_greedy(pair.target, prompt_ids, 40)
    out = _complete(served, PROMPTS[1], 40, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 40 and out["choices"][0]["finish_reason"] == "length"
    assert out["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    cut = want[: want.index(want[3]) + 1]
    out = _complete(served, PROMPTS[1], 40, ignore_eos=True, stop_token_ids=[want[3]])
    assert out["usage"]["completion_tokens"] == len(cut) and out["choices"][0]["finish_reason"] == "stop"
    with served.client() as c:  # a streamed chat answer arrives as deltas and is logged like the rest
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Name three rivers."}],
                                                 "max_tokens": 16, "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    recs = wait_for(lambda: [r for r in _records(served) if r.request_id in ids] if len(
        [r for r in _records(served) if r.request_id in ids]) == len(ids) else None, 30, what="the records")
    for rec in recs:
        assert len(rec.token_ids) == 24 and len(rec.topk_ids) == 24 and len(rec.topk_ids[0]) == 8
        assert all(rec.token_ids[j] in rec.topk_ids[j] for j in range(24))  # the target's own top-k, its token in it
        assert all(t == d for t, d, a in zip(rec.token_ids, rec.drafted_ids, rec.accepted, strict=True) if a)
        assert rec.temperature == 0 and rec.topk_logprobs[0] == sorted(rec.topk_logprobs[0], reverse=True)


@pytest.mark.slow
def test_greedy_through_vllm_is_the_float32_checkpoints_and_speculation_on_equals_vllms_own_off(served, tmp_path):
    """Issue 60 (the fixture acts as a bf16-native CPU): vLLM serves the checkpoint's float32 weights bit for bit, in
    strict float32 math, its greedy contract measured at start-up and on /health; greedy answers are the float32
    target's argmax up to that bound, and equal vLLM's own text without speculation on the same prompts."""
    from safetensors.torch import load_file

    from demo.greedy import check_greedy, check_plain
    from dvi.models.embedded import embedded_paths
    from dvi.models.loading import load_causal_lm
    from serving.vllm_greedy import BOUND_FACTOR, FP32_DEVIATION, PlainVllm
    from serving.vllm_process import TARGET_FILE

    engine = engine_of(served)
    c = engine.greedy_contract
    assert (c["dtype"], c["weights"], c["one_request"]) == ("float32", "float32", "near-tie"), c
    assert c["fpmath"].startswith("strict") and 0 < c["deviation"] <= FP32_DEVIATION, c
    assert c["bound"] == pytest.approx(BOUND_FACTOR * c["deviation"], abs=1e-6), c
    with served.client(token="adm") as cl:
        assert cl.get("/health").json()["greedy_contract"] == c
    b = served.replica_b.result(timeout=600)
    contract_b = httpx.get(b.url + "/health", headers={"Authorization": "Bearer adm"}, timeout=30).json()[
        "greedy_contract"]
    assert contract_b["weights"] == "float32" and contract_b["one_request"] == "near-tie", contract_b
    checkpoint = embedded_paths("smollm2").target
    served_weights = load_file(str(engine.process.target_dir / TARGET_FILE))
    assert all(torch.equal(served_weights[k], v) for k, v in load_file(str(checkpoint / "model.safetensors")).items())

    ids = [_complete(served, p)["dvi"]["request_id"] for p in PROMPTS]
    recs = wait_for(lambda: [r for r in _records(served) if r.request_id in ids] if len(
        [r for r in _records(served) if r.request_id in ids]) == len(ids) else None, 30, what="the records")
    reference = load_causal_lm(checkpoint, "cpu", "float32")
    targets = {int(r.target_version): reference for r in recs}  # the served weights are the checkpoint's (above)
    found = check_greedy(recs, targets, bound=c["bound"])
    assert found.answers == len(PROMPTS) and not found.changed, found.line()
    with PlainVllm(served.cfg.serve.vllm, reference, served.state.tokenizer, tmp_path) as plain:
        texts = plain.complete([list(r.prompt_ids) for r in recs], [len(r.token_ids) for r in recs])
    vs = check_plain(recs, {r.request_id: t for r, t in zip(recs, texts, strict=True)}, targets, c["bound"])
    assert vs["answers"] == len(PROMPTS) and not vs["changed"], vs


@pytest.mark.slow
def test_a_pinned_version_reaches_the_running_vllm_and_one_it_cannot_load_is_refused(served):
    from dvi.registry.store import AdapterRejected, DrafterRegistry
    from serving.engine_client import SetDrafter

    reg = DrafterRegistry(served.cfg.registry.dir)
    base_alpha = _alpha(served)
    bad = publish_peft_adapter(reg, lora_copy(drafter_lane(served).base, 2.0, 1, ("q_proj", "v_proj", "up_proj")), version_manifest(),
                                   set_latest=False)
    with served.client(token="adm") as c:
        r = c.post("/admin/drafter/pin", json={"version": bad})
        assert r.status_code == 200, r.text
        assert engine_of(served).drafter_version == bad
        assert _alpha(served) < 0.5 * base_alpha  # vLLM drafts with the new weights
        r = c.post("/admin/drafter/pin", json={"version": 0})
        assert r.status_code == 200, r.text
    assert abs(_alpha(served) - base_alpha) < 1e-9, "the startup drafter again, exactly"
    assert engine_of(served).swap_seconds[-1] < 10, engine_of(served).swap_seconds

    class Weights(torch.nn.Module):  # a drafter as vLLM takes it: its tensors
        def __init__(self, tensors):
            super().__init__()
            self.tensors = tensors

        def state_dict(self, *a, **k):
            return self.tensors

    good = {k: v.clone() for k, v in drafter_lane(served).base.state_dict().items()}
    wrong_shape = {**good, "model.embed_tokens.weight": torch.zeros(7, 576)}
    nan = {**good, "lm_head.weight": torch.full_like(good["lm_head.weight"], float("nan"))}
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    for tensors, why in ((wrong_shape, "has shape"), (nan, "non-finite"), (missing, "missing")):
        fut = served.state.scheduler.command(SetDrafter(Weights(tensors), 77))
        with pytest.raises(AdapterRejected, match=why):  # refused before vLLM sees it
            fut.result(timeout=120)
    assert engine_of(served).drafter_version == 0 and abs(_alpha(served) - base_alpha) < 1e-9


@pytest.mark.slow
def test_vllm_killed_mid_run_is_restarted_and_no_feedback_record_is_lost_or_doubled(served):
    proc = engine_of(served).process
    before = {r.request_id for r in _records(served)}

    def one(p: str) -> tuple[int, str | None]:
        with httpx.Client(base_url=served.url, timeout=600) as c:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 32, "temperature": 0})
        return r.status_code, (r.json().get("dvi") or {}).get("request_id") if r.status_code == 200 else None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = [pool.submit(one, p) for p in PROMPTS]
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGKILL)  # a crash: in flight are cut, new ones wait for the restart
        later = [pool.submit(one, p) for p in PROMPTS]
        answers = [f.result() for f in first + later]
    assert all(code in (200, 502) for code, _ in answers), answers
    assert all(code == 200 for code, _ in answers[len(first):]), "requests sent during the restart are served"
    assert proc.restarts == 1 and proc.ready.is_set()
    served_ids = {rid for code, rid in answers if code == 200}
    recs = wait_for(lambda: [r for r in _records(served) if r.request_id not in before] if served_ids <= {
        r.request_id for r in _records(served)} else None, 30, what="the records")
    ids = [r.request_id for r in recs]
    assert len(ids) == len(set(ids)), "no record written twice"
    assert served_ids <= set(ids)


@pytest.mark.slow
def test_new_target_weights_reach_the_running_vllm_and_bad_ones_are_refused(served):
    from serving.engine_client import UpdateTarget

    engine = engine_of(served)
    own = engine.target_state

    def first_logprob() -> tuple[str, float]:
        out = _complete(served, PROMPTS[0], 8, logprobs=0)
        return out["choices"][0]["text"], out["choices"][0]["logprobs"]["token_logprobs"][0]

    text, lp = first_logprob()
    nan = {"model.norm.weight": torch.full_like(own["model.norm.weight"], float("nan"))}
    with pytest.raises(ValueError, match="non-finite"):
        served.state.scheduler.command(UpdateTarget(nan, 5, complete=False)).result(timeout=300)
    assert engine.target_version == 0
    norm = own["model.norm.weight"].clone()
    # the final norm x 1.5 sharpens every logit: the same greedy text, a larger top log-prob
    served.state.scheduler.command(UpdateTarget({"model.norm.weight": norm * 1.5}, 1, complete=False)).result(timeout=300)
    text1, lp1 = first_logprob()
    assert engine.target_version == 1 and lp1 > lp + 1e-3, (lp, lp1)
    served.state.scheduler.command(UpdateTarget({"model.norm.weight": norm}, 2, complete=False)).result(timeout=300)
    assert first_logprob() == (text, pytest.approx(lp, abs=1e-5))


@pytest.mark.slow
def test_two_vllm_replicas_share_one_log_and_registry_and_each_promotes_and_rolls_back_alone(served):
    from dvi.registry.store import DrafterRegistry

    b = served.replica_b.result(timeout=600)  # started beside replica a (the `served` fixture)
    trainer = DrafterRegistry(served.cfg.registry.dir)  # what the one trainer publishes to

    def health(url: str) -> dict:
        return httpx.get(url + "/health", headers={"Authorization": "Bearer adm"}, timeout=30).json()

    with served.client(token="adm") as c:  # an earlier test left replica a pinned
        assert c.post("/admin/drafter/pin", json={"version": None}).status_code == 200
    sent = []
    for url in (served.url, b.url):  # both replicas log into the one feedback log: held-out records for both
        with httpx.Client(base_url=url, timeout=600) as c:
            for p in PROMPTS:
                r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16})
                assert r.status_code == 200, r.text
                sent.append(r.json()["dvi"]["request_id"])
    # records are held out by a hash of their random request ids: the eight above may hold too few positions for a
    # replica's shadow check (the suite once waited 300 s for a promotion that passes alone)
    need = served.cfg.trainer.shadow_min_positions
    for url in (served.url, b.url):
        with httpx.Client(base_url=url, timeout=600) as c:
            for i in range(64):
                if health(url)["drafter"]["heldout_positions"] >= need:
                    break
                r = c.post("/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i + 1),
                                                    "max_tokens": 16})
                assert r.status_code == 200, r.text
                sent.append(r.json()["dvi"]["request_id"])
    v = publish_peft_adapter(trainer, lora_copy(drafter_lane(served).base, 0.05, 3, ("q_proj", "v_proj")),
                                     version_manifest())
    for url in (served.url, b.url):  # each replica checks and promotes the trainer's version itself
        try:
            wait_for(lambda url=url: health(url)["drafter_version"] == v, 300, interval=0.5,
                     what=f"{url} to promote v{v}")
        except AssertionError as exc:
            d = health(url)["drafter"]
            raise AssertionError(f"{exc}; its swapper: " + str({k: d.get(k) for k in (
                "live_version", "latest", "waiting", "watch", "heldout_positions", "refused", "events")})) from exc
    assert health(b.url)["replica"] == "b" and health(b.url)["engine"]["kind"] == "vllm"
    with served.client(token="adm") as c:
        r = c.post("/admin/drafter/rollback", json={"reason": "replica a's traffic"})
        assert r.status_code == 200 and r.json()["drafter_version"] == 0, r.text
    time.sleep(3 * served.cfg.serve.registry_poll_seconds + 1)
    assert health(b.url)["drafter_version"] == v, "replica b keeps serving what replica a rolled back"
    assert health(served.url)["drafter_version"] == 0
    assert trainer.latest() == v, "a replica's rollback leaves the trainer's LATEST alone"
    a_rec, b_rec = (DrafterRegistry(served.cfg.registry.dir, replica=n) for n in ("a", "b"))
    assert v in a_rec.refusals() and v not in b_rec.refusals()
    assert {k: s.version for k, s in trainer.served_everywhere().items()} == {"a": 0, "b": v}
    b.__exit__()  # replica b drains and flushes its feedback
    ids = [r.request_id for r in _records(served)]
    assert len(ids) == len(set(ids)) and set(sent) <= set(ids)
