"""`dvi bench soak` end to end on the tiny pair with a very small budget, and its goal arithmetic."""

from __future__ import annotations

import json

import pytest

from benchmarks import soak


def _wave(tokens: int, acc: int, dra: int, rss: int | None = 100) -> dict:
    return {"feedback_tokens": tokens, "accepted": dict.fromkeys(soak.DOMAINS, acc),
            "drafted": dict.fromkeys(soak.DOMAINS, dra), "errors": 0, "promoted": 0, "rolled_back": 0,
            "server_rss": rss, "trainer_rss": rss}


def test_tail_alpha_pools_the_last_fifth_and_flatness_reads_the_second_half():
    waves = [_wave(100 * i, 1, 10) for i in range(1, 9)] + [_wave(900, 8, 10), _wave(1000, 6, 10, rss=125)]
    assert soak.tail_alpha(waves, "sql") == pytest.approx(14 / 20)  # tokens > 800: the last two waves
    assert soak.flatness(waves, "server_rss") == pytest.approx(1.25)
    summary, goals = soak.soak_goals({"online": {"waves": waves}, "frozen": {"waves": waves[:-2] + [_wave(900, 1, 10),
                                                                                                  _wave(1000, 1, 10)]}})
    assert summary["online_tail"]["code"] - summary["frozen_tail"]["code"] == pytest.approx(0.6)
    met = {g["name"].split(",")[0]: g["met"] for g in goals}
    assert met["online α - frozen α on code"] and not met["server memory max/min"]


def test_soak_runs_both_arms_on_the_tiny_pair(tiny_pair_dir, tmp_path):
    out = tmp_path / "soak.json"
    assert soak.main(["--preset", "tiny", "--pair-dir", str(tiny_pair_dir), "--feedback-tokens", "120", "--wave", "4",
                      "--max-tokens", "12", "--concurrency", "2", "--wandb", "offline", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"online", "frozen"} and res["png"] and (tmp_path / "soak.png").is_file()
    for arm in res["arms"].values():
        waves = arm["waves"]
        assert waves and waves[-1]["feedback_tokens"] >= 120 and all(w["errors"] == 0 for w in waves)
        assert all(w["server_rss"] > 0 for w in waves)
        assert {d for w in waves for d, a in w["alpha"].items() if a is not None} == set(soak.DOMAINS)
    assert all(w["trainer_rss"] for w in res["arms"]["online"]["waves"])
    assert not any(w["trainer_rss"] for w in res["arms"]["frozen"]["waves"])  # trainer off: none to sample
    names = {g["name"] for g in res["goals"]}
    assert {"errors (both arms)"} <= names and sum("online α - frozen α" in n for n in names) == 3
    for arm in ("online", "frozen"):
        rows = (tmp_path / "soak_work" / arm / "soak_wandb" / "metrics.jsonl").read_text().splitlines()
        assert any(json.loads(r).get("domain") == "sql" for r in rows)
        assert list((tmp_path / "soak_work" / arm / "soak_wandb" / "wandb").glob("offline-run-*"))


def test_mix_is_validated():
    with pytest.raises(SystemExit):
        soak.parse_args(["--mix", "code:1,poetry:1"])
    assert soak.parse_args(["--mix", "sql:1", "--preset", "tiny"]).mix == (("sql", 1.0),)


# -- the long soak (`--minutes`, issue 60 §2) ---------------------------------------------------------------
def _row(rid: str | None, outcome: str = "answered", tokens: int = 5, **kw) -> dict:
    return {"request_id": rid, "outcome": outcome, "tokens": tokens, "domain": "code", "accepted": 1, "drafted": 2,
            "latency": 0.1, "t0": 0.0, "t1": 1.0, **kw}


def test_record_checks_are_exact_about_what_the_log_must_hold():
    from benchmarks._soak_checks import record_checks

    rows = [_row("a"), _row("b"), _row(None, "cut"), _row(None, "abandoned"), _row(None, "http_5xx")]
    ok = [("a", "length", "code", 5), ("b", "stop", "code", 5), ("x", "abort", "code", 2)]
    r = record_checks(rows, ok, server_total=3)
    assert (r["n_missing"], r["n_doubled"], r["n_token_mismatches"], r["outside_cut_bounds"], r["server_diff"]) == \
        (0, 0, 0, 0, 0)
    assert record_checks(rows, ok + [("y", "abort", "code", 0)], 4)["outside_cut_bounds"] == 0  # the abandoned one ran
    bad = record_checks(rows, [ok[0], ok[0], ("b", "stop", "code", 4)], server_total=3)
    assert bad["doubled"] == ["a"] and bad["token_mismatches"] == ["b"] and bad["server_diff"] == 0
    assert bad["outside_cut_bounds"] == 1  # the cut request streamed tokens: it ran, so it must be logged
    assert record_checks(rows, ok[1:], 2)["missing"] == ["a"]
    many = record_checks(rows, ok + [("y", "abort", "code", 0), ("z", "abort", "code", 0)], 5)
    assert many["outside_cut_bounds"] == 1  # one cut and one abandon leave at most two records


def test_growth_and_rise_compare_quarters_within_each_process_life():
    from benchmarks._soak_checks import growth, rise

    def s(t: float, pid: int, rss: int, fds: int = 10) -> dict:
        return {"t": t, "trainer": {"pid": pid, "rss": rss, "fds": fds, "threads": 4}}

    steady = [s(i, 1, 100) for i in range(1, 9)] + [s(8 + i, 2, 50) for i in range(1, 9)]  # killed at 8: smaller
    assert growth(steady, "trainer", "rss", 16) == pytest.approx(0.0)
    leaking = steady[:8] + [s(8 + i, 2, 50 + 10 * i, fds=10 + i) for i in range(1, 9)]
    assert growth(leaking, "trainer", "rss", 16) > 0.3 and rise(leaking, "trainer", "fds", 16) >= 3
    assert growth(steady[:3], "trainer", "rss", 16) is None  # too short a life to judge


def test_alpha_falls_are_judged_inside_segments_and_explained_by_rollbacks():
    from benchmarks._soak_checks import alpha_falls

    rows = [dict(_row(str(i), t0=i, t1=i + 0.5), accepted=8 if i < 50 else 2, drafted=10) for i in range(100)]
    falls = alpha_falls(rows, 0.0, [], 100.0, [], ("code",))
    assert len(falls) == 1 and falls[0]["unexplained"] and falls[0]["fall"] == pytest.approx(0.6)
    assert not alpha_falls(rows, 0.0, [50.0], 100.0, [], ("code",))[0]["unexplained"]  # a drift at 50 splits it
    caught = alpha_falls(rows, 0.0, [], 100.0, [70.0], ("code",))[0]
    assert not caught["unexplained"] and caught["explained_by"] == "rollback"


def test_the_schedule_repeats_its_shapes_so_the_second_and_last_quarter_match():
    from benchmarks._soak_traffic import event_times, schedule

    phases = schedule(60, 10, (1, 4, 8))
    assert [p.shape for p in phases] == ["code-heavy@c1", "chat-heavy@c4", "sql-heavy@c8"] * 2
    assert phases[-1].end_s == 3600 and event_times(60, 15) == [900, 1800, 2700] and event_times(60, 0) == []
    assert schedule(1, 0.4, (2,))[-1].end_s == pytest.approx(60)  # the last phase is cut at the end


def test_long_soak_on_the_tiny_pair(tiny_pair_dir, tmp_path):
    """`--minutes` end to end, shortened: every interval in seconds; the end checks that hold at any length must
    hold (records = answered, 0 5xx, faults recovered, bounds), the quarter checks must have values."""
    out = tmp_path / "soak_long.json"
    assert soak.main(["--preset", "tiny", "--pair-dir", str(tiny_pair_dir), "--minutes", "0.8", "--drift-minutes",
                      "0.13334", "--target-update-minutes", "0.3", "--kill-minutes", "0.4", "--sample-seconds", "4",
                      "--poll-seconds", "0.5", "--max-tokens", "16", "--retention-mb", "1", "--log-max-kb", "16",
                      "--cut-share", "0.1", "--abandon-share", "0.1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    goals = {g["name"]: g for g in res["goals"]}
    for name in ("5xx responses (and SSE server errors)", "failed requests (transport errors, 4xx)",
                 "answered requests whose record is missing, doubled or of another token count",
                 "records beyond the answered outside [cuts, cuts + abandons]",
                 "records - the server's finished requests (dvi_request_latency_seconds_count)",
                 "feedback shards unread by the check (deleted first) or unreadable",
                 "feedback records dropped or failed to write", "samples taken", "minutes of traffic",
                 "target updates refused", "trainer kills it did not come back from",
                 "feedback: peak / retention bound", "logs: peak / bound", "registry versions: peak / bound"):
        assert goals[name]["met"], (goals[name], res["feedback"])
    # retention binds (most shards deleted) yet lets each shard live several polls (~32 shards of ~30 KB kept:
    # at 0.25 MB a shard lived ~1.5 s, under two polls on a loaded 2-core machine, and the check missed some)
    assert res["feedback"]["deleted_shards"] > res["feedback"]["shards_read"] / 2, res["feedback"]
    for name in ("server RSS growth, second -> last quarter of a life (medians)",
                 "p99 latency, last quarter / second quarter", "server open fds, a life's last quarter's max - second's"):
        assert goals[name]["value"] is not None, name
    rec = res["summary"]["records"]
    assert rec["answered"] > 50 and rec["records"] == rec["answered"] + rec["beyond_answered"]
    assert rec["cuts"] > 0 and rec["abandons"] > 0 and rec["by_reason"].get("abort", 0) >= rec["cuts"]
    assert res["feedback"]["deleted_shards"] > 0  # retention bound while the check read every shard
    kinds = [e["kind"] for e in res["events"]]
    assert kinds.count("target_update") == 2 and kinds.count("trainer_kill") == 1 and kinds.count("drift") == 5
    assert len(res["samples"]) >= 10 and all(s["server"]["rss"] > 0 for s in res["samples"])
    assert {d for s in res["samples"] for d, a in s["alpha"].items() if a is not None} == set(soak.DOMAINS)
    assert (tmp_path / "soak_long.png").is_file() and (tmp_path / "soak_long.requests.jsonl").is_file()
