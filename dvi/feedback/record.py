"""The feedback record schema: `FeedbackRecord`, the parquet `SCHEMA` and the conversions.

Kept apart from the writer and reader because the engine, rollout and trainer collation build
and read records without touching storage; this module has no filesystem code at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from dvi.decode.results import GenerationResult

SCHEMA = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("target_version", pa.int64(), nullable=False),
        pa.field("drafter_version", pa.int64(), nullable=False),
        pa.field("started_at", pa.float64(), nullable=False),
        pa.field("finished_at", pa.float64(), nullable=False),
        pa.field("temperature", pa.float32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("drafted_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("accepted", pa.list_(pa.bool_()), nullable=False),
        pa.field("topk_ids", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("topk_logprobs", pa.list_(pa.list_(pa.float32())), nullable=False),
        # eagle drafters: the target's features f_0..f_{L-2} as raw fp16 bytes [L - 1, hidden_dim]
        # (empty, 0 otherwise). Optional: shards written before they existed read as empty.
        pa.field("hidden", pa.large_binary(), nullable=True),
        pa.field("hidden_dim", pa.int32(), nullable=True),
        # why the request ended, as the server answered it ("stop", "length", "abort": the client left,
        # "shutdown": cut by a server stop); optional, "" in shards written before it existed
        pa.field("finish_reason", pa.string(), nullable=True),
        # per token, who proposed its draft: 0 none, 1 model, 2 suffix_request, 3 suffix_global
        # (`dvi.decode.emit.SOURCES`). Optional: shards written before it existed read as empty (every draft: model).
        pa.field("draft_source", pa.list_(pa.int8()), nullable=True),
    ]
)
"""Parquet schema of a shard; one column per `FeedbackRecord` field (docs/contracts.md)."""

OPTIONAL_FIELDS = {"hidden": b"", "hidden_dim": 0, "finish_reason": ""}
OPTIONAL_FIELDS = {"hidden": b"", "hidden_dim": 0, "draft_source": []}
"""Fields a shard may lack (older writers): their value when absent or null."""


def _as_list(x: Any) -> list:
    """Plain list from a list, tuple, numpy array or tensor (tensors via `.tolist()`)."""
    if type(x) is list:
        return x
    if hasattr(x, "tolist"):
        return x.tolist()
    return list(x)


@dataclass
class FeedbackRecord:
    """One finished sequence with per-position draft/accept feedback (docs/contracts.md)."""

    request_id: str
    domain: str
    target_version: int
    drafter_version: int
    started_at: float
    finished_at: float
    temperature: float
    prompt_ids: list[int]
    token_ids: list[int]
    drafted_ids: list[int]
    accepted: list[bool]
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    hidden: bytes = b""
    hidden_dim: int = 0
    finish_reason: str = ""
    draft_source: list[int] = field(default_factory=list)  # [n] or empty (old shards): see SCHEMA

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the field when per-position lists disagree with token_ids."""
        if not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a str, got {type(self.request_id).__name__}")
        if not isinstance(self.domain, str):
            raise ValueError(f"domain must be a str, got {type(self.domain).__name__}")
        n = len(self.token_ids)
        for name in ("drafted_ids", "accepted", "draft_source"):
            m = len(getattr(self, name))
            if m != n and not (name == "draft_source" and m == 0):
                raise ValueError(f"{name} has {m} entries but token_ids has {n}")
        nk, nl = len(self.topk_ids), len(self.topk_logprobs)
        if nk != nl:
            raise ValueError(f"topk_logprobs has {nl} positions but topk_ids has {nk}")
        if nk and nk != n:
            raise ValueError(f"topk_ids has {nk} positions but token_ids has {n} (must be equal or empty)")
        if nk and any(len(a) != len(b) for a, b in zip(self.topk_ids, self.topk_logprobs, strict=True)):
            j = next(j for j in range(nk) if len(self.topk_ids[j]) != len(self.topk_logprobs[j]))
            raise ValueError(
                f"topk_ids[{j}] has {len(self.topk_ids[j])} ids but topk_logprobs[{j}] "
                f"has {len(self.topk_logprobs[j])}"
            )
        self._validate_hidden()
        bad = [
            j
            for j, (a, t, d) in enumerate(zip(self.accepted, self.token_ids, self.drafted_ids, strict=True))
            if a and t != d
        ]
        if bad:
            j = bad[0]
            raise ValueError(
                f"accepted[{j}] is true but token_ids[{j}]={self.token_ids[j]} != drafted_ids[{j}]={self.drafted_ids[j]}"
            )

    def _validate_hidden(self) -> None:
        if not self.hidden:
            return
        n = len(self.prompt_ids) + len(self.token_ids) - 1
        if self.hidden_dim <= 0 or len(self.hidden) != 2 * n * self.hidden_dim:
            raise ValueError(f"hidden has {len(self.hidden)} bytes but {n} positions x hidden_dim "
                             f"{self.hidden_dim} x 2 (fp16) were expected")

    def features(self):
        """The target's features f_0..f_{L-2} as a float16 numpy array [L - 1, hidden_dim], or None."""
        if not self.hidden:
            return None
        import numpy as np

        return np.frombuffer(self.hidden, dtype=np.float16).reshape(-1, self.hidden_dim)

    @classmethod
    def from_result(
        cls,
        result: GenerationResult,
        domain: str | None = None,
    ) -> FeedbackRecord:
        """The stored projection of an engine result (its temperature is the one served: below the
        greedy floor that is 0); `domain` overrides the result's (`engine.generate` sets none)."""
        hidden = result.hidden
        return cls(
            request_id=str(result.request_id),
            domain=str(domain if domain is not None else (result.domain or "default")),
            target_version=int(result.target_version),
            drafter_version=int(result.drafter_version),
            started_at=float(result.started_at),
            finished_at=float(result.finished_at),
            temperature=float(result.temperature),
            prompt_ids=_as_list(result.prompt_ids),
            token_ids=_as_list(result.token_ids),
            drafted_ids=_as_list(result.drafted_ids),
            accepted=[bool(a) for a in _as_list(result.accepted)],
            # Rows are shared, not copied: the result is finished, and copying 128x32 lists
            # would dominate the engine-side logging cost.
            topk_ids=_as_list(result.topk_ids),
            topk_logprobs=_as_list(result.topk_logprobs),
            hidden=b"" if hidden is None else hidden.contiguous().numpy().tobytes(),
            hidden_dim=0 if hidden is None else int(hidden.shape[-1]),
            finish_reason=str(result.finish_reason or ""),
            draft_source=_as_list(result.draft_source),
        )

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> FeedbackRecord:
        """Inverse of the parquet row layout (as produced by `pyarrow.Table.to_pylist`)."""
        def value(name: str) -> Any:
            v = row.get(name)
            if v is None and name in OPTIONAL_FIELDS:
                d = OPTIONAL_FIELDS[name]
                return list(d) if isinstance(d, list) else d
            return v

        return cls(**{f.name: value(f.name) for f in fields(cls)})


FIELD_NAMES = tuple(f.name for f in fields(FeedbackRecord))
RECORD_OVERHEAD_BYTES = 512
BYTES_PER_VALUE = 36  # a list slot (8) + a boxed int/float (28-32) in CPython


def record_nbytes(r: FeedbackRecord) -> int:
    """Estimated memory of a buffered record (CPython lists of boxed numbers), for the buffer cap."""
    k = len(r.topk_ids[0]) if r.topk_ids else 0  # every position holds the same k (O(1), engine thread)
    n = len(r.prompt_ids) + 4 * len(r.token_ids) + 2 * k * len(r.topk_ids)
    return RECORD_OVERHEAD_BYTES + BYTES_PER_VALUE * n + len(r.hidden)


def _wide(t: pa.DataType) -> pa.DataType:
    if pa.types.is_float32(t):
        return pa.float64()
    if pa.types.is_list(t):
        return pa.list_(_wide(t.value_type))
    return t


def records_to_table(records: Sequence[FeedbackRecord]) -> pa.Table:
    """Columnar conversion with the explicit schema (done off the engine's write path).

    Python floats go in as float64 and are cast to float32: pyarrow converts nested Python
    floats straight to float32 ~15x slower, and this runs in a thread that shares the GIL with
    the engine loop.
    """
    arrays = []
    for f in SCHEMA:
        col = [getattr(r, f.name) for r in records]
        wide = _wide(f.type)
        arr = pa.array(col, type=wide)
        arrays.append(arr.cast(f.type) if wide != f.type else arr)
    return pa.Table.from_arrays(arrays, schema=SCHEMA)
