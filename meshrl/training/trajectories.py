"""Trajectories (token-in/token-out records of what the policy sampled) and everything that turns
them into the learner's Datums, each done once, in this order:

  reward shaping      DAPO overlong penalty per sampled turn (every task, one implementation)
  advantages          group-relative, one value per trajectory
  datums              one per trajectory with signal: tokens, sampler logprobs, the per-sequence
                      advantage and the sequence-local token weights (the step-wide normaliser is
                      applied once the whole step is in: losses.global_scale)
  KL shaping          optional: per-token advantages A_t + c (mean(d) - d_t), d = log q - log p_ref
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from meshrl.advantages import group_centered_advantages, kl_estimate, kl_reward_shaping, overlong_penalty
from meshrl.losses.aggregation import GlobalCounts, local_weights
from meshrl.types import Datum

Normalize = Literal["token_mean", "sequence_mean", "sum"]


@dataclass
class Trajectory:
    """One sampled episode as tokens: the prompt, then everything after it.

    ``tokens`` holds the policy's own sampled tokens and, in multi-turn episodes, the environment's
    turns appended token-wise; ``mask`` is 1 exactly on tokens the policy sampled, ``logprobs`` the
    sampler's log-probability of each of those tokens (0 elsewhere). ``info["turns"]`` (multi-turn)
    lists (context, action text, start, end) per policy turn, spans into ``tokens``.
    """

    id: str
    group: int
    problem: Any
    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    mask: list[int]
    version: int
    response_text: str = ""
    finish_reason: str = ""
    reward: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def sampled_tokens(self) -> int:
        return int(sum(self.mask))

    def turn_lengths(self) -> list[int]:
        """Sampled tokens of each policy turn (one turn for a single-turn trajectory)."""
        turns = self.info.get("turns")
        if not turns:
            return [self.sampled_tokens]
        return [int(sum(self.mask[start:end])) for _, _, start, end in turns]


def groups_of(trajectories: list[Trajectory]) -> dict[int, list[int]]:
    """Indices of the trajectories of each group, in order."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group, []).append(i)
    return groups


def uniform_groups(trajectories: list[Trajectory]) -> set[int]:
    """Groups whose rewards are all equal (no learning signal under group-relative advantages)."""
    return {g for g, members in groups_of(trajectories).items()
            if len({trajectories[i].reward for i in members}) == 1}


def shape_overlong(trajectories: list[Trajectory], max_tokens: int, cache_tokens: int) -> int:
    """DAPO soft overlong punishment added to each trajectory's reward: R_len summed over its
    turns (each turn may sample up to ``max_tokens``); recorded as ``info["overlong_penalty"]``.
    Returns how many trajectories were penalised."""
    penalised = 0
    for t in trajectories:
        penalty = float(overlong_penalty(t.turn_lengths(), max_tokens, cache_tokens).sum())
        t.info["overlong_penalty"] = penalty
        if penalty:
            t.reward += penalty
            penalised += 1
    return penalised


def group_advantages(trajectories: list[Trajectory], std_normalize: bool) -> list[float]:
    """A_i = r_i - mean(r over i's group) (optionally / std), in trajectory order."""
    out = [0.0] * len(trajectories)
    for members in groups_of(trajectories).values():
        rewards = torch.tensor([trajectories[i].reward for i in members], dtype=torch.float64)
        for i, a in zip(members, group_centered_advantages(rewards, normalize_std=std_normalize).tolist()):
            out[i] = a
    return out


def rl_datums(trajectories: list[Trajectory], advantages: list[float], normalize: Normalize,
              skip_zero_advantage: bool = True) -> tuple[list[Datum], dict]:
    """One Datum per trajectory for the policy-gradient losses.

    Each carries its tokens, the sampler's logprobs, its advantage as one per-sequence value, and
    ``mask`` = the sequence-local part of the token weights of ``normalize`` (1, or 1 / |o_i| for
    sequence_mean). The step-wide factor (1 / all sampled tokens, 1 / trajectories) is
    ``losses.global_scale(normalize, counts)`` over the counts of the whole step (``stats``:
    `tokens_total`, `trainable_trajectories`); the caller applies it once every piece of the step is
    in, so micro-batching, streaming and skipping cannot change the gradient. Trajectories with zero
    advantage give exactly zero gradient and are left out when ``skip_zero_advantage`` (their
    tokens still count).
    """
    trainable = [(t, a) for t, a in zip(trajectories, advantages) if t.sampled_tokens > 0]
    masks = [torch.tensor([0] * len(t.prompt_tokens) + list(t.mask), dtype=torch.float32)[None] for t, _ in trainable]
    counts = GlobalCounts.from_masks(masks)
    datums, skipped_zero = [], 0
    for (t, adv), mask in zip(trainable, masks):
        if skip_zero_advantage and adv == 0.0:
            skipped_zero += 1
            continue
        datums.append(Datum.from_sequence(
            t.prompt_tokens + t.tokens, per_sequence={"advantages": adv}, mask=local_weights(mask, normalize)[0],
            logprobs=[0.0] * len(t.prompt_tokens) + list(t.logprobs),
        ))
    stats = {"datums": len(datums), "trainable_trajectories": counts.num_sequences, "skipped_zero_advantage": skipped_zero,
             "tokens_total": int(counts.num_tokens)}
    return datums, stats


def kl_shape_datums(datums: list[Datum], reference_logprobs: list[list[float]], coef: float) -> dict:
    """KL-as-reward shaping against the frozen reference policy (pre-advantage, never a loss term):
    each datum's advantage becomes per token A_t + coef (mean_batch(d) - d_t) with
    d_t = log q_t - log p_ref_t on its sampled tokens. Returns the batch's mean d (a k1 estimate of
    KL(sampler || reference))."""
    pad = lambda rows: torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # noqa: E731
    sampled = pad([d.loss_fn_inputs["logprobs"] for d in datums])
    reference = pad([torch.tensor(r, dtype=torch.float32) for r in reference_logprobs])
    mask = pad([d.loss_fn_inputs["mask"] for d in datums]) != 0
    advantages = torch.stack([d.loss_fn_inputs["advantages"] for d in datums])
    count = int(mask.sum())
    mean_d = float(kl_estimate(sampled.double(), reference.double(), "k1")[mask].sum() / count) if count else 0.0
    shaped = kl_reward_shaping(advantages, sampled, reference, mask, coef, batch_mean=mean_d)
    for i, d in enumerate(datums):
        d.loss_fn_inputs["advantages"] = shaped[i, : d.length].clone()
    return {"kl/sampler_reference_k1": mean_d}
