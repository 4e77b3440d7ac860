"""What a caller without a token can see (issue 27 §4): a minimal liveness answer, no paths, pids or
reasons; the full health document only with the admin token; the API docs pages only when configured."""

from __future__ import annotations

import pytest
from test_serving_helpers import ServerThread, guarded_config

API_KEY, ADMIN = "k", "admin-secret"
PUBLIC = {"status", "drafter_version", "target_version"}


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory, allowed_dir):
    run = tmp_path_factory.mktemp("open-run")
    with ServerThread(guarded_config(tiny_pair_dir, run, API_KEY, ADMIN, allowed_dir)) as s:
        yield s


def test_health_without_admin_token_is_minimal(server) -> None:
    run_dir = str(server.cfg.run_dir)
    for token in (None, API_KEY, "wrong"):
        with server.client(token=token) as c:
            r = c.get("/health")
        assert r.status_code == 200
        body = r.json()
        assert set(body) == PUBLIC, sorted(body)
        assert body["status"] == "ok" and body["target_version"] == 0
        assert run_dir not in r.text and "feedback" not in r.text and "pid" not in r.text


def test_health_with_admin_token_has_the_details(server) -> None:
    with server.client(token=ADMIN) as admin:
        full = admin.get("/health").json()
        status = admin.get("/admin/status").json()
    assert PUBLIC <= set(full)
    assert full["feedback"]["dir"] == server.cfg.feedback.dir and "trainer" in full and "reasons" in full
    assert "feedback" in status


def test_api_docs_are_off_by_default(server) -> None:
    with server.client(token=ADMIN) as c:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404, path


def test_api_docs_can_be_switched_on(tiny_pair_dir, tmp_path, allowed_dir) -> None:
    cfg = guarded_config(tiny_pair_dir, tmp_path, API_KEY, ADMIN, allowed_dir, "serve.api_docs=true")
    with ServerThread(cfg) as s, s.client() as c:
        assert c.get("/openapi.json").status_code == 200
        assert c.get("/docs").status_code == 200


# -- issue 36 item 12: /metrics behind the API key unless configured open ----------------------------
def test_metrics_need_the_api_key_when_one_is_set(server) -> None:
    """/metrics shows per-domain traffic, α, latency, refusals and trainer state: no key, no metrics."""
    for token in (None, "wrong"):
        with server.client(token=token) as c:
            r = c.get("/metrics")
        assert r.status_code == 401, (token, r.text)
        assert "dvi_" not in r.text and r.json()["error"]["type"] == "authentication_error"
    for token in (API_KEY, ADMIN):  # what a Prometheus scraper sends as its bearer token
        with server.client(token=token) as c:
            r = c.get("/metrics")
        assert r.status_code == 200 and "dvi_requests_rejected_total" in r.text, token


def test_metrics_access_open_and_admin(tiny_pair_dir, tmp_path, allowed_dir) -> None:
    cfg = guarded_config(tiny_pair_dir, tmp_path / "open", API_KEY, ADMIN, allowed_dir, "serve.metrics_access=open")
    with ServerThread(cfg) as s, s.client() as c:
        assert c.get("/metrics").status_code == 200
    cfg = guarded_config(tiny_pair_dir, tmp_path / "admin", API_KEY, ADMIN, allowed_dir, "serve.metrics_access=admin")
    with ServerThread(cfg) as s:
        for token, status in ((None, 401), (API_KEY, 403), (ADMIN, 200)):
            with s.client(token=token) as c:
                assert c.get("/metrics").status_code == status, token


def test_metrics_access_admin_without_a_token_is_refused_at_load(tiny_pair_dir, tmp_path) -> None:
    from test_serving_helpers import tiny_config

    with pytest.raises(ValueError, match="metrics_access"):
        tiny_config(tiny_pair_dir, tmp_path, "serve.metrics_access=admin", "serve.admin_token=''")


# -- issue 36 item 13: the Authorization scheme is case-insensitive ----------------------------------
@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_bearer_scheme_in_any_case(server, scheme) -> None:
    with server.client(Authorization=f"{scheme} {API_KEY}") as c:
        assert c.get("/v1/models").status_code == 200
        assert c.get("/metrics").status_code == 200
    with server.client(Authorization=f"{scheme} {ADMIN}") as c:
        assert c.get("/admin/status").status_code == 200
        assert "feedback" in c.get("/health").json()
    with server.client(Authorization=f"Basic {API_KEY}") as c:  # another scheme is still no key
        assert c.get("/v1/models").status_code == 401
