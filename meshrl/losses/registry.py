"""The loss registry: every loss the learner can train on, by name.

The learner is algorithm-blind: `forward_backward(datums, loss_fn, loss_fn_config)` pads the
datums into micro-batches, wraps each in a :class:`ForwardPass` and calls the registered function
``fn(forward_pass, **loss_fn_config) -> LossOutput``; the function asks the pass for what it needs
(logits at the valid positions, logprobs of the target tokens, logprobs under the frozen reference
policy) and reads its own fields from ``forward_pass.inputs``. Adding a loss is one decorated
function in its own module (imported by ``meshrl.losses``) plus its test.

Every registered loss is sum-reduced: normalisation is folded into the datums by the caller (as
per-token weights in ``mask``, see :mod:`meshrl.losses.aggregation`), so micro-batching and data
parallelism never change the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Protocol

import torch

from meshrl.losses.base import LossOutput


class ForwardPass(Protocol):
    """One micro-batch as the learner's model sees it (computed lazily, at most once each)."""

    inputs: dict[str, torch.Tensor]
    """Padded loss inputs on the model's device: per-position fields [B, T, ...] (zero padding),
    per-sequence fields [B]."""

    valid: torch.Tensor
    """[B, T] bool: the positions the loss reads (its ``valid_key`` input is non-zero there)."""

    def logits(self) -> torch.Tensor:
        """[N, V] logits at the N valid positions (row-major over batch, position), with grad."""

    def logprobs(self) -> torch.Tensor:
        """[B, T] log-probability of ``target_tokens`` at valid positions (0 elsewhere), with grad."""

    def reference_logprobs(self) -> torch.Tensor:
        """[B, T] the same under the frozen reference policy (the initial weights), no grad."""


LossFn = Callable[..., LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """A registered loss and how the learner feeds it."""

    name: str
    fn: LossFn
    valid_key: str
    """The input whose non-zero entries mark the positions the loss reads."""
    datums_per_item: int
    """Consecutive datums that belong together (DPO: a chosen and a rejected answer) and are
    always put in the same micro-batch."""
    metric_weight: Literal["tokens", "items"]
    """How per-micro-batch metrics are averaged: by valid tokens, or by items."""


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, valid_key: str = "mask", datums_per_item: int = 1,
                  metric_weight: Literal["tokens", "items"] = "tokens") -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn(forward_pass, **config) -> LossOutput`` available as ``name``."""

    def decorate(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = LossSpec(name, fn, valid_key, datums_per_item, metric_weight)
        return fn

    return decorate


def get_loss(name: str) -> LossSpec:
    """The registered loss ``name``; a one-line error lists the known names."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss_fn {name!r}: expected one of {sorted(LOSSES)}") from None
