"""Which scored error sites a step trains, and how many: the sites where the hinted teacher and
the student disagree most, within a per-step budget that follows the channel's measured cost."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from meshrl.sdpo.sites import ErrorSite


@dataclass(frozen=True)
class ScoredSite:
    """An error site with the hinted teacher's top-k at its tokens."""

    site: ErrorSite
    indices: torch.Tensor | None
    """[length, k] token ids (None: ``logprobs`` covers the full vocabulary)."""
    logprobs: torch.Tensor
    """[length, k] (or [length, V]) log-probabilities."""
    disagreement: float
    """See `disagreement`."""


def disagreement(sampler_logprobs: Sequence[float], teacher_logprobs: torch.Tensor) -> float:
    """Mean over a site's tokens of the student's log-probability of each (the sampler's) minus the
    hinted teacher's: the tokens were sampled from the student, so this estimates
    KL(student || teacher) at the site, in nats a token. Large where the hint makes the teacher
    reject what the student wrote; about 0 where the hint changes nothing."""
    student = torch.as_tensor(list(sampler_logprobs), dtype=torch.float32)
    if student.numel() == 0 or student.shape != teacher_logprobs.shape:
        raise ValueError(f"disagreement: {student.numel()} sampler log-probs for {teacher_logprobs.numel()} teacher ones")
    return float((student - teacher_logprobs.float()).mean())


def most_informative(scored: list[ScoredSite], n: int) -> tuple[list[ScoredSite], list[ScoredSite]]:
    """The ``n`` sites of largest `disagreement` (ties: the earlier found) in the order they were
    found, and the others."""
    ranked = sorted(range(len(scored)), key=lambda i: (-scored[i].disagreement, i))
    keep = set(ranked[: max(n, 0)])
    return [s for i, s in enumerate(scored) if i in keep], [s for i, s in enumerate(scored) if i not in keep]


def next_budget(cost_share: float, step_s: float, channel_s: float, sites: int, most: int) -> int:
    """Sites the next step may train so that the channel's seconds are about ``cost_share`` times
    the rest of the step's: a step of ``step_s`` seconds trained ``sites`` sites, which cost
    ``channel_s`` of them; between 1 and ``most``."""
    if sites < 1 or channel_s <= 0:
        raise ValueError(f"next_budget needs a step that trained sites at a cost, got {sites} sites, {channel_s} s")
    per_site = channel_s / sites
    rest = max(step_s - channel_s, 0.0)
    return max(1, min(most, math.floor(cost_share * rest / per_site)))


def candidates(budget: int, per_site: float) -> int:
    """The sites the teacher scores for a budget of ``budget`` trained ones: ``per_site`` of each."""
    return math.ceil(budget * per_site)
