"""The suffix drafter's state in a server or rollout engine: per-request indices over prompt +
output and a global index over finished outputs (SuffixDecoding's two trees). The index itself, and
why it is not a tree, is in `dvi.drafters.suffix_index`; everything a caller needs is importable from here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from dvi.drafters.suffix_index import (
    MAX_TOKEN_ID,
    MAX_VOTERS,
    SuffixIndex,
    SuffixProposal,
    check_weight,
    token_list,
)

__all__ = ["MAX_VOTERS", "Calibrator", "SuffixCache", "SuffixIndex", "SuffixProposal"]

_LEN_BUCKETS = (1, 2, 3, 5, 8, 16, 32)
_POS_BUCKETS = (0, 1, 2, 3, 5, 8, 16)


def _table(bounds: tuple[int, ...], size: int = 65) -> list[int]:
    """x -> index of the first bound >= x (len(bounds) past the last), for x < size."""
    return [next((i for i, b in enumerate(bounds) if x <= b), len(bounds)) for x in range(size)]


_LEN_OF, _POS_OF = _table(_LEN_BUCKETS), _table(_POS_BUCKETS)


class Calibrator:
    """Online correction of a proposal's path probabilities from what the target then emitted.

    The raw per-step share (SuffixDecoding's count ratio) is 1.0 whenever the matched occurrences
    agree, so a short match seen once promises its whole continuation: replayed, matches of <= 3
    tokens scored 2.6-5 expected tokens and got 0.7-1.5. Per (source, match-length bucket, draft
    position bucket) this keeps the predicted step probabilities and the observed successes (a
    position counts once it is observed with every earlier draft token confirmed; the target's
    token is the observation, whichever drafter was used, which is what acceptance measures in law)
    and scales each step by successes / predicted, starting at 1 (`prior` pseudo-observations).
    Old evidence fades (sums halve past `horizon`), so a changing target re-calibrates.

    Those ratios pool every request, so they describe the traffic on average: after code, whose prompts the
    request's own index continues well, chat kept code's ratios for thousands of positions. A request therefore
    also keeps its own residual per source, its successes over what the pooled ratios predicted for it (`request_prior`
    pseudo-observations at 1, faded past `request_horizon`), which scales its steps on top of them.

    Both grade every lookup, drafted or not; what drafts is the better of two proposals by these same estimates, and a
    step drafts where they promise most, so a drafted proposal's estimate errs high (the winner's curse; measured in
    docs/design.md, "what a suffix draft's probabilities promise"). The drafted proposals therefore keep their own
    successes over what the ratios above predicted for them, per (source, position bucket) (`observe_drafted`;
    `drafted_prior` pseudo-observations at 1, faded past `drafted_horizon`), which scales their steps last."""

    def __init__(self, prior: float = 4.0, horizon: float = 2000.0, request_prior: float = 4.0,
                 request_horizon: float = 64.0, drafted_prior: float = 8.0, drafted_horizon: float = 500.0) -> None:
        self.prior, self.horizon = float(prior), float(horizon)
        self.request_prior, self.request_horizon = float(request_prior), float(request_horizon)
        self.drafted_prior, self.drafted_horizon = float(drafted_prior), float(drafted_horizon)
        self._sums: dict[tuple, list[float]] = {}
        self._requests: dict[Hashable, dict[str, list[float]]] = {}  # request -> source -> [pooled prediction, hits]
        self._drafted: dict[tuple, list[float]] = {}  # (source, position bucket) -> [prediction, hits] when drafted

    @staticmethod
    def _key(prop: SuffixProposal, j: int) -> tuple:
        return prop.source, _LEN_OF[min(prop.match_len, 64)], _POS_OF[min(j, 64)]

    def ratio(self, key: tuple) -> float:
        pred, hit = self._sums.get(key, (0.0, 0.0))
        return (hit + self.prior) / (pred + self.prior)

    def request_ratio(self, req: Hashable | None, source: str) -> float:
        """Request `req`'s successes from `source` over the pooled prediction for them (1 without evidence, at
        most 2)."""
        pred, hit = self._requests.get(req, {}).get(source, (0.0, 0.0))
        return min(2.0, (hit + self.request_prior) / (pred + self.request_prior))

    def drafted_ratio(self, source: str, j: int) -> float:
        """Drafted proposals' successes from `source` at draft position j over what they were predicted (1 without
        evidence, at most 1: it corrects the selection's optimism; a source underrated on every lookup is the pooled
        ratios' to raise)."""
        pred, hit = self._drafted.get((source, _POS_OF[min(j, 64)]), (0.0, 0.0))
        return min(1.0, (hit + self.drafted_prior) / (pred + self.drafted_prior))

    def adjust(self, prop: SuffixProposal, min_prob: float, req: Hashable | None = None) -> SuffixProposal:
        """`prop` with calibrated probs and score (the pooled ratios, then request `req`'s residual, then the drafted
        proposals' ratio), cut where the probability falls below `min_prob`."""
        probs, pooled, p, before = [], [], 1.0, 1.0
        own = self.request_ratio(req, prop.source)
        for j, raw in enumerate(prop.probs):
            step = min(1.0, raw / before * self.ratio(self._key(prop, j)) * own)
            p *= min(1.0, step * self.drafted_ratio(prop.source, j))
            before = raw
            if p < min_prob:
                break
            probs.append(p)
            pooled.append(step)
        return SuffixProposal(prop.tokens[:len(probs)], probs, float(sum(probs)), prop.match_len, prop.source,
                              raw_score=prop.score, pooled=pooled)

    def observe_drafted(self, prop: SuffixProposal, emitted: Sequence[int], drafted: int) -> None:
        """Grade calibrated proposal `prop`, whose first `drafted` tokens a step drafted, by the tokens the target then
        emitted (a position counts once every earlier one was confirmed)."""
        if prop.pooled is None:
            return
        for j, (tok, step) in enumerate(zip(prop.tokens[:drafted], prop.pooled, strict=False)):
            if j >= len(emitted):
                break
            hit = tok == emitted[j]
            _count(self._drafted.setdefault((prop.source, _POS_OF[min(j, 64)]), [0.0, 0.0]), step, hit,
                   self.drafted_horizon)
            if not hit:
                break

    def observe(self, prop: SuffixProposal, emitted: Sequence[int], req: Hashable | None = None) -> None:
        """Learn from the raw proposal `prop` and the tokens the target emitted after it (for request `req`)."""
        before = 1.0
        own = self._requests.setdefault(req, {}).setdefault(prop.source, [0.0, 0.0]) if req is not None else None
        for j, (tok, raw) in enumerate(zip(prop.tokens, prop.probs, strict=True)):
            if j >= len(emitted):
                break
            key = self._key(prop, j)
            hit = tok == emitted[j]
            if own is not None:  # graded against the pooled prediction before this observation joins it
                _count(own, min(1.0, raw / before * self.ratio(key)), hit, self.request_horizon)
            _count(self._sums.setdefault(key, [0.0, 0.0]), raw / before, hit, self.horizon)
            before = raw
            if not hit:
                break

    def forget(self, req: Hashable) -> None:
        """Drop request `req`'s residual (it finished or left)."""
        self._requests.pop(req, None)

    def table(self) -> dict[str, dict]:
        """The learned ratios, for reports: 'source/L<=b/pos<=q' -> {predicted, hits, ratio}."""
        out = {}
        for key, (pred, hit) in sorted(self._sums.items()):
            src, lb, pb = key
            name = f"{src}/L<={(*_LEN_BUCKETS, 'inf')[lb]}/pos<={(*_POS_BUCKETS, 'inf')[pb]}"
            out[name] = {"predicted": pred, "hits": hit, "ratio": self.ratio(key)}
        return out


def _count(sums: list[float], predicted: float, hit: bool, horizon: float) -> None:
    """Add one graded position to [predicted, hits]; both halve once predicted passes `horizon` (old evidence fades)."""
    sums[0] += predicted
    sums[1] += hit
    if sums[0] > horizon:
        sums[0] *= 0.5
        sums[1] *= 0.5


class SuffixCache:
    """What a server/rollout engine keeps: a per-request index over prompt + generated tokens, and a
    global index over recently finished outputs. propose() asks both and returns the higher-scoring
    proposal (ties: the request's own)."""

    def __init__(self, max_tokens: int = 1_000_000, max_seqs: int = 10_000, max_depth: int = 64,
                 *, calibrate: bool = True) -> None:
        self.calibrator = Calibrator() if calibrate else None
        self._pending: dict[Hashable, tuple[SuffixProposal, ...]] = {}
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
        if self.calibrator is not None:
            self.calibrator.forget(req_id)

    def append(self, req_id: Hashable, tokens: Sequence[int]) -> None:
        """Record the tokens `req_id` emitted this step (they also grade the step's proposal)."""
        idx = self._request(req_id)
        toks = token_list(tokens)
        if self.calibrator is not None:
            for raw in self._pending.pop(req_id, ()):
                self.calibrator.observe(raw, toks, req_id)
        idx.extend_checked(req_id, toks)
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
        self._pending.pop(req_id, None)
        if self.calibrator is not None:
            self.calibrator.forget(req_id)

    def add_finished(self, seq_id: Hashable, tokens: Sequence[int], weight: float = 1.0) -> None:
        """Add a finished output to the global index (other replicas' shards, RL siblings); an
        existing `seq_id` is replaced."""
        toks = token_list(tokens)
        w = check_weight(weight)
        self.global_index.remove(seq_id)
        self.global_index.extend(seq_id, toks, weight=w)

    def clear(self) -> None:
        """Empty the global index (live requests keep theirs, the calibration stays: it describes the
        target, not the traffic); for benchmarks that replay the same prompts in several settings."""
        g = self.global_index
        self.global_index = SuffixIndex(g.max_tokens, g.max_seqs, g.max_depth, source="global")

    def set_weight(self, seq_id: Hashable, weight: float) -> None:
        """Reweight a finished output in the global index (RL: decay older target versions)."""
        self.global_index.set_weight(seq_id, weight)

    def propose(self, req_id: Hashable, max_tokens: int, *, min_prob: float = 0.1,
                max_match: int = 32, max_spec_factor: float | None = None, scan: bool = False) -> SuffixProposal:
        """The better of the request's own and the global proposal for `req_id`'s next tokens
        (keywords as `SuffixIndex.propose`), compared by calibrated score when calibrating."""
        return self.propose_all(req_id, max_tokens, min_prob=min_prob, max_match=max_match,
                                max_spec_factor=max_spec_factor, scan=scan)[0]

    def propose_all(self, req_id: Hashable, max_tokens: int, *, min_prob: float = 0.1, max_match: int = 32,
                    max_spec_factor: float | None = None, scan: bool = False) -> list[SuffixProposal]:
        """Both proposals (the request's own, the global one; either may be empty), calibrated when
        calibrating, best score first (ties: the request's own): a draft tree verifies the runner-up
        beside the best, where one chain could carry only the best. Counts one lookup, and a hit for
        the best, as `propose`."""
        idx = self._request(req_id)
        ctx = self._context[req_id]
        self.lookups += 1
        kw = {"min_prob": min_prob, "max_match": max_match, "max_spec_factor": max_spec_factor, "scan": scan}
        local = idx.propose(ctx, max_tokens, **kw)
        remote = self.global_index.propose(ctx, max_tokens, exclude=req_id, **kw)
        if self.calibrator is not None:
            self._pending[req_id] = (local, remote)   # both are graded by the next append
            local, remote = (self.calibrator.adjust(x, min_prob, req_id) for x in (local, remote))
        ranked = [remote, local] if remote.score > local.score else [local, remote]
        if ranked[0].tokens:
            self.hits[ranked[0].source] += 1
        return ranked

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
