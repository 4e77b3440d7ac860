import os
import time
import uuid

import pytest
import torch

from dvi.decode.results import GenerationResult
from dvi.feedback import FIELD_NAMES, SCHEMA, FeedbackReader, FeedbackRecord, FeedbackWriter, Retention

torch.set_num_threads(1)


def make_record(i: int = 0, n: int = 4, k: int = 3, domain: str = "code") -> FeedbackRecord:
    drafted = [(i + j) % 50 if j % 3 != 2 else -1 for j in range(n)]
    accepted = [j % 3 == 0 for j in range(n)]
    tokens = [drafted[j] if accepted[j] else 100 + j for j in range(n)]
    return FeedbackRecord(
        request_id=f"r{i}",
        domain=domain,
        target_version=1,
        drafter_version=2,
        started_at=1.0,
        finished_at=2.0,
        temperature=0.0,
        prompt_ids=[1, 2, 3],
        token_ids=tokens,
        drafted_ids=drafted,
        accepted=accepted,
        topk_ids=[[j, j + 1, j + 2][:k] for j in range(n)],
        topk_logprobs=[[-0.5, -2.0, -3.0][:k] for _ in range(n)],
    )


def fake_result(n=3, temperature=0.0):
    return GenerationResult(
        request_id="abc",
        prompt_ids=[5, 6],
        token_ids=[7, 8, 9][:n],
        finish_reason="length",
        drafted_ids=[7, 1, -1][:n],
        accepted=[True, False, False][:n],
        topk_ids=[[7, 1], [8, 2], [9, 3]][:n],
        topk_logprobs=[[-0.1, -2.5], [-0.2, -2.0], [-0.3, -1.5]][:n],
        target_version=3,
        drafter_version=4,
        domain="prose",
        started_at=10.0,
        finished_at=11.5,
        temperature=temperature,
    )


def test_from_result():
    rec = FeedbackRecord.from_result(fake_result(temperature=0.7))
    assert rec.request_id == "abc" and rec.domain == "prose"
    assert rec.target_version == 3 and rec.drafter_version == 4
    assert rec.temperature == pytest.approx(0.7)
    assert rec.accepted == [True, False, False]
    assert FeedbackRecord.from_result(fake_result(), domain="code").domain == "code"


@pytest.mark.parametrize(
    "field,value,msg",
    [
        ("drafted_ids", [1, 2], "drafted_ids"),
        ("accepted", [True], "accepted"),
        ("topk_ids", [[1, 2]], "topk_ids"),
        ("topk_logprobs", [[-1.0], [-1.0], [-1.0]], "topk_ids"),
    ],
)
def test_validation_names_field(field, value, msg):
    res = fake_result()
    setattr(res, field, value)
    with pytest.raises(ValueError, match=msg):
        FeedbackRecord.from_result(res)


def test_validation_accepted_must_match_token():
    res = fake_result()
    res.accepted = [False, True, False]
    with pytest.raises(ValueError, match=r"accepted\[1\]"):
        FeedbackRecord.from_result(res)


def test_from_result_accepts_tensors_and_ints(tmp_path):
    res = fake_result()
    res.token_ids = torch.tensor([7, 8, 9])
    res.accepted = [1, 0, 0]
    res.topk_logprobs = torch.tensor(res.topk_logprobs)
    rec = FeedbackRecord.from_result(res)
    assert rec.token_ids == [7, 8, 9] and rec.accepted == [True, False, False]
    with FeedbackWriter(tmp_path / "fb") as w:
        w.write(rec)
    assert FeedbackReader(tmp_path / "fb").read(FeedbackReader(tmp_path / "fb").poll()).num_rows == 1


def test_empty_topk_allowed():
    res = fake_result()
    res.topk_ids, res.topk_logprobs = [], []
    assert FeedbackRecord.from_result(res).topk_ids == []


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_roundtrip_and_cursor_resume(tmp_path, kind):
    root = str(tmp_path / "fb") if kind == "local" else f"memory://fb-{uuid.uuid4().hex}"
    cursor = str(tmp_path / "cursor.json") if kind == "local" else f"memory://cur-{uuid.uuid4().hex}/c.json"
    recs = [make_record(i) for i in range(10)]
    with FeedbackWriter(root, shard_records=4) as w:
        for r in recs:
            w.write(r)
        # two full shards written inline, two records still buffered
        assert w.shards_written == 2 and w.pending() == 2
    assert w.shards_written == 3 and w.records_written == 10

    reader = FeedbackReader(root, cursor_path=cursor)
    shards = reader.poll()
    assert len(shards) == 3 and shards == sorted(shards)
    table = reader.read(shards)
    assert table.schema.equals(SCHEMA)
    assert table.num_rows == 10
    back = list(reader.iter_records(shards))
    assert back[0] == recs[0] and back[-1] == recs[-1]
    ds = reader.as_dataset(shards[:1])
    assert len(ds) == 4 and ds[0]["request_id"] == "r0"

    # train on the first shard only, then "crash"
    reader.commit(shards[0])
    reader2 = FeedbackReader(root, cursor_path=cursor)
    assert reader2.poll() == shards[1:]
    # new data arrives while the trainer is down
    with FeedbackWriter(root, shard_records=100) as w:
        w.write(make_record(99))
    new = reader2.poll()
    assert new[:2] == shards[1:] and len(new) == 3
    reader2.commit(new[-1])  # consumes everything polled up to it
    reader3 = FeedbackReader(root, cursor_path=cursor)
    assert reader3.poll() == []
    assert reader3.cursor == new[-1]


def test_late_shard_from_other_process_not_skipped(tmp_path):
    root = tmp_path / "fb"
    with FeedbackWriter(root, shard_records=1) as w:
        w.write(make_record(1))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    (first,) = reader.poll()
    reader.commit(first)
    # a shard whose name sorts before the cursor appears later (another writer, same grace window)
    ts = int(first.split("-")[1]) - 1000
    late = f"shard-{ts:020d}-1-000001.parquet"
    os.rename(tmp_path / "fb" / first, tmp_path / "fb" / "keep")
    with FeedbackWriter(tmp_path / "other", shard_records=1) as w2:
        w2.write(make_record(2))
    (other,) = os.listdir(tmp_path / "other")
    os.rename(tmp_path / "other" / other, root / late)
    os.rename(tmp_path / "fb" / "keep", tmp_path / "fb" / first)
    r2 = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    assert r2.poll() == [late]
    r2.commit(late)
    assert FeedbackReader(root, cursor_path=tmp_path / "c.json").poll() == []


def test_temp_files_ignored_and_names_unique(tmp_path):
    root = tmp_path / "fb"
    root.mkdir()
    (root / ".tmp-123-4.parquet").write_bytes(b"half a shard")
    w1 = FeedbackWriter(root, shard_records=1)
    w2 = FeedbackWriter(root, shard_records=1)  # a restart / second writer in the same dir
    for i in range(3):
        w1.write(make_record(i))
        w2.write(make_record(10 + i))
    w1.close()
    w2.close()
    shards = FeedbackReader(root).poll()
    assert len(shards) == 6 and len(set(shards)) == 6
    assert FeedbackReader(root).read(shards).num_rows == 6


def test_retention_by_count_and_bytes(tmp_path):
    root = tmp_path / "fb"
    with FeedbackWriter(root, shard_records=1, retention=Retention(shards=3)) as w:
        for i in range(5):
            w.write(make_record(i))
    assert w.deleted_shards == 2
    reader = FeedbackReader(root)
    shards = reader.poll()
    assert len(shards) == 3
    assert [r.request_id for r in reader.iter_records(shards)] == ["r2", "r3", "r4"]

    root2 = tmp_path / "fb2"
    with FeedbackWriter(root2, shard_records=1) as w:
        w.write(make_record(0))
    size = os.path.getsize(root2 / os.listdir(root2)[0])
    with FeedbackWriter(root2, shard_records=1, retention=Retention(bytes=int(size * 2.5))) as w:
        for i in range(4):
            w.write(make_record(i + 1))
    assert len(FeedbackReader(root2).poll()) == 2

    # a shard deleted between poll and read is skipped and counted, not an error
    shards = reader.poll()
    os.remove(root / shards[0])
    assert reader.read(shards).num_rows == 2 and reader.missed_shards == 1


def test_background_flush_by_age(tmp_path):
    root = tmp_path / "fb"
    w = FeedbackWriter(root, shard_records=1000, flush_seconds=0.05, background=True)
    w.write(make_record(0))
    deadline = time.time() + 5
    while w.shards_written == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert w.shards_written == 1
    w.write(make_record(1))
    w.close()
    assert FeedbackReader(root).read(FeedbackReader(root).poll()).num_rows == 2


def test_maybe_flush(tmp_path):
    w = FeedbackWriter(tmp_path / "fb", shard_records=1000, flush_seconds=0.01)
    w.write(make_record(0))
    assert not w.maybe_flush() or w.shards_written == 1
    time.sleep(0.02)
    w.maybe_flush()
    assert w.shards_written == 1 and w.pending() == 0
    w.close()


def test_write_cost_microbenchmark(tmp_path, capsys):
    """Engine-side logging cost: build a record (128 positions x top-32) + write()."""
    n, k = 128, 32
    res = fake_result()
    res.token_ids = list(range(n))
    res.drafted_ids = list(range(n))
    res.accepted = [True] * n
    res.topk_ids = [list(range(k)) for _ in range(n)]
    res.topk_logprobs = [[-1.0] * k for _ in range(n)]
    reps = 2000
    w = FeedbackWriter(tmp_path / "fb", shard_records=10**9, flush_seconds=3600)
    recs = []
    t0 = time.perf_counter()
    for _ in range(reps):
        recs.append(FeedbackRecord.from_result(res))
    t1 = time.perf_counter()
    for r in recs:
        w.write(r)
    t2 = time.perf_counter()
    build_us = (t1 - t0) / reps * 1e6
    write_us = (t2 - t1) / reps * 1e6
    t3 = time.perf_counter()
    w.flush()
    flush_us = (time.perf_counter() - t3) / reps * 1e6
    with capsys.disabled():
        print(
            f"\n[feedback cost, {n} pos x top-{k}] write(): {write_us:.2f} us/record, "
            f"from_result()+validate: {build_us:.1f} us/record, "
            f"flush (off the engine path): {flush_us:.1f} us/record"
        )
    assert write_us < 50


def test_stale_tmp_cleaned_and_pending_bounded(tmp_path):
    root = tmp_path / "fb"
    root.mkdir()
    stale = root / ".tmp-1-2.parquet"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = root / ".tmp-3-4.parquet"
    fresh.write_bytes(b"x")  # might be another live writer's
    w = FeedbackWriter(root, shard_records=100, max_pending=3)
    assert not stale.exists() and fresh.exists()
    for i in range(5):
        w.write(make_record(i))
    assert w.pending() == 3 and w.dropped_records == 2
    w.close()
    assert [r.request_id for r in FeedbackReader(root).iter_records(FeedbackReader(root).poll())] == [
        "r2",
        "r3",
        "r4",
    ]


def test_buffer_bytes_cap_and_failing_state(tmp_path):
    """Issue 17 item 8: while shard writes fail the buffer is capped in bytes (oldest dropped and
    counted), `failing` says so, and once storage works again every kept record is written once."""
    from dvi.feedback import record_nbytes

    root = tmp_path / "fb"
    size = record_nbytes(make_record(0))
    w = FeedbackWriter(root, shard_records=100, max_pending_bytes=int(3.5 * size))
    aside = tmp_path / "aside"
    root.rename(aside)
    root.write_text("a file where the dir was: writes fail")
    for i in range(7):
        w.write(make_record(i))
    with pytest.raises(OSError):
        w.flush()
    assert w.failing and w.last_error and w.flush_errors == 1
    assert w.pending() == 3 and w.dropped_records == 4 and w.pending_bytes() == 3 * size
    root.unlink()
    aside.rename(root)
    w.close()
    assert not w.failing and w.last_error is None and w.pending_bytes() == 0
    r = FeedbackReader(root)
    ids = r.read(r.list_shards()).column("request_id").to_pylist()
    assert ids == ["r4", "r5", "r6"] and w.records_written + w.dropped_records == 7


def test_unreadable_shard_is_quarantined_and_counted(tmp_path):
    """Issue 17 item 4 (library side): a corrupt file named like a shard is moved aside, not retried."""
    from dvi.feedback import QUARANTINE_DIR

    w = FeedbackWriter(tmp_path, shard_records=2)
    for i in range(4):
        w.write(make_record(i))
    w.close()
    bad = f"shard-{time.time_ns():020d}-1-000001.parquet"
    (tmp_path / bad).write_bytes(b"PAR1 not parquet")
    r = FeedbackReader(tmp_path)
    names = r.poll()
    assert bad in names and r.num_rows(bad) is None
    assert (tmp_path / QUARANTINE_DIR / bad).exists() and bad not in r.poll()
    assert r.read(r.poll()).num_rows == 4 and r.quarantined_shards == 1 and r.quarantined_total() == 1
    # valid parquet, foreign schema: read with SCHEMA it would come back as nulls
    import pyarrow as pa
    import pyarrow.parquet as pq

    foreign = f"shard-{time.time_ns():020d}-1-000002.parquet"
    pq.write_table(pa.table({"request_id": ["x", "y"]}), tmp_path / foreign)
    assert r.read(r.poll()).num_rows == 4 and r.quarantined_total() == 2
    # right schema, inconsistent record (accepted draft != token): quarantined when validating
    from dvi.feedback import records_to_table

    rec = make_record(9)
    rec.accepted = [True] * len(rec.token_ids)
    inconsistent = f"shard-{time.time_ns():020d}-1-000003.parquet"
    pq.write_table(records_to_table([rec]), tmp_path / inconsistent)
    assert r.read(r.poll()).num_rows == 5  # the plain read does not look inside records
    assert r.read(r.poll(), validate=True).num_rows == 4 and r.quarantined_total() == 3


def test_retention_by_age(tmp_path):
    # a shard named (written) more than age_s ago is deleted at the next write; the newest always stays
    root = tmp_path / "fb"
    with FeedbackWriter(root, shard_records=1, retention=Retention(age_s=3600)) as w:
        w.write(make_record(0))
        w.flush()
        old = next(root.glob("shard-*.parquet"))
        name = old.name.split("-", 2)
        aged = root / f"shard-{time.time_ns() - 7200 * 10**9:020d}-{name[2]}"
        old.rename(aged)
        w.write(make_record(1))
        w.flush()
    left = sorted(p.name for p in root.glob("shard-*.parquet"))
    assert len(left) == 1 and aged.name not in left and w.deleted_shards == 1


@pytest.mark.parametrize("missing", ["finish_reason", "hidden", "hidden_dim", "draft_source"])
def test_shards_from_before_an_optional_column_read_with_its_default(tmp_path, missing) -> None:
    """A shard written before an optional column existed reads whole, the column as the field's default; it
    is not quarantined (the finish_reason column was: two OPTIONAL_FIELDS literals, the second without it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "fb"
    root.mkdir()
    rec = make_record(1)
    table = pa.Table.from_pylist([{k: v for k, v in rec.__dict__.items() if k != missing}],
                                 schema=pa.schema([f for f in SCHEMA if f.name != missing]))
    pq.write_table(table, root / "shard-00000000000000000001-1-000001.parquet")
    r = FeedbackReader(root)
    (got,) = r.read_records(r.poll())
    assert r.quarantined_shards == 0
    default = getattr(FeedbackRecord(**{k: v for k, v in rec.__dict__.items() if k != missing}), missing)
    assert getattr(got, missing) == default and default is not None


def test_the_feedback_log_opens_as_a_dataset_and_dvi_report_reads_it(tmp_path, capsys):
    """Issue 59 §5: one call opens every shard as a `datasets.Dataset` with the trainer's columns and the derived
    acceptance counts; a damaged shard is skipped, never moved; `dvi report RUN_DIR` prints α per domain and drafter
    version from it."""
    from dvi.cli import main
    from dvi.feedback.dataset import DERIVED, acceptance_by, open_feedback

    run = tmp_path / "run"
    root = run / "feedback"
    recs = [make_record(i, n=6, domain="code" if i % 3 else "sql") for i in range(9)]
    with FeedbackWriter(str(root), shard_records=4) as w:
        for r in recs:
            w.write(r)
    (root / "shard-00000000000000000001-1-bad-000000000001.parquet").write_bytes(b"not parquet")
    ds = open_feedback(run)  # a run dir: its feedback/ dir
    assert len(ds) == 9 and set(FIELD_NAMES) | set(DERIVED) == set(ds.column_names)
    assert (root / "shard-00000000000000000001-1-bad-000000000001.parquet").exists()  # read only
    r0 = ds.filter(lambda r: r["request_id"] == "r0")[0]
    drafted = sum(1 for d in recs[0].drafted_ids if d >= 0)
    assert r0["num_drafted"] == drafted and r0["num_accepted"] == sum(recs[0].accepted)
    assert r0["alpha"] == pytest.approx(sum(recs[0].accepted) / drafted)
    by = {r["domain"]: r for r in acceptance_by(ds)}
    assert by["sql"]["records"] == 3 and by["code"]["records"] == 6
    assert by["sql"]["accepted"] == sum(sum(r.accepted) for r in recs if r.domain == "sql")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "9 feedback records" in out and "sql" in out and f"{by['sql']['alpha']:.3f}" in out
