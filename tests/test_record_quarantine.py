"""Issue 36 §5: one unusable feedback record is quarantined, the rest of its shard trains, the trainer goes on.

Before: a record whose prompt ids lay outside the vocabulary passed validation, failed the forward and
killed the trainer; the restarted trainer read the same shard again (4 restarts in ~35 s, never
quarantined, the cursor could not pass it).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from test_online import _consumed, _write_shards, engine_records, online_config
from test_online_process import _ids, _reap, _start, _stop, _wait, tiny_pair, trainer_config

from dvi import metrics as M
from dvi.feedback import FeedbackRecord
from dvi.feedback.shadow import is_heldout
from dvi.registry.store import DrafterRegistry
from trainers.online.loop import TrainerLoop
from trainers.online.trainer import OnlineTrainer

torch.set_num_threads(1)
OUTSIDE = 10**6  # a token id no tiny vocabulary has


@pytest.fixture(scope="module")
def records(tiny_pair_dir) -> list[FeedbackRecord]:
    return engine_records(tiny_pair(tiny_pair_dir), "prose", 24, max_new_tokens=12, prefix="q")


def _outside_vocab(rec: FeedbackRecord, fraction: float) -> FeedbackRecord:
    """`rec` with an out-of-vocabulary prompt id, under a request id that is trained on (not held out)."""
    rid = next(f"bad-{i}" for i in range(100) if not is_heldout(f"bad-{i}", fraction))
    return dataclasses.replace(rec, request_id=rid, prompt_ids=[OUTSIDE, *rec.prompt_ids])


def test_validation_names_an_id_outside_the_vocabulary(records) -> None:
    rec = records[0]
    rec.check_ids(512)
    with pytest.raises(ValueError, match=r"prompt_ids\[0\]=1000000 is outside the vocabulary of 512"):
        _outside_vocab(rec, 0.0).check_ids(512)
    bad_topk = copy.deepcopy(rec)
    bad_topk.topk_ids[2][1] = 512
    with pytest.raises(ValueError, match=r"topk_ids\[2\]\[1\]=512"):
        bad_topk.check_ids(512)


def _loop(cfg, drafter) -> TrainerLoop:
    loop = TrainerLoop(OnlineTrainer(cfg, copy.deepcopy(drafter), registry=DrafterRegistry(cfg.registry.dir)), cfg)
    loop.stop.requested = True  # take whatever is pending at once
    loop.restore()
    return loop


@pytest.mark.parametrize("flushed", [False, True], ids=["fresh", "from-checkpoint"])
def test_a_forward_that_fails_anyway_rewinds_without_its_record(records, tiny_pair_dir, tmp_path, flushed) -> None:
    """The last resort: a record the screen lets through (here: it is told no vocabulary) fails the forward;
    the loop finds it, refuses it and rewinds to its last flush instead of crashing."""
    drafter = tiny_pair(tiny_pair_dir).drafter
    cfg = online_config(tiny_pair_dir, tmp_path, "trainer.batch_size=4", "trainer.checkpoint_seconds=3600")
    bad = _outside_vocab(records[5], cfg.trainer.heldout_fraction)
    recs = [*records[:5], bad, *records[6:]]
    _write_shards(Path(cfg.feedback.dir), recs[:12], per_shard=4)
    loop = _loop(cfg, drafter)
    loop.screen.vocab_size = None
    assert loop.run_round() is not None  # the newest shard trains
    if flushed:
        loop.flush()  # the rewind then returns to this checkpoint, else to a fresh start
    for _ in range(10):
        loop.run_round()  # the bad record's round fails, rewinds, then everything trains without it
    loop.flush()
    entries = _consumed(tmp_path)
    assert sorted(_ids(entries)) == sorted(r.request_id for r in recs[:12] if r is not bad)
    assert [i for e in entries for i in e["quarantined"]] == [bad.request_id]
    assert loop.trainer.records_seen == sum(len(e["trained"]) for e in entries)
    assert loop.screen.quarantined == 1 and loop.reader.poll() == []
    kept = [json.loads(x) for x in loop.rundir.quarantined_records_path.read_text().splitlines()]
    assert [k["request_id"] for k in kept] == [bad.request_id] and "IndexError" in kept[0]["reason"]


@pytest.mark.slow
def test_the_trainer_process_quarantines_the_record_and_trains_the_rest(records, tiny_pair_dir, tmp_path) -> None:
    cfg, config = trainer_config(tiny_pair_dir, tmp_path, "trainer.batch_size=4", "trainer.min_new_records=4",
                                 "trainer.poll_seconds=0.2", "trainer.publish_every_steps=1000000")
    bad = _outside_vocab(records[3], cfg.trainer.heldout_fraction)
    recs = [*records[:3], bad, *records[4:]]
    _write_shards(Path(cfg.feedback.dir), recs, per_shard=4)  # the bad record shares its shard with 3 good ones
    log = tmp_path / "trainer.log"
    proc = _start(config, log)
    try:
        def accounted() -> int:
            entries = _consumed(tmp_path)
            return len(_ids(entries)) + sum(len(e.get("quarantined", [])) for e in entries)

        _wait(lambda: accounted() >= len(recs), 120, proc, "every record trained or quarantined")
        status = json.loads((tmp_path / "trainer" / "status.json").read_text())
        pid = proc.pid
        _stop(proc, log)
    finally:
        _reap(proc)
    entries = _consumed(tmp_path)
    assert sorted(_ids(entries)) == sorted(r.request_id for r in recs if r is not bad)
    assert [i for e in entries for i in e.get("quarantined", [])] == [bad.request_id]
    assert status[M.TRAINER_QUARANTINED_RECORDS] == 1 and status["pid"] == pid
    kept = [json.loads(x) for x in (tmp_path / "trainer" / "quarantined_records.jsonl").read_text().splitlines()]
    assert kept[0]["record"]["prompt_ids"][0] == OUTSIDE and "prompt_ids[0]" in kept[0]["reason"]
    text = log.read_text()
    assert f"feedback record {bad.request_id}" in text and "Traceback" not in text
    assert os.path.getsize(tmp_path / "trainer" / "quarantined_records.jsonl") < 100_000
