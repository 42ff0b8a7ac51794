"""Credit assignment for GRPO/DAPO-style RL: advantages, reward shaping and KL estimators.

  group-centred advantage      A_i = r_i - mean_group(r)                 (default: no std, no length
                                                                          normalisation, as Tinker)
  with normalize_std=True      A_i = (r_i - mean_group(r)) / (std_group(r) + eps)   (unbiased std)
  DAPO overlong shaping        R_len(L) = 0                               if L <= Lmax - Lcache
                                        = ((Lmax - Lcache) - L) / Lcache  if Lmax - Lcache < L <= Lmax
                                        = -1                              if L > Lmax
  KL-as-reward shaping         d_t = log q_t - log p_ref_t,  A_t <- A_t + c (mean_batch(d) - d_t)
  KL estimators of KL(P || Q) on tokens x ~ P, with log r = log Q(x) - log P(x):
                               k1 = -log r,   k2 = (log r)^2 / 2,   k3 = (r - 1) - log r
"""

from __future__ import annotations

from typing import Sequence

import torch


def group_centered_advantages(
    rewards: torch.Tensor | Sequence[Sequence[float]],
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | list[torch.Tensor]:
    """A_i = r_i - mean(group); optionally divided by (std(group) + eps).

    ``rewards``: a tensor [..., G] (groups along the last dim) or a list of ragged groups (returns
    a list of tensors).  A group of size 1 has advantage 0.  Computed in float64, returned float32.
    """
    if not isinstance(rewards, torch.Tensor):
        return [group_centered_advantages(torch.as_tensor(g, dtype=torch.float64), normalize_std, eps) for g in rewards]
    r = rewards.to(torch.float64)
    if r.dim() == 0 or r.shape[-1] == 0:
        raise ValueError("rewards need a non-empty group dimension (the last one)")
    centred = r - r.mean(dim=-1, keepdim=True)
    if normalize_std:
        if r.shape[-1] > 1:
            centred = centred / (r.std(dim=-1, keepdim=True, unbiased=True) + eps)
        else:
            centred = torch.zeros_like(centred)
    return centred.to(torch.float32)


def overlong_penalty(lengths: torch.Tensor | Sequence[int], max_length: int, cache_length: int) -> torch.Tensor:
    """DAPO soft overlong punishment R_len(L) (see module docstring), float32, to add to task rewards."""
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    length = torch.as_tensor(lengths, dtype=torch.float64)
    soft_start = max_length - cache_length
    inside = (soft_start - length) / cache_length
    penalty = torch.where(length <= soft_start, torch.zeros_like(length), inside)
    penalty = torch.where(length > max_length, torch.full_like(length, -1.0), penalty)
    return penalty.to(torch.float32)


def kl_reward_shaping(
    advantages: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    batch_mean: float | None = None,
) -> torch.Tensor:
    """A_t + coef (mean_batch(d) - d_t) with d_t = log q_t - log p_ref_t, on valid tokens.

    ``advantages`` [B] or [B, T]; returns [B, T].  ``batch_mean`` lets micro-batches share the mean of
    d over the whole batch (default: the mean over this call's valid tokens).  Entries with
    mask == 0 keep their (broadcast) advantage.
    """
    if sampling_logprobs.shape != ref_logprobs.shape or mask.shape != sampling_logprobs.shape:
        raise ValueError("sampling_logprobs, ref_logprobs and mask must have the same [B, T] shape")
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand(sampling_logprobs.shape).to(torch.float32)
    valid = mask != 0
    d = (sampling_logprobs.double() - ref_logprobs.double())
    if batch_mean is None:
        count = int(valid.sum())
        batch_mean = float(d[valid].sum() / count) if count else 0.0
    shaped = adv.double() + coef * (batch_mean - d)
    return torch.where(valid, shaped, adv.double()).to(torch.float32)


def kl_from_log_ratio(log_r: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(P || Q) from log r = log Q(x) - log P(x) on tokens x ~ P."""
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r.square()
    if kind == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def kl_estimate(logp_sampled: torch.Tensor, logp_other: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(P || Q) for tokens sampled from P (k1, k2 or k3; see module docstring)."""
    return kl_from_log_ratio(logp_other - logp_sampled, kind)


__all__ = [
    "group_centered_advantages",
    "kl_estimate",
    "kl_from_log_ratio",
    "kl_reward_shaping",
    "overlong_penalty",
]
