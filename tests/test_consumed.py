"""Issue 36 §4 (library side): what the trainer has consumed never depends on a writer's clock.

Shards from a replica whose clock runs 10 minutes fast, or from one whose clock was stepped back, are
polled like any other, across restarts; what retention deletes unread is counted as lost, a shard that
appears behind its writer's consumed count as skipped; the state stays bounded by the dir.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from test_feedback import make_record

from dvi.feedback import FeedbackReader, FeedbackWriter
from dvi.feedback.consumed import MARKER, MAX_WRITERS, ConsumedState
from dvi.feedback.storage import parse_shard, shard_name

TEN_MINUTES_NS = 600 * 10**9


def _write(root, ids, offset_ns: int = 0, monkeypatch=None, writer: FeedbackWriter | None = None) -> FeedbackWriter:
    """One shard per record, by `writer` (a new one if None) with its clock `offset_ns` off."""
    if offset_ns:
        real = time.time_ns
        monkeypatch.setattr(time, "time_ns", lambda: real() + offset_ns)
    w = writer or FeedbackWriter(root, shard_records=1)
    for i in ids:
        w.write(make_record(i))
    if offset_ns:
        monkeypatch.undo()
    return w


def _ids(reader: FeedbackReader, names: list[str]) -> list[str]:
    return sorted(r.request_id for r in reader.iter_records(names))


def test_a_fast_clock_shard_hides_nothing_written_after_it(tmp_path, monkeypatch) -> None:
    root, cursor = tmp_path / "fb", tmp_path / "cursor.json"
    _write(root, range(4))
    reader = FeedbackReader(root, cursor_path=cursor)
    reader.commit_shards(reader.poll())
    _write(root, [100], TEN_MINUTES_NS, monkeypatch)  # a replica 10 minutes fast
    (fast,) = reader.poll()
    reader.commit_shards([fast])
    _write(root, range(4, 10))  # the right clock again: named 10 minutes before the fast shard
    assert _ids(reader, reader.poll()) == sorted(f"r{i}" for i in range(4, 10))
    restarted = FeedbackReader(root, cursor_path=cursor)  # a trainer restart keeps every one pending
    assert _ids(restarted, restarted.poll()) == sorted(f"r{i}" for i in range(4, 10))
    restarted.commit_shards(restarted.poll())
    assert FeedbackReader(root, cursor_path=cursor).poll() == []
    assert restarted.state.lost == 0 and restarted.state.skipped == 0


def test_a_clock_stepped_back_hides_nothing(tmp_path, monkeypatch) -> None:
    root, cursor = tmp_path / "fb", tmp_path / "cursor.json"
    w = _write(root, range(3))
    reader = FeedbackReader(root, cursor_path=cursor)
    reader.commit_shards(reader.poll())
    _write(root, range(3, 6), -TEN_MINUTES_NS, monkeypatch, writer=w)  # the same writer, its clock stepped back
    pending = reader.poll()
    assert _ids(reader, pending) == ["r3", "r4", "r5"]
    reader.commit_shards(pending[1:])  # trained out of order (newest first): the first one stays pending
    assert reader.poll() == pending[:1]
    assert FeedbackReader(root, cursor_path=cursor).poll() == pending[:1]


def test_shards_deleted_unread_are_lost_quarantined_ones_are_not(tmp_path) -> None:
    root = tmp_path / "fb"
    w = _write(root, range(6))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    names = reader.poll()
    reader.commit_shards(names[:2])
    os.remove(root / names[2])  # seen, then deleted by retention before it was trained
    reader.quarantine(names[3], "test")  # unreadable: counted as quarantined, not lost
    before = set(reader.list_shards())
    _write(root, [6], writer=w)
    reader.poll()
    (listed,) = set(reader.list_shards()) - before
    os.remove(root / listed)  # listed, then deleted unread
    _write(root, [7, 8], writer=w)
    for n in set(reader.list_shards()) - before:
        os.remove(root / n)  # deleted before the trainer ever listed them
    _write(root, [9], writer=w)
    rest = reader.poll()
    assert _ids(reader, rest) == ["r4", "r5", "r9"]
    reader.commit_shards(rest)
    assert reader.state.lost == 4 and reader.state.skipped == 0
    assert FeedbackReader(root, cursor_path=tmp_path / "c.json").state.lost == 4  # persisted


def test_a_shard_behind_its_writers_count_is_skipped_and_counted(tmp_path, caplog) -> None:
    root = tmp_path / "fb"
    _write(root, range(3))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    names = reader.poll()
    p = parse_shard(names[1])
    os.rename(root / names[1], tmp_path / "aside")
    reader.commit_shards(reader.poll())  # seq 1 and 3: seq 2 counts as gone
    late = shard_name(p.time_ns, p.pid, p.writer, p.seq)
    os.rename(tmp_path / "aside", root / late)  # ...and then appears after all
    assert reader.poll() == []
    assert reader.state.skipped == 1 and any("counted as skipped" in r.getMessage() for r in caplog.records)


def test_the_state_stays_bounded(tmp_path) -> None:
    root = tmp_path / "fb"
    w = _write(root, range(20))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    reader.commit_shards(reader.poll())
    cur = reader.state.writers[w.writer_id]
    assert cur.upto == 20 and cur.done == set()
    for n in reader.list_shards():
        os.remove(root / n)
    state = ConsumedState()
    state.observe([shard_name(1, 1, f"{i:012x}", 1) for i in range(MAX_WRITERS + 10)])
    state.observe([shard_name(1, 1, f"{i:012x}", 1) for i in range(10)])
    assert len(state.writers) == MAX_WRITERS and all(f"{i:012x}" in state.writers for i in range(10))
    assert len(json.dumps(FeedbackReader(root, cursor_path=tmp_path / "c.json").state.to_json())) < 500


def test_an_old_cursor_keeps_judging_its_own_names(tmp_path) -> None:
    """A cursor written before writer ids ({"last", "recent"}) still says which legacy shards were consumed."""
    root = tmp_path / "fb"
    root.mkdir()
    w = _write(tmp_path / "src", range(3))
    src = sorted(os.listdir(tmp_path / "src"))
    now = time.time_ns()
    legacy = [f"shard-{now - 120 * 10**9:020d}-7-000001.parquet", f"shard-{now:020d}-7-000002.parquet",
              f"shard-{now + 1:020d}-7-000003.parquet"]
    for a, b in zip(src, legacy, strict=True):
        os.rename(tmp_path / "src" / a, root / b)
    (tmp_path / "c.json").write_text(json.dumps({"last": legacy[1], "recent": [legacy[1]]}))
    _write(root, [50], writer=w)
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    pending = reader.poll()
    assert legacy[0] not in pending and legacy[1] not in pending and legacy[2] in pending
    reader.commit_shards(pending)
    assert FeedbackReader(root, cursor_path=tmp_path / "c.json").poll() == []


def test_the_trainer_publishes_what_is_consumed_for_the_writers(tmp_path) -> None:
    root = tmp_path / "fb"
    _write(root, range(3))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    names = reader.poll()
    reader.commit_shards(names[:2])
    marker = json.loads((root / MARKER).read_text())
    state = ConsumedState.from_json(marker)
    assert [state.is_consumed(n) for n in names] == [True, True, False]
    assert FeedbackReader(root).poll() == names  # a reader without a cursor neither reads nor writes it


@pytest.mark.parametrize("offset", [TEN_MINUTES_NS, -TEN_MINUTES_NS])
def test_writer_names_count_without_gaps(tmp_path, monkeypatch, offset) -> None:
    w = _write(tmp_path / "fb", range(3), offset, monkeypatch)
    seqs = sorted(parse_shard(n).seq for n in os.listdir(tmp_path / "fb"))
    assert seqs == [1, 2, 3] and w.seq == 3


def test_a_full_disk_still_gets_the_consumed_state_out(tmp_path, monkeypatch) -> None:
    """When the feedback disk is too full for `consumed.json`, the trainer deletes its oldest consumed shard first,
    so the writers learn what else they may delete (else nothing consumed since the disk filled would ever go)."""
    import errno

    import dvi.feedback.reader as reader_module

    root = tmp_path / "fb"
    _write(root, range(3))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    names = reader.poll()
    reader.commit_shards(names[:1])
    real, refused = reader_module.write_state, []

    def full_once(fs, path, state):
        if path.endswith(MARKER) and not refused:
            refused.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fs, path, state)

    monkeypatch.setattr(reader_module, "write_state", full_once)
    reader.commit_shards(names[1:2])
    assert refused and not (root / names[0]).exists() and (root / names[2]).exists()
    assert ConsumedState.from_json(json.loads((root / MARKER).read_text())).is_consumed(names[1])


def test_a_trained_shard_deleted_before_its_commit_is_not_lost(tmp_path) -> None:
    root = tmp_path / "fb"
    _write(root, range(3))
    reader = FeedbackReader(root, cursor_path=tmp_path / "c.json")
    names = reader.poll()
    trained = set(names[:2])  # read and trained; the loop commits at its next flush
    os.remove(root / names[0])  # retention got there first
    assert reader.poll(in_flight=trained) == names[1:]
    reader.commit_shards(trained)
    assert reader.poll() == names[2:] and reader.state.lost == 0
