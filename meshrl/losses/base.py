"""Shared pieces of the loss functions: the return type and masking/broadcasting helpers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LossOutput:
    """A scalar loss (differentiable) and plain-float metrics for logging."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
    signal: torch.Tensor | None = None
    """The positions that carry a training signal ([B, T] bool, like the loss's logprobs), when
    the loss reads positions that do not (a policy-gradient token with advantage 0): the learner
    averages its per-token diagnostics (entropy) over them and weighs the metrics by their count.
    None: every position the loss reads."""


def as_weights(mask: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float weights, bool valid) of shape ``like.shape`` from an optional mask.

    ``mask`` may be bool or float; float masks act as per-token weights (this is how the aggregation
    helpers inject a global normaliser).  ``valid`` is ``mask != 0`` and decides which tokens count in
    the metrics.  ``None`` means every position is valid with weight 1.
    """
    if mask is None:
        return torch.ones_like(like), torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if mask.shape != like.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(like.shape)}")
    mask = mask.detach()
    return mask.to(like.dtype), mask != 0


def broadcast_advantages(advantages: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """Advantages as a constant [B, T] tensor: accepts a scalar, [B] (sequence-constant) or [B, T]."""
    adv = torch.as_tensor(advantages, dtype=like.dtype, device=like.device).detach()
    if adv.dim() == 1 and like.dim() == 2 and adv.shape[0] == like.shape[0]:
        adv = adv[:, None]
    if adv.dim() > like.dim() or torch.broadcast_shapes(adv.shape, like.shape) != like.shape:
        raise ValueError(f"advantages of shape {tuple(adv.shape)} do not broadcast to {tuple(like.shape)}")
    return adv.expand_as(like)


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> float:
    """Mean of ``values`` over ``valid`` positions as a Python float (0.0 when nothing is valid)."""
    count = int(valid.sum())
    if count == 0:
        return 0.0
    return float(values.detach()[valid].double().sum() / count)


def masked_max(values: torch.Tensor, valid: torch.Tensor) -> float:
    if not bool(valid.any()):
        return 0.0
    return float(values.detach()[valid].max())
