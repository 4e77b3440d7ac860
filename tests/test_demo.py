"""The demo's scenario on the test pair: its phases, the replayed reference (`demo.replay`), end to end."""

from __future__ import annotations

import itertools
import json

import pytest
from registry_doors import publish_full

from demo import scenario as demo
from dvi.config import load_config
from dvi.models.loading import load_tokenizer


def _cfg(tiny_pair_dir):
    return load_config(None, ["models.preset=tiny", f"models.target={tiny_pair_dir / 'target'}",
                              f"models.drafter={tiny_pair_dir / 'drafter'}",
                              f"models.tokenizer={tiny_pair_dir / 'tokenizer'}", "speculation.adaptive=false",
                              "speculation.num_draft_tokens=3"])


def test_phases_drift_away_from_code_and_back_to_the_drift_after_the_update(tiny_pair_dir):
    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    phases = demo._phases(cfg, tok, 5)
    assert [p.domain for p in phases] == ["code", "prose", "prose"]  # no chat template: prose drifts
    assert all(p.n == 5 for p in phases)


def test_phases_drift_to_sql_for_a_chat_tokenizer(tiny_pair_dir):
    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    phases = demo._phases(cfg, tok, 5)
    assert [p.domain for p in phases] == ["code", "sql", "sql"]
    endpoint, body = phases[1].request()
    assert endpoint == "/v1/chat/completions" and "CREATE TABLE" in body["messages"][0]["content"]
    assert body["metadata"] == {"domain": "sql"}


def test_demo_trainer_checks_for_a_publish_sooner_unless_the_config_says(tiny_pair_dir, tmp_path):
    """Promotions within the demo's minutes: publish checks every `PUBLISH_EVERY_STEPS` (default 20), a
    value the user's config sets is kept."""
    import yaml

    path, _ = demo._write_serve_config(_cfg(tiny_pair_dir), tmp_path, tmp_path / "targets")
    assert yaml.safe_load(path.read_text())["trainer"]["publish_every_steps"] == demo.PUBLISH_EVERY_STEPS == 5
    own = load_config(None, ["trainer.publish_every_steps=30"])
    path, _ = demo._write_serve_config(own, tmp_path, tmp_path / "targets")
    assert yaml.safe_load(path.read_text())["trainer"]["publish_every_steps"] == 30


def test_a_demo_with_one_shared_drafter_replays_half_of_each_batch_unless_the_config_says(tmp_path):
    import yaml

    def replay(*overrides) -> float:
        path, _ = demo._write_serve_config(load_config(None, list(overrides)), tmp_path, tmp_path / "targets")
        return yaml.safe_load(path.read_text())["trainer"]["replay_ratio"]

    assert replay("serve.engine=vllm") == demo.SHARED_REPLAY_RATIO == 0.5  # vLLM serves one drafter to all
    assert replay() == load_config(None, []).trainer.replay_ratio  # per-domain adapters: each its own buffer
    assert replay("serve.engine=vllm", "trainer.replay_ratio=0.1") == 0.1
    path, _ = demo._write_serve_config(load_config(None, []), tmp_path, tmp_path / "targets")
    assert yaml.safe_load(path.read_text())["registry"]["keep_last"] == demo.KEEP_VERSIONS  # every window replayable


@pytest.mark.parametrize(("acceptance", "k", "tokens"), [
    ([1, 1, 0, 1, 1, 1], 3, 3 + 2 + 1 + 4 + 3 + 2),  # runs cut at K and at the response's end
    ([1, 1, 1, 1], 2, 3 + 3 + 3 + 2),  # every draft agrees: K + 1 a step until the end
    ([0, 0, 0], 4, 3),  # nothing agrees: the target's one token a step
    ([1, 0, 1], 0, 3),  # speculation off: one token a step
    ([0.5, 0.5], 2, (1 + 0.5 + 0.25) + (1 + 0.5)),  # sampled: expected run, positions independent
])
def test_chain_tokens_counts_tokens_per_drafting_step_from_per_position_agreement(acceptance, k, tokens):
    """Replayed tokens per drafting step: every start position t drafts t .. t + K - 1 and keeps 1 + its run of
    agreeing positions."""
    import torch

    from dvi.feedback.shadow import chain_tokens

    assert chain_tokens(torch.tensor(acceptance, dtype=torch.float32), k) == pytest.approx(tokens)
    assert chain_tokens(torch.zeros(0), 3) == 0.0


def test_window_rate_divides_the_windows_tokens_by_its_wall_time_not_the_sum_of_latencies():
    """Requests in flight together share the wall clock: the window runs from its first send to its last answer."""
    stats = [{"completion_tokens": 30, "sent_s": 10.0, "received_s": 12.0},
             {"completion_tokens": 20, "sent_s": 10.5, "received_s": 13.0},
             {"completion_tokens": 50, "sent_s": 12.0, "received_s": 15.0}]
    assert demo.window_rate(stats) == (100, 5.0, 20.0)
    assert demo.window_rate([]) == (0, 0.0, None)


def _records(cfg, tok, n):
    """Greedy feedback records of the tiny pair on the first `n` code prompts, as the server logs them."""
    from dvi.feedback.record import FeedbackRecord
    from serving.engine_build import serving_engine
    from serving.loading import load_serving_pair

    engine = serving_engine(cfg, load_serving_pair(cfg))
    prompts = list(itertools.islice(demo._phases(cfg, tok, n)[0].prompts, n))
    return [FeedbackRecord.from_result(r, domain="code") for r in engine.generate(prompts, 24)]


def _perturbed_full_version(cfg, registry, scale):
    """A `full` drafter version: the tiny drafter with noise on its weights (a stand-in for a trained one)."""
    import torch

    from serving.loading import load_serving_pair

    d = load_serving_pair(cfg).drafter
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean())
    return publish_full(registry, d.state_dict(), d.config)


def test_replay_scores_each_window_through_the_frozen_and_the_serving_drafter_on_the_same_tokens(
        tiny_pair_dir, tmp_path):
    """The reference is the window's own responses replayed through v0: before a promotion α̂ served is it
    exactly (gain 0), and so are its tokens per drafting step; a window served by v1 reads v1's α̂ and length on
    the very tokens v0 is read on; a version that does not load (pruned) leaves its records out of both, never
    mixing drafters."""
    from demo import replay as demo_replay
    from dvi.feedback.shadow import chain_tokens, hf_logits_fn, record_acceptance, shadow_alpha
    from dvi.registry.codec import load_drafter_version
    from dvi.registry.store import DrafterRegistry
    from serving.loading import load_serving_pair

    cfg = _cfg(tiny_pair_dir)
    tok = load_tokenizer(tiny_pair_dir / "tokenizer")
    recs = _records(cfg, tok, 6)
    registry = DrafterRegistry(tmp_path / "registry")
    v1 = _perturbed_full_version(cfg, registry, 2.0)  # enough noise to change its argmax
    for r in recs[2:4]:
        r.drafter_version = v1
    recs[5].drafter_version = 7  # never published
    by_id = {r.request_id: r for r in recs}
    rows = [{"request_ids": [r.request_id for r in recs[i:i + 2]]} for i in (0, 2, 4)]
    demo_replay.replay_windows(rows, by_id, demo_replay.drafter_scorers(cfg, tmp_path / "registry"))

    base = load_serving_pair(cfg).drafter
    v0_fn = hf_logits_fn(base)
    v1_fn = hf_logits_fn(load_drafter_version(registry, v1, base)[0])
    first, second, third = rows
    assert first["gain"] == 0.0 and first["replay_alpha"] == first["frozen_alpha"] == shadow_alpha(v0_fn, recs[:2]).alpha
    assert first["replay_records"] == 2 and first["replay_positions"] == sum(len(r.token_ids) for r in recs[:2])
    assert second["replay_alpha"] == shadow_alpha(v1_fn, recs[2:4]).alpha
    assert second["frozen_alpha"] == shadow_alpha(v0_fn, recs[2:4]).alpha
    assert second["gain"] == pytest.approx(second["replay_alpha"] - second["frozen_alpha"])
    assert second["gain"] != 0.0  # a different drafter, scored on the same tokens
    assert third["replay_records"] == 1 and third["frozen_alpha"] == shadow_alpha(v0_fn, recs[4:5]).alpha

    k = cfg.speculation.num_draft_tokens  # 3
    per_position = record_acceptance(v0_fn, recs[:2])
    assert first["replay_len"] == first["frozen_len"] == pytest.approx(
        sum(chain_tokens(a, k) for _, a in per_position) / sum(a.numel() for _, a in per_position))
    for row in rows:
        assert 1.0 <= row["frozen_len"] <= k + 1 and 1.0 <= row["replay_len"] <= k + 1
    assert second["replay_len"] != second["frozen_len"]  # v1's chains, on the same tokens


def test_demo_end_to_end_on_the_test_pair_replays_every_response(tiny_pair_dir, tmp_path, capsys):
    """`run_demo` through a real `dvi serve` + trainer: every window's responses are found in the feedback log
    by their `dvi` block's request id and replayed; windows served by v0 show a gain of exactly 0 (the old
    reference, prompts decoded apart with their own K choices, read +0.07..+0.11 on code before any training)."""
    cfg = load_config(None, ["models.preset=tiny", f"models.target={tiny_pair_dir / 'target'}",
                             f"models.drafter={tiny_pair_dir / 'drafter'}",
                             f"models.tokenizer={tiny_pair_dir / 'tokenizer'}", f"run_dir={tmp_path / 'runs' / 'x'}",
                             "wandb.mode=disabled"])
    assert demo.run_demo(cfg, requests_per_phase=6) == 0
    (run,) = (tmp_path / "runs").glob("demo-*")
    out = json.loads((run / "timeline.json").read_text())
    rows = out["rows"]
    assert [r["n"] for r in rows] == [6, 6, 6] and out["errors"] == 0 and "frozen v0" in out["legend"]
    for r in rows:
        assert len(r["request_ids"]) == r["replay_records"] == 6 and r["replay_positions"] > 0
        assert r["frozen_alpha"] is not None and r["replay_alpha"] is not None
        assert 1.0 <= r["frozen_len"] <= out["k"] + 1 and 1.0 <= r["replay_len"] <= out["k"] + 1
        assert r["tok_s"] > 0 and r["completion_tokens"] > 0 and r["wall_s"] > 0
        if r["drafter_version"] == 0:
            assert r["gain"] == 0.0 and r["replay_len"] == r["frozen_len"]
    assert (run / "alpha.png").stat().st_size > 1000
    # the control group's two arms, live (demo.live_gain): every response of a group counted in one arm
    assert sum(r["learned_n"] + r["control_n"] for r in rows) == 18
    assert [g["phase"] for g in out["live_gain"]] == [r["phase"] for r in rows]
    # printed to a pipe (make demo | tee, CI logs) the table keeps its numbers whole: 80 columns cut gain to "+0.0…"
    printed = capsys.readouterr().out
    assert "+0.000" in printed and "…" not in printed.split("α timeline")[-1].split("α live")[0]
    header = printed.split("α timeline")[-1].split("│")[0]
    assert all(col in header for col in ("len srv/frz", "tpp L/C", "dec tok/s L/C", "tok/s"))
    assert "tok/s" in out["legend"] and "len srv/frz" in out["legend"]


def test_every_demo_and_soak_domain_gets_its_own_metrics_series():
    """The server pools any `metadata.domain` outside `serve.domains` as "other": the drift domain must be in."""
    from benchmarks import soak

    domains = set(load_config(None).serve.domains)
    assert {"code", "prose", "chat", "sql"} | set(soak.DOMAINS) <= domains


def test_the_greedy_check_finds_a_token_that_is_not_the_targets_argmax():
    from types import SimpleNamespace

    import torch
    from tiny_models import tiny_llama

    from demo.greedy import check_greedy
    from dvi.decode.target import plain_greedy

    target = tiny_llama(0).eval()
    prompt = [1, 5, 9, 2]
    tokens, _ = plain_greedy(target, prompt, 12)

    def record(rid, toks, temperature=0.0, version=0):
        return SimpleNamespace(request_id=rid, prompt_ids=prompt, token_ids=toks, temperature=temperature,
                               target_version=version)

    with torch.no_grad():
        logits = target(torch.tensor([prompt + tokens[:5]])).logits[0, -1]
    wrong = tokens[:5] + [int(logits.argmin())] + tokens[6:]  # the target's least likely token at index 5
    found = check_greedy([record("same", tokens), record("wrong", wrong), record("sampled", wrong, 0.7),
                          record("gone", wrong, version=3)], {0: target})
    assert (found.answers, found.equal, found.positions) == (2, 1, 24)
    # the first change is the swapped token (the greedy tokens after it may no longer be the argmax of the new prefix)
    assert {c["request_id"] for c in found.changed} == {"wrong"} and found.changed[0]["index"] == 5
    assert found.changed[0]["gap"] > 0 and "tokens CHANGED" in found.line()


def test_the_greedy_check_judges_by_the_devices_bound_and_against_vllms_own_plain_text():
    """Issue 60: a token off the reference's argmax within the bound vLLM's start-up probe measured is the device's
    kernels, not a changed token; served text is also held against vLLM's own text without speculation."""
    from types import SimpleNamespace

    import torch
    from tiny_models import tiny_llama

    from demo.greedy import check_greedy, check_plain
    from dvi.decode.target import plain_greedy

    target = tiny_llama(0).eval()
    prompt = [1, 5, 9, 2]
    tokens, _ = plain_greedy(target, prompt, 12)
    with torch.no_grad():
        logits = target(torch.tensor([prompt + tokens[:5]])).logits[0, -1]
    wrong = tokens[:5] + [int(logits.argmin())] + tokens[6:]
    recs = [SimpleNamespace(request_id=rid, prompt_ids=prompt, token_ids=t, temperature=0.0, target_version=0)
            for rid, t in (("same", tokens), ("wrong", wrong))]
    strict = check_greedy(recs, {0: target})
    gap = strict.changed[0]["gap"]
    loose = check_greedy(recs, {0: target}, bound=1e9)
    assert loose.bound == 1e9 and not loose.changed and loose.within_bound >= 1 and not loose.failed
    assert "within this device's bound" in loose.line() and "bound 1e+09" in loose.line()
    plain = {"same": tokens, "wrong": tokens}  # vLLM without speculation answered the target's own text
    vs = check_plain(recs, plain, {0: target}, bound=0.0)
    assert (vs["answers"], vs["equal"]) == (2, 1) and vs["changed"] == [
        {"request_id": "wrong", "index": 5, "gap": round(abs(float(logits[tokens[5]] - logits[wrong[5]])), 6)}]
    assert vs["changed"][0]["gap"] == gap
    strict.plain = vs
    assert strict.failed and "1/2 equal, 1 CHANGED" in strict.line()
    assert check_plain(recs, plain, {0: target}, bound=1e9)["near_ties"] == 1


def test_piped_demo_output_prints_progress_lines():
    """Issue 59 §7: with output that is no terminal (CI, `| tee`) the demo's progress bar renders nothing until the
    end, so a line goes out every few requests."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    out = io.StringIO()
    with Progress(console=Console(file=out, force_terminal=False)) as progress:
        live = demo.Live(demo.Timeline(), progress, health={"drafter_version": 3, "target_version": 1})
        live.task = progress.add_task("code", total=20)
        for _ in range(17):
            live.show("code")
    lines = [x for x in out.getvalue().splitlines() if "requests" in x]
    assert len(lines) == 2 and "16 requests" in lines[-1] and "drafter v3" in lines[-1], out.getvalue()
