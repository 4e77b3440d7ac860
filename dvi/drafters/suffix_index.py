"""Model-free drafting from history: SuffixDecoding (arXiv 2411.04975), as vLLM's `suffix` method
and Snowflake's Arctic Inference do it, without a suffix tree.

A proposal is the continuation that followed earlier occurrences of the context's suffix: among
the occurrences of the longest (or a better-scoring shorter) matching suffix, follow the
continuation greedily, at each step taking the most frequent next token (weighted by each
sequence's weight) and multiplying the path probability by that token's share; stop when the
probability falls below `min_prob`, the continuations run out, or the budget is spent. The score
is the sum of the per-token path probabilities, the expected number of accepted tokens, so the
draft length follows how often the continuation was seen (SuffixDecoding's rule).

Why no tree. A depth-capped suffix trie in Python dicts costs about a node per token per level
(kilobytes per stored token); Arctic's path-compressed tree needs C++. Here an index keeps its
tokens as linked lists in flat int32 numpy arrays (token, previous and next position, sequence
slot: 16 bytes a token) plus, per token id, the positions where it occurs (an `array('i')`, 4 bytes
a token). A lookup takes the occurrences of the context's last token, extends all their matches
backwards at once (vectorised gathers through `prev`), then walks the chosen occurrences forward
through `next`, voting at each step: a suffix tree node's count (the occurrences of its path) is
computed on demand instead of stored. Occurrences whose continuation is not known yet (the
current end of a sequence, e.g. the very position a request is continuing) are not counted.

Sequences are evicted whole, oldest first, past `max_tokens` / `max_seqs`; a removed sequence's
slots are dropped from lookups at once (weight 0) and from memory at the next compaction (when
dead positions outnumber live ones), which is linear and vectorised (~16 ms of CPU per 100k live
tokens: rare, as it needs as many tokens evicted as are kept).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from dvi.decode.sources import SUFFIX_SOURCE

INDEXES = tuple(SUFFIX_SOURCE)
"""The two indexes a `SuffixCache` holds, by name (`SuffixIndex.source`): "request" and "global"."""
MAX_TOKEN_ID = 2**31 - 1
# Past this many matched occurrences, the continuation vote samples the most recent ones: the
# shares are estimated to about +-3%, and a lookup stays bounded on a huge index.
MAX_VOTERS = 256
# A token seen this often also gets its occurrences grouped by the token before it, so a lookup
# ending in a frequent token (newline, indentation, a space) starts from the bigram's occurrences.
HOT = 256


@dataclass(frozen=True)
class SuffixProposal:
    """One draft: tokens with their path probabilities (non-increasing) and the expected accepted
    length `score` = sum(probs)."""

    tokens: list[int]
    probs: list[float]
    score: float
    match_len: int
    source: str
    raw_score: float | None = None   # before calibration (dvi.drafters.suffix.Calibrator), if calibrated
    pooled: list[float] | None = None  # if calibrated: each step's probability before the drafted-proposal ratio

    @staticmethod
    def empty(source: str = "global") -> SuffixProposal:
        return SuffixProposal([], [], 0.0, 0, source)


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_weight(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"weight must be a finite number >= 0, got {value!r}")
    return float(value)


def token_list(tokens: Sequence[int]) -> list[int]:
    """`tokens` as a list of ints, or ValueError naming `tokens` (non-integers, negatives, > int32)."""
    if isinstance(tokens, list | tuple) and len(tokens) <= 16:   # the per-step case, without numpy
        if all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in tokens):
            return list(tokens)
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError) as e:
        raise ValueError(f"tokens must be a sequence of token ids: {e}") from None
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be a flat sequence of integer token ids, got dtype {arr.dtype} "
                         f"shape {arr.shape}")
    if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID:
        raise ValueError("tokens must be token ids in [0, 2**31)")
    return arr.tolist()


def _group(keys: np.ndarray, positions: np.ndarray) -> dict[int, array]:
    """{key: array('i') of its positions, in the given (ascending) order}."""
    if not len(keys):
        return {}
    order = np.argsort(keys, kind="stable")
    ks = keys[order]
    ps = array("i", positions[order].astype(np.int32).tobytes())
    cuts = (np.flatnonzero(ks[1:] != ks[:-1]) + 1).tolist()
    starts, ends = [0, *cuts], [*cuts, len(ks)]
    return {k: ps[a:b] for k, a, b in zip(ks[starts].tolist(), starts, ends, strict=True)}


class SuffixIndex:
    """One bounded index over many token sequences (by id); oldest sequences evicted past
    max_tokens / max_seqs. `max_depth` caps both the matched suffix and a proposal's length, as a
    suffix tree's depth does."""

    def __init__(self, max_tokens: int = 1_000_000, max_seqs: int = 10_000, max_depth: int = 64,
                 *, source: str = "global") -> None:
        self.max_tokens = _positive_int("max_tokens", max_tokens)
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        self.max_depth = _positive_int("max_depth", max_depth)
        if source not in INDEXES:
            raise ValueError(f"source must be one of {INDEXES}, got {source!r}")
        self.source = source
        self.lookups = 0
        self.hits = 0
        self._reset(capacity=256)

    def _reset(self, capacity: int) -> None:
        # Position 0 is a sentinel: token -1 (matches nothing), prev = next = 0 (itself), slot 0
        # (weight 0), so "no neighbour" needs no masking in the vectorised gathers.
        self._tok = np.full(capacity, -1, np.int32)
        self._prev = np.zeros(capacity, np.int32)
        self._next = np.zeros(capacity, np.int32)
        self._slot = np.zeros(capacity, np.int32)
        self._n = 1                                    # next free position
        self._occ: dict[int, array] = {}               # token id -> positions, ascending
        self._hot: dict[int, dict[int, array]] = {}    # frequent token -> previous token -> positions
        self._w = np.zeros(64, np.float64)             # weight per slot; slot 0 = sentinel
        self._slots: dict[Hashable, int] = {}          # live sequences, oldest first
        self._last: list[int] = [0]                    # last position per slot (0: empty)
        self._len: list[int] = [0]                     # tokens per slot
        self._live = 0                                 # tokens of live sequences
        self._dead = 0                                 # positions of removed sequences

    # ---------------------------------------------------------------------------------------
    # writing

    @property
    def num_tokens(self) -> int:
        return self._live

    @property
    def num_seqs(self) -> int:
        return len(self._slots)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slots

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The stored tokens of `seq_id` (for checks and tests; walks the list)."""
        if seq_id not in self._slots:
            raise ValueError(f"seq_id {seq_id!r} is not in the index")
        pos = self._last[self._slots[seq_id]]
        while pos and self._prev[pos]:
            pos = int(self._prev[pos])
        out, nxt, tok = [], self._next, self._tok
        while pos:
            out.append(int(tok[pos]))
            pos = int(nxt[pos])
        return out

    def extend(self, seq_id: Hashable, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Append `tokens` to `seq_id`, creating it with `weight` if new (an existing sequence keeps
        its weight; `set_weight` changes it). Evicts the oldest sequences past the bounds."""
        self.extend_checked(seq_id, token_list(tokens), weight)

    def extend_checked(self, seq_id: Hashable, toks: list[int], weight: float = 1.0) -> None:
        """`extend` for tokens `token_list` already checked (a per-step caller validates once)."""
        slot = self._slots.get(seq_id)
        if slot is None:
            slot = self._new_slot(seq_id, check_weight(weight))
        if toks:
            self._append(slot, toks)
        if self._live > self.max_tokens or len(self._slots) > self.max_seqs:
            self._evict()

    def _new_slot(self, seq_id: Hashable, weight: float) -> int:
        slot = len(self._last)
        if slot >= len(self._w):
            self._w = np.concatenate([self._w, np.zeros(len(self._w), np.float64)])
        self._w[slot] = weight
        self._slots[seq_id] = slot
        self._last.append(0)
        self._len.append(0)
        return slot

    def _append(self, slot: int, toks: list[int]) -> None:
        k, p = len(toks), self._n
        end = p + k
        if end > len(self._tok):
            self._grow(end)
        last = self._last[slot]
        self._tok[p:end] = toks
        self._slot[p:end] = slot
        self._prev[p] = last
        self._next[end - 1] = 0
        if k > 1:
            self._prev[p + 1:end] = np.arange(p, end - 1, dtype=np.int32)
            self._next[p:end - 1] = np.arange(p + 1, end, dtype=np.int32)
        if last:
            self._next[last] = p
        occ, hot = self._occ, self._hot
        before = int(self._tok[last]) if last else -1
        for i, t in enumerate(toks, p):
            lst = occ.get(t)
            if lst is None:
                occ[t] = array("i", (i,))
            else:
                lst.append(i)
                h = hot.get(t)
                if h is not None:
                    sub = h.get(before)
                    if sub is None:
                        h[before] = array("i", (i,))
                    else:
                        sub.append(i)
                elif len(lst) == HOT:
                    pos = np.frombuffer(lst, dtype=np.int32).copy()
                    hot[t] = _group(self._tok[self._prev[pos]], pos)
            before = t
        self._n = end
        self._last[slot] = end - 1
        self._len[slot] += k
        self._live += k

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * len(self._tok))
        for name in ("_tok", "_prev", "_next", "_slot"):
            old = getattr(self, name)
            new = np.full(cap, -1, np.int32) if name == "_tok" else np.zeros(cap, np.int32)
            new[:self._n] = old[:self._n]
            setattr(self, name, new)

    def remove(self, seq_id: Hashable) -> None:
        """Drop `seq_id` (no-op if absent): out of lookups now, out of memory at the next compaction."""
        slot = self._slots.pop(seq_id, None)
        if slot is None:
            return
        self._w[slot] = 0.0
        self._live -= self._len[slot]
        self._dead += self._len[slot]
        self._len[slot] = 0
        self._last[slot] = 0
        self._maybe_compact()

    def set_weight(self, seq_id: Hashable, weight: float) -> None:
        """Scale how much `seq_id`'s occurrences count in votes (RL: older target versions decay)."""
        w = check_weight(weight)
        if seq_id not in self._slots:
            raise ValueError(f"seq_id {seq_id!r} is not in the index")
        self._w[self._slots[seq_id]] = w

    def _evict(self) -> None:
        while self._slots and (self._live > self.max_tokens or len(self._slots) > self.max_seqs):
            self.remove(next(iter(self._slots)))

    def _maybe_compact(self) -> None:
        dead_slots = len(self._last) - 1 - len(self._slots)
        if self._dead > max(self._live, 4096) or dead_slots > max(2 * len(self._slots), 1024):
            self._compact()

    def _compact(self) -> None:
        """Rebuild the arrays over the live sequences only (positions and slots renumbered)."""
        n = self._n
        live_slots = sorted(self._slots.values())
        slot_map = np.zeros(len(self._last), np.int32)
        slot_map[live_slots] = np.arange(1, len(live_slots) + 1, dtype=np.int32)
        keep = slot_map[self._slot[:n]] > 0
        keep[0] = True
        pos_map = (np.cumsum(keep) - 1).astype(np.int32)  # sentinel 0 -> 0, dropped -> unused
        tok, prev, nxt, slot = (a[:n][keep] for a in (self._tok, self._prev, self._next, self._slot))
        weights = self._w[live_slots]
        lens = [self._len[s] for s in live_slots]
        lasts = [int(pos_map[self._last[s]]) for s in live_slots]
        ids = {sid: int(slot_map[s]) for sid, s in self._slots.items()}
        self._reset(capacity=max(256, 2 * len(tok)))
        m = len(tok)
        self._tok[:m], self._prev[:m], self._next[:m] = tok, pos_map[prev], pos_map[nxt]
        self._slot[:m] = slot_map[slot]
        self._n = m
        self._w = np.zeros(max(64, 2 * len(live_slots) + 1), np.float64)
        self._w[1:len(live_slots) + 1] = weights
        self._slots = dict(sorted(ids.items(), key=lambda kv: kv[1]))
        self._last, self._len = [0, *lasts], [0, *lens]
        self._live = sum(lens)
        self._occ = _group(tok[1:], np.arange(1, m, dtype=np.int32))
        for t, lst in self._occ.items():
            if len(lst) >= HOT:
                pos = np.frombuffer(lst, dtype=np.int32).copy()
                self._hot[t] = _group(self._tok[self._prev[pos]], pos)

    # ---------------------------------------------------------------------------------------
    # reading

    def propose(self, context: Sequence[int], max_tokens: int, *, min_prob: float = 0.1,
                max_match: int = 32, exclude: Hashable | None = None,
                max_spec_factor: float | None = None, scan: bool = False) -> SuffixProposal:
        """Draft up to `max_tokens` tokens continuing `context` (see the module docstring).

        `scan`: also score every shorter match length whose occurrence set differs and keep the
        best score (Arctic's rule; it drafted no better in benchmarks/suffix_index.py and costs
        more); otherwise only the longest match. `max_spec_factor`: cap a match of length L at
        floor(L * factor) tokens (SuffixDecoding's rule, vLLM's default 1; None, the default here:
        no cap, as the calibrated probabilities already shorten weak drafts and the engine prices the
        draft length; with the real target at batch 1 the cap of 2 gave fewer tokens per step).
        `exclude`: a sequence id whose occurrences are ignored (e.g. the requester's own)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int | np.integer) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an integer >= 0, got {max_tokens!r}")
        if not isinstance(min_prob, int | float) or not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob must be in [0, 1], got {min_prob!r}")
        max_match = _positive_int("max_match", max_match)
        if max_spec_factor is not None and not (isinstance(max_spec_factor, int | float) and max_spec_factor > 0):
            raise ValueError(f"max_spec_factor must be > 0 or None, got {max_spec_factor!r}")
        self.lookups += 1
        budget = min(int(max_tokens), self.max_depth)
        ctx = context[-min(max_match, self.max_depth):]
        if not isinstance(ctx, list):
            ctx = [int(t) for t in ctx]
        if ctx and min(ctx) < 0:
            raise ValueError("context must hold token ids >= 0")
        if budget == 0 or not ctx:
            return SuffixProposal.empty(self.source)
        best = SuffixProposal.empty(self.source)
        for length, pos, w in self._match_sets(ctx, exclude, scan):
            cap = budget if max_spec_factor is None else min(budget, int(length * max_spec_factor + 1e-6))
            if cap <= 0 or cap <= best.score:
                continue   # a proposal of `cap` tokens scores at most `cap`
            toks, probs = self._walk(pos, w, cap, float(min_prob))
            score = float(sum(probs))
            if score > best.score:   # ties keep the longer match
                best = SuffixProposal(toks, probs, score, length, self.source)
        if best.tokens:
            self.hits += 1
        return best

    def _usable(self, pos: np.ndarray, exclude: Hashable | None) -> tuple[np.ndarray, np.ndarray]:
        """The occurrences (and weights) with a positive weight, not in `exclude`, whose next
        token is known."""
        slots = self._slot[pos]
        w = self._w[slots]
        if exclude is not None and exclude in self._slots:
            w = np.where(slots == self._slots[exclude], 0.0, w)
        ok = (w > 0) & (self._next[pos] != 0)
        return pos[ok], w[ok]

    def _match_sets(self, ctx: list[int], exclude: Hashable | None, scan: bool):
        """(match length, occurrences, weights), longest first: the longest match only, or (scan)
        every length whose occurrence set differs. Length-1 sets are the most recent MAX_VOTERS."""
        t = ctx[-1]
        occ = self._occ.get(t)
        if occ is None:
            return
        found = False
        if len(ctx) >= 2:
            hot = self._hot.get(t)
            if hot is not None:
                sub = hot.get(ctx[-2])
                cand = np.frombuffer(sub, dtype=np.int32).copy() if sub is not None else np.zeros(0, np.int32)
            else:
                allp = np.frombuffer(occ, dtype=np.int32)
                cand = allp[self._tok[self._prev[allp]] == ctx[-2]]
                del allp   # release the array('i') buffer: it must stay appendable
            pos, w = self._usable(cand, exclude)
            if pos.size:
                found = True
                lens = self._extend_back(pos, ctx)
                for length in (np.flatnonzero(np.bincount(lens))[::-1].tolist() if scan else [int(lens.max())]):
                    sel = lens >= length
                    yield length, pos[sel], w[sel]
        if scan or not found:
            recent = np.frombuffer(occ, dtype=np.int32)[-4 * MAX_VOTERS:].copy()
            pos, w = self._usable(recent, exclude)
            if pos.size:
                yield 1, pos[-MAX_VOTERS:], w[-MAX_VOTERS:]

    def _extend_back(self, pos: np.ndarray, ctx: list[int]) -> np.ndarray:
        """Match length (>= 2, as `pos` already match ctx's last two tokens) of each occurrence."""
        lens = np.full(pos.size, 2, np.int32)
        idx, cur = np.arange(pos.size), self._prev[pos]
        prev, tok = self._prev, self._tok
        for k in range(3, len(ctx) + 1):
            cur = prev[cur]
            hit = tok[cur] == ctx[-k]
            idx, cur = idx[hit], cur[hit]
            if not idx.size:
                break
            lens[idx] = k
        return lens

    def _walk(self, pos: np.ndarray, w: np.ndarray, budget: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Follow the continuations of occurrences `pos` (ascending, so most recent last) by
        weighted vote; see the module docstring."""
        if pos.size > MAX_VOTERS:
            pos, w = pos[-MAX_VOTERS:], w[-MAX_VOTERS:]
        tok, nxt = self._tok, self._next
        cur = nxt[pos]
        toks: list[int] = []
        probs: list[float] = []
        p = 1.0
        while len(toks) < budget:
            if cur.size == 1:   # one occurrence left: copy its continuation
                c = int(cur[0])
                while c and len(toks) < budget:
                    toks.append(int(tok[c]))
                    probs.append(p)
                    c = int(nxt[c])
                break
            col = tok[cur]
            first = col[-1]
            if (col == first).all():
                t, share = int(first), 1.0
            else:
                t, share = _vote(col, w)
            p *= share
            if p < min_prob:
                break
            toks.append(t)
            probs.append(p)
            keep = col == t
            cur, w = nxt[cur[keep]], w[keep]
            known = cur != 0
            if not known.all():
                cur, w = cur[known], w[known]
            if not cur.size:
                break
        return toks, probs


def _vote(col: np.ndarray, w: np.ndarray) -> tuple[int, float]:
    """The weighted most frequent token of `col` (ties: the one seen most recently) and its share."""
    total = float(w.sum())
    if col.size <= 32:
        counts: dict[int, float] = {}
        for t, x in zip(col.tolist(), w.tolist(), strict=True):
            counts[t] = counts.get(t, 0.0) + x
        # dicts keep first-insertion order; scan from the most recent for the tie-break
        recent = {t: i for i, t in enumerate(col.tolist())}
        t = max(counts, key=lambda u: (counts[u], recent[u]))
        return t, counts[t] / total
    rev = col[::-1]
    uniq, first, inv = np.unique(rev, return_index=True, return_inverse=True)
    cnt = np.bincount(inv, weights=w[::-1], minlength=uniq.size)
    k = int(np.lexsort((first, -cnt))[0])
    return int(uniq[k]), float(cnt[k]) / total

