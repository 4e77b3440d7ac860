"""A real dvi server (uvicorn, real engine, tiny pair) on a free loopback port, for the serving tests."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx

from dvi.config import DviConfig, load_config

TEST_ADMIN_TOKEN = "test-admin-token"
PROMPTS = ["def main(argv):\n", "import os\nimport sys\n", "class Foo:\n    def __init__(self", "for i in range("]
"""Code prompts the serving tests send (greedy references, traffic)."""


def tiny_config(pair_dir: Path, run_dir: Path, *overrides: str) -> DviConfig:
    """Config serving the tiny pair from `pair_dir`, everything written under `run_dir`."""
    base = [
        f"models.target={pair_dir / 'target'}",
        f"models.drafter={pair_dir / 'drafter'}",
        f"models.tokenizer={pair_dir / 'tokenizer'}",
        f"run_dir={run_dir}",
        f"feedback.dir={run_dir / 'feedback'}",
        f"registry.dir={run_dir / 'registry'}",
        "feedback.flush_seconds=0.5",
        "serve.trainer='off'",
        "serve.registry_poll_seconds=0.2",
        "wandb.mode=disabled",
        # the engine a thread of the test's server, so a test can read it (`engine_of`); tests/test_engine_process.py
        # serves through an engine process
        "serve.engine_process=false",
        "speculation.adaptive=false",
        "speculation.num_draft_tokens=3",
        "sampling.max_new_tokens=24",
        f"serve.admin_token={TEST_ADMIN_TOKEN}",  # /health's details need it
        # half the records held out, so that a few requests let the server shadow-check a candidate
        "trainer.heldout_fraction=0.5",
        "trainer.shadow_min_positions=16",
    ]
    return load_config(None, base + list(overrides))


def templated_tokenizer_dir(pair_dir: Path, dest: Path, chat_template: str) -> Path:
    """The tiny tokenizer with `chat_template`, saved at `dest` (a tokenizer dir a server loads)."""
    import shutil

    from dvi.models.loading import load_tokenizer

    shutil.rmtree(dest, ignore_errors=True)
    tok = load_tokenizer(pair_dir / "tokenizer")
    tok.chat_template = chat_template
    tok.save_pretrained(dest)
    return dest


def guarded_config(pair_dir: Path, run_dir: Path, api_key: str, admin_token: str, allowed_dir: Path,
                   *overrides: str) -> DviConfig:
    """`tiny_config` behind an API key and an admin token, admin paths confined to `allowed_dir`."""
    return tiny_config(pair_dir, run_dir, f"serve.api_key={api_key}", f"serve.admin_token={admin_token}",
                       f"serve.allowed_dirs=[{allowed_dir}]", *overrides)


class ServerThread:
    """`with ServerThread(cfg) as s:` -> a started server; `s.url`, `s.client()`, `s.state`."""

    def __init__(self, cfg: DviConfig, start_timeout_s: float = 120.0) -> None:
        self.cfg = cfg
        self.start_timeout_s = start_timeout_s
        self.server = None
        self.thread: threading.Thread | None = None
        self.url = ""

    def __enter__(self) -> ServerThread:
        from serving.app import bind_socket, make_server

        assert self.cfg.serve.host == "127.0.0.1"
        sock = bind_socket("127.0.0.1", 0)
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(self.cfg, sock)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    @property
    def state(self):
        return self.server.config.app.state.dvi

    def client(self, token: str | None = None, **headers: str) -> httpx.Client:
        """An HTTP client for this server; `token` is sent as `Authorization: Bearer <token>`."""
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def health(self) -> dict:
        """The full /health document (what the config's admin token sees)."""
        token = self.cfg.serve.admin_token.get_secret_value()
        with self.client(token=token) as c:
            r = c.get("/health")
        assert r.status_code == 200, r.text
        return r.json()

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.sock.close()


def engine_of(server) -> Any:
    """A test server's engine (dvi's or VllmEngine), behind its scheduler: the server's own threads reach it only
    through the scheduler's commands and snapshot; a test reads its state directly."""
    return server.state.scheduler.engine


class DrafterView:
    """A test's window on a server's shared drafter lane: every attribute read is the latest snapshot's
    (`DrafterSnapshot.shared`, a `serving.drafter.messages.LaneView`), what /health and /metrics read."""

    def __init__(self, server) -> None:
        self._server = server

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server.state.drafter.snapshot.shared, name)


def drafter_view(server) -> DrafterView:
    return DrafterView(server)


def drafter_lane(server) -> Any:
    """A test server's shared drafter lane itself, behind the drafter wing's door: the server's own threads only send
    it messages; a test reads (its startup drafter, its held-out set) or patches it directly."""
    return server.state.drafter.lane


def wait_for(pred, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """Poll `pred()` until truthy; returns its value or fails with `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads (and the final '[DONE]' marker)."""
    import json

    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def lora_copy(drafter, scale: float = 0.0, seed: int = 0, targets: tuple[str, ...] = ("q_proj", "v_proj")):
    """A peft LoRA on a copy of the drafter; scale 0 = identity (B = 0), large = a much worse drafter."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(copy.deepcopy(drafter), LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    if scale:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
    return pm


def version_manifest(**kw) -> dict:
    """The fields a published drafter version's manifest needs, overridable."""
    return {"target_version": 0, "steps": 1, "records_seen": 0, "heldout_alpha": None, **kw}
