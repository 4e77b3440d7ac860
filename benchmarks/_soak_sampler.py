"""The long soak's instruments (`benchmarks/soak.py --minutes`): what an SRE watches on a long-lived `dvi serve`.

Every `--sample-seconds`, one sample: resident memory, open fds and threads of the server, its trainer and (behind
vLLM) the engine's process tree, read from /proc; disk by part of the run dir (`RunDir.disk_usage`'s parts plus
everything else under the run dir); over the interval, p50 / p99 latency and time to first token, α per traffic
group and the requests by outcome (from the client's rows); the swapper's promotions and rollbacks and the trainer's
state (`/admin/status`); the queue depth, polled every few seconds (mean and max over the interval); the server's
own request count (`/metrics`). The feedback log is read as it is written (`FeedbackTally`: each shard once, by
name, before retention can delete it), so the records check at the end stays exact when retention binds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dvi.decode.results import acceptance_rate


# -- processes -----------------------------------------------------------------------------------------
def proc_stats(pid: int | None) -> dict[str, int] | None:
    """Resident bytes, open fds and threads of a live process (None when it is gone)."""
    if not pid:
        return None
    try:
        rss = threads = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
            elif line.startswith("State:") and line.split()[1] in ("Z", "X"):
                return None  # killed, not reaped yet: no process to measure
        return {"pid": pid, "rss": rss, "fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads}
    except (OSError, ValueError):
        return None


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's `children` list)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
    except OSError:
        return []
    return out


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out, stack = [], [pid]
    while stack:
        p = stack.pop()
        out.append(p)
        stack += child_pids(p)
    return out


def tree_stats(pids: list[int]) -> dict[str, int] | None:
    """Summed stats of processes (None when none is alive)."""
    stats = [s for s in (proc_stats(p) for p in pids) if s is not None]
    if not stats:
        return None
    return {k: sum(s[k] for s in stats) for k in ("rss", "fds", "threads")} | {"procs": len(stats),
                                                                           "pid": min(s["pid"] for s in stats)}


def process_roles(server_pid: int, trainer_pid: int | None) -> dict[str, dict | None]:
    """Stats per role: the server process, its trainer, and the engine (every other process below the server:
    dvi's engine process (`serve.engine_process`), or vLLM's server and its engine core)."""
    below = [p for p in descendants(server_pid) if p != server_pid]
    trainer_tree = set(descendants(trainer_pid)) if trainer_pid else set()
    engine = [p for p in below if p not in trainer_tree]
    return {"server": proc_stats(server_pid), "trainer": proc_stats(trainer_pid), "engine": tree_stats(engine)}


# -- disk ----------------------------------------------------------------------------------------------
def disk_parts(cfg: Any) -> dict[str, int]:
    """Bytes per part of the run dir (feedback, registry, logs, checkpoint, wandb: the server's own parts; vllm:
    what vLLM's engine keeps under the run dir) plus `other` (everything else under it: configs, status files, the
    server's stderr log) and `total`."""
    from dvi.fsutil import tree_bytes
    from dvi.rundir import RunDir

    parts = RunDir.of(cfg).disk_usage()
    parts["vllm"] = tree_bytes(Path(cfg.run_dir) / "vllm")  # behind vLLM: the served drafter's shards, its log
    total = tree_bytes(cfg.run_dir)
    inside = sum(n for k, n in parts.items() if k != "feedback" or _inside(cfg.feedback.dir, cfg.run_dir))
    return {**parts, "other": max(0, total - inside), "total": total}


def _inside(path: str, root: str) -> bool:
    return "://" not in path and Path(path).resolve().is_relative_to(Path(root).resolve())


def registry_versions(cfg: Any) -> int:
    """Version dirs in the registry (what `registry.keep_last` bounds)."""
    from dvi.registry.store import DrafterRegistry

    return len(DrafterRegistry(cfg.registry.dir, keep_last=cfg.registry.keep_last).list_versions())


# -- /metrics ------------------------------------------------------------------------------------------
def scrape(text: str) -> dict[str, Any]:
    """From a /metrics page: finished requests (the records the server logs: one per request that reached the
    engine), counted from the latency histogram (`dvi_requests_total` carries the drafter version, and the series
    of versions no longer served are removed, so its sum undercounts after promotions), and by finish reason
    (display only); the queue depth, promotions and rollbacks."""
    from prometheus_client.parser import text_string_to_metric_families

    from dvi import metrics as M

    out: dict[str, Any] = {"requests": {}, "finished": 0, "queue": None, "promotions": 0.0, "rollbacks": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == M.REQUEST_LATENCY + "_count":  # every finished request, by domain: never pruned
                out["finished"] += int(s.value)
            elif s.name == M.REQUESTS:
                reason = s.labels.get(M.L_FINISH, "")
                out["requests"][reason] = out["requests"].get(reason, 0) + int(s.value)
            elif s.name == M.QUEUE_DEPTH:
                out["queue"] = s.value
            elif s.name == M.DRAFTER_PROMOTIONS:
                out["promotions"] = s.value
            elif s.name == M.DRAFTER_ROLLBACKS:
                out["rollbacks"] = s.value
    return out


# -- the client's rows over an interval --------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def interval_stats(rows: list[dict], domains: tuple[str, ...]) -> dict[str, Any]:
    """Latency and TTFT percentiles (answered requests; TTFT: every request that streamed a token), α per
    traffic group (answered requests' drafted / accepted), requests by outcome, completion tokens."""
    done = [r for r in rows if r["outcome"] == "answered"]
    lat = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in rows if r.get("ttft") is not None]
    outcomes: dict[str, int] = {}
    for r in rows:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    alpha = {d: acceptance_rate(sum(r["accepted"] for r in done if r["domain"] == d),
                                sum(r["drafted"] for r in done if r["domain"] == d)) for d in domains}
    return {"requests": len(rows), "outcomes": outcomes, "tokens": sum(r.get("tokens", 0) for r in done),
            "latency_p50": pct(lat, 50), "latency_p99": pct(lat, 99), "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "alpha": alpha,
            "drafted": {d: sum(r["drafted"] for r in done if r["domain"] == d) for d in domains}}


# -- the feedback log, read as it is written ----------------------------------------------------------------
@dataclass
class FeedbackTally:
    """Every shard of the feedback dir (and its quarantine) read once, by name: its records' request id, finish
    reason, domain and token count; per writer, the shard numbers seen (a gap is a shard deleted unseen)."""

    root: Path
    shards: set[str] = field(default_factory=set)
    records: list[tuple[str, str, str, int]] = field(default_factory=list)
    seqs: dict[str, set[int]] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)

    def poll(self) -> int:
        """Read the shards not read yet; returns how many records they held."""
        import pyarrow.parquet as pq

        from dvi.feedback.storage import parse_shard

        n = 0
        for d in (self.root, self.root / "quarantine"):
            try:
                names = sorted(x for x in os.listdir(d) if parse_shard(x) is not None)
            except OSError:
                continue
            for name in names:
                if name in self.shards:
                    continue
                try:
                    t = pq.read_table(d / name, columns=["request_id", "finish_reason", "domain", "token_ids"])
                except FileNotFoundError:  # deleted (retention) or moved (quarantine) since listed: next poll
                    continue
                except Exception as e:  # noqa: BLE001 - a damaged shard is reported, not fatal
                    self.unreadable.append(f"{name}: {type(e).__name__}: {e}")
                    self.shards.add(name)
                    continue
                self.shards.add(name)
                n += self._add(name, t)
        return n

    def _add(self, name: str, t: Any) -> int:
        from dvi.feedback.storage import parse_shard

        sn = parse_shard(name)
        if sn is not None and sn.writer is not None:
            self.seqs.setdefault(sn.writer, set()).add(sn.seq)
        cols = t.to_pydict()
        for rid, reason, dom, ids in zip(cols["request_id"], cols["finish_reason"], cols["domain"],
                                         cols["token_ids"], strict=True):
            self.records.append((rid, reason or "", dom, len(ids or [])))
        return t.num_rows

    def gaps(self) -> int:
        """Shards a writer numbered that were never read (deleted before a poll saw them)."""
        return sum(max(s) - len(s) for s in self.seqs.values() if s)  # a writer numbers its shards 1, 2, ...


# -- the sampler ---------------------------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}M"


def progress_line(s: dict, minutes: float) -> str:
    """One sample as the line a person watching the run reads."""
    def proc(role: str) -> str:
        p = s.get(role)
        return f"{role} -" if not p else f"{role} {_mib(p['rss'])}/{p['fds']}fd/{p['threads']}thr"

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}s"

    alpha = " ".join(f"{d} {'-' if a is None else f'{a:.2f}'}" for d, a in s["alpha"].items())
    o = s["outcomes"]
    disk = " ".join(f"{k} {_mib(v)}" for k, v in s["disk"].items()
                    if k in ("feedback", "registry", "logs", "other") or (k == "vllm" and v))
    return (f"[soak {s['t'] / 60:5.1f}/{minutes:g} min] {s['shape']} | {s['requests']} req (answered "
            f"{o.get('answered', 0)}, cut {o.get('cut', 0)}, abandoned {o.get('abandoned', 0)}, 5xx "
            f"{o.get('http_5xx', 0)}, err {o.get('error', 0) + o.get('http_4xx', 0)}) | p50 {sec(s['latency_p50'])} "
            f"p99 {sec(s['latency_p99'])} ttft p99 {sec(s['ttft_p99'])} | α {alpha} | {proc('server')} "
            f"{proc('trainer')}{'' if not s.get('engine') else ' ' + proc('engine')} | {disk} | drafter "
            f"v{s['drafter_version']} target v{s['target_version']} promo {s['promotions']:.0f} rb "
            f"{s['rollbacks']:.0f} | queue max {s['queue_max']}")


class Sampler:
    """Polls the server every `poll_s` (queue depth, health, the feedback log) and takes a sample every
    `sample_s` (see the module docstring); `on_sample` gets each one (progress line, partial JSON)."""

    def __init__(self, srv: Any, rows: list[dict], phases: list, t_start: float, sample_s: float,
                 poll_s: float, domains: tuple[str, ...], on_sample: Any) -> None:
        self.srv, self.rows, self.phases, self.t_start = srv, rows, phases, t_start
        self.sample_s, self.poll_s, self.domains, self.on_sample = sample_s, poll_s, domains, on_sample
        self.tally = FeedbackTally(Path(srv.cfg.feedback.dir))
        self.samples: list[dict] = []
        self.polls: list[dict] = []  # since the last sample
        self.unhealthy_polls = 0
        self.swap_events: dict[tuple, dict] = {}  # /admin/status keeps the last 100: merged at every sample
        self._row_i = 0
        self.headers = {"Authorization": f"Bearer {srv.token}"}

    async def poll(self, client: Any) -> None:
        import asyncio

        r = await client.get("/metrics", headers=self.headers)
        m = scrape(r.text)
        h = (await client.get("/health")).json()
        self.unhealthy_polls += h.get("status") != "ok"
        self.polls.append({"queue": m["queue"] or 0, "health": h.get("status")})
        await asyncio.to_thread(self.tally.poll)

    async def run(self, client: Any, stop: Any) -> None:
        """Until `stop`: poll, and sample when one is due."""
        import asyncio
        import time

        due = self.t_start + self.sample_s
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), max(0.05, min(self.poll_s, due - time.monotonic())))
            except TimeoutError:
                pass
            await self.poll(client)
            if time.monotonic() >= due - 0.05 or stop.is_set():
                self.on_sample(await self.sample(client))
                due += self.sample_s

    def _phase_at(self, t: float) -> Any:
        return next((p for p in self.phases if p.start_s <= t < p.end_s), self.phases[-1])

    async def sample(self, client: Any) -> dict:
        """One sample (appended to `samples`)."""
        import asyncio
        import time

        st = (await client.get("/admin/status", headers=self.headers)).json()
        m = scrape((await client.get("/metrics", headers=self.headers)).text)
        tr, sw = st.get("trainer") or {}, st.get("drafter") or {}
        for e in st.get("swap_events") or []:
            self.swap_events[(e["kind"], e["version"], e["at"])] = e
        procs = await asyncio.to_thread(process_roles, self.srv.proc.proc.pid, tr.get("pid"))
        heap = (st.get("engine") or {}).get("heap") or {}
        if procs["server"] is not None and heap.get("rss_bytes"):
            # its resident size right after the engine thread's last trim: what it still used, freed heap given back
            procs["server"]["rss_trimmed"] = int(heap["rss_bytes"])
        if procs["trainer"] is not None:  # loaded: its loop has written its status (a life's quarters start there)
            procs["trainer"]["ready"] = (await asyncio.to_thread(self.srv.trainer)).get("pid") == tr.get("pid")
            theap = tr.get("heap") or {}
            if theap.get("rss_bytes") and procs["trainer"].get("pid") == tr.get("pid"):
                procs["trainer"]["rss_trimmed"] = int(theap["rss_bytes"])  # the same, after its last trim
        disk = await asyncio.to_thread(disk_parts, self.srv.cfg)
        rows, self._row_i = self.rows[self._row_i:], len(self.rows)
        polls, self.polls = self.polls, []
        t = time.monotonic() - self.t_start
        s = {"t": t, "time": time.time(), "phase": self._phase_at(t).index, "shape": self._phase_at(t).shape,
             **procs, "disk": disk, "registry_versions": await asyncio.to_thread(registry_versions, self.srv.cfg),
             **interval_stats(rows, self.domains),
             "promotions": m["promotions"], "rollbacks": m["rollbacks"], "swap_counts": sw.get("counts") or {},
             "drafter_version": st.get("drafter_version"), "target_version": st.get("target_version"),
             "trainer_pid": tr.get("pid"), "trainer_state": tr.get("state"), "trainer_restarts": tr.get("restarts"),
             "trainer_heap": tr.get("heap"),  # its last trim: resident size before and after, what it gave back
             "queue_mean": float(np.mean([p["queue"] for p in polls])) if polls else m["queue"],
             "queue_max": max([p["queue"] for p in polls], default=m["queue"]), "health": st.get("status"),
             "server_requests": m["requests"], "feedback_records_read": len(self.tally.records)}
        self.samples.append(s)
        return s
