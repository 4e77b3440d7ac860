"""The `suffix` / `hybrid` drafter kinds around the engine: config, serving (/health, /metrics, learning from
finished requests at once), feedback records' draft sources, the trainer's view of them, the replica tailer,
and the verify-width rule. Losslessness is in tests/test_engine.py and tests/test_sampling.py."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_feedback import fake_result, make_record
from test_serving_helpers import ServerThread, tiny_config

from dvi import metrics as M
from dvi.config import ConfigError, load_config
from dvi.decode.k_choice import choose_point_k
from dvi.feedback import FeedbackReader, FeedbackRecord, FeedbackWriter
from dvi.feedback.record import SCHEMA


def test_config_kinds_and_overrides():
    cfg = load_config(None, ["models.drafter_kind=hybrid", "models.hybrid_kind=eagle", "suffix.threshold=2.5",
                             "suffix.max_draft_tokens=24"])
    assert cfg.models.learned_kind == "eagle" and cfg.suffix.threshold == 2.5 and cfg.suffix.max_draft_tokens == 24
    assert load_config(None, ["models.drafter_kind=suffix"]).models.learned_kind is None
    assert load_config(None, []).models.learned_kind == "separate"
    with pytest.raises(ConfigError, match="models.hybrid_kind"):
        load_config(None, ["models.hybrid_kind=suffix"])
    with pytest.raises(ConfigError, match="suffix.max_draft_tokens"):
        load_config(None, ["suffix.max_draft_tokens=0"])


def test_choose_point_k_prices_the_verify_width():
    flat = lambda k: 1.0  # noqa: E731 - verify costs nothing more with K: the whole proposal pays
    assert choose_point_k([[0.9, 0.8, 0.5, 0.2]], 1, flat, 4) == 4
    steep = lambda k: 1.0 + 0.3 * k  # noqa: E731 - each verified token costs 30% of a step
    assert choose_point_k([[0.9, 0.8, 0.5, 0.2]], 1, steep, 4) == 2  # 0.5 and 0.2 do not pay 0.3 each
    assert choose_point_k([[0.1]], 1, steep, 1) == 0  # plain decoding wins
    assert choose_point_k([[0.9, 0.9]], 16, steep, 2) == 0  # one proposal among 16 rows does not pay the width


def test_draft_source_round_trips_and_old_shards_read_without_it(tmp_path):
    res = fake_result()
    res.draft_source = [2, 1, 0]
    rec = FeedbackRecord.from_result(res)
    assert rec.draft_source == [2, 1, 0]
    with pytest.raises(ValueError, match="draft_source"):
        make_record(3).__class__(**{**rec.__dict__, "draft_source": [1]})
    with FeedbackWriter(tmp_path / "fb", shard_records=1) as w:
        w.write(rec)
    old = [f for f in SCHEMA if f.name != "draft_source"]  # a shard written before the field existed
    table = pa.Table.from_pylist([{k: v for k, v in make_record(3).__dict__.items() if k != "draft_source"}],
                                 schema=pa.schema(old))
    pq.write_table(table, tmp_path / "fb" / "shard-00000000000000000001-1-000001.parquet")
    r = FeedbackReader(tmp_path / "fb")
    got = sorted(r.read_records(r.poll()), key=lambda x: x.request_id)
    assert {tuple(g.draft_source) for g in got} == {(2, 1, 0), ()}
    assert r.quarantined_shards == 0


def test_trainer_sees_only_the_models_own_drafts():
    rec = make_record(3, n=3)
    rec.drafted_ids, rec.accepted, rec.draft_source = [rec.token_ids[0], 4, rec.token_ids[2]], [True, False, True], \
        [3, 1, 1]
    ex = rec.compact()
    assert ex.drafted_ids.tolist() == [-1, 4, rec.token_ids[2]] and ex.accepted.tolist() == [False, False, True]
    rec.draft_source = []  # an old record: every draft was the model's
    assert rec.compact().drafted_ids.tolist() == rec.drafted_ids


def test_tailer_adds_other_writers_outputs(tmp_path):
    from dvi.drafters.suffix import SuffixCache
    from serving.suffix_tail import SuffixTailer

    root = tmp_path / "fb"
    with FeedbackWriter(root, shard_records=2) as w:
        for i in range(5):
            w.write(make_record(i))
    cache = SuffixCache()
    def add(items):
        for seq_id, toks in items:
            cache.add_finished(seq_id, toks)

    mine = SuffixTailer(str(root), add, max_records=3)  # this process wrote them: skipped
    assert mine.poll_once() == 0 and cache.stats()["seqs"] == 0
    other = SuffixTailer(str(root), add, max_records=3, pid=-1)
    assert other.poll_once() == 3 and cache.stats()["seqs"] == 3  # bounded per poll
    assert other.poll_once() == 0  # everything up to the newest shard was read


@pytest.fixture(scope="module")
def suffix_server(tiny_pair_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("suffix-run")
    cfg = tiny_config(tiny_pair_dir, run, "models.drafter_kind=suffix", "serve.trainer=supervised",
                      "serve.max_tokens_limit=64")
    with ServerThread(cfg) as s:
        yield s


def test_suffix_server_learns_from_finished_requests_and_trains_nothing(suffix_server, tiny_pair_dir):
    from dvi.engine.speculative import SpeculativeEngine
    from dvi.models.loading import load_pair

    pair = load_pair(tiny_pair_dir / "target", tiny_pair_dir / "drafter", tiny_pair_dir / "tokenizer", device="cpu")
    prompt = "def main(argv):\n"
    ids = pair.tokenizer.encode(prompt, add_special_tokens=True)
    ref = SpeculativeEngine(pair.target, None).generate([ids], 32, stop_token_ids=[pair.tokenizer.eos_token_id])[0]
    with suffix_server.client() as c:
        outs = [c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32}).json() for _ in range(2)]
        h = suffix_server.health()  # the details need the admin token
        text = c.get("/metrics").text
    want = pair.tokenizer.decode(ref.token_ids, skip_special_tokens=True)
    assert [o["choices"][0]["text"] for o in outs] == [want, want]
    assert h["status"] == "ok" and h["trainer"]["state"] == "off" and "nothing to train" in h["trainer"]["note"]
    assert h["drafter_kind"] == "suffix" and h["suffix"]["seqs"] >= 1 and h["suffix"]["hits_global"] > 0
    for name in (M.SUFFIX_INDEX_TOKENS, M.SUFFIX_LOOKUPS, M.SUFFIX_STEP_SECONDS, M.SOURCE_ACCEPTANCE_RATE):
        assert name in text, name
    assert f'{M.SOURCE_ACCEPTED_TOKENS}{{source="suffix_global"}}' in text


def test_outputs_of_older_target_versions_decay():
    """RL: a prompt's finished samples join the index with its prompt tail (later samples draft their first
    tokens from them); after new weights, the newer version's continuation wins the vote."""
    from types import SimpleNamespace

    import torch

    from dvi.drafters.suffix import SuffixCache
    from dvi.drafters.suffix_proposer import SuffixProposer

    cache = SuffixCache()
    sp = SuffixProposer(cache, 50, torch.device("cpu"), max_tokens=4, min_prob=0.01, version_decay=0.25)
    prompt = [1, 2, 3]

    def finish(rid: str, out: list[int]) -> None:
        cache.start(rid, prompt)
        sp.rids = [rid]
        sp.release([(0, SimpleNamespace(req=SimpleNamespace(prompt_ids=prompt), res=SimpleNamespace(token_ids=out)),
                     True)], [])

    finish("old-a", [7, 8, 9])
    finish("old-b", [7, 8, 9])
    sp.rebuild([], target_version=1)
    finish("new", [5, 6, 4])
    cache.start("next", prompt)
    assert cache.propose("next", 4, min_prob=0.01).tokens[:1] == [5]  # 2 x 0.25 < 1
    sp.rebuild([], target_version=1)  # idempotent
    assert cache.propose("next", 4, min_prob=0.01).tokens[:1] == [5]


def test_dvi_train_refuses_suffix_with_a_clear_message(capsys):
    from dvi.cli import main

    assert main(["train", "--online", "models.drafter_kind=suffix"]) == 2
    assert "no learned drafter to train" in capsys.readouterr().err


def test_goodput_guard_stops_drafting_that_measures_slower():
    from dvi.decode.adaptive import GoodputGuard

    g = GoodputGuard(window=4, margin=1.05, retry_every=3)
    assert g.allow(16)  # nothing measured
    for _ in range(2):
        g.observe(16, True, 20, 0.4)  # 3.1 tokens/s/row drafting
    assert not g.allow(16)  # plain not measured yet: measure it
    for _ in range(2):
        g.observe(16, False, 16, 0.2)  # 5 tokens/s/row plain
    assert not g.allow(16) and g.allow(1)  # plain wins in this bucket only
    assert not g.allow(16)  # the third refusal forgets the drafting samples...
    assert g.allow(16)  # ...so drafting is tried again
    for _ in range(2):
        g.observe(16, True, 40, 0.3)
    assert g.allow(16)


def test_no_drafter_proposes_nothing():
    """Without a drafter (kind `none`) every step is a plain step: the proposer's draft has width 0 and carries the
    one uniform per row a sampled token needs."""
    import torch

    from dvi.drafters.factory import make_proposer

    calls = []
    d = make_proposer("none", None, 8, "cpu").propose([object(), object()], [4, 4], None,
                                                      lambda n: calls.append(n) or torch.zeros(2, n), None)
    assert d.width == 0 and d.lens == [0, 0] and calls == [1]


def test_hybrid_bar_falls_to_what_the_learned_drafter_delivers():
    """A suffix proposal costs no model pass: once the learned drafter measurably accepts less per step than
    a proposal promises, the proposal drafts that row even below `suffix.threshold`."""
    from types import SimpleNamespace

    import torch
    from tiny_models import tiny_llama

    from dvi.drafters.factory import proposer_for_drafter
    from dvi.drafters.hybrid_proposer import HybridProposer
    from dvi.drafters.learned import SeparateDrafter
    from dvi.drafters.proposer import Draft
    from dvi.drafters.suffix import SuffixCache
    from dvi.drafters.suffix_proposer import SuffixProposer

    cache = SuffixCache()
    cache.add_finished("done", [1, 2, 3, 7, 8, 9])
    sp = SuffixProposer(cache, 64, torch.device("cpu"), max_tokens=4)
    hy = HybridProposer(proposer_for_drafter(SeparateDrafter(tiny_llama(seed=1)), 64, torch.device("cpu")), sp,
                        threshold=100.0)
    seqs = [SimpleNamespace(req=SimpleNamespace(request_id="r", prompt_ids=[5, 1, 2, 3], group=""))]
    hy.join(seqs, None)
    assert hy.bar == 100.0 and not hy.choose([4])[0]  # nothing clears a bar of 100
    # the learned drafter drafted 3 tokens and the target kept none of them: it emitted 7
    hy.observe(Draft(torch.zeros(1, 3, dtype=torch.long), None, [3], ["model"], None), [0], [[7]], None)
    assert hy.model_gain == 0.0 and hy.bar == 0.0
    chosen, model_rows = hy.choose([4])
    assert list(chosen) == [0] and model_rows == [] and chosen[0].tokens[:2] == [8, 9]


def test_a_refused_batch_size_does_no_suffix_lookups():
    """Where suffix drafts measured slower than plain steps (batch 16 on CPU), the engine does not even look
    them up: the lookups were the residue that kept `suffix` at 0.98x of speculation off there."""
    import torch
    from tiny_models import tiny_llama

    from dvi.drafters.factory import make_proposer
    from dvi.drafters.suffix import SuffixCache
    from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine

    target = tiny_llama(seed=0, vocab_size=64)
    cache = SuffixCache()
    eng = SpeculativeEngine(target, make_proposer("suffix", None, 64, "cpu", cache), adaptive=True)
    for _ in range(eng.suffix_guard.window // 2):  # measured (the guard's least): drafting 3 tokens/s/row, plain 5
        eng.suffix_guard.observe(4, True, 12, 1.0)
        eng.suffix_guard.observe(4, False, 20, 1.0)
    for i in range(4):
        eng.add_request(Request(f"r{i}", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_new_tokens=6)))
    eng.step()
    assert eng.num_active() == 4 and cache.lookups == 0 and eng.last_k == 0
    with torch.inference_mode():
        while eng.has_unfinished():
            eng.step()
    assert cache.lookups == 0


@pytest.mark.parametrize("kind", ["suffix", "history"])
def test_steps_without_lookups_index_their_tokens_before_the_next_lookup(kind):
    """Under load most steps look nothing up (`KPolicy.lookups_due`): their emitted tokens are only collected, and
    the next lookup step indexes them first, so every lookup proposes exactly what indexing every step would
    (rows' own indices, history's live siblings in the global one, the calibrated scores)."""
    import random
    from types import SimpleNamespace

    import torch

    from dvi.drafters.proposer import Draft
    from dvi.drafters.suffix import SuffixCache
    from dvi.drafters.suffix_proposer import SuffixProposer
    from dvi.rollout_history import HistoryProposer

    base = SuffixProposer if kind == "suffix" else HistoryProposer

    class EveryStep(base):  # the reference: every step's tokens indexed at once, as before the deferral
        def observe(self, draft, n, emitted, feats):
            self._looked = True
            super().observe(draft, n, emitted, feats)

    rng = random.Random(0)
    props = [cls(SuffixCache(), 16, torch.device("cpu"), max_tokens=4, min_prob=0.01) for cls in (base, EveryStep)]
    seqs = [SimpleNamespace(req=SimpleNamespace(request_id=f"r{i}", prompt_ids=[rng.randrange(6) for _ in range(5)],
                                                group="")) for i in range(3)]
    for p in props:
        p.join(seqs, None)
    looked = 0
    for step in range(60):
        lookups = rng.random() < 0.3
        sets = [p.proposal_sets([4, 4, 4], lookups) for p in props]
        assert [{i: [(q.tokens, q.probs, q.source) for q in f] for i, f in s.items()} for s in sets] == \
            [{i: [(q.tokens, q.probs, q.source) for q in f] for i, f in sets[1].items()}] * 2, step
        looked += lookups and bool(sets[0])
        emitted = [[rng.randrange(6) for _ in range(rng.randrange(3))] for _ in seqs]
        for p in props:
            p.observe(Draft.empty(len(seqs), lambda n: None, torch.device("cpu")), [0] * len(seqs), emitted, None)
    assert looked > 5  # the lookups found drafts to compare
