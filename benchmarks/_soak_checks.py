"""The long soak's end checks (`benchmarks/soak.py --minutes`): records against answered requests, errors, bounds,
the quarter comparisons and α per group, as `goals`; and its figure.

Records: every request that reached the engine is logged once (`serving.finished`: the final record; a request
the client left while it decoded is logged with finish_reason "abort", one cancelled while it waited for a slot is
not). So: every answered request's id is in the log exactly once, with the token count the client got; no id
twice; each cut request (it streamed a token, so it ran) adds one record and each abandoned one (closed before any
content) at most one, so the records beyond the answered number between the cuts and the cuts plus the abandons;
and the log holds as many records as the server counted finished requests (`dvi_request_latency_seconds_count`).

Quarters: memory, fds and threads compare the second and the last quarter of each process's life (the server
lives the whole run, so its quarters are the run's; a killed trainer's successor is a new life, compared within
itself): memory by the quarters' medians, fds and threads by their maxima. p99 latency compares the answered
requests that ended in the run's second and last quarter.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from benchmarks._common import goal
from benchmarks._soak_sampler import pct
from dvi.decode.results import acceptance_rate

FD_SLACK, THREAD_SLACK = 8, 2  # "flat": the last quarter's maximum at most this far above the second's
FEEDBACK_SLACK = 512 * 1024  # the shard being renamed in, the consumed marker
LOG_SLACK = 64 * 1024  # per rotated log: what is written between a rotation check and the next


# -- records ----------------------------------------------------------------------------------------------
def record_checks(rows: list[dict], records: list[tuple[str, str, str, int]], server_total: int | None) -> dict:
    """The log against the client's rows (see the module docstring); `records`: (request id, finish reason,
    domain, tokens) per logged record."""
    answered = {r["request_id"]: r for r in rows if r["outcome"] == "answered"}
    counts: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for rid, _reason, _dom, n in records:
        counts[rid] = counts.get(rid, 0) + 1
        tokens[rid] = n
    missing = [rid for rid in answered if counts.get(rid, 0) == 0]
    doubled = [rid for rid, n in counts.items() if n > 1]
    mismatched = [rid for rid, r in answered.items() if rid in tokens and tokens[rid] != r.get("tokens")]
    extra = sum(n for rid, n in counts.items() if rid not in answered)
    cuts = sum(r["outcome"] == "cut" for r in rows)
    abandons = sum(r["outcome"] == "abandoned" for r in rows)
    reasons: dict[str, int] = {}
    for _rid, reason, _dom, _n in records:
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"answered": len(answered), "records": len(records), "by_reason": reasons, "missing": missing[:20],
            "n_missing": len(missing), "doubled": doubled[:20], "n_doubled": len(doubled),
            "token_mismatches": mismatched[:20], "n_token_mismatches": len(mismatched),
            "beyond_answered": extra, "cuts": cuts, "abandons": abandons,
            "outside_cut_bounds": max(0, cuts - extra) + max(0, extra - cuts - abandons),
            "server_total": server_total,
            "server_diff": None if server_total is None else len(records) - server_total}


# -- quarters ---------------------------------------------------------------------------------------------
def quarter(samples: list[dict], q: int, total_s: float) -> list[dict]:
    """Samples of quarter `q` (1..4): t in ((q-1)/4, q/4] of the run."""
    lo, hi = (q - 1) * total_s / 4, q * total_s / 4
    return [s for s in samples if lo < s["t"] <= hi + 1e-6]


def lives(samples: list[dict], role: str, total_s: float) -> list[list[dict]]:
    """A role's samples within the run, one list per process (by pid: a killed trainer's successor is a new life),
    from the process's first sample as loaded (a trainer: once its loop wrote its status)."""
    out: dict[int, list[dict]] = {}
    for s in samples:
        if s.get(role) and s[role].get("ready", True) and s["t"] <= total_s + 1e-6:
            out.setdefault(s[role]["pid"], []).append(s[role])
    return list(out.values())


def _quarters(life: list[dict], key: str) -> tuple[list[float], list[float]]:
    """The second and the last quarter of a life's samples (by count: samples are evenly spaced)."""
    n = len(life)
    return [x[key] for x in life[n // 4: n // 2]], [x[key] for x in life[3 * n // 4:]]


def growth(samples: list[dict], role: str, key: str, total_s: float) -> float | None:
    """Per process life of at least 4 samples, the median of its last quarter over its second quarter's, minus
    1; the largest over lives (the server has one life: the run's quarters). None without such a life."""
    out = []
    for life in lives(samples, role, total_s):
        a, b = _quarters(life, key)
        if len(life) >= 4 and a and b and np.median(a) > 0:
            out.append(float(np.median(b) / np.median(a) - 1.0))
    return max(out) if out else None


def rise(samples: list[dict], role: str, key: str, total_s: float) -> float | None:
    """Per process life of at least 4 samples, its last quarter's maximum minus its second quarter's; the
    largest over lives (None without such a life)."""
    out = []
    for life in lives(samples, role, total_s):
        a, b = _quarters(life, key)
        if len(life) >= 4 and a and b:
            out.append(float(max(b) - max(a)))
    return max(out) if out else None


def latency_ratio(rows: list[dict], t0_wall: float, total_s: float, key: str = "latency") -> float | None:
    """p99 of `key` over the answered requests that ended in the last quarter, over the second quarter's."""
    def q(n: int) -> list[float]:
        lo, hi = (n - 1) * total_s / 4, n * total_s / 4
        return [r[key] for r in rows if r["outcome"] == "answered" and r.get(key) is not None
                and lo < r["t1"] - t0_wall <= hi]

    a, b = pct(q(2), 99), pct(q(4), 99)
    return None if a is None or b is None or a == 0 else b / a


# -- α per group ------------------------------------------------------------------------------------------
def _half(rows: list[dict], domain: str) -> tuple[float | None, list[float], int]:
    """Pooled α of `domain`'s answered rows, their per-request α values and drafted tokens."""
    mine = [r for r in rows if r["domain"] == domain and r["outcome"] == "answered" and r.get("drafted")]
    per = [r["accepted"] / r["drafted"] for r in mine]
    drafted = sum(r["drafted"] for r in mine)
    return acceptance_rate(sum(r["accepted"] for r in mine), drafted), per, drafted


def alpha_falls(rows: list[dict], t0_wall: float, boundaries: list[float], total_s: float,
                rollback_times: list[float], domains: tuple[str, ...], margin: float = 0.05,
                min_requests: int = 8) -> list[dict]:
    """Per segment between two boundaries (drifts, target updates), per traffic group: α of the segment's second
    half against its first (requests started and ended inside the segment). A fall beyond `margin` plus two
    standard errors of the per-request α is unexplained unless the swapper rolled back a version inside the
    segment (it caught that fall). Returns every judged segment and group."""
    edges = sorted({0.0, *[b for b in boundaries if 0 < b < total_s], total_s})
    out = []
    for lo, hi in zip(edges, edges[1:], strict=False):
        mid = (lo + hi) / 2
        seg = [r for r in rows if lo <= r["t0"] - t0_wall and r["t1"] - t0_wall <= hi]
        first = [r for r in seg if r["t1"] - t0_wall <= mid]
        second = [r for r in seg if r["t1"] - t0_wall > mid]
        for d in domains:
            (a1, p1, _), (a2, p2, _) = _half(first, d), _half(second, d)
            if a1 is None or a2 is None or len(p1) < min_requests or len(p2) < min_requests:
                continue
            se = math.sqrt(np.var(p1, ddof=1) / len(p1) + np.var(p2, ddof=1) / len(p2))
            fall = a1 - a2
            rolled = any(lo < t <= hi for t in rollback_times)
            out.append({"from_s": lo, "to_s": hi, "domain": d, "first": a1, "second": a2, "fall": fall,
                        "allowance": margin + 2 * se, "requests": (len(p1), len(p2)),
                        "unexplained": fall > margin + 2 * se and not rolled,
                        "explained_by": "rollback" if fall > margin + 2 * se and rolled else None})
    return out


def alpha_by_phase(rows: list[dict], phases: list, domains: tuple[str, ...]) -> list[dict]:
    """α per traffic group in every phase (what the figure and the summary show across the run)."""
    out = []
    for p in phases:
        mine = [r for r in rows if r.get("phase") == p.index]
        out.append({"phase": p.index, "shape": p.shape, "alpha": {d: _half(mine, d)[0] for d in domains},
                    "requests": len(mine)})
    return out


# -- disk ------------------------------------------------------------------------------------------------
def disk_bounds(cfg: Any) -> dict[str, float | None]:
    """What the config bounds each part to: feedback by its retention (plus the shard being renamed in and the
    consumed marker), the rotated logs by 5 x (1 + backups) x log_max_bytes plus the compacted consumed log, the
    registry by `keep_last` versions plus the served, last good and pinned ones (counted in versions)."""
    fb, files = cfg.feedback, cfg.files
    logs = 5 * (1 + files.log_backups) * (files.log_max_bytes + LOG_SLACK) + files.consumed_log_max_bytes
    return {"feedback": None if fb.retention_bytes is None else fb.retention_bytes + FEEDBACK_SLACK,
            "logs": logs, "registry_versions": cfg.registry.keep_last + 3}


def disk_checks(samples: list[dict], cfg: Any, total_s: float) -> dict:
    """The largest each bounded part got against its bound, and every part's growth between the quarters."""
    b = disk_bounds(cfg)
    peak = {k: max((s["disk"].get(k, 0) for s in samples), default=0) for k in samples[0]["disk"]} if samples else {}
    versions = max((s["registry_versions"] for s in samples), default=0)

    def grow(part: str) -> float | None:
        a = [s["disk"][part] for s in quarter(samples, 2, total_s)]
        z = [s["disk"][part] for s in quarter(samples, 4, total_s)]
        return float(np.median(z) / np.median(a) - 1) if a and z and np.median(a) > 0 else None

    return {"bounds": b, "peak": peak, "peak_registry_versions": versions,
            "feedback_of_bound": None if b["feedback"] is None else peak.get("feedback", 0) / b["feedback"],
            "logs_of_bound": peak.get("logs", 0) / b["logs"],
            "registry_of_bound": versions / b["registry_versions"],
            "growth_q2_q4": {k: grow(k) for k in peak}}


# -- the goals ----------------------------------------------------------------------------------------------
def _count_goals(rows: list[dict], rec: dict, fb: dict) -> list[dict]:
    n5 = sum(r["outcome"] == "http_5xx" for r in rows)
    failed = sum(r["outcome"] in ("error", "http_4xx") for r in rows)
    bad = rec["n_missing"] + rec["n_doubled"] + rec["n_token_mismatches"]
    return [goal("5xx responses (and SSE server errors)", n5, 0, False),
            goal("failed requests (transport errors, 4xx)", failed, 0, False),
            goal("answered requests whose record is missing, doubled or of another token count", bad, 0, False),
            goal("records beyond the answered outside [cuts, cuts + abandons]", rec["outside_cut_bounds"], 0, False),
            goal("records - the server's finished requests (dvi_request_latency_seconds_count)",
                 None if rec["server_diff"] is None else abs(rec["server_diff"]), 0, False),
            goal("feedback shards unread by the check (deleted first) or unreadable", fb["gaps"] + fb["unreadable"], 0,
                 False),
            goal("feedback records dropped or failed to write", fb["dropped"] + fb["write_errors"], 0, False)]


def _quarter_goals(samples: list[dict], rows: list[dict], t0_wall: float, total_s: float) -> tuple[dict, list]:
    roles = [r for r in ("server", "trainer", "engine") if any(s.get(r) for s in samples)]
    q = {f"{role}_{k}": f(samples, role, k, total_s) for role in roles
         for k, f in (("rss", growth), ("fds", rise), ("threads", rise))}
    # no goal: what each process still used after its trims grew by this much (the RSS goal's growth less freed heap
    # glibc held: the trainer's is what its last round's batches freed, so it follows the traffic of the moment)
    for role in ("server", "trainer"):
        q[f"{role}_rss_trimmed"] = growth([s for s in samples if (s.get(role) or {}).get("rss_trimmed")], role,
                                          "rss_trimmed", total_s)
    q["latency_p99_ratio"] = latency_ratio(rows, t0_wall, total_s)
    q["ttft_p99_ratio"] = latency_ratio(rows, t0_wall, total_s, "ttft")
    goals = []
    for role in roles:
        goals += [goal(f"{role} RSS growth, second -> last quarter of a life (medians)", q[f"{role}_rss"], 0.10, False),
                  goal(f"{role} open fds, a life's last quarter's max - second's", q[f"{role}_fds"], FD_SLACK, False),
                  goal(f"{role} threads, a life's last quarter's max - second's", q[f"{role}_threads"], THREAD_SLACK, False)]
    goals.append(goal("p99 latency, last quarter / second quarter", q["latency_p99_ratio"], 1.2, False))
    return q, goals


def _disk_goals(d: dict) -> list[dict]:
    out = [goal("logs: peak / bound", d["logs_of_bound"], 1.0, False),
           goal("registry versions: peak / bound", d["registry_of_bound"], 1.0, False)]
    if d["feedback_of_bound"] is not None:
        out.insert(0, goal("feedback: peak / retention bound", d["feedback_of_bound"], 1.0, False))
    return out


def long_goals(run: dict, cfg: Any, args: Any) -> tuple[dict, list[dict]]:
    """Every check of a long soak (`run`: rows, samples, events, records, feedback, phases, t0_wall, total_s)."""
    rows, samples, ev, total = run["rows"], run["samples"], run["events"], run["total_s"]
    rec = record_checks(rows, run["records"], run["server_total"])
    quarters, qgoals = _quarter_goals(samples, rows, run["t0_wall"], total)
    disk = disk_checks(samples, cfg, total)
    bounds = [e["t"] for e in ev if e["kind"] in ("drift", "target_update")]
    falls = alpha_falls(rows, run["t0_wall"], bounds, total, [e["t"] for e in ev if e["kind"] == "rollback"],
                        run["domains"], args.alpha_margin)
    updates = [e for e in ev if e["kind"] == "target_update"]
    kills = [e for e in ev if e["kind"] == "trainer_kill"]
    expected_samples = int(total // args.sample_seconds)
    goals = [goal("minutes of traffic", run["traffic_s"] / 60, args.minutes * 0.98),
             goal("samples taken", len(samples), max(1, expected_samples - 1)),
             *_count_goals(rows, rec, run["feedback"]), *qgoals, *_disk_goals(disk),
             goal("α falls inside a segment no drift, target update or rollback explains",
                  sum(f["unexplained"] for f in falls), 0, False),
             goal("target updates refused", sum(e.get("status") != 200 for e in updates), 0, False),
             goal("trainer kills it did not come back from", sum(not e.get("recovered_s") for e in kills), 0, False)]
    summary = {"records": rec, "quarters": quarters, "disk": disk, "alpha_segments": falls,
               "alpha_by_phase": alpha_by_phase(rows, run["phases"], run["domains"]),
               "target_updates": len(updates), "trainer_kills": len(kills), "requests": len(rows),
               "outcomes": {o: sum(r["outcome"] == o for r in rows) for o in {r["outcome"] for r in rows}},
               "latency_p50": pct([r["latency"] for r in rows if r["outcome"] == "answered"], 50),
               "latency_p99": pct([r["latency"] for r in rows if r["outcome"] == "answered"], 99),
               "unhealthy_polls": run.get("unhealthy_polls")}
    return summary, goals


# -- the figure -------------------------------------------------------------------------------------------
EVENT_STYLE = {"drift": ("0.5", ":"), "target_update": ("tab:blue", "--"), "trainer_kill": ("tab:red", "-"),
               "promoted": ("tab:green", "-"), "rollback": ("tab:orange", "-")}


def _series(ax: Any, samples: list[dict], lines: list[tuple[str, Any]], ylabel: str, scale: float = 1.0) -> None:
    xs = [s["t"] / 60 for s in samples]
    for label, get in lines:
        ys = [None if get(s) is None else get(s) / scale for s in samples]
        if any(y is not None for y in ys):
            ax.plot(xs, [np.nan if y is None else y for y in ys], marker=".", ms=3, lw=1, label=label)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=6, ncol=4, loc="upper left")
    ax.tick_params(labelsize=7)


def _proc(role: str, key: str) -> Any:
    return lambda s: (s.get(role) or {}).get(key)


def _panels(samples: list[dict], domains: tuple[str, ...]) -> list[tuple[list, str, float]]:
    parts = ("feedback", "registry", "logs", "checkpoint", "vllm", "other")
    return [
        ([("latency p50", lambda s: s["latency_p50"]), ("latency p99", lambda s: s["latency_p99"]),
          ("TTFT p99", lambda s: s["ttft_p99"])], "seconds", 1.0),
        ([(f"α {d}", lambda s, d=d: s["alpha"].get(d)) for d in domains], "α per group", 1.0),
        ([(f"{r} RSS", _proc(r, "rss")) for r in ("server", "trainer", "engine")], "MiB", 2**20),
        ([(f"{r} {k}", _proc(r, k)) for r in ("server", "trainer", "engine") for k in ("fds", "threads")],
         "fds / threads", 1.0),
        ([(p, lambda s, p=p: s["disk"].get(p)) for p in parts], "disk MiB (symlog)", 2**20),
        ([("queue max", lambda s: s["queue_max"]), ("queue mean", lambda s: s["queue_mean"]),
          ("requests / interval", lambda s: s["requests"])], "requests", 1.0),
    ]


def plot_long(path: Any, samples: list[dict], events: list[dict], domains: tuple[str, ...], title: str) -> None:
    """The series of a long soak, one panel each, the events marked on every panel (drifts dotted, target
    updates blue dashed, trainer kills red, promotions green, rollbacks orange)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(samples, domains)
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.1 * len(panels)), sharex=True)
    for ax, (lines, ylabel, scale) in zip(axes, panels, strict=True):
        _series(ax, samples, lines, ylabel, scale)
        if "symlog" in ylabel:  # parts differ by orders of magnitude (vLLM's drafter shards vs a rotated log)
            ax.set_yscale("symlog", linthresh=1.0)
        for e in events:
            color, style = EVENT_STYLE.get(e["kind"], ("k", "-"))
            ax.axvline(e["t"] / 60, color=color, ls=style, lw=0.8, alpha=0.5)
    axes[0].set_title(title, fontsize=9)
    axes[-1].set_xlabel("minutes of traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
