"""Which of dvi's files does a request and its feedback run code in, startup excluded (issue 39)?

Counted by execution, not by reading: `dvi serve` on the tiny preset with its supervised trainer, both processes
under a call tracer (a `sitecustomize` on their PYTHONPATH: `sys.settrace` / `threading.settrace`, recording the
file of every Python function called; no line events; a module's body run by a late import is not a call). Once
the server answers and the trainer has finished its start-up, both forget what they recorded (SIGUSR1); then completions and chat requests (streamed and not) run until the trainer
published a version and the server promoted it (or `--max-requests`), and both write what they recorded since
(SIGUSR2). A file counts when code in it ran in either process after the reset: the request path, the feedback
log, the trainer's rounds and publish gate, the swapper's validation, judgement, swap and watch. Shutdown is not
counted (dumped before it).

    PYTHONPATH=. .venv/bin/python benchmarks/request_trace.py [--adapter-key domain] [--json bench_results/trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import clean_json, goal, print_goals  # noqa: E402

PACKAGES = ("dvi", "serving", "trainers")
GOAL_FILES = 30

SITECUSTOMIZE = r'''
import json, os, signal, sys, threading
_root, _out = os.environ["DVI_TRACE_ROOT"], os.environ["DVI_TRACE_OUT"]
_seen = set()
def _tracer(frame, event, arg):
    code = frame.f_code
    if code.co_filename.startswith(_root) and code.co_name != "<module>":
        _seen.add(code.co_filename)
    return None
def _reset(signum, frame):
    _seen.clear()
def _dump(signum, frame):
    path = os.path.join(_out, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"argv": sys.argv, "files": sorted(_seen)}, fh)
    os.replace(path + ".tmp", path)
sys.settrace(_tracer)
threading.settrace(_tracer)
signal.signal(signal.SIGUSR1, _reset)
signal.signal(signal.SIGUSR2, _dump)
'''


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out


def write_config(run_dir: Path, adapter_key: str) -> Path:
    import yaml

    from dvi.config import dump_config, load_config

    cfg = load_config(None, ["models.preset=tiny"])
    data = dump_config(cfg)
    data.update(run_dir=str(run_dir))
    data["feedback"].update(dir=str(run_dir / "feedback"), flush_seconds=1.0)
    data["registry"]["dir"] = str(run_dir / "registry")
    data["trainer"].update(adapter_key=adapter_key, publish_every_steps=2, shadow_min_positions=32,
                           adapter_min_records=4, publish_margin=-0.05)  # publish early: the walk, not the gain
    data["serve"].update(trainer="supervised", admin_token="trace", rollback_window=4)
    data["wandb"]["mode"] = "disabled"
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "serve_config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def promoted(server_log: Path) -> bool:
    """The server promoted a version (read from its log, not /health: a poll would count health.py in)."""
    return "promoted v" in server_log.read_text(errors="replace")


def traffic(url: str, max_requests: int, server_log: Path) -> tuple[int, int, bool]:
    """Requests until a promotion; (sent, errors, promoted)."""
    import httpx

    bodies = [("/v1/completions", {"prompt": "def main(argv):\n", "stream": False}),
              ("/v1/completions", {"prompt": "import os\nimport sys\n", "stream": True}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "name a prime"}], "stream": False}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "count to five"}], "stream": True})]
    errors = 0
    with httpx.Client(base_url=url, timeout=120, headers={"Authorization": "Bearer trace"}) as c:

        def send(i: int) -> bool:
            endpoint, body = bodies[i % len(bodies)]
            r = c.post(endpoint, json={**body, "max_tokens": 24, "metadata": {"domain": ("code", "chat")[i % 2]}})
            return r.status_code == 200

        for i in range(max_requests):
            errors += not send(i)
            if i % 8 == 7 and promoted(server_log):
                errors += sum(not send(j) for j in range(8))  # the promoted version's watch
                return i + 9, errors, True
    return max_requests, errors, False


def run(a) -> dict:
    from dvi.rundir import RunDir
    from serving.server_process import ServerProcess

    run_dir = a.out.resolve()
    site, out = run_dir / "site", run_dir / "trace"
    site.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DVI_TRACE_ROOT": str(ROOT) + os.sep, "DVI_TRACE_OUT": str(out)}
    config = write_config(run_dir, a.adapter_key)
    with ServerProcess(["--config", str(config)], run_dir / "server.log", env=env) as srv:
        pids = [srv.proc.pid]
        log = RunDir(run_dir).trainer_log_path
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # the trainer finished its start-up: it tails the feedback log
            if log.exists() and "trainer: tailing" in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the trainer did not start; see {log}")
        time.sleep(a.settle_s)
        pids += children(srv.proc.pid)
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)
        t0 = time.perf_counter()
        sent, errors, ok = traffic(srv.url, a.max_requests, run_dir / "server.log")
        time.sleep(3)  # the trainer's round on the last shard
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(2)
        wall = time.perf_counter() - t0
    per_process = {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}
    files = sorted({os.path.relpath(f, ROOT) for d in per_process.values() for f in d["files"]})
    files = [f for f in files if f.split(os.sep)[0] in PACKAGES]
    return {"adapter_key": a.adapter_key, "requests": sent, "errors": errors, "promoted": ok, "wall_s": wall,
            "processes": {pid: {"argv": d["argv"][:4], "files": len(d["files"])} for pid, d in per_process.items()},
            "files": files, "count": len(files)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter-key", default="none", choices=["none", "domain"])
    ap.add_argument("--max-requests", type=int, default=400)
    ap.add_argument("--settle-s", type=float, default=2.0, help="after the trainer's start-up, before the reset")
    ap.add_argument("--out", type=Path, default=Path("runs") / time.strftime("trace-%Y%m%d-%H%M%S"))
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    res = run(a)
    by_pkg: dict[str, list[str]] = {}
    for f in res["files"]:
        by_pkg.setdefault(os.path.dirname(f), []).append(os.path.basename(f))
    print(f"{res['requests']} requests, {res['errors']} errors, promoted: {res['promoted']}, "
          f"adapter_key {res['adapter_key']}, {res['wall_s']:.0f} s")
    for pkg, names in sorted(by_pkg.items()):
        print(f"  {pkg + '/':<20} {len(names):>3}  {' '.join(names)}")
    print(f"  {'total':<20} {res['count']:>3}")
    res["goals"] = [goal("files a request and its feedback run code in, startup excluded", res["count"],
                         GOAL_FILES, higher_is_better=False)]
    print_goals(res["goals"])
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(clean_json(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
