"""The gates a drafter version passes (issues 35 §4, 36 §3 and §8): one held-out set, one comparison, per group.

Every test failed on the code before: the shadow check read the newest 64 held-out records and the watch the next 32,
both weighted by traffic, records served under a `logit_bias` counted as evidence, the trainer and the server kept
their own held-out buffers, and a version published while the previous one's watch ran waited for requests an idle
server never got.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from registry_doors import publish_full, publish_peft_adapter
from test_online import engine_records, online_config
from test_serving_helpers import PROMPTS, TEST_ADMIN_TOKEN, lora_copy, tiny_config, version_manifest, wait_for

from dvi.config import dump_config
from dvi.feedback.heldout import HeldOutSet, client_key, group_of, unfit_reason
from dvi.feedback.record import FeedbackRecord
from dvi.feedback.shadow import is_heldout
from dvi.feedback.verdict import judge
from dvi.models.loading import load_causal_lm, load_pair
from dvi.registry.store import DrafterRegistry

FORCED = 0  # the token the majority client forces with its logit_bias, and the one the bad candidate always drafts


@pytest.fixture(scope="module")
def pair(tiny_pair_dir):
    return load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")


def one_token_drafter_state(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The drafter's weights with its final norm zeroed: every logit is 0, so it always drafts token 0 (`FORCED`)."""
    sd = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    sd["model.norm.weight"].zero_()
    return sd


def _serve(cfg, tmp_path: Path, name: str = "server"):
    from serving.server_process import ServerProcess

    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    return ServerProcess(["--config", str(path), f"serve.admin_token={TEST_ADMIN_TOKEN}"], tmp_path / f"{name}.log")


def _events(run_dir: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in (run_dir / "swap_events.jsonl").read_text().splitlines()]
    except FileNotFoundError:
        return []


def _verdict(run_dir: Path, version: int, timeout: float = 60.0) -> dict:
    """The first promoted / refused event of `version` in the server's swap event log."""
    return wait_for(lambda: next((e for e in _events(run_dir) if e["version"] == version
                                  and e["kind"] in ("promoted", "refused")), None), timeout, what=f"v{version}'s verdict")


def _metric(text: str, name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#") and all(w in line for w in want))


# -- A: one client's traffic decides neither gate ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("honest_domain", ["code", "prose"])
def test_majority_client_forcing_a_token_cannot_promote_a_drafter_that_fails_the_others(
        tiny_pair_dir, tmp_path, honest_domain) -> None:
    """Issue 36 §3 through a real `dvi serve`: a client sending 90% of the traffic (greedy, `logit_bias` forcing one
    token) and a candidate that drafts only that token. Before: promoted on the majority's records (α ~1 vs ~0) while
    the honest group's α fell to 0. Now: the forced records are no evidence (counted on /metrics), the honest group
    is judged on its own records, and the candidate is refused."""
    cfg = tiny_config(tiny_pair_dir, tmp_path)
    honest_held = 0
    with _serve(cfg, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        i = 0
        while honest_held < 5:
            for k in range(10):
                i += 1
                honest = k == 9
                body = {"prompt": PROMPTS[i % len(PROMPTS)] + " " * (i % 5), "max_tokens": 16,
                        "metadata": {"domain": honest_domain if honest else "code"},
                        "user": "honest" if honest else "bulk"}
                if not honest:
                    body["logit_bias"] = {str(FORCED): 100}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                honest_held += honest and is_heldout(r.json()["dvi"]["request_id"], cfg.trainer.heldout_fraction)
            assert i < 400, "too few honest held-out records"
        reg = DrafterRegistry(cfg.registry.dir)
        base = load_causal_lm(tiny_pair_dir / "drafter", "cpu", "float32")
        v = publish_full(reg, one_token_drafter_state(base), base.config, version_manifest())
        ev = _verdict(tmp_path, v)
        assert ev["kind"] == "refused", ev
        honest_group = f"{honest_domain}/greedy/{client_key('honest')}"
        assert honest_group in ev["reason"], ev["reason"]
        metrics = c.get("/metrics").text
        assert _metric(metrics, "dvi_drafter_heldout_unfit_records", reason="transformed") > 0
        assert _metric(metrics, "dvi_drafter_gate_groups", gate="promotion", judged="true") >= 1
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "user": "honest"})
        assert r.json()["dvi"]["drafter_version"] == 0


def _fit_majority(records: list[FeedbackRecord], n: int) -> list[FeedbackRecord]:
    """`n` code records of client "bulk" whose every token is `FORCED`, as if the target wrote them (fit evidence:
    no transform logged), on the prompts of `records`."""
    out = []
    for i in range(n):
        r = records[i % len(records)]
        k = len(r.token_ids)
        out.append(FeedbackRecord(
            request_id=f"bulk-{i}", domain="code", target_version=0, drafter_version=0, started_at=float(i),
            finished_at=float(i), temperature=0.0, prompt_ids=list(r.prompt_ids), token_ids=[FORCED] * k,
            drafted_ids=[-1] * k, accepted=[False] * k, client=client_key("bulk")))
    return out


def test_a_group_falling_by_more_than_the_margin_refuses_publish_and_promotion(pair, tiny_pair_dir, tmp_path) -> None:
    """Issue 35 §4 + 36 §3: the trainer's publish gate and the server's promotion check are the same comparison,
    per group. The majority's (fit) records favour the candidate (pooled α up by ~0.8), a minority client's fall
    from ~0.4 to 0: the trainer does not publish it, and the server refuses it when it is published anyway."""
    from serving.drafter.lane import Lane
    from serving.drafter.policy import LifecyclePolicy
    from trainers.online.trainer import OnlineTrainer

    honest = [FeedbackRecord(**{**r.__dict__, "client": client_key("honest")})
              for r in engine_records(pair, "prose", 6, max_new_tokens=16, prefix="hon")]
    majority = _fit_majority(honest, 54)
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.mode=full", "trainer.publish_margin=0.0")
    reg = DrafterRegistry(cfg.registry.dir)
    tr = OnlineTrainer(cfg, copy.deepcopy(pair.drafter), registry=reg)
    tr.heldout.extend(r.compact() for r in majority + honest)
    bad = one_token_drafter_state(pair.drafter)
    tr.trainable.load_state(bad)
    d = tr.maybe_publish(force=True)
    assert d.heldout_alpha > d.parent_heldout_alpha + 0.5, d  # pooled, the candidate looks far better
    assert d.published is None and f"prose/greedy/{client_key('honest')}" in d.reason, d.reason
    v = publish_full(reg, bad, pair.drafter.config, version_manifest())
    sw = Lane(reg, None, pair.drafter, LifecyclePolicy.of(cfg))
    for r in majority + honest:
        sw.heldout.add(r)
    while sw.step():  # restore, validate, judge: the lane's steps until it waits for a poll
        pass
    view = sw.view()
    assert view.live_version == 0 and v in view.refused, view.events
    assert f"prose/greedy/{client_key('honest')}" in view.refused[v]


def test_the_watch_judges_each_client_alone(pair) -> None:
    """The rollback watch's groups carry the client: a minority client's fall is not averaged away by the
    majority's gain in the same domain and temperature (before: one `code/greedy` group, kept)."""
    from dvi.feedback.verdict import watch_rule

    honest = [FeedbackRecord(**{**r.__dict__, "domain": "code", "client": client_key("honest")})
              for r in engine_records(pair, "code", 6, max_new_tokens=16, prefix="w")]
    majority = _fit_majority(honest, 26)
    rule = watch_rule(0.05, 2.0, 4)
    new = [(r, float(len(r.token_ids)) if r.client == client_key("bulk") else 0.0, len(r.token_ids))
           for r in majority + honest]
    old = [(r, 0.0 if r.client == client_key("bulk") else 0.5 * len(r.token_ids) + 0.1 * (i % 3), len(r.token_ids))
           for i, r in enumerate(majority + honest)]
    v = judge(new, old, rule)
    assert v.failed and f"code/greedy/{client_key('honest')}" in v.reason, v.reason


# -- the held-out set ------------------------------------------------------------------------------------------------
def _rec(i: int, domain: str = "code", client: str = "", **kw) -> FeedbackRecord:
    return FeedbackRecord(request_id=f"r{domain}{client}{i}", domain=domain, target_version=0, drafter_version=0,
                          started_at=i, finished_at=i, temperature=kw.pop("temperature", 0.0), prompt_ids=[3, 4],
                          token_ids=[5, 6, 7], drafted_ids=[-1] * 3, accepted=[False] * 3, client=client, **kw)


def test_held_out_set_keeps_minority_groups_and_leaves_transformed_records_out() -> None:
    """A flood of one group evicts its own oldest records, not a minority's; records served under a transform
    are counted, never kept; one record per request id; iteration in arrival order."""
    hs = HeldOutSet(capacity=20)
    for i in range(6):
        hs.add(_rec(i, "prose", client_key("honest")))
    for i in range(500):
        hs.add(_rec(i, "code", client_key("bulk")))
    assert not hs.add(_rec(0, "code", client_key("bulk"), transformed=True))
    sizes = hs.group_sizes()
    assert sizes[f"prose/greedy/{client_key('honest')}"] == 6 and sizes[f"code/greedy/{client_key('bulk')}"] == 14
    assert len(hs) == 20 and hs.unfit["transformed"] == 1 and hs.evicted == 486
    assert [r.request_id for r in hs][-1] == f"rcode{client_key('bulk')}499"
    hs.add(_rec(499, "code", client_key("bulk")))
    assert len(hs) == 20
    assert group_of(_rec(1, temperature=0.7)) == "code/sampled" and unfit_reason(_rec(1)) is None
    assert client_key("") == "" and client_key("alice") != client_key("bob") and "alice" not in client_key("alice")


# -- D: a verdict within seconds on an idle server ------------------------------------------------------------------
@pytest.mark.slow
def test_idle_server_gives_every_published_version_a_verdict_within_seconds(tiny_pair_dir, tmp_path) -> None:
    """Issue 36 §8 through a real `dvi serve`: after traffic stops, v1 is promoted; v2 (good) and v3 (bad) are
    published one after the other. Before: v2 waited for v1's watch (rollback_window requests that an idle server
    never gets), forever. Now v1's watch ends on the records it has once the server is idle, and each version gets
    its verdict within 5 s; the times are on /metrics. A restarted server checks a version on the held-out records
    of its feedback log at once."""
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.registry_poll_seconds=0.5", "serve.watch_idle_s=1.0")
    base = load_causal_lm(tiny_pair_dir / "drafter", "cpu", "float32")
    with _serve(cfg, tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        for i in range(16):
            assert c.post("/v1/completions", json={"prompt": PROMPTS[i % 4] + " " * i, "max_tokens": 16}).status_code == 200
        reg = DrafterRegistry(cfg.registry.dir)
        seconds = {}
        for k, scale in enumerate((0.0, 0.0, 2.0)):
            v = publish_peft_adapter(reg, lora_copy(base, scale, k), version_manifest())
            ev = _verdict(tmp_path, v, timeout=15)
            seconds[v] = ev["publish_to_verdict_s"]
            assert ev["kind"] == ("refused" if scale else "promoted"), ev
        assert all(s is not None and s <= 5.0 for s in seconds.values()), seconds
        kept = [e for e in _events(tmp_path) if e["kind"] == "kept"]
        assert kept and "ended early" in kept[0]["reason"], kept
        metrics = c.get("/metrics").text
        assert _metric(metrics, "dvi_drafter_publish_to_verdict_seconds_count") == 3
    v4 = publish_peft_adapter(reg, lora_copy(base, 0.0, 9), version_manifest())
    t0 = time.monotonic()
    with _serve(cfg, tmp_path, "restarted"):
        ev = _verdict(tmp_path, v4, timeout=15)
        assert ev["kind"] == "promoted" and time.monotonic() - t0 < 60, ev
