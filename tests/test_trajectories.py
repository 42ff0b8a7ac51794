"""Trajectories -> shaped rewards -> advantages -> Datums, against hand-computed values."""

import pytest
import torch

from meshrl.losses.aggregation import GlobalCounts, global_scale

from meshrl.training.trajectories import (Trajectory, group_advantages, kl_shape_datums, rl_datums, shape_overlong,
                                          uniform_groups)


def _traj(group, reward, sampled, env=0, prompt=3, turns=None):
    tokens = list(range(100, 100 + sampled + env))
    mask = [1] * sampled + [0] * env
    info = {"turns": turns} if turns else {}
    return Trajectory(f"t{group}-{reward}", group, None, list(range(prompt)), tokens, [-1.0] * len(tokens), mask,
                      0, reward=reward, info=info)


def test_overlong_penalty_per_sampled_turn_of_multi_turn_episodes():
    # Lmax 8, window 4: free to 4 tokens, -(L - 4) / 4 up to 8, -1 beyond
    single = _traj(0, 1.0, sampled=6)
    # two policy turns of 7 and 3 sampled tokens, 5 environment tokens between them (not counted)
    tokens_mask = [1] * 7 + [0] * 5 + [1] * 3
    multi = Trajectory("m", 0, None, [0, 1], list(range(15)), [-1.0] * 15, tokens_mask, 0, reward=1.0,
                       info={"turns": [(None, "a", 0, 7), (None, "b", 12, 15)]})
    short = _traj(1, 0.0, sampled=4)
    assert shape_overlong([single, multi, short], max_tokens=8, cache_tokens=4) == 2
    assert single.reward == pytest.approx(1.0 - 0.5)
    assert multi.reward == pytest.approx(1.0 - 0.75) and multi.turn_lengths() == [7, 3]
    assert short.reward == 0.0 and short.info["overlong_penalty"] == 0.0


def test_advantages_and_uniform_groups():
    ts = [_traj(0, 1.0, 2), _traj(0, 0.0, 2), _traj(1, 0.5, 2), _traj(1, 0.5, 3)]
    assert group_advantages(ts, std_normalize=False) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert uniform_groups(ts) == {1}


@pytest.mark.parametrize("normalize, local, scale", [
    ("token_mean", [1.0, 1.0], 1 / 10),  # 10 sampled tokens in the step, zero-advantage ones included
    ("sequence_mean", [1 / 2, 1 / 4], 1 / 3),  # 1 / |o_i|, and 1 / (3 trajectories with tokens)
    ("sum", [1.0, 1.0], 1.0),
])
def test_datum_weights_and_the_step_wide_normaliser(normalize, local, scale):
    ts = [_traj(0, 1.0, 2), _traj(0, 0.0, 4), _traj(1, 0.5, 4), _traj(1, 0.5, 0)]
    advantages = group_advantages(ts, False)
    datums, stats = rl_datums(ts, advantages, normalize)
    assert stats == {"datums": 2, "trainable_trajectories": 3, "skipped_zero_advantage": 1, "tokens_total": 10}
    counts = GlobalCounts(stats["tokens_total"], stats["trainable_trajectories"])
    assert global_scale(normalize, counts) == pytest.approx(scale)
    for d, weight, adv in zip(datums, local, [0.5, -0.5]):
        w = d.loss_fn_inputs["mask"]
        assert w[w != 0].tolist() == pytest.approx([weight] * int((w != 0).sum()))
        assert float(d.loss_fn_inputs["advantages"]) == adv
        assert d.loss_fn_inputs["logprobs"][w != 0].tolist() == [-1.0] * int((w != 0).sum())
        assert d.length == 3 + int((w != 0).sum()) - 1  # prompt + reply, shifted by one


def test_kl_shaping_hand_values():
    ts = [_traj(0, 1.0, 2), _traj(0, 0.0, 2)]
    datums, _ = rl_datums(ts, group_advantages(ts, False), "sum", skip_zero_advantage=False)
    # sampler logprob -1 everywhere; reference -1.5 and -0.5 on the two sampled tokens of each
    reference = [[0.0, 0.0, -1.5, -0.5], [0.0, 0.0, -1.5, -0.5]]
    stats = kl_shape_datums(datums, reference, coef=0.2)
    # d = q - p_ref = +0.5, -0.5 -> mean 0 -> A_t = A + 0.2 * (0 - d_t)
    assert stats["kl/sampler_reference_k1"] == pytest.approx(0.0)
    assert datums[0].loss_fn_inputs["advantages"][2:].tolist() == pytest.approx([0.5 - 0.1, 0.5 + 0.1])
    assert datums[1].loss_fn_inputs["advantages"][2:].tolist() == pytest.approx([-0.5 - 0.1, -0.5 + 0.1])
    assert datums[0].loss_fn_inputs["advantages"].shape == torch.Size([4])
