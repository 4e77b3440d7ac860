"""Shutdown drains (issue 27 §1): a signal with requests in flight fails none of them silently.

On SIGTERM/SIGINT a real `dvi serve` process stops accepting work (JSON 503 + Retry-After),
lets the requests it has finish for up to `serve.drain_timeout_s`, then ends the rest with a JSON
503 (non-streamed) or an SSE error event and `data: [DONE]` (streamed), writes what was cut to the
feedback log (finish_reason "shutdown"), counts it on /metrics and exits 0 with its trainer stopped.
Before the fix: uvicorn cancelled the handlers after its 5 s window (plain-text 500s, streams cut
without `[DONE]`) and the process died of the re-raised signal.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serving_helpers import TEST_ADMIN_TOKEN, ServerThread, sse_events, tiny_config, wait_for

from dvi import metrics as M
from dvi.feedback import FeedbackReader

pytestmark = pytest.mark.slow

PROMPT = "def main(argv):\n"
LONG, MID, SHORT = 1000, 400, 48  # tokens; 40 long ones at batch 4 take ~10 s on the tiny pair, longer than the drain
DRAIN_S = 6


@functools.cache
def _no_eos(tiny_pair_dir: Path) -> dict[str, float]:
    """A `logit_bias` that bans the pair's eos, so every answer runs to its max tokens: how early a sampled eos comes
    depends on the dtype (the tiny pair serves bf16 on a bf16-native CPU, and there the long answers ended within the
    drain, Intel AMX)."""
    eos = json.loads((tiny_pair_dir / "target" / "config.json").read_text())["eos_token_id"]
    return {str(eos): -100.0}


class Clients:
    """Plain and streamed completions in threads; each outcome is kept raw (status, headers, body)."""

    def __init__(self, url: str, tiny_pair_dir: Path) -> None:
        self.url = url
        self.no_eos = _no_eos(tiny_pair_dir)
        self.results: list[dict] = []
        self.first_delta = threading.Event()
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, stream: bool, max_tokens: int, n: int) -> None:
        for _ in range(n):
            t = threading.Thread(target=self._one, args=(stream, max_tokens), daemon=True)
            t.start()
            self.threads.append(t)

    def _one(self, stream: bool, max_tokens: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "stream": stream, "temperature": 1.0, "seed": 1,
                "logit_bias": self.no_eos}
        out: dict = {"stream": stream, "max_tokens": max_tokens}
        try:
            with httpx.Client(base_url=self.url, timeout=120) as c, c.stream("POST", "/v1/completions",
                                                                                json=body) as r:
                out["status"], out["headers"] = r.status_code, dict(r.headers)
                chunks = []
                for chunk in r.iter_text():
                    chunks.append(chunk)
                    if stream and '"text"' in chunk:
                        self.first_delta.set()
                out["body"] = "".join(chunks)
        except httpx.HTTPError as exc:
            out["exc"] = repr(exc)
        out["t_end"] = time.monotonic()
        with self._lock:
            self.results.append(out)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a client hung after the server stopped"


def _outcome(r: dict) -> str:
    """'done' (finished with a finish_reason), 'cut' (told so: a JSON 503 / an SSE error then [DONE]),
    or a description of what went wrong."""
    if "exc" in r:
        return f"transport error {r['exc']}"
    if not r["stream"] or r["status"] != 200:
        try:
            body = json.loads(r["body"])
        except ValueError:
            return f"non-JSON {r['status']}: {r['body'][:80]!r}"
        if r["status"] == 200 and body["choices"][0]["finish_reason"] in ("stop", "length"):
            return "done"
        if r["status"] == 503 and body["error"]["code"] == "shutting_down":
            return "cut"
        return f"unexpected {r['status']}: {r['body'][:120]!r}"
    try:
        events = sse_events(r["body"])
    except (AssertionError, ValueError):
        return f"unparsable stream {r['body'][-120:]!r}"
    if len(events) < 2 or events[-1] != "[DONE]":
        return f"stream ended without [DONE] ({len(events)} events)"
    last = events[-2]
    if "error" in last and last["error"]["code"] == "shutting_down":
        return "cut"
    if "choices" in last and last["choices"][0]["finish_reason"] in ("stop", "length"):
        return "done"
    return f"stream ended with {last!r}"


def _gauge(url: str, name: str) -> float:
    lines = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[1]) if lines else 0.0


def _serve_cfg(tiny_pair_dir, tmp_path, *extra: str):
    return tiny_config(tiny_pair_dir, tmp_path, "serve.max_batch_size=4", f"serve.drain_timeout_s={DRAIN_S}",
                       "serve.max_tokens_limit=1000", "speculation.num_draft_tokens=2", *extra)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_then_cuts_with_an_answer_and_exits_cleanly(tiny_pair_dir, tmp_path, sig) -> None:
    import yaml

    from dvi.config import dump_config
    from serving.server_process import ServerProcess

    cfg = _serve_cfg(tiny_pair_dir, tmp_path, "serve.trainer=supervised")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    admin = {"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}  # dump_config leaves secrets out: pass it again
    with ServerProcess(["--config", str(path), f"serve.admin_token={TEST_ADMIN_TOKEN}"], tmp_path / "server.log") as srv:
        trainer_pid = wait_for(lambda: httpx.get(srv.url + "/health", headers=admin).json()["trainer"]["pid"], 60,
                               what="trainer pid")
        clients = Clients(srv.url, tiny_pair_dir)
        for stream in (False, True):  # the short ones take the batch first, the long ones queue behind
            clients.start(stream, SHORT, 2)
        time.sleep(0.3)
        for stream in (False, True):
            clients.start(stream, LONG, 20)
        wait_for(lambda: _gauge(srv.url, M.QUEUE_DEPTH) >= 36, 60, what="every long request queued")
        t_sig = time.monotonic()
        srv.proc.send_signal(sig)
        time.sleep(0.3)
        try:
            late = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}, timeout=30)
        except httpx.HTTPError as exc:  # before the fix: the listener closed at once
            late = exc
        clients.join(60)
        rc = srv.proc.wait(60)
        elapsed = time.monotonic() - t_sig
    log = (tmp_path / "server.log").read_text()
    outcomes = [_outcome(r) for r in clients.results]
    bad = [o for o in outcomes if o not in ("done", "cut")]
    assert not bad, (bad, log[-3000:])
    assert isinstance(late, httpx.Response), late
    assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
    assert int(late.headers["retry-after"]) > 0
    # requests in flight at the signal finished during the drain; the rest were cut with an answer
    assert any(o == "done" and r["t_end"] > t_sig for o, r in zip(outcomes, clients.results, strict=True)), outcomes
    cut = [o for o in outcomes if o == "cut"]
    assert cut, outcomes
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert elapsed < DRAIN_S + 20, elapsed
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(trainer_pid, 0)
            time.sleep(0.1)
    # every request that reached the engine is in the feedback log: the finished ones, and those the cut
    # found decoding (at most a full batch: a row may have just left it) as "shutdown"; the waiting ones
    # never produced a token
    reader = FeedbackReader(cfg.feedback.dir)
    reasons = [r.finish_reason for r in reader.read_records(reader.list_shards())]
    assert sum(r in ("stop", "length") for r in reasons) == outcomes.count("done"), reasons
    assert 1 <= reasons.count("shutdown") <= cfg.serve.max_batch_size, reasons
    assert len(reasons) == outcomes.count("done") + reasons.count("shutdown"), reasons


def test_cut_requests_are_counted_on_metrics(tiny_pair_dir, tmp_path) -> None:
    """The in-process server: what the drain cut is on /metrics, by stage (no drain window: cut at once)."""
    cfg = _serve_cfg(tiny_pair_dir, tmp_path, "serve.drain_timeout_s=0", "serve.max_batch_size=2")
    with ServerThread(cfg) as srv:
        clients = Clients(srv.url, tiny_pair_dir)
        clients.start(True, LONG, 2)
        clients.start(False, LONG, 6)  # waiting: the batch holds 2
        # all 6 queued before the cut: one still on its way in would be refused at the door (a 503 "cut" that is
        # neither running nor waiting; seen once in the full suite)
        # and both running: under load the second one was seen still queued when six waited (1 running, 7 waiting)
        wait_for(lambda: srv.state.scheduler.queue_depth() >= 6 and srv.state.scheduler.num_running() == 2, 30,
                 what="a full batch and requests waiting")
        srv.server.should_exit = True
        clients.join(60)
        srv.thread.join(30)
    body = srv.state.metrics.render()[0].decode()
    counts = {stage: sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                         if line.startswith(M.REQUESTS_CUT + "{") and f'stage="{stage}"' in line)
              for stage in ("running", "waiting")}
    outcomes = [_outcome(r) for r in clients.results]
    assert set(outcomes) <= {"done", "cut"}, outcomes
    assert counts["running"] == 2.0, counts  # a full batch
    assert counts["running"] + counts["waiting"] == outcomes.count("cut") >= 4, (counts, outcomes)


def test_a_second_signal_cuts_at_once(tiny_pair_dir, tmp_path) -> None:
    """With a long drain window, a second SIGTERM ends the drain: everything still running is cut now."""
    cfg = _serve_cfg(tiny_pair_dir, tmp_path, "serve.drain_timeout_s=120")
    with ServerThread(cfg) as srv:
        clients = Clients(srv.url, tiny_pair_dir)
        clients.start(True, LONG, 4)
        clients.start(False, LONG, 8)
        wait_for(lambda: srv.state.scheduler.queue_depth() >= 6, 30, what="requests queued")
        t0 = time.monotonic()
        srv.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        time.sleep(0.5)
        assert srv.thread.is_alive()  # draining
        srv.server.handle_exit(signal.SIGTERM, None)
        clients.join(30)
        srv.thread.join(30)
        took = time.monotonic() - t0
    outcomes = [_outcome(r) for r in clients.results]
    assert set(outcomes) <= {"done", "cut"} and "cut" in outcomes, outcomes
    assert took < 15, took


EXIT_AFTER_LAST_ANSWER_S = 6.0
"""Issue 42 §3: a drained server exited 11-17 s after its last answer (it waited on its trainer's last round,
publish and interpreter teardown, one after the other, after the drain, then spent 4-6 s in its own teardown).
The goal is <= 5 s; the stop now waits at most ~3.5 s after the drain (`serving.wiring.TRAINER_STOP_S`), 6 leaves
a loaded 2-core machine its margin and still fails that hang (8.3 s in this test before the fix)."""


def _request_id(r: dict) -> str | None:
    """The `dvi.request_id` of an answered request (the plain body's, or the stream's last chunk's)."""
    if not r["stream"]:
        return json.loads(r["body"]).get("dvi", {}).get("request_id")
    return next((e["dvi"]["request_id"] for e in sse_events(r["body"]) if isinstance(e, dict) and "dvi" in e), None)


def test_48_in_flight_all_answered_then_the_process_is_gone_within_seconds(tiny_pair_dir, tmp_path) -> None:
    """A real `dvi serve` with a training trainer, 48 requests in flight (24 streamed, 24 plain), SIGTERM: every one
    finishes in the drain, the process (trainer stopped) is gone within seconds of the last answer, exits 0, and
    the feedback log holds exactly one record per answered request. (SIGINT takes the same drain:
    `test_signal_drains_then_cuts_with_an_answer_and_exits_cleanly` sends both.)"""
    sig = signal.SIGTERM
    import yaml

    from dvi.config import dump_config
    from dvi.rundir import RunDir
    from serving.server_process import ServerProcess

    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.trainer=supervised", "serve.max_batch_size=8",
                      "serve.drain_timeout_s=60")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    admin = {"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}
    rundir = RunDir.of(cfg)

    def engine() -> dict:
        return httpx.get(srv.url + "/health", headers=admin, timeout=30).json()["engine"]

    with ServerProcess(["--config", str(path), f"serve.admin_token={TEST_ADMIN_TOKEN}"], tmp_path / "server.log") as srv:
        trainer_pid = wait_for(lambda: httpx.get(srv.url + "/health", headers=admin).json()["trainer"]["pid"], 60,
                               what="trainer pid")
        warm = Clients(srv.url, tiny_pair_dir)
        deadline = time.monotonic() + 180
        while rundir.read_trainer_status().get("dvi_trainer_step", 0) < 1:  # the trainer trains when told to stop
            assert time.monotonic() < deadline, "the trainer took no step"
            batch = Clients(srv.url, tiny_pair_dir)
            for stream in (False, True):
                batch.start(stream, SHORT, 8)
            batch.join(120)
            warm.results += batch.results
        completed0 = engine()["completed"]
        clients = Clients(srv.url, tiny_pair_dir)
        for stream in (False, True):  # long enough that the first ones are still running when the last come in
            clients.start(stream, MID, 24)  # (with SHORT on a loaded machine: 32 of 48 done before the last came in)
        e = wait_for(lambda: (lambda e: e if e["running"] + e["queue"] + e["completed"] - completed0 >= 48 else None)(
            engine()), 60, interval=0.02, what="all 48 requests in")
        in_flight = e["running"] + e["queue"]
        t_sig = time.monotonic()
        srv.proc.send_signal(sig)
        clients.join(120)
        t_last = max(r["t_end"] for r in clients.results)
        rc = srv.proc.wait(60)
        exit_after = time.monotonic() - t_last
    log = (tmp_path / "server.log").read_text()
    print(f"{sig!r}: {in_flight} in flight, last answer {t_last - t_sig:.2f}s after the signal, process gone "
          f"{exit_after:.2f}s after it (warm-up: {len(warm.results)} requests)")
    assert in_flight >= 40, in_flight  # (the tiny pair may finish a few while the last ones come in)
    outcomes = [_outcome(r) for r in clients.results]
    assert len(outcomes) == 48 and outcomes == ["done"] * 48, (outcomes, log[-3000:])
    assert rc == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert exit_after <= EXIT_AFTER_LAST_ANSWER_S, (f"exited {exit_after:.1f}s after the last answer", log[-3000:])
    assert "stopped in" in log, log[-3000:]  # the state's stop ran (trainer, watcher, engine, feedback flush)
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(trainer_pid, 0)
            time.sleep(0.1)
    # 0 records lost: one record per answered request (the warm-up's and the 48), none twice, none other
    answered = [_request_id(r) for r in warm.results + clients.results if _outcome(r) == "done"]
    assert None not in answered and len(answered) == len(warm.results) + 48, answered
    reader = FeedbackReader(cfg.feedback.dir)
    logged = [r.request_id for r in reader.read_records(reader.list_shards())]
    assert sorted(logged) == sorted(answered), (len(logged), len(answered))
