"""`dvi serve` as a real child process: how the demo, the tests and the benchmarks start a server and stop it the way an
operator would (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from dvi.fsutil import PRIVATE

__all__ = ["ServerProcess"]


class ServerProcess:
    """`dvi serve` in a subprocess on a free loopback port (serve.port=0; the port is read from its
    first stdout line). Stopped with SIGTERM (the server drains, `serving.drain`), then SIGKILL."""

    def __init__(self, args: list[str], log_path: Path, cwd: Path | None = None,
                 start_timeout_s: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "dvi.cli", "serve", *args, "serve.port=0", "serve.host=127.0.0.1"]
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.env = env or {}  # more environment for the server (and its children)
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        import httpx

        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE)  # the run dir's log: owner-only
        self._log = os.fdopen(fd, "w")  # closed in __exit__
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                     env=env)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for line in self.proc.stdout:
                self._log.write(line)
                m = re.search(r"serving on (http://127\.0\.0\.1:\d+)", line)
                if m:
                    self.url = m.group(1)
                    break
            if not self.url:
                raise RuntimeError(f"server exited before serving; see {self.log_path}")
            while time.monotonic() < deadline:
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited; see {self.log_path}")
                time.sleep(0.2)
            raise RuntimeError(f"server not healthy after {self.start_timeout_s}s; see {self.log_path}")
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
