"""Slow clients against a real server on real sockets (issue 27 §7).

A client that sends its headers or its body a byte at a time must not hold a connection past the
configured deadlines (`serve.header_timeout_s`, `serve.body_timeout_s`): it gets a 408 and the
connection is closed. Meanwhile a bystander is served as fast as without them. Every socket here
has its own timeout, so a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from test_serving_helpers import ServerThread, tiny_config

HEADER_S, BODY_S = 1.0, 1.5
N_SLOW = 6


@pytest.fixture(scope="module")
def server(tiny_pair_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("slow-run")
    cfg = tiny_config(tiny_pair_dir, run, f"serve.header_timeout_s={HEADER_S}", f"serve.body_timeout_s={BODY_S}")
    with ServerThread(cfg) as s:
        yield s


def _trickle(url: str, data: bytes, every_s: float, give_up_s: float) -> tuple[float, bytes]:
    """Send `data` a byte at a time; (seconds until the server closed or answered, what it answered).

    Stops sending once the server has answered or closed; gives up (returns give_up_s) after that long."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    got = b""
    with socket.create_connection((host, int(port)), timeout=give_up_s) as sock:
        sock.settimeout(every_s)
        for i in range(len(data)):
            if time.monotonic() - t0 > give_up_s:
                return give_up_s, got
            try:
                sock.sendall(data[i:i + 1])
            except OSError:  # reset by the server
                return time.monotonic() - t0, got
            try:
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return time.monotonic() - t0, got
            got += chunk
            if not chunk or got:
                sock.settimeout(1.0)
                try:
                    while chunk := sock.recv(4096):
                        got += chunk
                except OSError:
                    pass
                return time.monotonic() - t0, got
    return time.monotonic() - t0, got


def _request(body: bytes = b'{"prompt": "def f(", "max_tokens": 4}') -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body)) + body


def test_slow_headers_are_cut_at_the_header_deadline(server) -> None:
    took, got = _trickle(server.url, _request(), every_s=0.1, give_up_s=8.0)
    assert took < HEADER_S + 1.5, f"a client trickling its headers held the connection {took:.1f}s"
    assert got.startswith(b"HTTP/1.1 408"), got[:80]


def test_slow_body_is_cut_at_the_body_deadline(server) -> None:
    req = _request(b'{"prompt": "' + b"x" * 200 + b'", "max_tokens": 4}')
    head, body = req.split(b"\r\n\r\n", 1)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head + b"\r\n\r\n")
        t0 = time.monotonic()
        took, got = None, b""
        sock.settimeout(0.2)
        for i in range(len(body)):
            if time.monotonic() - t0 > 8.0:
                break
            try:
                sock.sendall(body[i:i + 1])
                chunk = sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            got += chunk
            took = time.monotonic() - t0
            break
    assert took is not None and took < BODY_S + 1.5, f"a client trickling its body held the connection {took}s"
    assert got.startswith(b"HTTP/1.1 408"), got[:80]


def test_bystander_is_served_while_slow_clients_trickle(server) -> None:
    with server.client() as c:
        c.post("/v1/completions", json={"prompt": "warm", "max_tokens": 4})
        t0 = time.monotonic()
        for _ in range(3):
            assert c.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 8}).status_code == 200
        alone = (time.monotonic() - t0) / 3
    results: list[tuple[float, bytes]] = []
    slow = [threading.Thread(target=lambda: results.append(_trickle(server.url, _request(), 0.05, 8.0)))
            for _ in range(N_SLOW)]
    for t in slow:
        t.start()
    time.sleep(0.3)
    lat = []
    with server.client() as c:
        for _ in range(3):
            t0 = time.monotonic()
            r = c.post("/v1/completions", json={"prompt": "def f(", "max_tokens": 8})
            lat.append(time.monotonic() - t0)
            assert r.status_code == 200, r.text
    for t in slow:
        t.join(15)
    assert max(lat) < max(1.0, 5 * alone), (lat, alone)
    assert len(results) == N_SLOW and all(took < HEADER_S + 1.5 for took, _ in results), results


def test_cut_connections_are_counted(server) -> None:
    from dvi import metrics as M

    with server.client() as c:
        text = c.get("/metrics").text
    counts = {ln.split('phase="')[1].split('"')[0]: float(ln.split()[-1]) for ln in text.splitlines()
              if ln.startswith(M.HTTP_REQUEST_TIMEOUTS + "{")}
    assert counts.get("headers", 0) >= 1 + N_SLOW and counts.get("body", 0) >= 1, counts


def test_silent_connection_is_closed_at_the_header_deadline(server) -> None:
    # connect and send nothing: uvicorn arms no timer before the first byte of the first request
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=8.0) as sock:
        t0 = time.monotonic()
        try:
            got = sock.recv(4096)
        except TimeoutError:
            got = None
        took = time.monotonic() - t0
    assert got == b"" and took < HEADER_S + 1.5, (got, took)


def test_oversized_headers_are_refused(server) -> None:
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=8.0) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (server.cfg.serve.max_header_bytes + 1024)
                     + b"\r\n\r\n")
        got = sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 431"), got[:80]  # whole at once: our limit (trickled: h11's 400)
