"""dvi's engine in a process of its own (`serve.engine_process`, the default; `serving.engine_core` and
`serving.engine_process`): what a client gets is what it gets from the engine as a thread, the final records reach the
server's subscribers, commands cross, a client gone frees its row, and the engine process dying fails requests and
reads down instead of hanging. Real servers, real engine processes, the tiny pair."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from test_serving_helpers import (
    PROMPTS,
    TEST_ADMIN_TOKEN,
    ServerThread,
    drafter_lane,
    lora_copy,
    tiny_config,
    wait_for,
)

from dvi import metrics as M
from serving.engine_client import AddHistory, SetDrafter

pytestmark = pytest.mark.slow



def test_the_server_side_pair_holds_no_target_weights(tiny_pair_dir, tmp_path) -> None:
    """The server's process beside an engine process loads the target's configs and shapes, not its weights: the same
    vocabulary, eos ids and checks as the whole pair, every target tensor on the meta device, the drafter real."""
    from serving.loading import load_serving_pair

    cfg = tiny_config(tiny_pair_dir, tmp_path)
    whole, shape = load_serving_pair(cfg), load_serving_pair(cfg, target_weights=False)
    assert {t.device.type for t in shape.target.state_dict().values()} == {"meta"}
    assert {t.device.type for t in whole.target.state_dict().values()} == {"cpu"}
    assert shape.target.get_output_embeddings().weight.shape == whole.target.get_output_embeddings().weight.shape
    assert shape.target.config.to_dict() == whole.target.config.to_dict()
    assert shape.stop_ids == whole.stop_ids and shape.warnings == whole.warnings
    assert shape.drafter is not None and next(shape.drafter.parameters()).device.type == "cpu"
    for a, b in zip(shape.drafter.state_dict().values(), whole.drafter.state_dict().values(), strict=True):
        assert (a == b).all()


def _answers(s: ServerThread) -> list:
    """Greedy answers: plain, streamed with a stop string, and a request of three choices."""
    out = []
    with s.client() as c:
        for p in PROMPTS:
            r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 16, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append((r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]))
        r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "stream": True, "stop": ["\n\n"]})
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        out.append(("".join(ch["choices"][0]["text"] for ch in chunks), chunks[-1]["choices"][0]["finish_reason"]))
        r = c.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 12, "n": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        out.append(tuple(ch["text"] for ch in r.json()["choices"]))
    return out


def test_an_engine_process_answers_as_an_engine_thread_and_feeds_the_server(tiny_pair_dir, tmp_path) -> None:
    thread_cfg = tiny_config(tiny_pair_dir, tmp_path / "t")
    with ServerThread(thread_cfg) as s:
        want = _answers(s)
        shape = (s.state.vocab_size, s.state.context_len, s.state.tokenizer_warnings)
    cfg = tiny_config(tiny_pair_dir, tmp_path / "p", "serve.engine_process=true")
    with ServerThread(cfg) as s:
        assert _answers(s) == want
        assert (s.state.vocab_size, s.state.context_len, s.state.tokenizer_warnings) == shape
        engine = s.health()["engine"]
        assert engine["alive"] and engine["pid"] != os.getpid() and engine["completed"] >= 8
        os.kill(engine["pid"], 0)  # the engine's own process
        with s.client() as c:  # the final records reached the telemetry in the server's process
            metrics = c.get("/metrics").text
        done = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(M.REQUESTS + "{"))
        assert done >= 8, metrics[:2000]
        assert float(next(line for line in metrics.splitlines() if line.startswith(M.ENGINE_STEPS + " ")).split()[1]) > 0
        pid = engine["pid"]
    with pytest.raises(ProcessLookupError):  # the server's stop stopped its engine
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
    # and the feedback log (written in the server's process) holds every request
    from dvi.feedback.dataset import open_feedback

    assert len(open_feedback(cfg.feedback.dir)) >= 8


def test_commands_cross_into_the_engine_process(tiny_pair_dir, tmp_path) -> None:
    """A drafter (a module with LoRA layers) and history travel by value; the future resolves once the snapshot
    shows the swap; greedy text does not move; a command that fails raises through its future."""
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.engine_process=true")
    with ServerThread(cfg) as s:
        with s.client() as c:
            ref = c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 16}).json()["choices"][0]["text"]
            s.state.scheduler.command(SetDrafter(lora_copy(drafter_lane(s).base, seed=3), 7)).result(timeout=60)
            assert s.state.scheduler.snapshot.drafter_version == 7
            r = c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 16}).json()
            assert r["choices"][0]["text"] == ref and r["dvi"]["drafter_version"] == 7
            assert s.state.scheduler.command(AddHistory((("h1", (1, 2, 3)),))).result(timeout=60) == 1
            with pytest.raises(Exception):  # noqa: B017 - whatever the engine raises, raised here
                s.state.scheduler.command(SetDrafter("not a drafter", 8)).result(timeout=60)
            assert s.state.scheduler.snapshot.drafter_version == 7
            assert c.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 16}).status_code == 200


def _first_text(lines) -> str:
    """Read a completions stream up to its first text (an error chunk fails the test)."""
    for line in lines:
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"][0]["text"]:
                return chunk["choices"][0]["text"]
    return ""


def test_a_client_gone_frees_its_row_in_the_engine_process(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.engine_process=true")
    with ServerThread(cfg) as s:
        seen: list = []
        s.state.scheduler.finished.subscribe(seen.append)  # the final records, published in the server's process
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1000, "stream": True,
                                                           "ignore_eos": True}) as r:
                assert _first_text(r.iter_lines())
        wait_for(lambda: seen and s.state.scheduler.snapshot.running == 0 and not s.state.scheduler.busy(), 30,
                 what="the gone client's row freed")
        assert seen[0].finish_reason == "abort" and len(seen[0].token_ids) < 1000
        assert s.state.scheduler.snapshot.completed == 1


def test_the_engine_process_dying_fails_requests_and_reads_down(tiny_pair_dir, tmp_path) -> None:
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.engine_process=true")
    with ServerThread(cfg) as s:
        pid = s.health()["engine"]["pid"]
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1000, "stream": True,
                                                           "ignore_eos": True}) as r:
                lines = r.iter_lines()
                assert _first_text(lines)
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                rest = list(lines)  # the stream ends, with the error, instead of hanging
            assert time.monotonic() - t0 < 30
            errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and "error" in x]
            assert errors and "engine process exited" in errors[-1]["error"]["message"], rest[-3:]
            h = s.health()
            assert h["status"] == "down" and not h["engine"]["alive"], h["reasons"]
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4})
            assert r.status_code == 503, r.text


def test_the_queue_limit_holds_with_an_engine_process(tiny_pair_dir, tmp_path) -> None:
    """One row running and one waiting fill a batch of 1 and a queue of 1: the next request is a 429, and the two are
    answered in full."""
    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.engine_process=true", "serve.max_batch_size=1",
                      "serve.queue_limit=1")
    with ServerThread(cfg) as s:
        body = {"prompt": PROMPTS[0], "max_tokens": 300, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=s.url, timeout=60) as c1, httpx.Client(base_url=s.url, timeout=60) as c2:
            with c1.stream("POST", "/v1/completions", json=body) as r1, \
                    c2.stream("POST", "/v1/completions", json=body) as r2:
                first = r1.iter_lines()
                assert _first_text(first)  # the first runs; the second waits for its slot
                with s.client() as c3:
                    r3 = c3.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4})
                assert r3.status_code == 429 and r3.json()["error"]["code"] == "queue_full", r3.text
                for rest in (first, r2.iter_lines()):
                    lines = [x for x in rest if x]
                    assert lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines), lines[-3:]


def test_a_server_killed_outright_leaves_no_engine_behind(tiny_pair_dir, tmp_path) -> None:
    """`dvi serve` SIGKILLed (no drain, no stop): its engine process sees its pipe close and ends, without a
    traceback."""
    import yaml

    from dvi.config import dump_config
    from serving.server_process import ServerProcess

    cfg = tiny_config(tiny_pair_dir, tmp_path, "serve.engine_process=true")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(dump_config(cfg)))
    with ServerProcess(["--config", str(path), f"serve.admin_token={TEST_ADMIN_TOKEN}"], tmp_path / "server.log") as srv:
        with httpx.Client(base_url=srv.url, timeout=60, headers={"Authorization": f"Bearer {TEST_ADMIN_TOKEN}"}) as c:
            assert c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8}).status_code == 200
            engine_pid = c.get("/health").json()["engine"]["pid"]
        srv.proc.kill()
        srv.proc.wait(30)
        with pytest.raises(ProcessLookupError):
            for _ in range(100):
                os.kill(engine_pid, 0)
                time.sleep(0.1)
    log = (tmp_path / "server.log").read_text()
    assert "the server's pipe closed; the engine stops" in log and "Traceback" not in log, log[-2000:]

