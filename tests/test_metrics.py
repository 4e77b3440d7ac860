import json
import sys

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from dvi import metrics as M
from dvi.decode.results import GenerationResult

torch.set_num_threads(1)


def result(domain="code", version=1, drafted=8, accepted=6, steps=3, acc_pos=(3, 2, 1), dr_pos=(3, 3, 2)):
    return GenerationResult(
        request_id="r",
        prompt_ids=[1],
        token_ids=list(range(9)),
        finish_reason="length",
        num_steps=steps,
        num_drafted=drafted,
        num_accepted=accepted,
        accepted_per_position=list(acc_pos),
        drafted_per_position=list(dr_pos),
        drafter_version=version,
        target_version=0,
        domain=domain,
        started_at=100.0,
        finished_at=100.5,
    )


def test_names_unique_and_prefixed():
    assert all(n.startswith("dvi_") for n in M.METRICS)
    assert M.NUM_ACCEPTED_PER_POS in M.METRICS and M.METRICS[M.NUM_ACCEPTED_PER_POS].labels[-1] == "position"


def sample(reg, name, **labels):
    return reg.get_sample_value(name, labels)


def test_prometheus_observe_result():
    reg = CollectorRegistry()
    m = M.build_prometheus_metrics(reg)
    m.observe_result(result())
    m.observe_result(result(drafted=4, accepted=0, acc_pos=(0, 0), dr_pos=(2, 2), steps=2))
    m.observe_result(result(domain="prose", version=2), domain="prose")
    lv = {"drafter_version": "1", "domain": "code"}
    assert sample(reg, M.NUM_DRAFTS, **lv) == 5
    assert sample(reg, M.NUM_DRAFT_TOKENS, **lv) == 12
    assert sample(reg, M.NUM_ACCEPTED_TOKENS, **lv) == 6
    assert sample(reg, M.NUM_ACCEPTED_PER_POS, **lv, position="0") == 3
    assert sample(reg, M.NUM_DRAFTED_PER_POS, **lv, position="2") == 2
    assert sample(reg, M.ACCEPTANCE_RATE, **lv) == pytest.approx(0.5)
    assert sample(reg, M.MEAN_ACCEPTED_LENGTH, **lv) == pytest.approx(1 + 6 / 5)
    assert sample(reg, M.ACCEPTANCE_RATE, drafter_version="2", domain="prose") == pytest.approx(0.75)
    assert sample(reg, M.GENERATION_TOKENS, **lv) == 18
    assert sample(reg, M.REQUEST_LATENCY + "_count", domain="code") == 2
    m.set_versions(drafter_version=3, target_version=1)
    m.set_trainer_state("running")
    m.set_trainer({M.TRAINER_LOSS: 1.5, M.TRAINER_KL_LOSS: float("nan")})
    m.record_refusal("non-finite")
    m.record_promotion()
    m.record_rollback()
    assert sample(reg, M.DRAFTER_VERSION) == 3 and sample(reg, M.TRAINER_STATE) == M.TRAINER_STATES["running"]
    assert sample(reg, M.TRAINER_LOSS) == 1.5
    assert sample(reg, M.DRAFTER_REFUSALS, reason="non-finite") == 1
    text = generate_latest(reg).decode()
    for name in (
        M.NUM_DRAFTS,
        M.NUM_ACCEPTED_PER_POS,
        M.ACCEPTANCE_RATE,
        M.TOKENS_PER_SECOND,
        M.DRAFTER_ROLLBACKS,
    ):
        assert name in text


def test_per_request_acceptance_histogram_and_low_acceptance_requests():
    """Issue 59 §3: per-request acceptance per traffic group, and requests whose drafts kept failing counted (a
    garbled or looping output); a request that drafted little enters neither."""
    reg = CollectorRegistry()
    m = M.build_prometheus_metrics(reg)
    m.observe_result(result(drafted=40, accepted=30))
    m.observe_result(result(drafted=40, accepted=1))
    m.observe_result(result(drafted=4, accepted=0, acc_pos=(0, 0), dr_pos=(2, 2), steps=2))
    m.observe_result(result(domain="sql", drafted=32, accepted=0, acc_pos=(0,), dr_pos=(8,), steps=8), domain="sql")
    assert sample(reg, M.REQUEST_ACCEPTANCE + "_count", domain="code") == 2
    assert sample(reg, M.REQUEST_ACCEPTANCE + "_bucket", domain="code", le="0.05") == 1
    assert sample(reg, M.REQUEST_ACCEPTANCE + "_bucket", domain="code", le="0.8") == 2
    assert sample(reg, M.LOW_ACCEPTANCE_REQUESTS, domain="code") == 1
    assert sample(reg, M.LOW_ACCEPTANCE_REQUESTS, domain="sql") == 1
    assert M.low_acceptance(result(drafted=40, accepted=2)) and not M.low_acceptance(result(drafted=31, accepted=0))


def test_alpha_window_rolls():
    w = M.AlphaWindow(window=2)
    w.observe(result(drafted=10, accepted=10, acc_pos=(5, 5), dr_pos=(5, 5), steps=5))
    w.observe(result(drafted=10, accepted=0, acc_pos=(0, 0), dr_pos=(5, 5), steps=5))
    assert w.alpha("code", 1) == pytest.approx(0.5)
    w.observe(result(drafted=10, accepted=0, acc_pos=(0, 0), dr_pos=(5, 5), steps=5))
    assert w.alpha("code", 1) == 0.0  # the all-accepted result fell out of the window
    assert w.per_position("code", 1) == [0.0, 0.0]
    assert w.alpha("code", 7) is None
    w.observe(result(version=2, drafted=4, accepted=1))
    assert set(w.keys()) == {("code", 1), ("code", 2)}
    assert w.summary()[("code", 2)][M.ACCEPTANCE_RATE] == 0.25


def test_summarize_results():
    r = GenerationResult(request_id="r", prompt_ids=[1], token_ids=[1, 2, 3], drafted_ids=[1, 5, -1],
                         accepted=[True, False, False], num_steps=2, num_drafted=2, num_accepted=1)
    s = M.summarize_results([r])
    assert s[M.NUM_DRAFT_TOKENS] == 2 and s[M.ACCEPTANCE_RATE] == 0.5 and s[M.MEAN_ACCEPTED_LENGTH] == 1.5


def test_logger_jsonl_and_report(tmp_path):
    with M.MetricsLogger(tmp_path, wandb_mode="disabled") as lg:
        for i in range(6):
            dom = "code" if i % 2 == 0 else "prose"
            lg.log(
                {M.ACCEPTANCE_RATE: 0.5 + i / 20, M.TRAINER_LOSS: float("nan")},
                step=i,
                domain=dom,
                drafter_version=1 if i < 3 else 2,
            )
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and rows[0]["domain"] == "code" and rows[0][M.TRAINER_LOSS] is None
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"torn')  # crash mid-line
    out = M.report(tmp_path)
    assert out == tmp_path / "alpha.png" and out.stat().st_size > 1000
    with pytest.raises(FileNotFoundError):
        M.report(tmp_path / "nope")


def test_logger_survives_wandb_failure(tmp_path, monkeypatch):
    class BrokenWandb:
        @staticmethod
        def init(**kw):
            raise RuntimeError("no network")

    monkeypatch.setitem(sys.modules, "wandb", BrokenWandb)
    lg = M.MetricsLogger(tmp_path, wandb_mode="online")
    assert lg.wandb_run is None
    lg.log({M.ACCEPTANCE_RATE: 0.9})
    lg.close()
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


def test_logger_passes_values_to_wandb(tmp_path, monkeypatch):
    logged, inits = [], []

    class Run:
        def log(self, d):
            logged.append(d)

        def finish(self):
            logged.append("finished")

    class FakeWandb:
        @staticmethod
        def init(**kw):
            inits.append(kw)
            return Run()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    with M.MetricsLogger(tmp_path, config={"k": 4}) as lg:
        lg.log({M.ACCEPTANCE_RATE: 0.8, "note": "text"}, step=3, domain="code", drafter_version=5)
    assert (
        inits[0]["mode"] == "offline" and inits[0]["dir"] == str(tmp_path) and inits[0]["config"] == {"k": 4}
    )
    assert inits[0]["entity"] is None
    assert logged[0] == {f"{M.ACCEPTANCE_RATE}/code": 0.8, "drafter_version": 5, "step": 3}
    assert logged[-1] == "finished"


def test_label_values_are_bounded():
    """Issue 17 item 7: unknown domains count as "other"; only the newest drafter versions keep series."""
    reg = CollectorRegistry()
    m = M.Metrics(reg, domains=["code"], max_versions=2)
    for v in range(1, 6):
        for d in ("code", f"tenant-{v}"):
            m.observe_result(result(domain=d, version=v), domain=d)
    text = generate_latest(reg).decode()
    assert 'domain="tenant' not in text and 'domain="other"' in text
    versions = {ln.split('drafter_version="')[1].split('"')[0] for ln in text.splitlines() if "drafter_version=" in ln}
    assert versions == {"4", "5"}
    assert sample(reg, M.NUM_DRAFT_TOKENS, drafter_version="5", domain="other") == 8
    assert {k[1] for k in m.alpha_window.keys()} == {4, 5}


def test_logger_passes_the_wandb_entity(tmp_path, monkeypatch):
    """`wandb.entity` in the config reaches wandb.init (it used to be accepted and ignored)."""
    inits = []

    class FakeWandb:
        @staticmethod
        def init(**kw):
            inits.append(kw)
            return None

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    M.MetricsLogger(tmp_path, project="p", entity="my-team").close()
    assert inits[0]["entity"] == "my-team" and inits[0]["project"] == "p"


def test_vllm_named_counters_count_what_ours_count():
    """vLLM v1's spec-decode counter names sit beside ours, labelled by model_name (and position) only."""
    reg = CollectorRegistry()
    m = M.Metrics(reg, domains=["code"], max_versions=2, model_name="tiny")
    for v in range(1, 5):  # versions beyond max_versions lose their dvi_ series, never the vllm: counts
        m.observe_result(result(domain="code", version=v), domain="code")
        m.observe_result(result(domain="tenant", version=v, drafted=4, accepted=1, acc_pos=(1,), dr_pos=(2, 2)),
                         domain="tenant")
    assert sample(reg, M.VLLM_NUM_DRAFTS, model_name="tiny") == 4 * (3 + 2)
    assert sample(reg, M.VLLM_NUM_DRAFT_TOKENS, model_name="tiny") == 4 * (8 + 4)
    assert sample(reg, M.VLLM_NUM_ACCEPTED_TOKENS, model_name="tiny") == 4 * (6 + 1)
    assert sample(reg, M.VLLM_NUM_ACCEPTED_PER_POS, model_name="tiny", position="0") == 4 * (3 + 1)
    assert sample(reg, M.VLLM_NUM_ACCEPTED_PER_POS, model_name="tiny", position="2") == 4 * 1
    # the newest version's dvi_ series equal its share of the vllm: counts
    assert sample(reg, M.NUM_DRAFT_TOKENS, drafter_version="4", domain="code") == 8
    text = generate_latest(reg).decode()
    vllm_lines = [ln for ln in text.splitlines() if ln.startswith("vllm:spec_decode_")]
    assert vllm_lines and not [ln for ln in vllm_lines if "drafter_version" in ln or "domain" in ln]
    assert set(M.VLLM_ALIASES.values()) == set(M.VLLM_METRICS)
    assert all(n.startswith("vllm:spec_decode_num_") and n.endswith("_total") for n in M.VLLM_METRICS)


def test_drafter_version_is_a_gauge():
    spec = M.METRICS[M.DRAFTER_VERSION]
    assert spec.metric_type == "gauge" and spec.labels == ()
    reg = CollectorRegistry()
    m = M.Metrics(reg)
    for v in (3, 4):
        m.set_versions(drafter_version=v)
    assert sample(reg, M.DRAFTER_VERSION) == 4
