"""The held-out set: the records a candidate drafter is judged on, balanced across groups of traffic.

One type for every gate (the trainer's publish check, the server's promotion check, `dvi.feedback.verdict`):
the trainer and the server fill theirs with the same rule (`HeldOutSet.offer`: the held-out slice by request-id
hash, never trained on by any rank), from the same records (the server also warms its set from the feedback
log, `newest_logged`, so what the trainer judged on the server holds too).

Why groups (issue 36 §3): the newest N records are weighted by traffic, so one client sending 90% of it
decided both gates while another group's α fell to 0. Records are grouped by domain x temperature class x
client (a short hash of the request's `user`, `client_key`); when the set is full the oldest record of the
*largest* group goes, so a minority group keeps its records however much the majority sends. Records served
under a `logit_bias` or a penalty are no evidence (`unfit_reason`): their tokens are the transformed
target's, and a drafter that drafts one forced token looks perfect on them.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator

from dvi.feedback.record import FeedbackRecord
from dvi.feedback.shadow import is_heldout, served_temperature

CLIENT_HASH_CHARS = 10


def client_key(user: str | None) -> str:
    """The `client` a record carries for a request's `user` field: a short hash ("" for none), so groups
    can tell clients apart without the feedback log storing who they are."""
    if not user:
        return ""
    return "u" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:CLIENT_HASH_CHARS]


def adapter_group(key: str, domain: str | None, client: str | None) -> str:
    """The traffic group whose drafter adapter serves and learns from a request (`trainer.adapter_key`): its
    `domain` (one of `serve.domains`, bounded), its client (`client_key` of its `user`), or "" (none: the
    shared drafter)."""
    if key == "domain":
        return domain or "default"
    if key == "user":
        return client or ""
    return ""


def temperature_class(temperature: float | None) -> str:
    """'greedy' or 'sampled': acceptance follows a different law in each (argmax match vs Σ min(p, q))."""
    return "greedy" if served_temperature(temperature) == 0.0 else "sampled"


def group_of(record: FeedbackRecord) -> str:
    """`domain/temperature class[/client]`: the unit a gate judges separately."""
    key = f"{record.domain or 'default'}/{temperature_class(record.temperature)}"
    client = getattr(record, "client", "")
    return f"{key}/{client}" if client else key


def unfit_reason(record: FeedbackRecord) -> str | None:
    """Why a record is no evidence of how well a drafter drafts the target (None: it is).

    A request's `logit_bias` and penalties transform the target (`dvi.decode.sampling.penalize`) and the logged
    tokens follow the transformed target, so the drafter would be judged on what the client forced, not on the
    target: such records never enter a held-out set or a watch (they are counted, `HeldOutSet.unfit`)."""
    if getattr(record, "transformed", False):
        return "transformed"
    if not len(record.prompt_ids) or not len(record.token_ids):
        return "empty"
    return None


class HeldOutSet:
    """At most `capacity` fit held-out records, kept per group (`group_of`), oldest of the largest group evicted
    first; one record per request id. Thread-safe: the engine thread adds, the registry watcher reads."""

    def __init__(self, capacity: int, fraction: float = 0.0) -> None:
        if capacity < 1:
            raise ValueError("a held-out set holds at least one record")
        self.capacity = capacity
        self.fraction = fraction
        self._groups: dict[str, collections.OrderedDict[str, tuple[int, FeedbackRecord]]] = {}
        self._size = 0
        self._arrival = itertools.count()
        self._lock = threading.Lock()
        self.unfit: collections.Counter[str] = collections.Counter()  # held-out records that are no evidence
        self.evicted = 0

    # -- filling -------------------------------------------------------------------------------------
    def offer(self, record: FeedbackRecord) -> bool:
        """Keep `record` if it is in the held-out slice; True when it is (then no one may train on it, kept
        as evidence or not)."""
        if not is_heldout(record.request_id, self.fraction):
            return False
        self.add(record)
        return True

    def add(self, record: FeedbackRecord) -> bool:
        """Keep `record` as evidence whatever its request id (False: unfit, counted by reason)."""
        why = unfit_reason(record)
        if why is not None:
            with self._lock:
                self.unfit[why] += 1
            return False
        key = group_of(record)
        with self._lock:
            group = self._groups.setdefault(key, collections.OrderedDict())
            if group.pop(record.request_id, None) is not None:
                self._size -= 1
            group[record.request_id] = (next(self._arrival), record)
            self._size += 1
            while self._size > self.capacity:
                self._evict_one()
        return True

    def extend(self, records: Iterable[FeedbackRecord]) -> None:
        for r in records:
            self.add(r)

    def split(self, records: Iterable[FeedbackRecord], other: Callable[[FeedbackRecord], None]) -> int:
        """`offer` every record; the others (the trainable ones) go to `other`. Returns how many were held out."""
        held = 0
        for r in records:
            if self.offer(r):
                held += 1
            else:
                other(r)
        return held

    def clear(self) -> None:
        """Forget every record (a trainer rewinding to its last checkpoint refills the set from the log)."""
        with self._lock:
            self._groups.clear()
            self._size = 0

    def _evict_one(self) -> None:
        """Drop the oldest record of the largest group (ties: the group whose oldest record is oldest)."""
        key = max(self._groups, key=lambda k: (len(self._groups[k]), -next(iter(self._groups[k].values()))[0]))
        group = self._groups[key]
        group.popitem(last=False)
        if not group:
            del self._groups[key]
        self._size -= 1
        self.evicted += 1

    # -- reading -------------------------------------------------------------------------------------
    def records(self) -> list[FeedbackRecord]:
        """The records, in the order they arrived."""
        with self._lock:
            kept = [x for g in self._groups.values() for x in g.values()]
        return [r for _, r in sorted(kept, key=lambda x: x[0])]

    def __iter__(self) -> Iterator[FeedbackRecord]:
        return iter(self.records())

    def __len__(self) -> int:
        return self._size

    def positions(self) -> int:
        """Generated positions held: what a gate's `min_positions` counts."""
        return sum(len(r.token_ids) for r in self.records())

    def group_sizes(self) -> dict[str, int]:
        """Records per group (for /health and log lines)."""
        with self._lock:
            return {k: len(g) for k, g in sorted(self._groups.items())}

    def info(self) -> dict:
        """What /health shows: records and positions per group, unfit records left out, evictions."""
        return {"records": len(self), "positions": self.positions(), "capacity": self.capacity,
                "groups": self.group_sizes(), "unfit": dict(self.unfit), "evicted": self.evicted}


def newest_logged(feedback_dir: str, max_shards: int = 8) -> list[FeedbackRecord]:
    """The records of the newest `max_shards` shards of a feedback log (a restarted server's held-out set
    starts from them, as the trainer's does)."""
    from dvi.feedback.reader import FeedbackReader

    reader = FeedbackReader(feedback_dir)
    return reader.read_records(reader.list_shards()[-max_shards:])
