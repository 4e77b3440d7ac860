"""What learning bought the demo's users, live: the learned arm against the control arm (issue 59 §1, §6).

The demo's server runs a control group (`serve.control_share`, `DEMO_CONTROL_SHARE` unless the config sets it): a
share of each group's requests drafts with the frozen base in the same batches. Every response's `dvi` block says
its arm, the adapter version that drafted it, its tokens per target pass and its decode tok/s as the engine timed it,
so the demo measures the gain from what users got, not from a replay. Per phase, the requests before the group's
first promotion are an A/A check (both arms draft with the frozen base: the uplift must hold 1.0) and those after
it are the gain, each with its 95% interval (`dvi.metrics.uplift`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dvi.metrics.uplift import MEASURES, ArmSample, arm_summary, compare, sample_of_response

DEMO_CONTROL_SHARE = 0.25
"""The demo's control share where the config leaves `serve.control_share` unset: with 96 requests a phase, a quarter
gives the control arm ~20 requests after a promotion, enough for an interval that can exclude 1.0 (the server's own
default, 0.05, is for long runs)."""


def window_arms(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A window's learned and control means (tokens per pass, decode tok/s) and request counts, for its table row."""
    samples = [s for s in (sample_of_response(x) for x in stats) if s is not None]
    out: dict[str, Any] = {}
    for arm in ("learned", "control"):
        a = arm_summary(x for x in samples if x.arm == arm)
        out.update({f"{arm}_n": a["requests"], f"{arm}_tpp": a["tokens_per_pass"],
                    f"{arm}_dtps": a["decode_tokens_per_s"]})
    return out


def _split(samples: list[ArmSample]) -> tuple[list[ArmSample], list[ArmSample]]:
    """(before, after) the first learned request that a promoted adapter drafted."""
    first = next((i for i, s in enumerate(samples) if s.arm == "learned" and s.adapter_version > 0), len(samples))
    return samples[:first], [s for s in samples[first:] if s.arm == "control" or s.adapter_version > 0]


def live_gain(responses: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per phase (in order), the arms before and after the group's first promotion and the uplift of each."""
    phases: dict[str, list[ArmSample]] = {}
    for r in responses:
        s = sample_of_response(r)
        if s is not None:
            phases.setdefault(r["phase"], []).append(s)
    out = []
    for phase, samples in phases.items():
        before, after = _split(samples)
        out.append({"phase": phase, "before_promotion": compare(before), "after_promotion": compare(after)})
    return out


def _cell(c: dict[str, Any], measure: str) -> str:
    u = c["uplift"].get(measure)
    learned, control = c["learned"][measure], c["control"][measure]
    if learned is None or control is None:
        return "-"
    ci = f" [{u['low']:.2f}, {u['high']:.2f}]" if u and u["low"] is not None else ""
    return f"{learned:.2f} / {control:.2f} = {u['ratio']:.2f}x{ci}" if u else "-"


def print_live_gain(console: Any, gains: list[dict[str, Any]], share: float) -> None:
    """The live gain table: per phase and part, both arms' means and the uplift with its 95% interval."""
    from rich.table import Table

    table = Table(title=f"live gain: learned arm vs control arm (frozen base drafts {share:.0%} of each group's "
                        "requests, same batches; mean per request, learned / control = uplift [95% interval])")
    for col in ("phase", "part", "requests L / C", "tokens per target pass", "decode tok/s (engine)"):
        table.add_column(col, justify="left" if col in ("phase", "part") else "right")
    for g in gains:
        for part, label in (("before_promotion", "before promotion (A/A)"), ("after_promotion", "promoted adapter")):
            c = g[part]
            if not c["learned"]["requests"] and not c["control"]["requests"]:
                continue
            table.add_row(g["phase"], label, f"{c['learned']['requests']} / {c['control']['requests']}",
                          *(_cell(c, m) for m in MEASURES))
    console.print(table)


def alpha_moves(health: dict[str, Any]) -> list[dict[str, Any]]:
    """Every move of live α the server explained (`serving.drafter.diagnosis`), from its final /health: the shared
    lane's and each traffic group's, in window order per lane."""
    lanes = [(health.get("drafter") or {})]
    lanes += list(((health.get("adapters") or {}).get("groups") or {}).values())
    return [m for lane in lanes for m in (lane.get("alpha_diagnosis") or {}).get("moves", [])]
