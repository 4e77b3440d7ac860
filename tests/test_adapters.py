"""Issue 40: one drafter adapter per traffic group, learned, judged and served per group (the tiny pair).

- rows of several groups draft in one lean forward, each exactly as its own merged adapter would;
- the engine stays lossless with per-row adapters (greedy: equal to plain decoding);
- the trainer's lanes: a group gets its adapter after `adapter_min_records`, trains on its records only, publishes
  to its own registry, and one group's traffic (garbage included) leaves every other adapter as it was;
- the server: a group's version is judged on that group's records, served to that group's rows only, and a
  refusal in one group changes nothing in another.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from test_online import engine_records, online_config
from test_serving_helpers import ServerThread, drafter_view, tiny_config, wait_for
from tiny_models import tiny_llama

from dvi.decode.attention import Attention
from dvi.decode.lean import LeanModel
from dvi.drafters.adapters import AdapterBank, LoraFactors, projection_sizes
from dvi.drafters.draft_cache import LeanDraftCache
from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import SpeculativeEngine
from dvi.feedback.heldout import adapter_group
from dvi.models.loading import load_pair
from dvi.registry.groups import group_names, group_registry
from dvi.rundir import RunDir
from trainers.online.groups import ACTIVE_S, GroupLanes, adapter_name
from trainers.online.trainer import OnlineTrainer

torch.set_num_threads(1)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(base, seed: int, scale: float = 0.3):
    """(peft state, merged model) of a random LoRA on a copy of `base`."""
    pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return get_peft_model_state_dict(pm), pm.merge_and_unload().eval()


def _factors(sd, base) -> LoraFactors:
    return LoraFactors.from_peft(sd, 8 / 4, projection_sizes(base), base.config.num_hidden_layers)


def test_rows_of_several_groups_draft_each_as_its_merged_adapter() -> None:
    base = tiny_llama(0).eval()
    adapters = {g: _adapter(base, i + 1) for i, g in enumerate(("code", "sql"))}
    lean = LeanModel(copy.deepcopy(base))
    bank = AdapterBank(len(lean.layers), lean.dtype, lean.device)
    for g, (sd, _) in adapters.items():
        bank.set(g, _factors(sd, base))
    groups = ["sql", "", "code", "other"]  # "" and "other": no adapter, the base drafts
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(0))
    cache = lean.new_cache(4)
    cache.add_rows(4)
    lean.adapters = bank.rows(groups)
    out = lean.forward(cache, ids, torch.zeros(4, dtype=torch.long), Attention(6, causal=True))
    for i, g in enumerate(groups):
        ref = (adapters[g][1] if g in adapters else base)(ids[i : i + 1]).logits[0]
        assert torch.allclose(out[i], ref, atol=1e-5), (g, (out[i] - ref).abs().max())
    bank.set("code", None)  # back to the base for code's rows
    assert bank.rows(["code", ""]) is None


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


def test_greedy_with_per_row_adapters_equals_plain_decoding(pair) -> None:
    from dvi.decode.request import Request, SamplingParams

    prompts = [[5 + i, 9, 17 + 2 * i, 3] for i in range(6)]
    plain = SpeculativeEngine(pair.target, None).generate(prompts, 20)
    runs = []
    for adapters in (True, False):
        eng = SpeculativeEngine(pair.target, proposer_for(pair.target, copy.deepcopy(pair.drafter)),
                                num_draft_tokens=3)
        for g, seed in (("a", 1), ("b", 2)) if adapters else ():
            eng.set_adapter(g, _factors(_adapter(pair.drafter, seed, scale=1.0)[0], pair.drafter), seed)
        for i, p in enumerate(prompts):
            eng.add_request(Request(f"r{i}", p, SamplingParams(20), group="ab"[i % 2] if i < 4 else ""))
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    out[o.result.request_id] = o.result
        runs.append([out[f"r{i}"] for i in range(6)])
        assert [r.token_ids for r in runs[-1]] == [r.token_ids for r in plain]
        assert eng.adapter_versions == ({"a": 1, "b": 2} if adapters else {})
    with_adapters, without = runs  # rows of a group with an adapter draft otherwise; the rest as before
    assert all(with_adapters[i].drafted_ids != without[i].drafted_ids for i in range(4))
    assert all(with_adapters[i].drafted_ids == without[i].drafted_ids for i in (4, 5))


def test_acceptance_pools_by_who_drafts(pair) -> None:
    """A row's acceptance pool is its domain and the adapter drafting it: rows of a group without an adapter and the
    group's control rows (no group for the engine) share the base's pool; an adapter gives its rows their own, and
    a new version of it forgets only that pool."""
    from dvi.decode.request import Request, SamplingParams

    eng = SpeculativeEngine(pair.target, proposer_for(pair.target, copy.deepcopy(pair.drafter)), num_draft_tokens=3)
    for i, group in enumerate(("a", "", "a")):
        eng.add_request(Request(f"r{i}", [5, 9, 17 + i], SamplingParams(8), domain="code", group=group))
    eng.step()
    assert [s.pool for s in eng._seqs] == ["code", "code", "code"]
    eng.set_adapter("a", _factors(_adapter(pair.drafter, 1, scale=1.0)[0], pair.drafter), 1)
    assert [s.pool for s in eng._seqs] == ["code/a", "code", "code/a"]
    eng.step()
    assert set(eng.acceptance._pools) == {"code", "code/a"}
    eng.set_adapter("a", _factors(_adapter(pair.drafter, 2, scale=1.0)[0], pair.drafter), 2)
    assert set(eng.acceptance._pools) == {"code"}


@pytest.fixture(scope="module")
def records(pair):
    """(code, prose) greedy records of the real engine, 24 each."""
    return (engine_records(pair, "code", 24, max_new_tokens=16, prefix="gc"),
            engine_records(pair, "prose", 24, max_new_tokens=16, prefix="gp"))


def test_lanes_train_each_group_on_its_own_records_and_publish_to_its_registry(records, pair, tiny_pair_dir,
                                                                                tmp_path) -> None:
    code, prose = records
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.adapter_key=domain", "trainer.adapter_min_records=12",
                        "trainer.publish_margin=-1.0", "trainer.gate_group_margin=1.0")
    main = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    lanes = GroupLanes(main, cfg, RunDir.of(cfg))
    stats = lanes.train_on_records(code[:8])  # fewer than adapter_min_records: the group waits
    assert not lanes.lanes and stats.steps == 0 and not stats.untrained_ids and len(lanes.waiting["code"]) == 8
    lanes.train_on_records(code[8:] + prose[:4])
    assert list(lanes.lanes) == ["code"] and lanes.waiting == {"prose": prose[:4]}
    peft_model = main.trainable.drafter
    lanes.train_on_records(prose[4:])
    assert sorted(lanes.lanes) == ["code", "prose"]
    prose_before = {k: v.clone() for k, v in lanes.lanes["prose"].trainable.state().items()}
    # traffic unlike the rest of code's (prose sent as code) moves only code's adapter
    junk = [dataclasses.replace(r, request_id=r.request_id + "j", domain="code") for r in prose]
    lanes.train_on_records(junk)
    after = lanes.lanes["prose"].trainable.state()
    assert all(torch.equal(prose_before[k], after[k]) for k in after)
    # an idle trainer replays only for the groups that sent records lately (prose went quiet), each on its own
    lanes.last_new["prose"] -= ACTIVE_S + 1
    code_before = {k: v.clone() for k, v in lanes.lanes["code"].trainable.state().items()}
    assert lanes.train_on_replay(2).steps == 2
    moved = lanes.lanes["code"].trainable.state()
    assert any(not torch.equal(code_before[k], moved[k]) for k in moved)
    assert all(torch.equal(prose_before[k], v) for k, v in lanes.lanes["prose"].trainable.state().items())
    decisions = lanes.maybe_publish(force=True)
    assert any(d.published for d in decisions), [d.reason for d in decisions]
    assert group_names(cfg.registry.dir) == ["code", "prose"]
    v = group_registry(cfg.registry.dir, "code").latest()
    assert v is not None and adapter_name("code") in peft_model.peft_config
    # a restart resumes every group's adapter from its checkpoint
    lanes.save(tmp_path / "checkpoint")
    again = GroupLanes(OnlineTrainer(cfg, copy.deepcopy(pair.drafter)), cfg, RunDir.of(cfg))
    again.restore(tmp_path / "checkpoint")
    assert sorted(again.lanes) == ["code", "prose"]
    saved, resumed = lanes.lanes["code"].trainable.state(), again.lanes["code"].trainable.state()
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)


@pytest.mark.slow
def test_server_judges_and_serves_a_groups_adapter_on_that_group_only(records, pair, tiny_pair_dir, tmp_path) -> None:
    code, prose = records
    cfg = tiny_config(tiny_pair_dir, tmp_path, "trainer.adapter_key=domain", "trainer.adapter_min_records=8",
                      "trainer.shadow_margin=1.0", "trainer.gate_group_margin=1.0", "trainer.publish_margin=-1.0",
                      "serve.rollback_window=64")
    main = OnlineTrainer(cfg, copy.deepcopy(pair.drafter))
    lanes = GroupLanes(main, cfg, RunDir.of(cfg))
    lanes.train_on_records(code + prose)
    assert any(d.published for d in lanes.maybe_publish(force=True))
    with ServerThread(cfg) as s, s.client() as c:
        for i in range(60):
            domain = "code" if i % 2 else "prose"
            r = c.post("/v1/completions", json={"prompt": f"def f{i}(x):" if domain == "code" else f"The day {i}",
                                                "max_tokens": 12, "metadata": {"domain": domain}})
            assert r.status_code == 200, r.text
            if s.state.scheduler.snapshot.adapter_versions.get("code"):
                break
        wait_for(lambda: s.state.scheduler.snapshot.adapter_versions.get("code"), 60, what="code's adapter promoted")
        # the lane swaps the engine first, then its own state: /health follows within the door's next publish
        latest = group_registry(cfg.registry.dir, "code").latest()
        wait_for(lambda: s.health()["adapters"]["groups"].get("code", {}).get("live_version") == latest, 30,
                 what="/health reports code's promoted adapter")
        health = s.health()["adapters"]
        assert health["adapter_key"] == "domain" and "code" in health["groups"]
        assert health["groups"]["code"]["live_version"] == latest
        assert drafter_view(s).live_version == 0  # the shared drafter stays as started
        v = health["groups"]["code"]["live_version"]
        assert f'dvi_drafter_adapter_version{{group="code"}} {float(v)}' in c.get("/metrics").text
    assert adapter_group("domain", "code", "") == "code"


@pytest.mark.slow
def test_control_rows_draft_with_the_frozen_base_in_the_same_batches(records, pair, tiny_pair_dir, tmp_path) -> None:
    """Issue 59 §1: a control request of a group with a served adapter drafts without it (its response and record
    say adapter 0, arm control), its greedy text equals the learned arm's, a retried key keeps its arm, and /metrics
    and /admin/status carry both arms."""
    from dvi.feedback.reader import FeedbackReader
    from serving.control import draw_arm

    code, prose = records
    cfg = tiny_config(tiny_pair_dir, tmp_path, "trainer.adapter_key=domain", "trainer.adapter_min_records=8",
                      "trainer.shadow_margin=1.0", "trainer.gate_group_margin=1.0", "trainer.publish_margin=-1.0",
                      "serve.rollback_window=64", "serve.control_share=0.5")
    lanes = GroupLanes(OnlineTrainer(cfg, copy.deepcopy(pair.drafter)), cfg, RunDir.of(cfg))
    lanes.train_on_records(code + prose)
    assert any(d.published for d in lanes.maybe_publish(force=True))
    keys = {arm: [k for k in (f"key-{i}" for i in range(64)) if draw_arm(0.5, "code", k) == arm][:6]
            for arm in ("learned", "control")}
    with ServerThread(cfg) as s, s.client() as c:
        for i in range(60):
            c.post("/v1/completions", json={"prompt": f"def f{i}(x):", "max_tokens": 12, "metadata": {"domain": "code"}},
                   headers={"X-Request-Id": keys["learned"][0]})
            if s.state.scheduler.snapshot.adapter_versions.get("code"):
                break
        wait_for(lambda: s.state.scheduler.snapshot.adapter_versions.get("code"), 60, what="code's adapter promoted")
        v = s.state.scheduler.snapshot.adapter_versions["code"]
        answers: dict[str, list[dict]] = {"learned": [], "control": []}
        for j in range(6):
            for arm in ("learned", "control"):
                r = c.post("/v1/completions", json={"prompt": f"def g{j}(y, z):", "max_tokens": 16,
                                                    "metadata": {"domain": "code"}},
                           headers={"X-Request-Id": keys[arm][j]})
                assert r.status_code == 200, r.text
                answers[arm].append(r.json())
        for arm, version in (("learned", v), ("control", 0)):
            assert {(a["dvi"]["arm"], a["dvi"]["adapter_version"]) for a in answers[arm]} == {(arm, version)}
        # lossless in both arms: greedy text is the target's whatever drafted it
        assert [a["choices"][0]["text"] for a in answers["learned"]] == \
            [a["choices"][0]["text"] for a in answers["control"]]
        assert any(a["dvi"]["drafted"] for a in answers["control"])
        metrics = c.get("/metrics").text
        assert 'dvi_control_requests_total{arm="control",group="code"} 6.0' in metrics
        assert "dvi_control_share 0.5" in metrics and 'dvi_control_uplift{bound="ratio",group="code"' in metrics
        status = s.health()["control"]
        assert status["share"] == 0.5 and status["groups"]["code"]["adapter_version"] == v
        assert status["groups"]["code"]["control"]["requests"] == 6 and status["groups"]["code"]["learned"]["requests"] >= 6
        prose_answer = c.post("/v1/completions", json={"prompt": "The day", "max_tokens": 4,
                                                       "metadata": {"domain": "prose"}}).json()
        assert prose_answer["dvi"]["arm"] in ("learned", "control")
    reader = FeedbackReader(cfg.feedback.dir)
    recs = {r.request_id: r for r in reader.iter_records(reader.list_shards())}
    for arm, version in (("learned", v), ("control", 0)):
        rec = recs[answers[arm][0]["dvi"]["request_id"]]
        assert (rec.arm, rec.adapter_version) == (arm, version)


def test_every_value_of_adapter_key_starts_dvi_serve(tiny_pair_dir, tmp_path) -> None:
    """`domain` starts above, `none` (the default) in every other server test; `user` here (a user's requests are
    its own group, hashed)."""
    key = "user"
    cfg = tiny_config(tiny_pair_dir, tmp_path, f"trainer.adapter_key={key}")
    with ServerThread(cfg) as s, s.client() as c:
        r = c.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4, "user": "alice"})
        assert r.status_code == 200 and r.json()["dvi"]["adapter_version"] == 0, r.text
        adapters = s.health()["adapters"]
        assert (adapters is None) if key == "none" else adapters["adapter_key"] == "user"


def test_the_trainer_loop_trains_group_lanes_exactly_once_and_resumes_them(records, pair, tiny_pair_dir,
                                                                           tmp_path) -> None:
    """Through the loop that tails the feedback log: every record is trained by its group's lane, held out, or
    logged as untrained (none counted twice); a new process resumes every lane from the one checkpoint."""
    from test_online import _consumed, _drain, _write_shards

    from trainers.online.loop import TrainerLoop

    code, prose = records
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.adapter_key=domain", "trainer.adapter_min_records=8",
                        "trainer.checkpoint_seconds=0")
    _write_shards(Path(cfg.feedback.dir), code + prose[:4], per_shard=4)

    def new_loop() -> TrainerLoop:
        loop = TrainerLoop(OnlineTrainer(cfg, copy.deepcopy(pair.drafter)), cfg)
        loop.stop.requested = True  # take whatever is pending without waiting for min_new_records
        loop.restore()
        return loop

    loop = new_loop()
    _drain(loop)
    loop.flush()
    assert sorted(loop.lanes.lanes) == ["code"] and loop.lanes.lanes["code"].step > 0
    state = loop.lanes.lanes["code"].trainable.state()
    entries = _consumed(tmp_path)
    ids = [i for e in entries for key in ("trained", "heldout", "dropped", "untrained") for i in e.get(key, [])]
    assert sorted(ids) == sorted(r.request_id for r in code)  # prose's 4 wait for their lane, logged when trained
    assert list(loop.lanes.waiting) == ["prose"]  # below the bar: logged untrained, kept until prose has enough
    again = new_loop()
    assert sorted(again.lanes.lanes) == ["code"] and again.lanes.lanes["code"].step == loop.lanes.lanes["code"].step
    resumed = again.lanes.lanes["code"].trainable.state()
    assert all(torch.equal(state[k], resumed[k]) for k in state)
    assert list(again.lanes.waiting) == ["prose"]  # warmed from the consumed shards


def test_a_ragged_catch_up_drafts_each_row_as_its_own_forward_would() -> None:
    """`LeanDraftCache.forward_rows` with rows of different lengths (a row that just joined brings its prompt, the
    others a token or two) runs only the real tokens: each row's logits and its cache are those of the row's own
    forward, through its group's adapter."""
    base = tiny_llama(0).eval()
    sd, merged = _adapter(base, 1)
    bank = AdapterBank(base.config.num_hidden_layers, torch.float32, torch.device("cpu"))
    bank.set("code", _factors(sd, base))
    dkv = LeanDraftCache(copy.deepcopy(base), bank)
    g = torch.Generator().manual_seed(0)
    history = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (5, 3, 7)]
    dkv.add_rows(3, ["code", "", "code"])
    dkv.forward_rows(history)  # rows already in the batch
    pending = [[11, 12], torch.randint(3, 64, (9,), generator=g).tolist(), [13]]
    out = dkv.forward_rows(pending)
    assert dkv.cache.lengths == [7, 12, 8]
    for i, grp in enumerate(["code", "", "code"]):
        ref = (merged if grp else base)(torch.tensor([history[i] + pending[i]])).logits[0, -1]
        assert torch.allclose(out[i], ref, atol=1e-5), (i, (out[i] - ref).abs().max())
    nxt = dkv.forward(torch.tensor([[20], [21], [22]]))  # the caches hold every row's real keys
    for i, grp in enumerate(["code", "", "code"]):
        ref = (merged if grp else base)(torch.tensor([history[i] + pending[i] + [20 + i]])).logits[0, -1]
        assert torch.allclose(nxt[i], ref, atol=1e-5), (i, (nxt[i] - ref).abs().max())
