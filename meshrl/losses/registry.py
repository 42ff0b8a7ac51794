"""The loss registry: every loss the learner can train on, by name.

The learner is algorithm-blind: `forward_backward(datums, loss_fn, loss_fn_config)` pads the
datums into micro-batches, wraps each in a :class:`ForwardPass` and calls the registered function
``fn(forward_pass, **loss_fn_config) -> LossOutput``; the function asks the pass for what it needs
(logits at the valid positions, logprobs of the target tokens, logprobs under the frozen reference
policy) and reads its own fields from ``forward_pass.inputs``. Adding a loss is one decorated
function in its own module (imported by ``meshrl.losses``, or by a module a run names in
`plugins`) plus its test. A loss declares its ``kind`` (what its datums look like, so what can use
it: `trainer.loss.name` takes a `policy_gradient` loss) and its parameters as a typed config
(``params``: a `Section` whose fields are the function's keyword arguments), which is how
`trainer.loss.params` is checked.

Every registered loss is sum-reduced: normalisation is folded into the datums by the caller (as
per-token weights in ``mask``, see :mod:`meshrl.losses.aggregation`), so micro-batching and data
parallelism never change the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol

import torch

from meshrl.config.base import Section
from meshrl.losses.base import LossOutput


class ForwardPass(Protocol):
    """One micro-batch as the learner's model sees it (computed lazily, at most once each)."""

    inputs: dict[str, torch.Tensor]
    """Padded loss inputs on the model's device: per-position fields [B, T, ...] (zero padding),
    per-sequence fields [B]."""

    valid: torch.Tensor
    """[B, T] bool: the positions the loss reads (its ``valid_key`` input is non-zero there)."""

    temperature: float
    """The sampling temperature the tokens were drawn at: `logprobs` and `reference_logprobs` are
    those of softmax(logits / temperature), the distribution the sampler's recorded logprobs are
    of (1 unless the caller says otherwise; `logits` are never scaled)."""

    def logits(self) -> torch.Tensor:
        """[N, V] logits at the N valid positions (row-major over batch, position), with grad."""

    def logprobs(self) -> torch.Tensor:
        """[B, T] log-probability of ``target_tokens`` at valid positions (0 elsewhere), with grad."""

    def reference_logprobs(self) -> torch.Tensor:
        """[B, T] the same under the frozen reference policy (the initial weights), no grad."""


LossFn = Callable[..., LossOutput]
LossKind = Literal["policy_gradient", "supervised", "distillation", "preference", "other"]
"""What a loss's datums carry: `policy_gradient` (per-token `advantages`, the sampler's `logprobs`
and `mask` weights: the datums the policy-gradient term builds), `supervised` (`weights`),
`distillation` (a teacher's top-k), `preference` (chosen/rejected pairs), `other`."""


class NoParams(Section):
    """A loss without parameters."""


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
    kind: LossKind
    """What its datums look like (see `LossKind`)."""
    params: type[Section]
    """Its parameters (the function's keyword arguments) as a typed config."""

    def config(self, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``params`` checked against the loss's typed parameters, defaults filled in, as the
        ``loss_fn_config`` a learner call takes; a ValueError names an unknown or bad one."""
        from pydantic import ValidationError

        from meshrl.config.base import format_validation_error

        try:
            return self.params.model_validate(params or {}).model_dump()
        except ValidationError as e:
            raise ValueError(format_validation_error(e, f"loss {self.name!r}")) from None


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, kind: LossKind = "other", params: type[Section] = NoParams,
                  valid_key: str = "mask", datums_per_item: int = 1,
                  metric_weight: Literal["tokens", "items"] = "tokens") -> Callable[[LossFn], LossFn]:
    """Decorator: make ``fn(forward_pass, **config) -> LossOutput`` available as ``name``, its
    keyword arguments described by ``params``."""

    def decorate(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is registered twice")
        LOSSES[name] = LossSpec(name, fn, valid_key, datums_per_item, metric_weight, kind, params)
        return fn

    return decorate


def get_loss(name: str) -> LossSpec:
    """The registered loss ``name``; a one-line error lists the known names."""
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss_fn {name!r}: expected one of {sorted(LOSSES)}") from None


def losses_of_kind(kind: LossKind) -> list[str]:
    """The names of the registered losses of ``kind``, sorted."""
    return sorted(name for name, spec in LOSSES.items() if spec.kind == kind)
