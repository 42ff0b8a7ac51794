"""Advantages, DAPO shaping/filtering and KL estimators against hand-computed values."""

import math

import pytest
import torch

from meshrl.advantages import (
    group_centered_advantages,
    kl_estimate,
    kl_reward_shaping,
    overlong_penalty,
)


def test_group_centered_advantages_no_std_by_default():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 0.0, 0.0, 0.0]])
    adv = group_centered_advantages(rewards)
    torch.testing.assert_close(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [2.25, -0.75, -0.75, -0.75]]))


def test_group_centered_advantages_with_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # unbiased std of [1, 0, 0, 1] = sqrt(1/3)
    adv = group_centered_advantages(rewards, normalize_std=True, eps=0.0)
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([[0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s]]))
    # all-equal groups give 0, not nan
    flat = group_centered_advantages(torch.tensor([[2.0, 2.0, 2.0]]), normalize_std=True)
    assert torch.equal(flat, torch.zeros(1, 3))
    assert torch.equal(group_centered_advantages(torch.tensor([[5.0]]), normalize_std=True), torch.zeros(1, 1))


def test_group_centered_advantages_ragged_groups():
    adv = group_centered_advantages([[1.0, 2.0, 3.0], [4.0, 0.0]])
    torch.testing.assert_close(adv[0], torch.tensor([-1.0, 0.0, 1.0]))
    torch.testing.assert_close(adv[1], torch.tensor([2.0, -2.0]))


def test_overlong_penalty_piecewise():
    # Lmax = 20, Lcache = 4: free up to 16, linear to -1 at 20, -1 beyond
    lengths = [0, 16, 17, 18, 20, 21, 100]
    penalty = overlong_penalty(lengths, max_length=20, cache_length=4)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]))
    with pytest.raises(ValueError):
        overlong_penalty([1], max_length=4, cache_length=5)


def test_kl_reward_shaping():
    sampling = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -3.0], [-2.0, -9.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # d = [[0.5, -1, 0], [1, ., .]], mean over valid = 0.5 / 4 = 0.125
    shaped = kl_reward_shaping(torch.tensor([1.0, -2.0]), sampling, ref, mask, coef=0.1)
    expected = torch.tensor([[1.0 + 0.1 * (0.125 - 0.5), 1.0 + 0.1 * 1.125, 1.0 + 0.1 * 0.125],
                             [-2.0 + 0.1 * (0.125 - 1.0), -2.0, -2.0]])
    torch.testing.assert_close(shaped, expected)
    # an explicit batch mean (e.g. over all micro-batches) is used as given
    shaped = kl_reward_shaping(torch.zeros(2, 3), sampling, ref, mask, coef=1.0, batch_mean=0.0)
    torch.testing.assert_close(shaped[0], torch.tensor([-0.5, 1.0, 0.0]))
    # the shaping is zero-mean over the batch's valid tokens
    shaped = kl_reward_shaping(torch.zeros(2), sampling, ref, mask, coef=0.3)
    assert shaped[mask.bool()].sum().item() == pytest.approx(0.0, abs=1e-6)


def test_kl_estimators_hand_values_and_unbiasedness():
    p, q = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # samples from P = 0.5 mass token, Q gives 0.25: log r = log(0.25/0.5) = -log 2
    assert kl_estimate(p, q, "k1").item() == pytest.approx(math.log(2))
    assert kl_estimate(p, q, "k2").item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert kl_estimate(p, q, "k3").item() == pytest.approx(0.5 - 1 + math.log(2))
    # exact expectation over a full categorical P equals KL(P || Q) for k1 and k3
    P = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    Q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)
    true_kl = (P * (P / Q).log()).sum()
    for kind in ("k1", "k3"):
        assert (P * kl_estimate(P.log(), Q.log(), kind)).sum().item() == pytest.approx(true_kl.item())
    assert (kl_estimate(P.log(), Q.log(), "k3") >= 0).all()
    with pytest.raises(ValueError):
        kl_estimate(p, q, "k4")
