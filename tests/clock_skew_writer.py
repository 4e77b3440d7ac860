"""A replica whose clock is off, as its own process: `python tests/clock_skew_writer.py OFFSET_S SRC DST` writes
the records of SRC's shards into DST through one `FeedbackWriter` whose process clock (`time.time`,
`time.time_ns`) runs OFFSET_S seconds off: 600 is a replica 10 minutes fast, -600 one stepped back."""

from __future__ import annotations

import sys
import time


def main(offset_s: float, src: str, dst: str) -> None:
    real_ns, offset_ns = time.time_ns, int(offset_s * 1e9)
    time.time_ns = lambda: real_ns() + offset_ns
    time.time = lambda: (real_ns() + offset_ns) / 1e9
    from dvi.feedback import FeedbackReader, FeedbackWriter

    reader = FeedbackReader(src)
    records = reader.read_records(reader.list_shards())
    with FeedbackWriter(dst, shard_records=len(records)) as w:
        for r in records:
            w.write(r)


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], sys.argv[3])
