"""The feedback record schema: `FeedbackRecord`, the parquet `SCHEMA` and the conversions.

Kept apart from the writer and reader because the engine, rollout and trainer collation build
and read records without touching storage; this module has no filesystem code at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pyarrow as pa

from dvi.decode.results import GenerationResult


def _column(arrow: pa.DataType, optional: bool = False, **default: Any) -> Any:
    """A record field and its parquet column type; an `optional` column may be absent or null in shards
    written before it existed, and reads as the field's default."""
    return field(metadata={"arrow": arrow, "optional": optional}, **default)


def _as_list(x: Any) -> list:
    """Plain list from a list, tuple, numpy array or tensor (tensors via `.tolist()`)."""
    if type(x) is list:
        return x
    if hasattr(x, "tolist"):
        return x.tolist()
    return list(x)


@dataclass
class FeedbackRecord:
    """One finished sequence with per-position draft/accept feedback (docs/contracts.md): the one stored
    record, as written and read (lists) and as the trainer holds it (`compact`: numpy arrays)."""

    request_id: str = _column(pa.string())
    domain: str = _column(pa.string())
    target_version: int = _column(pa.int64())
    drafter_version: int = _column(pa.int64())
    started_at: float = _column(pa.float64())
    finished_at: float = _column(pa.float64())
    temperature: float = _column(pa.float32())
    # per-token lists as written and read; numpy arrays in a compact record (`compact`)
    prompt_ids: list[int] | np.ndarray = _column(pa.list_(pa.int32()))
    token_ids: list[int] | np.ndarray = _column(pa.list_(pa.int32()))
    drafted_ids: list[int] | np.ndarray = _column(pa.list_(pa.int32()))
    accepted: list[bool] | np.ndarray = _column(pa.list_(pa.bool_()))
    topk_ids: list[list[int]] | np.ndarray = _column(pa.list_(pa.list_(pa.int32())), default_factory=list)
    topk_logprobs: list[list[float]] | np.ndarray = _column(pa.list_(pa.list_(pa.float32())), default_factory=list)
    # eagle drafters: the target's features f_0..f_{L-2} as raw fp16 bytes [L - 1, hidden_dim] (empty, 0 otherwise)
    hidden: bytes = _column(pa.large_binary(), optional=True, default=b"")
    hidden_dim: int = _column(pa.int32(), optional=True, default=0)
    # why the request ended, as the server answered it ("stop", "length", "abort": the client left,
    # "shutdown": cut by a server stop)
    finish_reason: str = _column(pa.string(), optional=True, default="")
    # per token, who proposed its draft: 0 none, 1 model, 2 suffix_request, 3 suffix_global
    # (`dvi.decode.sources.SOURCES`); empty in shards written before it existed (every draft: the model's)
    draft_source: list[int] | np.ndarray = _column(pa.list_(pa.int8()), optional=True, default_factory=list)
    # who sent it: a short hash of the request's `user` ("" when it names none), a group of the held-out set
    # (`dvi.feedback.heldout`); the raw identifier is never stored
    client: str = _column(pa.string(), optional=True, default="")
    # served under a logit_bias or a penalty: its tokens are the transformed target's, so it is no evidence of
    # how well a drafter drafts the target (`dvi.feedback.heldout.unfit_reason`)
    transformed: bool = _column(pa.bool_(), optional=True, default=False)
    # the version of its traffic group's drafter adapter that drafted it (trainer.adapter_key; 0: none)
    adapter_version: int = _column(pa.int64(), optional=True, default=0)
    # the control group's arm of a request of a traffic group: "learned" (its adapter drafted) or "control" (the
    # frozen base drafted, `serving.control`); "" for a request of no group
    arm: str = _column(pa.string(), optional=True, default="")

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

    def check_ids(self, vocab_size: int) -> None:
        """Raise ValueError naming the field and position of a token id outside [0, vocab_size) (drafted ids
        and padded top-k ids may also be -1): a record checks its own shape, only a model knows its vocabulary,
        and an id past it fails the trainer's forward, never a parquet write."""
        e = self.compact()
        for name, ids, lo in (("prompt_ids", e.prompt_ids, 0), ("token_ids", e.token_ids, 0),
                              ("drafted_ids", e.drafted_ids, -1), ("topk_ids", e.topk_ids, -1)):
            bad = np.flatnonzero((ids < lo) | (ids >= vocab_size))
            if len(bad):
                j = np.unravel_index(bad[0], ids.shape)
                where = "][".join(str(int(x)) for x in j)
                raise ValueError(f"{name}[{where}]={int(ids[j])} is outside the vocabulary of {vocab_size} ids")

    def _validate_hidden(self) -> None:
        if not self.hidden:
            return
        n = len(self.prompt_ids) + len(self.token_ids) - 1
        if self.hidden_dim <= 0 or len(self.hidden) != 2 * n * self.hidden_dim:
            raise ValueError(f"hidden has {len(self.hidden)} bytes but {n} positions x hidden_dim "
                             f"{self.hidden_dim} x 2 (fp16) were expected")

    def features(self) -> np.ndarray | None:
        """The target's features f_0..f_{L-2} as a float16 numpy array [L - 1, hidden_dim], or None."""
        if not self.hidden:
            return None
        return np.frombuffer(self.hidden, dtype=np.float16).reshape(-1, self.hidden_dim)

    def compact(self) -> FeedbackRecord:
        """The record as the trainer holds it (a replay buffer holds thousands): numpy arrays in place of the
        per-token lists (ids int64), top-k padded to [n, k] (-1 ids, -inf log-probs; a record logged without
        top-k gets the target's own token as a one-hot [n, 1], log-prob 0, the best the log allows), and only
        the learned drafter's own drafts (`draft_source` 2, 3: a suffix proposal, not the drafter's sample,
        reads as undrafted: -1, not accepted). Compact records are never written; compacting one is a no-op."""
        if isinstance(self.token_ids, np.ndarray):
            return self
        tokens = np.asarray(self.token_ids, dtype=np.int64)  # [n]
        tk, tl = self.topk_ids, self.topk_logprobs  # n ragged lists (k or fewer each), or empty
        if len(tk) == len(tokens) and len(tokens):
            k = max(len(r) for r in tk)  # pad every position to [k]
            ids = np.full((len(tokens), k), -1, dtype=np.int64)
            lps = np.full((len(tokens), k), -np.inf, dtype=np.float32)
            for j, (a, b) in enumerate(zip(tk, tl, strict=True)):
                ids[j, : len(a)] = a
                lps[j, : len(b)] = b
        else:
            ids = tokens.reshape(-1, 1).copy()  # [n, 1]: the token itself, log-prob 0 (one-hot)
            lps = np.zeros((len(tokens), 1), dtype=np.float32)
        drafted, accepted = np.asarray(self.drafted_ids, dtype=np.int64), np.asarray(self.accepted, dtype=bool)
        src = np.asarray(self.draft_source, dtype=np.int8)
        if len(src) == len(drafted) and len(drafted):
            other = src > 1
            drafted, accepted = np.where(other, -1, drafted), accepted & ~other
        return dataclasses.replace(self, prompt_ids=np.asarray(self.prompt_ids, dtype=np.int64), token_ids=tokens,
                                   drafted_ids=drafted, accepted=accepted, topk_ids=ids, topk_logprobs=lps,
                                   draft_source=src)

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
            adapter_version=int(getattr(result, "adapter_version", 0)),
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


SCHEMA = pa.schema([pa.field(f.name, f.metadata["arrow"], nullable=f.metadata["optional"])
                    for f in fields(FeedbackRecord)])
"""Parquet schema of a shard: one column per `FeedbackRecord` field, in field order (docs/contracts.md)."""

OPTIONAL_FIELDS = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
                   for f in fields(FeedbackRecord) if f.metadata["optional"]}
"""Fields a shard may lack (older writers): their value when absent or null."""

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
