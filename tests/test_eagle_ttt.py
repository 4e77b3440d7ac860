"""EAGLE-3 heads (fused target layers, own-state chaining, deeper / wider) and the training-time-test unroll:
the parallel unroll computes exactly what the engine's KV-cached drafting computes, chain by chain."""

from __future__ import annotations

import pytest
import torch
from test_engine import tiny
from transformers import DynamicCache

from dvi.drafters.eagle import EagleDrafter, features_from_hidden
from trainers.builds.eagle_ttt import EagleObjective, chain_predictions, ttt_loss, unroll

torch.set_num_threads(1)


def noisy(d: EagleDrafter, scale: float = 0.3, seed: int = 1) -> EagleDrafter:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.abs().mean().clamp_min(0.05))
    return d


def stepped_chain(d: EagleDrafter, ids: torch.Tensor, feats: torch.Tensor, start: int, steps: int) -> list[torch.Tensor]:
    """The engine's way: prefill inputs 0..start with true features, then feed x_{start+1}, ... one at a time with
    the head's own output of the position before. Returns the normed output of each chain step."""
    m = d.model
    cache = DynamicCache()
    out = m(ids[:, : start + 1], feats[:, : start + 1], past_key_values=cache, use_cache=True)
    f = m.norm(out.features) if m.fuse is not None else out.features
    outs = [f[:, -1]]
    own = out.features[:, -1:]
    for k in range(1, steps):
        j = start + k
        mask = torch.zeros(1, 1, 1, j + 1)
        out = m(ids[:, j: j + 1], own, attention_mask=mask, position_ids=torch.tensor([[j]]), past_key_values=cache,
                use_cache=True)
        outs.append(m.norm(out.features[:, -1]) if m.fuse is not None else out.features[:, -1])
        own = out.features
    return outs


@pytest.mark.parametrize("design", ["final", "fused", "fused_2layers_wide"])
def test_unroll_equals_stepped_drafting(design):
    target = tiny("llama", seed=0, layers=3)
    kw = {"final": {}, "fused": {"feature_layers": (0, 2)},
          "fused_2layers_wide": {"feature_layers": (0, 1, 2), "num_layers": 2, "intermediate_size": 192}}[design]
    d = noisy(EagleDrafter(target, **kw))
    t = 12
    ids = torch.randint(0, target.config.vocab_size, (1, t))
    feats = torch.randn(1, t, d.feature_dim)
    outs = unroll(d.model, ids, feats, steps=4)
    for start in (0, 3, 7):
        ref = stepped_chain(d, ids, feats, start, 4)
        for k in range(4):
            torch.testing.assert_close(outs[k][:, start + k], ref[k], atol=1e-4, rtol=1e-3)


def test_fused_head_saves_and_loads(tmp_path):
    target = tiny("llama", seed=0, layers=3)
    d = noisy(EagleDrafter(target, feature_layers=(0, 2), num_layers=2, intermediate_size=160))
    d.save(tmp_path / "h")
    back = EagleDrafter.load(target, tmp_path / "h")
    assert back.feature_layers == (0, 2) and back.feature_dim == 2 * 64 and len(back.model.layers) == 2
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    feats = torch.randn(1, 6, d.feature_dim)
    torch.testing.assert_close(back.model(ids, feats).logits, d.model(ids, feats).logits)


def test_untrained_wide_head_is_the_target_layer():
    """A wider FFN starts as the same function (extra units' down-projection at zero)."""
    target = tiny("llama", seed=0, layers=3)
    a, b = EagleDrafter(target), EagleDrafter(target, intermediate_size=256)
    ids = torch.randint(0, target.config.vocab_size, (2, 7))
    feats = torch.randn(2, 7, 64)
    torch.testing.assert_close(a.model(ids, feats).logits, b.model(ids, feats).logits)


def test_ttt_loss_trains_chains():
    """A few steps of the unrolled loss lower it; chain predictions have the documented shape."""
    target = tiny("llama", seed=0, layers=3)
    d = EagleDrafter(target, feature_layers=(0, 2))
    ids = torch.randint(0, target.config.vocab_size, (2, 16))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    hidden = torch.cat([hs[1], hs[3]], -1)  # residual after layers 0 and 2 (HF: hidden_states[i + 1])
    final = hs[-1]
    head = target.lm_head.weight
    params = d.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=3e-3)
    first = None
    for _ in range(25):
        loss, per_step = ttt_loss(d.model, ids, features_from_hidden(hidden), final, head,
                                  EagleObjective(ttt_steps=3, feature_weight=0.0))
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.7 * first and len(per_step) == 3
    preds = chain_predictions(d.model, ids, hidden, head, torch.arange(head.shape[0]), steps=3)
    assert preds.shape == (3, 2, 16)


@pytest.mark.parametrize("design", ["final", "fused"])
def test_chain_acceptance_equals_stepped_drafting_on_greedy_text(design):
    """Accepted lengths from the parallel unroll equal those of drafting chain by chain on the target's greedy text
    (a lightly perturbed first-recipe head on a 1-layer target is nearly the target: long chains get accepted)."""
    from trainers.builds.eagle_eval import chain_acceptance

    fused = design == "fused"
    target = tiny("llama", seed=0, layers=3 if fused else 1)
    d = noisy(EagleDrafter(target, feature_layers=(0, 2) if fused else None), scale=0.05 if fused else 0.01)
    prompt = torch.randint(0, target.config.vocab_size, (1, 5))
    with torch.no_grad():
        seq = target.generate(prompt, max_new_tokens=14, do_sample=False, pad_token_id=0)[0].tolist()
        hs = target(torch.tensor([seq]), output_hidden_states=True)
    hidden = torch.cat([hs.hidden_states[1], hs.hidden_states[3]], -1) if fused else hs.hidden_states[-1]
    top = hs.logits.argmax(-1)  # [1, L]
    vocab = torch.arange(target.config.vocab_size)
    k, start = 3, 4
    res = chain_acceptance(d.model, [seq], [start], hidden, top, vocab, k=k)
    feats = features_from_hidden(hidden)
    reach, steps = [0] * k, 0
    for s in range(start, len(seq) - k + 1):
        outs = stepped_chain(d, torch.tensor([seq]), feats, s, k)
        n = 0
        for j, f in enumerate(outs):
            if int(target.lm_head(f).argmax()) != int(top[0, s + j]):
                break
            n += 1
        for j in range(n):
            reach[j] += 1
        steps += 1
    assert res["steps"] == steps and res["greedy_share"] > 0.9
    assert res["acceptance"] == pytest.approx([r / steps for r in reach])
    assert fused or (reach[-1] > 0 and reach[0] < steps)
