"""The demo's scenario on the test pair: its phases and the frozen drafter's reference α."""

from __future__ import annotations

import itertools

from dvi.config import load_config
from dvi.models.loading import load_tokenizer
from serving import demo


def _cfg(tiny_pair_dir):
    return load_config(None, ["models.preset=tiny", f"models.target={tiny_pair_dir / 'target'}",
                              f"models.drafter={tiny_pair_dir / 'drafter'}",
                              f"models.tokenizer={tiny_pair_dir / 'tokenizer'}", "speculation.adaptive=false",
                              "speculation.num_draft_tokens=3"])


def test_phases_drift_away_from_code_and_back_to_the_drift_after_the_update(tiny_pair_dir):
    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    phases = demo._phases(cfg, tok, 5)
    assert [p.domain for p in phases] == ["code", "prose", "prose"]  # no chat template: prose drifts
    assert all(p.n == 5 for p in phases)


def test_phases_drift_to_sql_for_a_chat_tokenizer(tiny_pair_dir):
    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    phases = demo._phases(cfg, tok, 5)
    assert [p.domain for p in phases] == ["code", "sql", "sql"]
    endpoint, body = phases[1].request()
    assert endpoint == "/v1/chat/completions" and "CREATE TABLE" in body["messages"][0]["content"]
    assert body["metadata"] == {"domain": "sql"}


def test_frozen_reference_is_the_engine_alpha_per_domain(tiny_pair_dir):
    """One α per phase domain, in [0, 1], deterministic (greedy), and the table says the gain over it."""
    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    ref = demo._frozen_reference(cfg, tok, k=2)
    assert set(ref) == {"code", "prose"} and all(0.0 <= a <= 1.0 for a in ref.values())
    assert demo._frozen_reference(cfg, tok, k=2) == ref
    t = demo.Timeline(window=2)
    t.frozen = ref
    for _ in range(2):
        t.add("code", {"accepted": 3, "drafted": 6, "steps": 4, "drafter_version": 0, "target_version": 0}, "code")
    assert t.rows[0]["domain"] == "code" and t.rows[0]["alpha"] == 0.5
    assert list(itertools.islice(demo._phases(cfg, tok, 2)[0].prompts, 2)) == [
        list(x) for x in itertools.islice(demo._phases(cfg, tok, 2)[0].prompts, 2)]


def test_every_demo_and_soak_domain_gets_its_own_metrics_series():
    """The server pools any `metadata.domain` outside `serve.domains` as "other": the drift domain must be in."""
    from benchmarks import soak

    domains = set(load_config(None).serve.domains)
    assert {"code", "prose", "chat", "sql"} | set(soak.DOMAINS) <= domains
