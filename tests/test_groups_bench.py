"""The tenant benchmark scores adapters on prompts no arm trained on, and waits for verdicts it can see (issue 40)."""

import itertools

from benchmarks import groups, lane_recipe


def test_unseen_prompts_are_never_sent_as_traffic():
    """sql and chat (code prompts need a tokenizer; its cuts do not repeat)."""
    for i, tenant in enumerate(("sql", "chat")):
        drawn = list(itertools.islice(groups.tenant_requests(tenant, None, groups.EVAL_SEED + i), 400))
        unseen = {groups.body_key(b) for _, b in drawn[:24]}
        plain = [groups.body_key(b) for _, b in itertools.islice(groups.tenant_requests(tenant, None, i), 400)]
        assert unseen & set(plain), f"{tenant}: the generator repeats, so a traffic stream does meet unseen prompts"
        kept = [groups.body_key(b) for _, b in
                itertools.islice(groups.tenant_requests(tenant, None, i, frozenset(unseen)), 400)]
        assert not unseen & set(kept)
        assert kept[:5] == [k for k in plain if k not in unseen][:5]  # the same stream, less the unseen prompts


def test_a_latest_version_without_a_verdict_is_unjudged():
    promoted = {"kind": "promoted", "version": 3}
    assert not groups.unjudged({"latest": None, "live_version": 0})
    assert not groups.unjudged({"latest": 3, "live_version": 3, "events": [promoted]})
    assert groups.unjudged({"latest": 4, "live_version": 3, "events": [promoted]})
    assert not groups.unjudged({"latest": 4, "live_version": 3, "events": [promoted, {"kind": "refused", "version": 4}]})
    assert not groups.unjudged({"latest": 4, "live_version": 3, "events": [], "refused": {"4": "worse"}})


class _Rec:
    def __init__(self, domain, prompt, t):
        self.domain, self.prompt_ids, self.token_ids, self.finished_at = domain, prompt, [1, 2], t


def test_split_by_prompt_keeps_every_record_of_an_evaluation_prompt_out_of_training():
    recs = [_Rec("sql", [i % 20, 5], t) for t, i in enumerate(range(80))]
    train, evals = lane_recipe.split_by_prompt(recs, 0.4)
    evaluated = {tuple(r.prompt_ids) for r in evals["sql"]}
    assert evaluated and all(tuple(r.prompt_ids) not in evaluated for r in train)
    assert len(evals["sql"]) == len(evaluated)  # one record per distinct prompt
    assert [r.finished_at for r in train] == sorted(r.finished_at for r in train)
