import math

import pytest
import torch
import torch.nn.functional as F

from trainers.losses import LoggedTargets, LossWeights, dvi_loss, ramp_weight, reward_loss, topk_kl_loss

torch.set_num_threads(1)


def topk_of(logits, k):
    lp = F.log_softmax(logits, -1)
    vals, ids = lp.topk(k, -1)
    return ids, vals


@pytest.mark.parametrize("tail", [True, False])
def test_kl_zero_for_equal_distributions(tail):
    torch.manual_seed(0)
    logits = torch.randn(6, 20)
    ids, lps = topk_of(logits, 5)
    assert topk_kl_loss(logits, ids, lps, tail_bucket=tail).abs().item() < 1e-6
    # full support: the tail bucket is empty
    ids, lps = topk_of(logits, 20)
    assert topk_kl_loss(logits, ids, lps, tail_bucket=tail).abs().item() < 1e-6


def test_kl_matches_hand_computation():
    # V=3, k=2: target top-2 = ids [0, 1] with probs 0.5, 0.3 (tail 0.2)
    student = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    ids = torch.tensor([[0, 1]])
    lps = torch.log(torch.tensor([[0.5, 0.3]]))
    want_tail = 0.5 * math.log(0.5 / 0.25) + 0.3 * math.log(0.3 / 0.25) + 0.2 * math.log(0.2 / 0.5)
    got = topk_kl_loss(student, ids, lps).item()
    assert got == pytest.approx(want_tail, abs=1e-6) and got > 0
    # renormalised variant: p = (5/8, 3/8), q = (1/2, 1/2)
    want_renorm = 5 / 8 * math.log((5 / 8) / 0.5) + 3 / 8 * math.log((3 / 8) / 0.5)
    assert topk_kl_loss(student, ids, lps, tail_bucket=False).item() == pytest.approx(want_renorm, abs=1e-6)


def test_tail_bucket_sees_mass_outside_topk():
    # the student matches the target's top-k ratios but parks mass on an unranked token
    target = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    ids, lps = topk_of(target, 2)
    student = torch.log(torch.tensor([[0.2, 0.1, 0.7, 0.0 + 1e-9]]))
    assert topk_kl_loss(student, ids, lps, tail_bucket=False).item() < 1e-6
    assert topk_kl_loss(student, ids, lps, tail_bucket=True).item() > 0.1


@pytest.mark.parametrize("tail", [True, False])
def test_kl_padding_ignored_and_finite(tail):
    torch.manual_seed(5)
    target = torch.randn(3, 10)
    ids, lps = topk_of(target, 3)
    logits = torch.randn(3, 10, requires_grad=True)
    ref = topk_kl_loss(logits, ids, lps, tail_bucket=tail)
    # pad to k=5 two ways: repeat the first id at -inf, or id -1
    pad_ids = torch.cat([ids, ids[:, :1], torch.full((3, 1), -1)], 1)
    pad_lps = torch.cat([lps, torch.full((3, 1), float("-inf")), torch.zeros(3, 1)], 1)
    got = topk_kl_loss(logits, pad_ids, pad_lps, tail_bucket=tail)
    assert got.item() == pytest.approx(ref.item(), abs=1e-6)
    # a row that is all padding, masked out, must not poison the gradient
    pad_ids[2] = -1
    topk_kl_loss(logits, pad_ids, pad_lps, torch.tensor([1, 1, 0]), tail_bucket=tail).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[2].abs().sum() == 0


def test_kl_mask_and_batch_shape():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 10)
    target = torch.randn(2, 3, 10)
    ids, lps = topk_of(target, 4)
    mask = torch.tensor([[1, 0, 0], [0, 0, 1]], dtype=torch.bool)
    full = topk_kl_loss(logits, ids, lps, mask)
    rows = [
        topk_kl_loss(logits[0, 0:1], ids[0, 0:1], lps[0, 0:1]),
        topk_kl_loss(logits[1, 2:3], ids[1, 2:3], lps[1, 2:3]),
    ]
    assert full.item() == pytest.approx((rows[0] + rows[1]).item() / 2, abs=1e-6)
    # garbage in masked-out rows changes nothing
    logits2 = logits.clone()
    logits2[0, 1] = 1e4
    assert topk_kl_loss(logits2, ids, lps, mask).item() == pytest.approx(full.item(), abs=1e-6)
    assert topk_kl_loss(logits, ids, lps, torch.zeros(2, 3)).item() == 0.0


def test_kl_gradient_reduces_kl():
    torch.manual_seed(2)
    target = torch.randn(4, 12)
    ids, lps = topk_of(target, 3)
    logits = torch.zeros(4, 12, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=1.0)
    first = None
    for _ in range(50):
        loss = topk_kl_loss(logits, ids, lps)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first * 0.2


def test_reward_step_moves_accepted_up_rejected_down():
    torch.manual_seed(3)
    logits = torch.randn(2, 8, requires_grad=True)
    drafted = torch.tensor([3, 5])
    accepted = torch.tensor([True, False])
    before = F.log_softmax(logits, -1).gather(1, drafted[:, None])[:, 0].detach()
    loss = reward_loss(logits, drafted, accepted)
    loss.backward()
    with torch.no_grad():
        after = F.log_softmax(logits - 0.5 * logits.grad, -1).gather(1, drafted[:, None])[:, 0]
    assert after[0] > before[0]  # accepted draft more likely
    assert after[1] < before[1]  # rejected draft less likely


def test_reward_mask_and_missing_drafts():
    logits = torch.randn(3, 8, requires_grad=True)
    drafted = torch.tensor([1, -1, 2])
    accepted = torch.tensor([1.0, 0.0, 0.0])
    mask = torch.tensor([1, 1, 0])
    reward_loss(logits, drafted, accepted, mask, baseline=0.0).backward()
    assert logits.grad[1].abs().sum() == 0  # no draft
    assert logits.grad[2].abs().sum() == 0  # masked
    assert logits.grad[0].abs().sum() > 0
    # with the batch-mean baseline a batch where everything was accepted carries no signal
    logits.grad = None
    reward_loss(logits, torch.tensor([1, 2, 3]), torch.ones(3)).backward()
    assert logits.grad.abs().max() < 1e-7


def test_ramp_weight_schedule():
    assert ramp_weight(0, start=10, ramp_steps=100, max_weight=0.5) == 0.0
    assert ramp_weight(10, start=10, ramp_steps=100, max_weight=0.5) == 0.0
    assert ramp_weight(60, start=10, ramp_steps=100, max_weight=0.5) == pytest.approx(0.25)
    assert ramp_weight(110, start=10, ramp_steps=100, max_weight=0.5) == 0.5
    assert ramp_weight(10_000, start=10, ramp_steps=100, max_weight=0.5) == 0.5
    assert ramp_weight(10, start=10, ramp_steps=0, max_weight=0.5) == 0.5


def test_dvi_loss_combines():
    torch.manual_seed(4)
    logits = torch.randn(5, 16, requires_grad=True)
    ids, lps = topk_of(torch.randn(5, 16), 4)
    drafted = torch.tensor([1, 2, -1, 3, 4])
    acc = torch.tensor([1, 0, 0, 1, 0])
    early = dvi_loss(logits, LoggedTargets(ids, lps, drafted, acc), step=0, weights=LossWeights(reward_start=100))
    assert early.reward_weight == 0.0 and early.loss.item() == pytest.approx(early.kl.item())
    late = dvi_loss(logits, LoggedTargets(ids, lps, drafted, acc), step=10_000,
                    weights=LossWeights(reward_start=100, reward_max_weight=0.3))
    want = late.kl + 0.3 * reward_loss(logits, drafted, acc)
    assert late.reward_weight == 0.3 and late.loss.item() == pytest.approx(want.item(), abs=1e-6)
    late.loss.backward()
    assert torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------- reduced draft vocabulary
def _subset_index(v: int, ids: list[int]) -> torch.Tensor:
    index = torch.full((v,), -1, dtype=torch.long)
    index[torch.tensor(ids)] = torch.arange(len(ids))
    return index


def test_subset_loss_equals_full_vocab_loss_when_target_topk_inside():
    """Same value as the full-vocab loss on the -inf-padded logits the engine serves, when that one is finite."""
    torch.manual_seed(0)
    v, subset = 20, [1, 2, 4, 5, 8, 9, 11, 13, 16, 19]
    sub = torch.randn(3, 6, len(subset), requires_grad=True)
    full = torch.full((3, 6, v), float("-inf")).index_copy(-1, torch.tensor(subset), sub)
    target = torch.randn(3, 6, v).index_fill(-1, torch.tensor([0, 3, 6, 7, 10, 12, 14, 15, 17, 18]), -30.0)
    ids, lps = topk_of(target, 5)
    assert bool(torch.isin(ids, torch.tensor(subset)).all())
    drafted = torch.tensor(subset)[torch.randint(len(subset), (3, 6))]
    accepted = torch.rand(3, 6) < 0.5
    kw = dict(step=10, weights=LossWeights(reward_start=0, reward_ramp_steps=1, reward_max_weight=0.5))
    logged = LoggedTargets(ids, lps, drafted, accepted)
    got = dvi_loss(sub, logged, subset_index=_subset_index(v, subset), **kw)
    want = dvi_loss(full, logged, **kw)
    assert got.loss.item() == pytest.approx(want.loss.item(), abs=1e-5) and got.reward.item() != 0


def test_subset_loss_drops_outside_ids_and_renormalises():
    # V=4, subset {0, 1, 2}; target logs id 0 (0.5) and id 3 (0.3), tail 0.2; student q = (0.5, 0.25, 0.25) on S
    sub = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    ids, lps = torch.tensor([[0, 3]]), torch.log(torch.tensor([[0.5, 0.3]]))
    index = _subset_index(4, [0, 1, 2])
    # id 3 dropped, the rest renormalised by 1 - 0.3: p_S = (5/7 on id 0, tail 2/7); student tail = 0.5
    want = 5 / 7 * math.log((5 / 7) / 0.5) + 2 / 7 * math.log((2 / 7) / 0.5)
    out = dvi_loss(sub, LoggedTargets(ids, lps, torch.tensor([3]), torch.tensor([False])), subset_index=index)
    assert out.kl.item() == pytest.approx(want, abs=1e-6)
    # the full-vocab loss on the served (-inf outside S) logits is not usable: that is what the mapping avoids
    served = torch.cat([sub, torch.tensor([[float("-inf")]])], -1)
    assert not math.isfinite(topk_kl_loss(served, ids, lps).item())


@pytest.mark.parametrize("case", ["top1_outside", "all_outside", "no_topk_logged"])
def test_subset_loss_finite_with_finite_gradients(case):
    torch.manual_seed(1)
    v, subset = 30, list(range(0, 30, 3))
    index = _subset_index(v, subset)
    sub = torch.randn(2, 5, len(subset), requires_grad=True)
    target = torch.randn(2, 5, v)
    if case == "top1_outside":
        target[..., 1] = 10.0  # id 1 is not in the subset and holds most of the mass
    elif case == "all_outside":
        target[..., subset] = -50.0
    ids, lps = topk_of(target, 4)
    if case == "no_topk_logged":  # records without top-k: the target token as a one-hot (FeedbackRecord.compact)
        ids, lps = ids[..., :1], torch.zeros(2, 5, 1)
    drafted = torch.tensor(subset)[torch.randint(len(subset), (2, 5))]
    drafted[0, 0] = 1  # a draft outside the subset (an older full-vocab drafter's) is ignored
    out = dvi_loss(sub, LoggedTargets(ids, lps, drafted, torch.rand(2, 5) < 0.5), step=5,
                   weights=LossWeights(reward_start=0, reward_ramp_steps=1), subset_index=index)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and bool(torch.isfinite(sub.grad).all())


def test_dvi_loss_defaults_are_the_config_defaults():
    """Leaving a weight out of dvi_loss trains what a default config trains."""
    import inspect

    from dvi.config import TrainerConfig

    tc, w = TrainerConfig(), inspect.signature(dvi_loss).parameters["weights"].default
    assert w.kl_weight == tc.kl_weight
    assert w.reward_start == tc.reward_ramp_start
    assert w.reward_ramp_steps == tc.reward_ramp_steps
    assert w.reward_max_weight == tc.reward_weight
    assert LossWeights.of(tc) == w
