"""Trajectories (token-in/token-out records of what the policy sampled) and their conversion into
training Datums with group-relative advantages and the step's global normaliser."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from meshrl.advantages import group_centered_advantages
from meshrl.types import Datum


@dataclass
class Trajectory:
    """One sampled episode as tokens: the prompt, then everything after it.

    ``tokens`` holds the policy's own sampled tokens and, in multi-turn episodes, the environment's
    turns appended token-wise; ``mask`` is 1 exactly on tokens the policy sampled, ``logprobs`` the
    sampler's log-probability of each of those tokens (0 elsewhere).
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


def group_advantages(trajectories: list[Trajectory], std_normalize: bool) -> list[float]:
    """A_i = r_i - mean(r over i's group) (optionally / std), in trajectory order."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        groups.setdefault(t.group, []).append(i)
    out = [0.0] * len(trajectories)
    for members in groups.values():
        rewards = torch.tensor([trajectories[i].reward for i in members], dtype=torch.float64)
        adv = group_centered_advantages(rewards, normalize_std=std_normalize)
        for i, a in zip(members, adv.tolist()):
            out[i] = a
    return out


def uniform_groups(trajectories: list[Trajectory]) -> set[int]:
    """Groups whose rewards are all equal (no learning signal under group-relative advantages)."""
    by_group: dict[int, set[float]] = {}
    for t in trajectories:
        by_group.setdefault(t.group, set()).add(t.reward)
    return {g for g, rewards in by_group.items() if len(rewards) == 1}


def build_datums(
    trajectories: list[Trajectory],
    advantages: list[float],
    normalize: Literal["token_mean", "sequence_mean", "sum"],
    skip_zero_advantage: bool = True,
) -> tuple[list[Datum], dict]:
    """Datums for the learner's sum-reduced loss, with normalisation folded into the advantages.

    ``token_mean`` scales every advantage by 1 / (sampled tokens of ALL trajectories of the step), so
    micro-batching and skipping cannot change the gradient; ``sequence_mean`` by
    1 / (|o_i| * number of trajectories). Trajectories with zero advantage contribute exactly zero
    gradient and are left out when ``skip_zero_advantage`` (their tokens still count in the normaliser).
    """
    trainable = [t for t in trajectories if t.sampled_tokens > 0]
    total_tokens = sum(t.sampled_tokens for t in trainable)
    datums: list[Datum] = []
    skipped_zero = 0
    for t, adv in zip(trajectories, advantages):
        if t.sampled_tokens == 0:
            continue
        if skip_zero_advantage and adv == 0.0:
            skipped_zero += 1
            continue
        if normalize == "token_mean":
            scale = 1.0 / total_tokens
        elif normalize == "sequence_mean":
            scale = 1.0 / (t.sampled_tokens * len(trainable))
        else:
            scale = 1.0
        n_prompt = len(t.prompt_tokens)
        datums.append(
            Datum.from_sequence(
                t.prompt_tokens + t.tokens,
                mask=[0] * n_prompt + list(t.mask),
                logprobs=[0.0] * n_prompt + list(t.logprobs),
                advantages=[0.0] * n_prompt + [adv * scale * m for m in t.mask],
            )
        )
    stats = {
        "datums": len(datums),
        "trainable_trajectories": len(trainable),
        "skipped_zero_advantage": skipped_zero,
        "tokens_total": total_tokens,
    }
    return datums, stats
