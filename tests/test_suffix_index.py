"""The suffix index and cache (dvi.drafters.suffix): exact proposals on hand-made sequences, voting, the
probability cut, eviction, weights, exclusion, request vs global, degenerate input, bad arguments."""

from __future__ import annotations

import random

import pytest
import torch

from dvi.drafters.suffix import MAX_VOTERS, SuffixCache, SuffixIndex, SuffixProposal
from dvi.drafters.suffix_index import HOT


def prop(ix: SuffixIndex, ctx, k=8, **kw) -> SuffixProposal:
    kw.setdefault("max_spec_factor", None)
    return ix.propose(ctx, k, **kw)


def test_longest_match_continuation_and_score():
    ix = SuffixIndex()
    ix.extend("a", [1, 2, 3, 4, 5, 6, 9, 3, 4, 7])
    p = prop(ix, [2, 3, 4])
    assert p.tokens == [5, 6, 9, 3, 4, 7] and p.match_len == 3
    assert p.probs == [1.0] * 6 and p.score == 6.0 and p.source == "global"
    # with only [3, 4] matching, both occurrences vote: a tie, the most recent (7) wins
    p = prop(ix, [8, 3, 4], min_prob=0.0)
    assert p.tokens == [7] and p.probs == [0.5] and p.match_len == 2
    assert prop(ix, [2, 3, 4], k=2).tokens == [5, 6]


def test_frequency_voting_and_path_probability():
    ix = SuffixIndex()
    for i, tail in enumerate([[7, 8], [7, 8], [7, 9], [5, 1]]):
        ix.extend(i, [1, 2, *tail])
    p = prop(ix, [1, 2], min_prob=0.0)
    assert p.tokens == [7, 8] and p.match_len == 2
    assert p.probs == pytest.approx([0.75, 0.5]) and p.score == pytest.approx(1.25)
    # a tie goes to the most recently seen continuation
    ix.extend(9, [1, 2, 7, 9])
    assert prop(ix, [1, 2], min_prob=0.0).tokens == [7, 9]


def test_min_prob_cuts_the_draft():
    ix = SuffixIndex()
    for i, tail in enumerate([[7, 8], [7, 9], [7, 6], [5, 5]]):
        ix.extend(i, [1, 2, *tail])
    assert prop(ix, [1, 2], min_prob=0.5).tokens == [7]          # 0.75, then 0.25 < 0.5
    assert prop(ix, [1, 2], min_prob=0.8).tokens == []
    assert prop(ix, [1, 2], min_prob=0.2).tokens == [7, 6]       # 0.75 * 1/3 = 0.25


def test_max_spec_factor_caps_by_match_length():
    ix = SuffixIndex()
    ix.extend("a", list(range(10, 30)))
    assert len(ix.propose([11, 12], 16, max_spec_factor=2.0).tokens) == 4
    assert len(ix.propose([10, 11, 12], 16, max_spec_factor=1.0).tokens) == 3
    assert len(ix.propose([12], 16, max_spec_factor=None).tokens) == 16


def test_scan_prefers_a_shorter_match_with_a_better_score():
    ix = SuffixIndex()
    ix.extend("old", [5, 1, 2, 3, 9])                  # the long match: continues with 9 then ends
    for i in range(4):
        ix.extend(i, [1, 2, 3, 4, 4, 4, 4])            # the short match [2, 3]... continues further
    ctx = [8, 5, 1, 2, 3]
    longest = prop(ix, ctx)
    assert longest.match_len == 4 and longest.tokens == [9]
    scanned = prop(ix, ctx, scan=True)
    assert scanned.tokens[:4] == [4, 4, 4, 4] and scanned.score > longest.score and scanned.match_len < 4


def test_eviction_by_tokens_and_seqs_oldest_first():
    ix = SuffixIndex(max_tokens=10, max_seqs=3)
    for i in range(3):
        ix.extend(i, [i, i + 1, i + 2])
    assert ix.num_seqs == 3 and ix.num_tokens == 9
    ix.extend(3, [50, 51])                               # 11 tokens, 4 seqs: evicts seq 0
    assert 0 not in ix and ix.num_seqs == 3 and ix.num_tokens == 8
    ix.extend(4, [60, 61, 62, 63, 64, 65])               # evicts 1 and 2 (tokens), then seqs ok
    assert [s for s in range(5) if s in ix] == [3, 4] and ix.num_tokens == 8
    assert prop(ix, [0, 1]).tokens == [] and prop(ix, [50]).tokens == [51]
    ix.extend(5, list(range(100, 120)))                  # longer than max_tokens on its own: all go
    assert ix.num_tokens <= 10


def test_compaction_keeps_lookups_exact():
    rng = random.Random(0)
    ix = SuffixIndex(max_tokens=5000, max_seqs=200)
    ref: dict[int, list[int]] = {}
    for i in range(400):
        seq = [rng.randrange(20) for _ in range(rng.randrange(5, 60))]
        ix.extend(i, seq)
        ref[i] = seq
        if i % 7 == 0:
            ix.remove(i - 3)
    live = [i for i in ref if i in ix]
    assert ix.num_seqs == len(live) <= 200 and ix.num_tokens == sum(len(ref[i]) for i in live) <= 5000
    for i in live[-20:]:
        assert ix.tokens(i) == ref[i]
    # a brute-force check of one proposal over the survivors
    ctx = ref[live[-1]][:3]
    follow = [s[j + 3] for i in live for s in [ref[i]] for j in range(len(s) - 3) if s[j:j + 3] == ctx]
    p = prop(ix, ctx, k=1, min_prob=0.0)
    if follow:
        best = max(follow.count(t) for t in set(follow))
        assert follow.count(p.tokens[0]) == best and p.probs[0] == pytest.approx(best / len(follow))


def test_hot_tokens_match_like_cold_ones():
    """A frequent last token (past HOT occurrences) is looked up through its bigram groups; the
    answer is the same as the plain scan would give."""
    ix = SuffixIndex()
    filler = [0, 1] * (HOT + 10)                        # token 1 becomes hot
    ix.extend("filler", filler)
    ix.extend("a", [7, 8, 1, 42, 43])
    ix.extend("b", [2, 1, 0, 5])
    assert prop(ix, [8, 1]).tokens == [42, 43]
    assert prop(ix, [9, 7, 8, 1]).match_len == 3
    ix.extend("c", [7, 8, 1, 44])                         # appended after the token became hot
    assert prop(ix, [7, 8, 1], min_prob=0.0).tokens == [44]      # tie: most recent wins
    assert prop(ix, [7, 8, 1], min_prob=0.0).probs == [0.5]
    assert len(prop(ix, [3, 1], min_prob=0.0).tokens) >= 1           # no bigram match: the unigram's votes


def test_voters_are_capped_to_the_most_recent():
    ix = SuffixIndex()
    for i in range(MAX_VOTERS + 50):
        ix.extend(i, [3, 4, 5 if i < 50 else 6])
    p = prop(ix, [3, 4], min_prob=0.0)
    assert p.tokens == [6] and p.probs == [1.0]   # the 50 oldest fall outside the sample


def test_weights_decay_and_zero_weight():
    ix = SuffixIndex()
    ix.extend("v1", [1, 2, 3], weight=1.0)
    ix.extend("v2a", [1, 2, 4])
    ix.extend("v2b", [1, 2, 4])
    assert prop(ix, [1, 2]).tokens == [4]
    ix.set_weight("v2a", 0.2)
    ix.set_weight("v2b", 0.2)
    p = prop(ix, [1, 2], min_prob=0.0)
    assert p.tokens == [3] and p.probs == pytest.approx([1.0 / 1.4])
    ix.set_weight("v1", 0.0)
    assert prop(ix, [1, 2]).tokens == [4] and prop(ix, [1, 2]).probs == [1.0]
    ix.extend("v1", [9])                                  # extending keeps the weight
    assert prop(ix, [2, 3]).tokens == []


def test_exclude_and_unknown_continuations():
    ix = SuffixIndex()
    ix.extend("me", [1, 2, 3, 1, 2])
    ix.extend("other", [1, 2, 8])
    assert prop(ix, [1, 2], min_prob=0.0).probs == [0.5]      # me's [1,2]->3 and other's ->8 (tie: other)
    assert prop(ix, [1, 2], exclude="other").tokens == [3, 1, 2]
    assert prop(ix, [1, 2], exclude="me").tokens == [8]
    # [3, 1, 2] occurs only at me's open end (no known continuation): the usable match is [1, 2]
    p = prop(ix, [3, 1, 2], exclude="other")
    assert p.tokens == [3, 1, 2] and p.match_len == 2
    assert prop(ix, [9, 2, 3, 1, 2], exclude="other").match_len == 2


def test_cache_request_source_sees_prompt_and_output():
    c = SuffixCache()
    c.start("r", [10, 11, 12, 13, 14, 10, 11])
    p = c.propose("r", 3, max_spec_factor=None)
    assert p.tokens == [12, 13, 14] and p.source == "request"
    c.append("r", [12, 13, 99])
    c.append("r", [12, 13])
    assert c.propose("r", 2, max_spec_factor=None, min_prob=0.0).tokens[0] in (14, 99)
    c.finish("r")
    s = c.stats()
    assert s["seqs"] == 1 and s["tokens"] == 5 and s["requests"] == 0   # the output only
    c.start("q", [0, 12, 13])
    p = c.propose("q", 4, max_spec_factor=None)
    assert p.tokens == [99, 12, 13] and p.source == "global"
    assert c.stats()["hits_global"] == 1 and c.stats()["hits_request"] == 2


def test_cache_prefers_higher_score_and_finishing_without_keep():
    c = SuffixCache()
    c.add_finished("x", [5, 6, 7, 8, 9, 10])
    c.add_finished("y", [5, 6, 7, 8, 9, 10])
    c.start("r", [1, 5, 6, 0, 5, 6])
    p = c.propose("r", 5, max_spec_factor=None)          # request: [0, 5, 6] (3) < global (4)
    assert p.tokens == [7, 8, 9, 10] and p.source == "global"
    assert c.propose("r", 3, max_spec_factor=None).source == "request"   # a tie keeps the request's
    c.finish("r", keep=False)
    assert c.stats()["seqs"] == 2
    c.add_finished("x", [1])                                   # replaces
    assert c.global_index.tokens("x") == [1]
    c.set_weight("y", 0.0)
    c.start("s", [5, 6])
    assert c.propose("s", 3).tokens == []
    c.forget("s")
    c.forget("s")


def test_degenerate_inputs():
    ix = SuffixIndex()
    assert prop(ix, [1, 2]) == SuffixProposal.empty("global")
    ix.extend("a", [])
    ix.extend("b", [4])
    assert ix.num_seqs == 2 and ix.num_tokens == 1
    assert prop(ix, []).tokens == [] and prop(ix, [4]).tokens == [] and prop(ix, [1, 2], k=0).tokens == []
    ix.extend("c", [4, 4, 4, 4])
    assert prop(ix, [4]).tokens == [4, 4, 4]                   # a run continues into itself
    ix.remove("nope")
    c = SuffixCache()
    c.start("e", [])
    assert c.propose("e", 4).tokens == []
    c.finish("e")
    assert c.stats()["seqs"] == 0


@pytest.mark.parametrize("call, name", [
    (lambda: SuffixIndex(max_tokens=0), "max_tokens"),
    (lambda: SuffixIndex(max_seqs=-1), "max_seqs"),
    (lambda: SuffixIndex(max_depth=0), "max_depth"),
    (lambda: SuffixIndex(source="x"), "source"),
    (lambda: SuffixIndex().extend("a", [1, -2]), "tokens"),
    (lambda: SuffixIndex().extend("a", [1.5, 2.0]), "tokens"),
    (lambda: SuffixIndex().extend("a", [[1, 2]]), "tokens"),
    (lambda: SuffixIndex().extend("a", [1], weight=-1), "weight"),
    (lambda: SuffixIndex().extend("a", [1], weight=float("nan")), "weight"),
    (lambda: SuffixIndex().set_weight("a", 1.0), "seq_id"),
    (lambda: SuffixIndex().tokens("a"), "seq_id"),
    (lambda: SuffixIndex().propose([1], -1), "max_tokens"),
    (lambda: SuffixIndex().propose([3, -1], 4), "context"),
    (lambda: SuffixIndex().propose([1], 4, min_prob=1.5), "min_prob"),
    (lambda: SuffixIndex().propose([1], 4, max_match=0), "max_match"),
    (lambda: SuffixIndex().propose([1], 4, max_spec_factor=0), "max_spec_factor"),
    (lambda: SuffixCache().append("r", [1]), "req_id"),
    (lambda: SuffixCache().propose("r", 4), "req_id"),
    (lambda: SuffixCache().finish("r"), "req_id"),
    (lambda: SuffixCache().start("r", [-1]), "tokens"),
    (lambda: SuffixCache().add_finished("r", [1], weight=-0.5), "weight"),
])
def test_bad_arguments_raise_value_error_naming_them(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_calibrator_learns_from_emitted_tokens_and_cuts():
    from dvi.drafters.suffix import Calibrator

    cal = Calibrator(prior=1.0)
    raw = SuffixProposal([5, 6, 7, 8], [1.0, 1.0, 1.0, 1.0], 4.0, 2, "global")
    assert cal.adjust(raw, 0.1).probs == [1.0] * 4                  # no evidence: unchanged
    for _ in range(20):
        cal.observe(raw, [5, 9, 9, 9])                              # first token right, second wrong
    adj = cal.adjust(raw, 0.1)
    assert adj.raw_score == 4.0 and adj.tokens == [5] and adj.score == pytest.approx(1.0)
    assert adj.probs == pytest.approx([1.0])                        # 21/21 then 1/21 < 0.1: cut
    other = SuffixProposal([5, 6], [1.0, 1.0], 2.0, 30, "global")   # another match-length bucket
    assert cal.adjust(other, 0.1).tokens == [5, 6]
    cal.observe(raw, [5])                                           # censored: only position 0 seen
    assert any(v["hits"] == 21 for v in cal.table().values())


def test_cache_calibration_changes_the_choice_between_sources():
    def cache(calibrate: bool) -> SuffixCache:
        c = SuffixCache(calibrate=calibrate)
        c.add_finished("g", [1, 2, 3, 4, 5, 6])
        for step in range(60):                 # the global 2-token match keeps being wrong
            c.start(step, [1, 2])
            c.propose(step, 4, max_spec_factor=None)
            c.append(step, [9, 9, 9])
            c.forget(step)
        c.start("r", [1, 2, 7, 1, 2])           # the request's own [1, 2] -> [7, 1, 2] (score 3)
        return c

    plain = cache(calibrate=False).propose("r", 4, max_spec_factor=None)
    assert plain.tokens == [3, 4, 5, 6] and plain.source == "global" and plain.raw_score is None
    learned = cache(calibrate=True).propose("r", 4, max_spec_factor=None)
    assert learned.tokens == [7, 1, 2] and learned.source == "request" and learned.raw_score == 3.0


def test_clear_empties_the_global_index_only():
    c = SuffixCache()
    c.add_finished("g", [1, 2, 3])
    c.start("r", [1, 2, 3, 1, 2])
    c.clear()
    assert c.stats()["seqs"] == 0 and c.stats()["requests"] == 1
    assert c.propose("r", 2).tokens == [3, 1]


def test_calibrator_keeps_a_residual_per_request_on_top_of_the_pooled_ratios():
    from dvi.drafters.suffix import Calibrator

    cal = Calibrator(prior=1.0)
    prop = SuffixProposal([5, 6, 7, 8], [1.0, 1.0, 1.0, 1.0], 4.0, 2, "request")
    for _ in range(50):
        cal.observe(prop, [5, 6, 7, 8], "code")                     # pooled evidence: the continuation holds
    for _ in range(10):
        cal.observe(prop, [9, 9, 9, 9], "chat")                     # this request's own: it never does
    chat, code, fresh = (cal.adjust(prop, 0.1, r) for r in ("chat", "code", "new"))
    assert cal.request_ratio("chat", "request") < 0.35 < 0.95 < cal.request_ratio("code", "request")
    assert chat.tokens == [5] and chat.score < 0.3                 # cut after one step
    assert code.tokens == fresh.tokens == [5, 6, 7, 8] and code.score >= fresh.score > 3.0
    assert cal.request_ratio("chat", "global") == 1.0               # per source: the global index is not judged
    cal.forget("chat")
    assert cal.adjust(prop, 0.1, "chat").probs == fresh.probs


def test_cache_grades_each_request_on_its_own_and_forgets_it_with_the_request():
    c = SuffixCache()
    c.start("a", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])    # its own history: [1, 2] -> 3 every time
    c.start("b", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    first = c.propose("a", 4, max_spec_factor=None)
    assert first.tokens[:1] == [3]
    for i in range(12):                                 # the target keeps emitting something else after [1, 2]
        c.propose("a", 4, max_spec_factor=None)
        c.append("a", [20 + i, 1, 2])
    missed = c.calibrator.request_ratio("a", "request")
    assert missed < 0.7 and c.calibrator.request_ratio("b", "request") == 1.0
    assert c.propose("a", 4, max_spec_factor=None).score < c.propose("b", 4, max_spec_factor=None).score
    c.start("a", [1, 2])                                # a restarted id starts over
    assert c.calibrator.request_ratio("a", "request") == 1.0
    c.append("b", [3])                                  # graded: the proposal's first token held
    assert c.calibrator.request_ratio("b", "request") > 1.0
    c.forget("b")                                       # a finished request's residual goes with it
    assert c.calibrator.request_ratio("b", "request") == 1.0


def test_drafted_proposals_that_keep_less_than_promised_are_scaled_down_per_source():
    """The pooled ratios grade every lookup; what drafts is the likeliest-looking proposal, whose estimate errs high:
    the drafted proposals' own successes scale their steps, per source and position, from what their calibrated
    probabilities promised (not from the already scaled ones, so the ratio settles instead of compounding)."""
    from dvi.drafters.suffix import Calibrator

    cal = Calibrator(prior=1.0)
    raw = SuffixProposal([5, 6, 7], [0.8, 0.8, 0.8], 2.4, 2, "global")
    before = cal.adjust(raw, 0.05)
    assert before.probs == pytest.approx([0.8] * 3) and before.pooled == pytest.approx([0.8, 1.0, 1.0])
    for _ in range(40):                                  # drafted: the first token held a quarter of the time
        p = cal.adjust(raw, 0.05)
        cal.observe_drafted(p, [5, 6, 7] if _ % 4 == 0 else [9, 9, 9], drafted=3)
    after = cal.adjust(raw, 0.05)
    assert cal.drafted_ratio("global", 0) == pytest.approx((10 + 8) / (40 * 0.8 + 8))  # 8 pseudo-observations at 1
    assert after.probs[0] == pytest.approx(0.8 * 0.45) and after.pooled[0] == pytest.approx(0.8)
    assert cal.drafted_ratio("request", 0) == 1.0        # per source: the request's own index is not judged
    own = SuffixProposal([5, 6, 7], [0.8, 0.8, 0.8], 2.4, 2, "request")
    assert cal.adjust(own, 0.05).probs == pytest.approx([0.8] * 3)
    cal.observe_drafted(raw, [5, 6, 7], drafted=1)       # uncalibrated (no `pooled`): nothing to grade against
    cal.observe_drafted(after, [5], drafted=3)           # censored: only position 0 seen
    assert cal.drafted_ratio("global", 1) == 1.0         # position 1 held all 10 times it was promised


def test_the_suffix_proposer_grades_only_the_rows_that_drafted_their_proposal():
    from dvi.drafters.proposer import Draft
    from dvi.drafters.suffix_proposer import SuffixProposer

    class _Req:
        def __init__(self, rid, prompt):
            self.request_id, self.prompt_ids = rid, prompt

    class _Seq:
        def __init__(self, rid, prompt):
            self.req = _Req(rid, prompt)

    prop = SuffixProposer(SuffixCache(), 32, torch.device("cpu"))
    prop.join([_Seq("a", [1, 2, 3, 1, 2]), _Seq("b", [4, 5, 6, 4, 5])], None)
    sets = prop.proposal_sets([4, 4])
    assert set(sets) == {0, 1} and sets[0][0].tokens[:1] == [3] and sets[1][0].tokens[:1] == [6]
    ids = torch.tensor([[3, 1], [0, 0]])
    draft = Draft(ids, None, [2, 0], ["suffix_request", None], None, suffix_rows=True)  # row b drafted nothing
    prop.observe(draft, [0, 0], [[9], [6]], None)          # row a's first draft missed
    cal = prop.cache.calibrator
    pred, hit = cal._drafted[("request", 0)]
    assert hit == 0 and 0 < pred <= 1.0                      # one graded position: row a's, a miss
