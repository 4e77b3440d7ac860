"""benchmarks/serve_field.py (issue 61 §4): the field's client's data set and command line, its recorded result read
back, the goals, and the reason it gives where vLLM's venv is missing. Nothing here starts a server or vLLM."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import _field_client as fc
from benchmarks import serve_field as sf

FIXTURE = Path(__file__).parent / "fixtures" / "serve_field_client_result.json"
"""A result JSON `vllm bench serve --save-detailed` wrote in serve_field's smoke run (dvi off, 8 prompts, C=4)."""


def _level(**kw) -> dict:
    return {"concurrency": 4, "prompts": 8, "max_tokens": 64, "warmups": 0, "ignore_eos": False,
            "result_dir": "/r", "result_file": "off-r0-c4.json", "label": "off", **kw}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_client_argv_is_greedy_closed_at_c_and_saves_detail():
    argv = fc.client_argv("http://127.0.0.1:1", "field", "/tok", "/d.json", _level())
    assert _flag(argv, "--backend") == "openai" and _flag(argv, "--endpoint") == "/v1/completions"
    assert _flag(argv, "--dataset-name") == "sharegpt" and "--disable-shuffle" in argv
    assert _flag(argv, "--max-concurrency") == "4" and _flag(argv, "--request-rate") == "inf"
    assert _flag(argv, "--temperature") == "0" and _flag(argv, "--sharegpt-output-len") == "64"
    assert _flag(argv, "--num-prompts") == "8" and _flag(argv, "--model") == _flag(argv, "--served-model-name")
    assert {"--save-result", "--save-detailed"} <= set(argv) and "--ignore-eos" not in argv
    assert _flag(argv, "--percentile-metrics") == "ttft,tpot,itl,e2el" and _flag(argv, "--metric-percentiles") == "50,99"
    assert "--ignore-eos" in fc.client_argv("u", "m", "t", "d", _level(ignore_eos=True))


def test_the_data_set_is_sharegpt_alternating_domains(tmp_path):
    prompts = fc.interleave(["c0", "c1", "c2"], ["h0", "h1"])
    assert [p["domain"] for p in prompts] == ["code", "chat", "code", "chat", "code"]
    records = json.loads(fc.write_dataset(tmp_path / "d.json", prompts).read_text())
    # what vLLM's ShareGPT loader reads: at least two turns, the first the prompt
    assert [r["conversations"][0]["value"] for r in records] == ["c0", "h0", "c1", "h1", "c2"]
    assert all(len(r["conversations"]) >= 2 for r in records)


def test_warm_up_then_the_prefix_cache_emptied_on_vllm_only():
    posts = fc.warm_up_posts("http://h", "field", "hi", 2, reset_prefix_cache=True)
    assert [(u, n) for u, _, n in posts] == [("http://h/v1/completions", 1)] * 2 + [("http://h/reset_prefix_cache", 1)]
    assert posts[0][1]["temperature"] == 0 and posts[0][1]["model"] == "field"
    assert len(fc.warm_up_posts("http://h", "field", "hi", 2, reset_prefix_cache=False)) == 2
    # a burst as wide as the level, as long as its longest prompt: the batch and KV cache grown before it is timed
    burst = fc.warm_up_posts("http://h", "field", "hi", 2, False, ("hi" * 50, 16, 64))[-1]
    assert burst[2] == 16 and burst[1]["prompt"] == "hi" * 50 and burst[1]["max_tokens"] == 64


def test_a_recorded_result_parses_and_pools():
    raw = json.loads(FIXTURE.read_text())
    r = fc.parse_result(raw)
    assert r["client"]["completed"] == len(r["texts"]) == len(r["ttfts_s"]) == 8 and not r["errors"]
    assert r["client"]["output_throughput"] == pytest.approx(raw["total_output_tokens"] / raw["duration"])
    assert fc.pool([r, r])["output_tok_s"] == pytest.approx(raw["output_throughput"])
    pooled = fc.pool([r])  # one round: the client's own percentiles, from its per-request figures
    assert pooled["ttft_p50_ms"] == pytest.approx(raw["median_ttft_ms"])
    assert pooled["ttft_p99_ms"] == pytest.approx(raw["p99_ttft_ms"])
    assert pooled["itl_p99_ms"] == pytest.approx(raw["p99_itl_ms"])
    assert pooled["tpot_mean_ms"] == pytest.approx(raw["mean_tpot_ms"], rel=1e-6)
    assert fc.differing(r["texts"], r["texts"]) == 0
    assert fc.differing(r["texts"][:-1] + ["other"], r["texts"]) == 1 and fc.differing(r["texts"][:6], r["texts"]) == 2


def test_a_run_splits_into_its_steady_state_and_its_draining_tail():
    """C = 2, three requests: both slots busy from the second start (t = 1) to the third (t = 4); after it only the
    third runs. Chunk times are start + TTFT + the gaps; a chunk's tokens are its request's spread over its chunks."""
    raw = {"max_concurrency": 2, "start_times": [0.0, 1.0, 4.0], "ttfts": [0.5, 0.5, 0.5],
           "itls": [[1.0, 1.0, 1.0], [1.0, 1.0], [1.0]], "output_lens": [8, 3, 4], "latencies": [3.5, 2.5, 1.5]}
    ph = fc.phases(raw, [True] * 3)
    # request 0's chunks at 0.5, 1.5, 2.5, 3.5 (2 tokens each), 1's at 1.5, 2.5, 3.5 (1 each), 2's at 4.5, 5.5 (2 each)
    assert ph == {"steady_tokens": 3 * 2 + 3 * 1, "steady_s": 3.0, "tail_tokens": 4.0, "tail_s": 1.5}
    pooled = fc.pooled_phases([{"phases": ph}, {"phases": ph}])
    assert pooled == {"steady_tok_s": 3.0, "tail_s": 1.5, "tail_tok_s": pytest.approx(4 / 1.5)}
    assert fc.phases(raw, [True, True, False])["steady_s"] == 0.0  # no more requests than slots: no steady state
    r = fc.parse_result(json.loads(FIXTURE.read_text()))  # the recorded smoke run: 8 requests at C = 4
    assert r["phases"]["steady_s"] > 0 and r["phases"]["steady_tokens"] > 0


def _args(**kw) -> argparse.Namespace:
    return sf.parse_args(["--json", "/dev/null", *[x for k, v in kw.items() for x in (f"--{k}", str(v))]])


def _fig(tok_s: float, ttft: float, texts: list[str]) -> dict:
    return {"client": {"total_output_tokens": tok_s * 10, "duration": 10.0, "completed": len(texts), "failed": 0,
                       "output_throughput": tok_s, "spec_decode_acceptance_rate": None},
            "ttfts_s": [ttft / 1000] * len(texts), "tpots_s": [0.1], "itls_s": [0.1], "texts": texts, "errors": []}


def test_goals_from_figures_fp32():
    args = _args(concurrency="8", arms="off,separate,suffix,vllm,vllm-ngram")
    speed = {"off": 13.0, "separate": 14.0, "suffix": 12.0, "vllm": 10.0, "vllm-ngram": 10.0}
    runs = {a: {8: [_fig(v, 100.0, ["a", "b" if a != "suffix" else "x"])]} for a, v in speed.items()}
    gs = {g["name"]: g for g in sf.goals(sf.goal_specs(args, bf16_native=False), sf.figures(runs))}
    assert gs["dvi separate vs dvi off, output tok/s, C=8 (fp32)"]["met"]
    assert not gs["dvi suffix vs dvi off, output tok/s, C=8 (fp32)"]["met"]
    assert gs["dvi off vs vLLM plain, output tok/s, C=8 (fp32)"]["value"] == pytest.approx(1.3)
    assert gs["dvi's best kind vs vLLM ngram, output tok/s, C=8 (fp32)"]["value"] == pytest.approx(1.4)
    differ = next(g for n, g in gs.items() if n.startswith("dvi answers whose greedy text differs"))
    assert differ["value"] == 1.0 and not differ["met"]
    assert not any("bf16" in n for n in gs)  # vLLM is compared at the same dtype only
    bf16 = sf.goal_specs(_args(concurrency="8", dtype="bf16", arms="off,vllm"), bf16_native=True)
    assert [s[0] for s in bf16 if "vLLM" in s[0]] == ["dvi's best (bf16) vs vLLM's best (fp32), output tok/s, C=8"]


def test_an_arm_whose_server_failed_leaves_its_goals_unmet_not_the_run():
    args = _args(concurrency="8", arms="off,separate,vllm")
    runs = {"off": {8: [_fig(10.0, 100.0, ["a"])]}, "separate": {8: [_fig(12.0, 90.0, ["a"])]}, "vllm": {8: []}}
    figs = sf.figures(runs)
    assert "vllm" not in figs and [r["arm"] for r in sf.rows(figs, [8])] == ["off", "separate"]
    gs = {g["name"]: g for g in sf.goals(sf.goal_specs(args, bf16_native=False), figs)}
    assert gs["dvi separate vs dvi off, output tok/s, C=8 (fp32)"]["met"]
    assert gs["dvi off vs vLLM plain, output tok/s, C=8 (fp32)"]["value"] is None
    assert gs["TTFT p50, dvi off / vLLM plain, C=8 (fp32)"]["value"] is None


def test_suffix_arms_get_a_fresh_server_per_level():
    assert sf.server_spans("suffix", [1, 4]) == [[1], [4]] and sf.server_spans("hybrid", [1]) == [[1]]
    assert sf.server_spans("off", [1, 4]) == sf.server_spans("vllm", [1, 4]) == [[1, 4]]


def test_ignore_eos_is_sent_only_where_every_server_takes_it():
    from serving.protocol import UNSUPPORTED

    on, why = sf.ignore_eos("auto", ["off", "vllm"])
    assert on == ("ignore_eos" not in UNSUPPORTED) and why
    assert sf.ignore_eos("auto", ["vllm"])[0] and sf.ignore_eos("off", ["vllm"]) == (False, "--ignore-eos off")


def test_smoke_is_short():
    a = sf.parse_args(["--smoke"])
    assert a.levels == [1, 4] and a.arm_list == ["off", "vllm"] and a.rounds == 1 and a.prompts == 8
    assert a.json.endswith("_smoke.json")


def test_without_vllms_venv_it_says_why_and_marks_the_goals_not_measured(tmp_path, capsys):
    out = tmp_path / "field.json"
    assert sf.main(["--vllm-python", str(tmp_path / "no-venv" / "python"), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["measured"] is False and "does not exist" in res["not_measured"] and "make vllm-venv" in res["not_measured"]
    assert res["goals"] and all(g["measured"] is False and g["value"] is None and not g["met"] for g in res["goals"])
    assert res["machine"]["cpu"] and res["machine"]["goals_stated_for"]
    assert "not measured: vLLM's venv is missing" in capsys.readouterr().out


def test_vllms_intel_openmp_is_preloaded_only_where_its_venv_has_one(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    assert fc.iomp_preload(str(python)) == ""
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").write_bytes(b"")
    assert fc.iomp_preload(str(python)) == str(tmp_path / "venv" / "lib" / "libiomp5.so")


def test_from_results_reports_a_recorded_run_without_servers(tmp_path):
    (tmp_path / "work" / "results").mkdir(parents=True)
    (tmp_path / "work" / "results" / "off-r0-c4.json").write_text(FIXTURE.read_text())
    out = tmp_path / "field.json"
    argv = ["--arms", "off,separate", "--concurrency", "4", "--rounds", "1", "--from-results", str(tmp_path / "work"),
            "--vllm-python", str(tmp_path / "none"), "--json", str(out)]
    assert sf.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["figures"]["off"]["4"]["output_tok_s"] == pytest.approx(json.loads(FIXTURE.read_text())["output_throughput"])
    assert [f["arm"] for f in res["failures"]] == ["separate"] and len(res["texts"]["off"]["4"][0]) == 8


def test_each_servers_kernel_choice_is_read_from_its_log_and_a_difference_said(tmp_path, caplog, capsys):
    """The probe's own log line (`dvi.decode.rows_kernel`), read back per server: two servers of a run whose start-up
    probes chose apart measured different engines, and the report says so."""
    import logging

    from tiny_models import tiny_llama

    from dvi.decode import rows_kernel
    from dvi.decode.lean import LeanModel

    if rows_kernel.load() is None:
        pytest.skip(f"rows kernel unavailable: {rows_kernel.unavailable_reason()}")
    rows_kernel._KERNEL_ROWS.clear()  # timed again, so it logs
    with caplog.at_level(logging.INFO, logger="dvi.decode.rows_kernel"):
        LeanModel(tiny_llama(0, vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)).use_rows_kernel()
    line = [r.getMessage() for r in caplog.records if "rows kernel (" in r.getMessage()][-1]
    other = ("fp32 rows kernel (AVX2), 2-layer model: forwards of up to 2 rows (its time over torch's kernels at (1, 2, 4) "
             "rows: 1 1 2)")
    drafter = line.replace("2-layer model", "1-layer model")
    for name, text in (("off-r0-c8", line), ("suffix-r0-c8", line), ("hybrid-r0-c8", other)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "server.log").write_text(f"2026-12-06 INFO dvi.decode.rows_kernel: {drafter}\n"
                                                    f"2026-12-06 INFO dvi.decode.rows_kernel: {text}\nserving\n")
    kernels = sf.server_kernels(tmp_path)
    assert kernels["off-r0-c8"] == kernels["suffix-r0-c8"] and set(kernels["off-r0-c8"]) == {"2-layer", "1-layer"}
    assert kernels["hybrid-r0-c8"]["2-layer"] == "AVX2: forwards of up to 2 rows"
    sf.print_kernels({k: v for k, v in kernels.items() if k != "hybrid-r0-c8"})
    assert "NOTE" not in capsys.readouterr().out
    sf.print_kernels(kernels)
    out = capsys.readouterr().out
    assert "for the 2-layer model" in out and "hybrid-r0-c8 AVX2: forwards of up to 2 rows" in out
    assert "1-layer" not in out  # the drafters chose alike


def test_dvi_servers_counters_are_read_around_each_level(tmp_path):
    """A dvi arm's level carries its server's own counters (a sidecar `_run_client` writes from /metrics before and
    after): drafted tokens per output token, their acceptance and tokens a step come from what they moved by; the
    names are dvi's (`dvi.metrics.names`); a level without a sidecar (vLLM's servers) has none."""
    import http.server
    import threading

    from dvi.metrics import names as M

    assert fc.SERVER_COUNTERS == [M.ENGINE_STEPS, M.GENERATION_TOKENS, M.NUM_DRAFT_TOKENS, M.NUM_ACCEPTED_TOKENS]
    text = (f"# HELP {M.ENGINE_STEPS} steps\n# TYPE {M.ENGINE_STEPS} counter\n{M.ENGINE_STEPS} 40.0\n"
            f'{M.GENERATION_TOKENS}{{domain="a"}} 100.0\n{M.GENERATION_TOKENS}{{domain="b"}} 28.0\n'
            f'{M.NUM_DRAFT_TOKENS}{{domain="a"}} 50.0\n{M.NUM_ACCEPTED_TOKENS}{{domain="a"}} 20.0\n'
            f"{M.NUM_DRAFT_TOKENS}_created 1.7e9\n")

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        after = fc.scrape_counters(f"http://127.0.0.1:{srv.server_port}/metrics", fc.SERVER_COUNTERS)
    finally:
        srv.shutdown()
    assert after == {M.ENGINE_STEPS: 40.0, M.GENERATION_TOKENS: 128.0, M.NUM_DRAFT_TOKENS: 50.0,
                     M.NUM_ACCEPTED_TOKENS: 20.0}
    result = tmp_path / "separate-r0-c4.json"
    result.write_text(FIXTURE.read_text())
    assert fc.read_level(result)["server"] is None and fc.pool([fc.read_level(result)]).get("drafted_per_token") is None
    before = dict.fromkeys(after, 0.0) | {M.ENGINE_STEPS: 8.0, M.GENERATION_TOKENS: 28.0}
    result.with_suffix(".server.json").write_text(json.dumps({"before": before, "after": after}))
    r = fc.read_level(result)
    assert r["server"][M.GENERATION_TOKENS] == 100.0 and r["server"][M.ENGINE_STEPS] == 32.0
    f = fc.pool([r, r])
    assert f["drafted_per_token"] == pytest.approx(0.5) and f["server_alpha"] == pytest.approx(0.4)
    assert f["tokens_per_step"] == pytest.approx(100 / 32)
