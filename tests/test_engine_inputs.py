"""Bad input raises ValueError naming the argument (never a crash deep inside a forward, never a hang)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from dvi.drafters.factory import proposer_for
from dvi.engine.speculative import Request, SamplingParams, SpeculativeEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def engine():
    dims = dict(vocab_size=50, num_key_value_heads=1, max_position_embeddings=40)
    target = tiny_llama(0, **dims)
    return SpeculativeEngine(target, proposer_for(target, tiny_llama(None, **dims)), num_draft_tokens=2)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(prompts=[]), "prompts"),
        (dict(prompts=[[1, 2], []]), "prompts"),
        (dict(prompts=[[1, 50]]), "prompts"),
        (dict(prompts=[[-1, 2]]), "prompts"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=-3), "max_new_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(prompts=[[1] * 30], max_new_tokens=11), "max_new_tokens"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_generate_bad_inputs(engine, kwargs, name):
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=name):
        engine.generate(**args)
    assert not engine.has_unfinished()  # nothing half-added


def test_add_request_bad_inputs(engine):
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request(Request("a", [], SamplingParams(4)))
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add_request(Request("a", [99], SamplingParams(4)))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add_request(Request("a", [1], SamplingParams(0)))
    engine.add_request(Request("dup", [1], SamplingParams(2)))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request(Request("dup", [1], SamplingParams(2)))
    engine.abort("dup")
    engine.step()
    assert not engine.has_unfinished()


def test_constructor_limits(engine):
    t = engine.target
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeEngine(t, proposer_for(t, t), num_draft_tokens=9, max_draft_tokens=8)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeEngine(t, proposer_for(t, t), num_draft_tokens=-1)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SpeculativeEngine(t, proposer_for(t, t), num_draft_tokens=4, max_draft_tokens=33)
    with pytest.raises(ValueError, match="feedback_top_k"):
        SpeculativeEngine(t, proposer_for(t, t), feedback_top_k=-1)
    with pytest.raises(TypeError, match="takes a Proposer.*proposer_for"):  # a drafter goes through the factory
        SpeculativeEngine(t, t)


def test_update_target_weights_bad_input(engine, tmp_path):
    with pytest.raises(ValueError, match="state_dict_or_path"):
        engine.update_target_weights({"nope.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="state_dict_or_path"):
        engine.update_target_weights(tmp_path / "missing", version=1)
    sd = engine.target.state_dict()
    k = next(iter(sd))
    with pytest.raises(ValueError, match="state_dict_or_path"):
        engine.update_target_weights({k: torch.zeros(3)}, version=1)


def test_max_context_exactly_fits(engine):
    r = engine.generate([[1] * 30], max_new_tokens=10)[0]
    assert len(r.token_ids) == 10


def test_invalid_params_name_the_field_and_tiny_temperature_is_greedy(engine):
    """Issue 17 items 1, 6, 16: the error names the parameter; top_k is bounded by the vocabulary."""
    from dvi.engine.speculative import InvalidParam

    for params, field in ((SamplingParams(4, top_k=51), "top_k"), (SamplingParams(4, temperature=float("inf")),
                          "temperature"), (SamplingParams(4, temperature=1.0, seed=2**70), "seed"),
                          (SamplingParams(4, top_p=0.0), "top_p")):
        with pytest.raises(InvalidParam) as exc:
            engine.add_request(Request("bad", [1, 2], params))
        assert exc.value.param == field
    greedy = engine.generate([[1, 2, 3]], max_new_tokens=6)[0].token_ids
    tiny = engine.generate([[1, 2, 3]], max_new_tokens=6, temperature=1e-45, seed=0)[0]
    assert tiny.token_ids == greedy and tiny.temperature == 0.0


def test_update_target_weights_refuses_non_finite_and_partial(engine):
    """Issue 17 item 9: NaN / inf / (with complete=True) partial weights are refused, nothing changes."""
    own = {k: v.clone() for k, v in engine.target.state_dict().items()}
    name = next(k for k in own if k.endswith("q_proj.weight"))
    for bad in (float("nan"), float("inf")):
        sd = {k: v.clone() for k, v in own.items()}
        sd[name][0, 0] = bad
        with pytest.raises(ValueError, match="non-finite"):
            engine.update_target_weights(sd, version=1)
    partial = {k: v for k, v in own.items() if k != name}
    with pytest.raises(ValueError, match="partial"):
        engine.update_target_weights(partial, version=1, complete=True)
    assert all(torch.equal(v, own[k]) for k, v in engine.target.state_dict().items())
    assert engine.target_version == 0
