"""The Grafana dashboard dvi ships, built from the names in `dvi.metrics.names`, and the check that a server exports
every series its queries name.

`build_dashboard()` is the one definition: every query below names its metrics through the constants of `names`,
so a renamed metric renames its panels. The JSON a user imports, `dvi/metrics/grafana/dvi.json` (package data;
`dvi dashboard --out FILE` writes it), is that dict as written by `write_dashboard()`; `tests/test_dashboard.py`
checks the file against it and every query against a live `dvi serve`'s /metrics.

Panels (one Prometheus datasource, `$datasource`; one or more scraped servers, `$instance`):

* acceptance: α by drafter version, by traffic group (the request's domain, which is the adapter group under
  `trainer.adapter_key: domain`), the adapter version each group serves, α by who drafted (the learned drafter
  or the suffix index), by draft position, the per-request acceptance histogram and low-acceptance requests;
* tokens per target pass: 1 + accepted / drafting steps per domain, accepted tokens per pass by tree-sibling rank;
* promotions and rollbacks: the served drafter and target versions, promotions, rollbacks and refusals by reason,
  publish-to-verdict seconds, the gates' groups and the held-out set;
* trainer: its state (value mapping from `names.TRAINER_STATES`), heartbeat age and restarts, losses, progress, the
  feedback it lost, skipped or quarantined and publishes the registry refused;
* feedback backlog: records served vs records trained per second, records buffered in memory, write failures,
  bytes on disk by part;
* throughput and latency: tokens/s, request latency and time to first token quantiles, requests by finish reason,
  queue depth, rejected requests and slow-client timeouts.

Not on it: learned vs control (issue 59 §1's control group exports no metric yet; its panel comes with its names).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dvi.metrics import names as N

DASHBOARD_PATH = Path(__file__).resolve().parent / "grafana" / "dvi.json"
"""Where the dashboard ships (package data)."""

UID = "dvi-serve"
RI = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def sel(name: str, matchers: str = "") -> str:
    """`name` scoped to the dashboard's `$instance` choice (plus `matchers`, PromQL label matchers)."""
    return f'{name}{{instance=~"$instance"{"," + matchers if matchers else ""}}}'


def rate(name: str, window: str = RI) -> str:
    return f"rate({sel(name)}[{window}])"


def increase(name: str, window: str = RI) -> str:
    return f"increase({sel(name)}[{window}])"


def ratio(num: str, den: str, by: str = "") -> str:
    """sum-by(num rate) / sum-by(den rate): a rate of two counters, e.g. α = accepted / drafted tokens."""
    b = f" by ({by})" if by else ""
    return f"sum{b} ({rate(num)}) / sum{b} ({rate(den)})"


def quantile(q: float, histogram: str, by: str = "") -> str:
    return f"histogram_quantile({q}, sum by (le{', ' + by if by else ''}) ({rate(histogram + '_bucket')}))"


def target(expr: str, legend: str = "", ref: str = "A", **extra: Any) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "refId": ref, "range": True, **extra}


def panel(title: str, targets: list[dict], panel_type: str = "timeseries", unit: str = "short", description: str = "",
          **extra: Any) -> dict:
    """One panel; its position is set by `build_dashboard`'s layout."""
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    p = {"type": panel_type, "title": title, "description": description, "datasource": DS, "targets": targets,
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
    if panel_type == "timeseries":
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    p.update(extra)
    return p


def _unit_range(p: dict, lo: float = 0.0, hi: float | None = 1.0) -> dict:
    d = p["fieldConfig"]["defaults"]
    d["min"] = lo
    if hi is not None:
        d["max"] = hi
    return p


ALPHA = "α = accepted drafted tokens / drafted tokens, over the rate window"


def _acceptance() -> list[dict]:
    return [
        _unit_range(panel("α by drafter version", [
            target(ratio(N.NUM_ACCEPTED_TOKENS, N.NUM_DRAFT_TOKENS, N.L_DRAFTER_VERSION), "v{{drafter_version}}"),
        ], unit="percentunit", description=f"{ALPHA}, per drafter version that drafted it (the newest "
                                           "serve.metrics_versions versions keep their series).")),
        _unit_range(panel("α by traffic group (domain)", [
            target(ratio(N.NUM_ACCEPTED_TOKENS, N.NUM_DRAFT_TOKENS, N.L_DOMAIN), "{{domain}}"),
        ], unit="percentunit", description=f"{ALPHA}, per the request's metadata.domain (bounded by serve.domains; "
                                           "the adapter group with trainer.adapter_key: domain).")),
        panel("Adapter version by traffic group", [
            target(f"max by ({N.L_GROUP}) ({sel(N.DRAFTER_ADAPTER_VERSION)})", "{{group}}"),
        ], description="The adapter version serving each traffic group's rows (trainer.adapter_key; empty with one "
                       "shared drafter)."),
        _unit_range(panel("α by who drafted (learned drafter vs suffix index)", [
            target(ratio(N.SOURCE_ACCEPTED_TOKENS, N.SOURCE_DRAFT_TOKENS, N.L_SOURCE), "{{source}}"),
        ], unit="percentunit", description=f"{ALPHA}, by draft source: model (the learned drafter), suffix_request, "
                                           "suffix_global (the suffix index; hybrid and suffix kinds).")),
        _unit_range(panel("Acceptance by draft position", [
            target(ratio(N.NUM_ACCEPTED_PER_POS, N.NUM_DRAFTED_PER_POS, N.L_POSITION), "position {{position}}"),
        ], unit="percentunit", description="Accepted / drafted tokens at each draft position (0: the first draft "
                                           "of a step).")),
        panel("Per-request acceptance (histogram)", [
            target(f"sum by (le) ({increase(N.REQUEST_ACCEPTANCE + '_bucket')})", "{{le}}", format="heatmap"),
        ], panel_type="heatmap", unit="short",
            description="Requests by their own acceptance rate (requests that drafted at least "
                        f"{N.REQUEST_ACCEPTANCE_MIN_DRAFTED} tokens).",
            options={"calculate": False, "yAxis": {"axisLabel": "α of the request"},
                     "cellValues": {"unit": "short"}, "color": {"mode": "scheme", "scheme": "Blues"}}),
        _unit_range(panel("Per-request acceptance quantiles by domain", [
            target(quantile(0.1, N.REQUEST_ACCEPTANCE, N.L_DOMAIN), "p10 {{domain}}"),
            target(quantile(0.5, N.REQUEST_ACCEPTANCE, N.L_DOMAIN), "p50 {{domain}}"),
        ], unit="percentunit", description="The 10th and 50th percentile of requests' own acceptance rate.")),
        panel("Low-acceptance requests", [
            target(f"sum by ({N.L_DOMAIN}) ({increase(N.LOW_ACCEPTANCE_REQUESTS)})", "{{domain}}"),
        ], description=f"Requests that drafted at least {N.LOW_ACCEPTANCE[0]} tokens with α at most "
                       f"{N.LOW_ACCEPTANCE[1]}, each logged with its request id (garbled or looping output, or a "
                       "drafter that does not fit its traffic group)."),
    ]


def _passes() -> list[dict]:
    return [
        panel("Tokens per target pass (drafting steps)", [
            target(f"1 + {ratio(N.NUM_ACCEPTED_TOKENS, N.NUM_DRAFTS, N.L_DOMAIN)}", "{{domain}}"),
            target(f"1 + {ratio(N.NUM_ACCEPTED_TOKENS, N.NUM_DRAFTS)}", "all"),
        ], description="Mean accepted length: 1 + accepted drafted tokens / drafting steps (the target's bonus "
                       "token included)."),
        panel("Accepted tokens per pass by sibling rank (draft trees)", [
            target(f"sum by ({N.L_RANK}) ({rate(N.NUM_ACCEPTED_PER_RANK)}) / scalar(sum({rate(N.NUM_DRAFTS)}))",
                   "rank {{rank}}"),
        ], description="Accepted drafted tokens per drafting step by the node's rank among its siblings (0: the "
                       "drafter's chain; 1-3: its next candidates)."),
    ]


def _promotions() -> list[dict]:
    return [
        panel("Served versions", [
            target(f"max({sel(N.DRAFTER_VERSION)})", "drafter"),
            target(f"max({sel(N.TARGET_VERSION)})", "target"),
        ], description="The drafter version serving now (a step up: a promotion; down: a rollback or a pin) and "
                       "the target weights' version.", fieldConfig={"defaults": {"unit": "short", "decimals": 0,
                                                                                   "custom": {"lineInterpolation": "stepAfter"}},
                                                                      "overrides": []}),
        panel("Promotions, rollbacks, refusals", [
            target(f"sum({increase(N.DRAFTER_PROMOTIONS)})", "promotions"),
            target(f"sum({increase(N.DRAFTER_ROLLBACKS)})", "rollbacks"),
            target(f"sum by ({N.L_REASON}) ({increase(N.DRAFTER_REFUSALS)})", "refused: {{reason}}"),
        ], description="Drafter versions swapped in, rolled back after their watch, and refused (validation, "
                       "shadow check), per rate window.", panel_type="timeseries",
            fieldConfig={"defaults": {"unit": "short", "custom": {"drawStyle": "bars", "fillOpacity": 60}},
                         "overrides": []}),
        panel("Publish to verdict", [
            target(quantile(0.5, N.DRAFTER_PUBLISH_TO_VERDICT, N.L_VERDICT), "p50 {{verdict}}"),
            target(quantile(0.9, N.DRAFTER_PUBLISH_TO_VERDICT, N.L_VERDICT), "p90 {{verdict}}"),
        ], unit="s", description="Seconds from a version's publish to the server's first verdict on it."),
        panel("Gates: groups judged, held-out records", [
            target(f"max by ({N.L_GATE}, {N.L_JUDGED}) ({sel(N.DRAFTER_GATE_GROUPS)})",
                   "{{gate}} judged={{judged}}"),
            target(f"max({sel(N.DRAFTER_HELDOUT_RECORDS)})", "held-out records"),
            target(f"max by ({N.L_REASON}) ({sel(N.DRAFTER_HELDOUT_UNFIT)})", "unfit: {{reason}}"),
        ], description="Groups in each gate's last verdict (judged=false: too few records to judge), and the "
                       "server's held-out set."),
    ]


def _trainer() -> list[dict]:
    states = {str(code): {"index": code, "text": name} for name, code in N.TRAINER_STATES.items()}
    return [
        panel("Trainer state", [target(f"max({sel(N.TRAINER_STATE)})", "state")], panel_type="state-timeline",
              description=f"The online trainer's state ({', '.join(N.TRAINER_STATES)}).",
              fieldConfig={"defaults": {"unit": "short", "mappings": [{"type": "value", "options": states}]},
                           "overrides": []},
              options={"showValue": "auto", "mergeValues": True}),
        panel("Trainer heartbeat and restarts", [
            target(f"max({sel(N.TRAINER_HEARTBEAT_AGE)})", "heartbeat age (s)"),
            target(f"max({sel(N.TRAINER_RESTARTS)})", "restarts"),
            target(f"sum({sel(N.TRAINER_STALE_RESTARTS)})", "stale restarts"),
        ], description="Seconds since the trainer's last heartbeat; restarts by the supervisor (stale: killed "
                       "for a heartbeat older than serve.trainer_stale_s)."),
        panel("Trainer loss", [
            target(f"max({sel(N.TRAINER_LOSS)})", "total"),
            target(f"max({sel(N.TRAINER_KL_LOSS)})", "top-k KL"),
            target(f"max({sel(N.TRAINER_REWARD_LOSS)})", "reward"),
        ]),
        panel("Trainer progress", [
            target(f"max({sel(N.TRAINER_STEP)})", "optimizer steps"),
            target(f"max({sel(N.TRAINER_RECORDS_SEEN)})", "records trained"),
            target(f"max({sel(N.TRAINER_HELDOUT_ALPHA)})", "held-out α of the last publish"),
        ]),
        panel("Trainer: feedback it could not use, publishes refused", [
            target(f"max({sel(N.TRAINER_LOST_SHARDS)})", "shards lost to retention"),
            target(f"max({sel(N.TRAINER_SKIPPED_SHARDS)})", "shards skipped"),
            target(f"max({sel(N.TRAINER_QUARANTINED_SHARDS)})", "shards quarantined"),
            target(f"max({sel(N.TRAINER_QUARANTINED_RECORDS)})", "records quarantined"),
            target(f"max({sel(N.TRAINER_PUBLISH_FAILURES)})", "publish failures"),
        ]),
    ]


def _backlog() -> list[dict]:
    return [
        panel("Feedback: records served vs trained", [
            target(f"sum({rate(N.REQUESTS)})", "records written (finished requests/s)"),
            target(f"sum(deriv({sel(N.TRAINER_RECORDS_SEEN)}[{RI}]))", "records trained/s"),
        ], unit="reqps", description="Every finished request writes one feedback record; the trainer trains on "
                                     "the newest first, holds a slice out and never trains it, so a gap that "
                                     "keeps growing is a backlog."),
        panel("Feedback buffered in memory", [
            target(f"sum({sel(N.FEEDBACK_PENDING_RECORDS)})", "records not yet in a shard"),
            target(f"max({sel(N.FEEDBACK_FAILING)})", "writes failing"),
        ]),
        panel("Feedback lost or reclaimed", [
            target(f"sum({increase(N.FEEDBACK_DROPPED_RECORDS)})", "records dropped (buffer full)"),
            target(f"sum({increase(N.FEEDBACK_WRITE_ERRORS)})", "shard write errors"),
            target(f"sum({increase(N.FEEDBACK_RECLAIMED_SHARDS)})", "consumed shards reclaimed (disk full)"),
        ]),
        panel("Bytes on disk by part", [
            target(f"max by ({N.L_PART}) ({sel(N.DISK_BYTES)})", "{{part}}"),
        ], unit="bytes", description=f"Bytes on disk by part {N.DISK_PARTS}."),
    ]


def _throughput() -> list[dict]:
    return [
        panel("Generated tokens/s", [
            target(f"sum({rate(N.GENERATION_TOKENS)})", "tokens/s (rate)"),
            target(f"sum({sel(N.TOKENS_PER_SECOND)})", "tokens/s (server's window)"),
        ]),
        panel("Request latency", [
            target(quantile(0.5, N.REQUEST_LATENCY), "p50"),
            target(quantile(0.99, N.REQUEST_LATENCY), "p99"),
        ], unit="s"),
        panel("Time to first token", [
            target(quantile(0.5, N.TIME_TO_FIRST_TOKEN), "p50"),
            target(quantile(0.99, N.TIME_TO_FIRST_TOKEN), "p99"),
        ], unit="s"),
        panel("Requests by finish reason", [
            target(f"sum by ({N.L_FINISH}) ({rate(N.REQUESTS)})", "{{finish_reason}}"),
        ], unit="reqps"),
        panel("Queue depth", [target(f"sum({sel(N.QUEUE_DEPTH)})", "waiting for a batch slot")]),
        panel("Engine busy share and steps per second", [
            target(f"sum({rate(N.ENGINE_BUSY_SECONDS)})", "busy share (1: compute-bound)"),
            target(f"sum({rate(N.ENGINE_STEPS)})", "steps/s"),
        ]),
        panel("Refused requests and slow-client timeouts", [
            target(f"sum by ({N.L_REASON}) ({rate(N.REQUESTS_REJECTED)})", "{{reason}}"),
            target(f"sum by ({N.L_PHASE}) ({rate(N.HTTP_REQUEST_TIMEOUTS)})", "408 ({{phase}})"),
        ], unit="reqps"),
    ]


def _control() -> list[dict]:
    by, per = f"{N.L_GROUP}, {N.L_ARM}", f"{N.L_GROUP}, {N.L_MEASURE}"
    ratio_sel, low_sel = sel(N.CONTROL_UPLIFT, f'{N.L_BOUND}="ratio"'), sel(N.CONTROL_UPLIFT, f'{N.L_BOUND}="low"')
    window = ("since the group's served adapter version went live (serve.control_share of each group's requests "
              "draft with the frozen base: the control arm)")
    return [
        panel("Uplift: learned over control", [
            target(f"max by ({per}) ({ratio_sel})", "{{group}} {{measure}}"),
            target(f"max by ({per}) ({low_sel})", "{{group}} {{measure}} 95% low"),
        ], description=f"The learned arm's mean over the control arm's, {window}; 1.0: learning bought nothing. "
                       "A 95% low above 1.0: it did, with confidence."),
        panel("Tokens per target pass: learned vs control", [
            target(f"max by ({by}) ({sel(N.CONTROL_TOKENS_PER_PASS)})", "{{group}} {{arm}}"),
        ], description=f"A request's tokens per target pass (1 + accepted / steps), mean by arm, {window}."),
        panel("Decode tok/s per request: learned vs control", [
            target(f"max by ({by}) ({sel(N.CONTROL_DECODE_TOKENS_PER_SECOND)})", "{{group}} {{arm}}"),
        ], unit="short", description=f"A request's decode tokens per second as the engine timed it, mean by arm, "
                                     f"{window}."),
        _unit_range(panel("α: learned vs control", [
            target(f"max by ({by}) ({sel(N.CONTROL_ACCEPTANCE_RATE)})", "{{group}} {{arm}}"),
        ], unit="percentunit", description=f"{ALPHA}, pooled by arm, {window}.")),
        panel("Why α moved (by cause)", [
            target(f"sum by ({N.L_GROUP}, {N.L_CAUSE}) ({increase(N.ALPHA_MOVES)})", "{{group}} {{cause}}"),
        ], description="Moves of a lane's live α between two windows of its records, by the cause the server named "
                       "(serving_disagrees: the engine drafts what its weights do not say; drafter_changed; "
                       "target_changed; traffic_changed; unexplained). Each is logged with its numbers and listed under "
                       "alpha_diagnosis in /admin/status."),
    ]


def _sections() -> list[tuple[str, list[dict]]]:
    """The dashboard's rows, each a title and its panels (in reading order, two a line)."""
    return [("Acceptance", _acceptance()), ("What learning buys (control group)", _control()),
            ("Tokens per target pass", _passes()),
            ("Promotions and rollbacks", _promotions()), ("Trainer", _trainer()), ("Feedback backlog", _backlog()),
            ("Throughput and latency", _throughput())]


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (import it, or provision it from a file)."""
    panels, y, pid = [], 0, 1
    for title, section in _sections():
        panels.append({"type": "row", "title": title, "collapsed": False, "id": pid, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(section):
            p["id"] = pid
            p["gridPos"] = {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}
            panels.append(p)
            pid += 1
        y += 8 * ((len(section) + 1) // 2)
    annotations = [
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
         "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
        {"datasource": DS, "enable": True, "iconColor": "green", "name": "promotions",
         "expr": f"sum({increase(N.DRAFTER_PROMOTIONS, '1m')}) > 0", "step": "1m", "titleFormat": "promotion"},
        {"datasource": DS, "enable": True, "iconColor": "red", "name": "rollbacks",
         "expr": f"sum({increase(N.DRAFTER_ROLLBACKS, '1m')}) > 0", "step": "1m", "titleFormat": "rollback"},
    ]
    templating = [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1},
        {"name": "instance", "label": "server", "type": "query", "datasource": DS,
         "query": {"query": f"label_values({N.DRAFTER_VERSION}, instance)", "refId": "instance"},
         "definition": f"label_values({N.DRAFTER_VERSION}, instance)", "includeAll": True, "multi": True,
         "allValue": ".*", "current": {}, "hide": 0, "refresh": 2, "sort": 1},
    ]
    return {
        "uid": UID, "title": "dvi: speculative decoding with an online drafter",
        "description": "dvi serve's /metrics: acceptance by drafter version and traffic group, tokens per target "
                       "pass, promotions and rollbacks, the online trainer, the feedback backlog, throughput and "
                       "latency. Generated by dvi.metrics.dashboard from dvi.metrics.names.",
        "tags": ["dvi", "speculative-decoding"], "editable": True, "graphTooltip": 1, "schemaVersion": 39,
        "version": 1, "refresh": "30s", "time": {"from": "now-3h", "to": "now"}, "timezone": "",
        "annotations": {"list": annotations}, "templating": {"list": templating}, "panels": panels,
    }


def dashboard_json(dashboard: dict | None = None) -> str:
    """The dashboard as the file holds it (stable key order, one trailing newline)."""
    return json.dumps(dashboard if dashboard is not None else build_dashboard(), indent=1, ensure_ascii=False) + "\n"


def write_dashboard(path: Path = DASHBOARD_PATH) -> Path:
    """Write the dashboard JSON to `path` (default: the shipped file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dashboard_json(), encoding="utf-8")
    return path


# -- checking a dashboard against a server -------------------------------------------------------------
_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                       "unless", "offset", "inf", "nan", "atan2"})


def queries(dashboard: dict) -> list[str]:
    """Every PromQL expression in `dashboard`: panel targets (rows' nested panels too), annotations, and the
    metric part of `label_values(metric, label)` template queries."""
    out: list[str] = []

    def walk(panels: Iterable[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    out.extend(a["expr"] for a in dashboard.get("annotations", {}).get("list", []) if a.get("expr"))
    for v in dashboard.get("templating", {}).get("list", []):
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v.get("type") == "query" and isinstance(q, str):
            m = re.fullmatch(r"\s*label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)\s*", q)
            out.append(m.group(1) if m else q)
    return out


def series_names(expr: str) -> set[str]:
    """The metric (series) names a PromQL expression selects: identifiers that are neither functions,
    aggregations, keywords, label names (inside {...} or by/without/on/ignoring/group_* lists) nor numbers."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    s = re.sub(r"(?<![A-Za-z0-9_:])\d+(?:\.\d+)?(?:[eE][+-]?\d+|[smhdwy]+)?", " ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        if m.group(0) in _KEYWORDS or s[m.end():].lstrip().startswith("("):
            continue
        names.add(m.group(0))
    return names


def exported_series(exposition: str) -> tuple[set[str], set[str]]:
    """(names a query can select, names with at least one sample) from a Prometheus text exposition.

    A declared family counts even without samples (a labelled metric has none until its first label set):
    a counter by its `_total` name, a histogram by its `_bucket`, `_sum` and `_count` series, anything else by
    its own name."""
    declared: set[str] = set()
    sampled: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, metric_type = line.split(maxsplit=3)
            if metric_type == "histogram":
                declared |= {name + "_bucket", name + "_sum", name + "_count"}
            elif metric_type == "summary":
                declared |= {name, name + "_sum", name + "_count"}
            else:
                declared.add(name)
        elif line and not line.startswith("#"):
            sampled.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return declared | sampled, sampled


def missing_series(dashboard: dict, exposition: str) -> dict[str, set[str]]:
    """Query -> the series it names that `exposition` (a server's /metrics) does not export; empty: all there."""
    exported, _ = exported_series(exposition)
    out = {}
    for q in queries(dashboard):
        missing = series_names(q) - exported
        if missing:
            out[q] = missing
    return out


if __name__ == "__main__":
    print(f"wrote {write_dashboard()}")
