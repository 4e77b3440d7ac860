"""The suffix drafter's state in a server or rollout engine: per-request indices over prompt +
output and a global index over finished outputs (SuffixDecoding's two trees). The index itself, and
why it is not a tree, is in `dvi.suffix_index`; everything a caller needs is importable from here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from dvi.suffix_index import MAX_TOKEN_ID, MAX_VOTERS, SuffixIndex, SuffixProposal, check_weight, token_list

__all__ = ["MAX_VOTERS", "SuffixCache", "SuffixIndex", "SuffixProposal"]


class SuffixCache:
    """What a server/rollout engine keeps: a per-request index over prompt + generated tokens, and a
    global index over recently finished outputs. propose() asks both and returns the higher-scoring
    proposal (ties: the request's own)."""

    def __init__(self, max_tokens: int = 1_000_000, max_seqs: int = 10_000, max_depth: int = 64) -> None:
        self.global_index = SuffixIndex(max_tokens, max_seqs, max_depth, source="global")
        self.max_depth = self.global_index.max_depth
        self._requests: dict[Hashable, SuffixIndex] = {}
        self._context: dict[Hashable, list[int]] = {}
        self._prompt_len: dict[Hashable, int] = {}
        self.lookups = 0
        self.hits = {"request": 0, "global": 0}

    def _request(self, req_id: Hashable) -> SuffixIndex:
        idx = self._requests.get(req_id)
        if idx is None:
            raise ValueError(f"req_id {req_id!r} was not started")
        return idx

    def start(self, req_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Begin `req_id` with its prompt (a restarted id starts over)."""
        toks = token_list(prompt_ids)
        idx = SuffixIndex(max_tokens=MAX_TOKEN_ID, max_seqs=1, max_depth=self.max_depth, source="request")
        idx.extend(req_id, toks)
        self._requests[req_id] = idx
        self._context[req_id] = toks
        self._prompt_len[req_id] = len(toks)

    def append(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Record the tokens `req_id` emitted this step."""
        idx = self._request(req_id)
        toks = token_list(tokens)
        idx.extend(req_id, toks)
        self._context[req_id].extend(toks)

    def finish(self, req_id: Hashable, keep: bool = True) -> None:
        """End `req_id`; with `keep`, its output (not its prompt) joins the global index."""
        self._request(req_id)
        out = self._context[req_id][self._prompt_len[req_id]:]
        self.forget(req_id)
        if keep and out:
            self.add_finished(req_id, out)

    def forget(self, req_id: Hashable) -> None:
        """Drop `req_id`'s per-request state (no-op if unknown)."""
        self._requests.pop(req_id, None)
        self._context.pop(req_id, None)
        self._prompt_len.pop(req_id, None)

    def add_finished(self, seq_id: Hashable, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Add a finished output to the global index (other replicas' shards, RL siblings); an
        existing `seq_id` is replaced."""
        toks = token_list(tokens)
        w = check_weight(weight)
        self.global_index.remove(seq_id)
        self.global_index.extend(seq_id, toks, weight=w)

    def set_weight(self, seq_id: Hashable, weight: float) -> None:
        """Reweight a finished output in the global index (RL: decay older target versions)."""
        self.global_index.set_weight(seq_id, weight)

    def propose(self, req_id: Hashable, max_tokens: int, *, min_prob: float = 0.1,
                max_match: int = 32, max_spec_factor: float | None = 2.0, scan: bool = False) -> SuffixProposal:
        """The better of the request's own and the global proposal for `req_id`'s next tokens
        (keywords as `SuffixIndex.propose`)."""
        idx = self._request(req_id)
        ctx = self._context[req_id]
        self.lookups += 1
        kw = {"min_prob": min_prob, "max_match": max_match, "max_spec_factor": max_spec_factor, "scan": scan}
        local = idx.propose(ctx, max_tokens, **kw)
        remote = self.global_index.propose(ctx, max_tokens, exclude=req_id, **kw)
        best = remote if remote.score > local.score else local
        if best.tokens:
            self.hits[best.source] += 1
        return best

    def stats(self) -> dict:
        """Sizes and counters for /metrics: global tokens and sequences, live requests, lookups, hits."""
        return {
            "tokens": self.global_index.num_tokens,
            "seqs": self.global_index.num_seqs,
            "requests": len(self._requests),
            "request_tokens": sum(len(c) for c in self._context.values()),
            "lookups": self.lookups,
            "hits": self.hits["request"] + self.hits["global"],
            "hits_request": self.hits["request"],
            "hits_global": self.hits["global"],
        }
