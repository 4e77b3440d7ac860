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
