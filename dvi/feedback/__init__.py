"""Feedback records: what the target said about each drafted token, logged as parquet shards.

One `FeedbackRecord` per finished sequence, the stored projection of the engine's `GenerationResult`
(`FeedbackRecord.from_result`), built by whoever finishes it: the server's feedback log
(`serving.wiring.FeedbackLog`, a scheduler observer) or an RL rollout (`dvi.rollout`). `FeedbackWriter` buffers them
and writes parquet shards that are whole or absent (temp name in the same dir, fsync, rename),
so a crash never leaves half a shard. `FeedbackReader` tails the shards for the online trainer
with a persisted consumed state (`consumed`: per writer, by the writer's own gapless shard count, never
a clock), so a killed and restarted trainer neither trains a record twice nor skips one, whatever the
replicas' clocks say.

Retention wins over readers: a writer with a `Retention` (bytes, shards, age) deletes the
oldest shards even if no trainer consumed them yet. A trainer that falls behind by more than the
retention window misses that data; the writer counts and logs every deletion
(`FeedbackWriter.deleted_shards`) and the reader counts every shard gone before it was read, listed or
not (`FeedbackReader.state.lost`). A full disk is different: there the writer deletes only shards the
trainer has consumed (`consumed.json`, the trainer's copy of its state) and writes again.

Roots are local paths or any fsspec URL (`memory://`, `s3://...`); fsync only applies locally.

The package is split by job: `record` (schema and conversions), `storage` (shard names, listing,
fsspec and atomic-write helpers shared by both sides), `writer`, `reader`, `consumed` (what the trainer
consumed), `shadow` (acceptance estimated from logged records, without the target), `heldout` (the held-out set a
drafter version is judged on, balanced across groups of traffic) and `verdict` (THE comparison of two versions: the
trainer's publish check, the server's promotion check and rollback watch), `dataset` (the log as a
`datasets.Dataset` for analysis, `open_feedback`). Every name that callers import from
`dvi.feedback` (all its public names) is re-exported here; `heldout` and `verdict` are imported from their modules.
"""

from dvi.feedback.reader import QUARANTINE_DIR, FeedbackReader
from dvi.feedback.record import (
    BYTES_PER_VALUE,
    FIELD_NAMES,
    RECORD_OVERHEAD_BYTES,
    SCHEMA,
    FeedbackRecord,
    record_nbytes,
    records_to_table,
)
from dvi.feedback.storage import SHARD_RE, shard_time_ns
from dvi.feedback.writer import FeedbackWriter, Retention

__all__ = [
    "BYTES_PER_VALUE",
    "FIELD_NAMES",
    "QUARANTINE_DIR",
    "RECORD_OVERHEAD_BYTES",
    "SCHEMA",
    "SHARD_RE",
    "FeedbackReader",
    "FeedbackRecord",
    "FeedbackWriter",
    "Retention",
    "record_nbytes",
    "records_to_table",
    "shard_time_ns",
]
