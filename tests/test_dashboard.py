"""The Grafana dashboard dvi ships (issue 59 §4): the shipped JSON is the one `dvi.metrics.dashboard` builds from
`dvi.metrics.names`, and every series any of its queries names is one a live `dvi serve` exports on /metrics."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from test_serving_helpers import TEST_ADMIN_TOKEN, tiny_config

from dvi.metrics import dashboard as D
from dvi.metrics import names as N

# what a few requests make a server sample (the rest are declared and fill in as events happen)
TRAFFIC_SERIES = (N.NUM_DRAFTS, N.NUM_DRAFT_TOKENS, N.NUM_ACCEPTED_TOKENS, N.NUM_ACCEPTED_PER_POS,
                  N.NUM_DRAFTED_PER_POS, N.GENERATION_TOKENS, N.REQUESTS, N.REQUEST_LATENCY + "_bucket",
                  N.TIME_TO_FIRST_TOKEN + "_bucket", N.REQUEST_ACCEPTANCE + "_bucket", N.SOURCE_DRAFT_TOKENS,
                  N.SOURCE_ACCEPTED_TOKENS, N.DRAFTER_VERSION, N.TRAINER_STATE, N.TOKENS_PER_SECOND)


def _catalogue_series() -> set[str]:
    """The series names the catalogue's specs give Prometheus (a histogram's _bucket/_sum/_count)."""
    out = set()
    for spec in (*N.METRICS.values(), *N.VLLM_METRICS.values()):
        if spec.metric_type == "histogram":
            out |= {spec.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            out.add(spec.name)
    return out


def _misspelled(dashboard: dict) -> tuple[dict, str]:
    """`dashboard` with one name in one query misspelled (a letter dropped), and that name."""
    bad = copy.deepcopy(dashboard)
    p = next(p for p in bad["panels"] if p.get("targets"))
    wrong = N.NUM_ACCEPTED_TOKENS.replace("accepted", "acepted")
    p["targets"][0]["expr"] = p["targets"][0]["expr"].replace(N.NUM_ACCEPTED_TOKENS, wrong)
    assert wrong in p["targets"][0]["expr"]
    return bad, wrong


def test_shipped_json_is_the_generated_dashboard() -> None:
    """One source of truth: the shipped file is `build_dashboard()` as written (regenerate:
    `python -m dvi.metrics.dashboard`)."""
    assert D.DASHBOARD_PATH.read_text(encoding="utf-8") == D.dashboard_json(), \
        "dvi/metrics/grafana/dvi.json is stale: run `python -m dvi.metrics.dashboard`"
    d = json.loads(D.DASHBOARD_PATH.read_text(encoding="utf-8"))
    titles = [p["title"] for p in d["panels"]]
    for want in ("α by drafter version", "α by traffic group (domain)", "Tokens per target pass (drafting steps)",
                 "Promotions, rollbacks, refusals", "Trainer state", "Feedback: records served vs trained",
                 "Per-request acceptance (histogram)", "Low-acceptance requests", "Generated tokens/s",
                 "Request latency"):
        assert want in titles
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])


def test_every_query_names_catalogued_series() -> None:
    known = _catalogue_series()
    qs = D.queries(D.build_dashboard())
    assert len(qs) > 40
    for q in qs:
        names = D.series_names(q)
        assert names, q
        assert names <= known, (q, names - known)


def test_series_names_parses_promql() -> None:
    sn = D.series_names
    assert sn('sum by (le, domain) (rate(a_bucket{instance=~"$instance",x="y{z}"}[$__rate_interval]))') == {"a_bucket"}
    assert sn("histogram_quantile(0.99, sum by (le) (rate(b_bucket[5m])))") == {"b_bucket"}
    assert sn("1 + sum(rate(a_total[1m])) / scalar(sum(rate(b_total[1m]))) > 0.5e-3") == {"a_total", "b_total"}
    assert sn("a / on (x) group_left (y) b offset 5m") == {"a", "b"}
    assert sn("vllm:spec_decode_num_drafts_total") == {"vllm:spec_decode_num_drafts_total"}
    assert D.queries({"templating": {"list": [{"type": "query", "query": {"query": "label_values(m, instance)"}}]}}) \
        == ["m"]


def test_checker_catches_a_misspelled_name_and_a_bare_histogram() -> None:
    """The checker can fail: against a server's exposition (here an in-process registry) a misspelled name, and a
    histogram's bare name (Prometheus stores only its _bucket/_sum/_count series), are reported."""
    from prometheus_client import CollectorRegistry, generate_latest

    from dvi.metrics import Metrics

    reg = CollectorRegistry()
    Metrics(reg)
    text = generate_latest(reg).decode()
    assert D.missing_series(D.build_dashboard(), text) == {}
    bad, wrong = _misspelled(D.build_dashboard())
    missing = D.missing_series(bad, text)
    assert list(missing.values()) == [{wrong}]
    bare = D.build_dashboard()
    bare["panels"][1]["targets"][0]["expr"] = f"sum(rate({N.REQUEST_LATENCY}[5m]))"
    assert list(D.missing_series(bare, text).values()) == [{N.REQUEST_LATENCY}]


@pytest.mark.slow
def test_dashboard_against_a_live_server(tiny_pair_dir, tmp_path) -> None:
    """`dvi serve` on the tiny pair, a few completions and chats (streamed and not, two domains), then /metrics:
    every series every dashboard query names is exported, the traffic panels have samples, and the same check
    reports a misspelled name."""
    import yaml

    from dvi.config import dump_config
    from serving.server_process import ServerProcess

    cfg = tiny_config(tiny_pair_dir, tmp_path)
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    with ServerProcess(["--config", str(path)], tmp_path / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=120,
                          headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}) as c:
            for i, prompt in enumerate(["def main(argv):\n", "import os\nimport sys\n", "for i in range("]):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "stream": i == 1,
                                                    "metadata": {"domain": "code"}})
                assert r.status_code == 200, r.text
            for content in ("hello there", "say something"):
                r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                         "max_tokens": 24, "metadata": {"domain": "chat"}})
                assert r.status_code == 200, r.text
            r = c.get("/metrics")
            assert r.status_code == 200, r.text
            text = r.text
    dash = json.loads(D.DASHBOARD_PATH.read_text(encoding="utf-8"))
    assert D.missing_series(dash, text) == {}
    exported, sampled = D.exported_series(text)
    named = set().union(*(D.series_names(q) for q in D.queries(dash)))
    assert set(TRAFFIC_SERIES) <= named
    assert set(TRAFFIC_SERIES) <= sampled, set(TRAFFIC_SERIES) - sampled
    bad, wrong = _misspelled(dash)
    assert list(D.missing_series(bad, text).values()) == [{wrong}]
