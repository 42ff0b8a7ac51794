"""Tinker-shaped data types exchanged between the controller, the learner and the generator.

Alignment convention (used everywhere in meshrl): a training sequence ``tokens = [x_0 .. x_N]`` is
stored as ``model_input = [x_0 .. x_{N-1}]`` and per-position loss inputs of the same length N, where
position ``i`` of every loss input refers to the token the model predicts there, ``x_{i+1}``.  So
``loss_fn_inputs["target_tokens"][i] == x_{i+1}`` and the learner gathers ``logits[i, target[i]]``
with no further shift.  :meth:`Datum.from_sequence` is the one place that performs this shift for
per-token data; :func:`meshrl.logprobs.causal_shift` is its tensor counterpart for raw logits.

A loss input is either per position (first dimension ``model_input.length``; further dimensions
allowed, e.g. a teacher's top-k per position) or per sequence (a 0-dim tensor, e.g. one advantage
for the whole sequence). Conventional ``loss_fn_inputs`` keys (each registered loss in
:mod:`meshrl.losses` documents the ones it reads):
  - ``target_tokens`` (int64): the predicted token at each position (always present).
  - ``weights`` (float32): per-token weight for ``cross_entropy``; 0 on prompt tokens.
  - ``logprobs`` (float32): sampler log-probabilities of ``target_tokens`` (RL losses).
  - ``advantages`` (float32): per-sequence (0-dim) or per-token advantages (RL losses).
  - ``mask`` (float32): non-zero on trainable (assistant) tokens; its values are the per-token
    weights that carry the step's normaliser (1 / total tokens under token-mean).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class EncodedTextChunk:
    """A run of token ids (the only chunk kind meshrl uses; images are out of scope)."""

    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class ModelInput:
    """The token sequence fed to the model, as a list of chunks (Tinker's shape)."""

    chunks: tuple[EncodedTextChunk, ...] = ()

    @classmethod
    def from_ints(cls, tokens: Sequence[int]) -> "ModelInput":
        return cls((EncodedTextChunk(tuple(int(t) for t in tokens)),))

    def to_ints(self) -> list[int]:
        return [t for chunk in self.chunks for t in chunk.tokens]

    @property
    def length(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor(self.to_ints(), dtype=torch.long)


def _as_tensor(name: str, value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        tensor = torch.as_tensor(value)
    except Exception as exc:  # pragma: no cover - message path
        raise TypeError(f"loss_fn_inputs[{name!r}] is not convertible to a tensor: {exc}") from None
    if tensor.dtype == torch.float64:
        tensor = tensor.to(torch.float32)
    return tensor


@dataclass
class Datum:
    """One training example: the model input and per-position loss inputs aligned with it.

    Every per-position tensor in ``loss_fn_inputs`` has first dimension ``model_input.length`` (see
    the module docstring for the alignment: position i holds data about predicted token i+1 of the
    sequence); a 0-dim tensor is a per-sequence value.
    """

    model_input: ModelInput
    loss_fn_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.model_input.length
        converted = {}
        for name, value in self.loss_fn_inputs.items():
            tensor = _as_tensor(name, value)
            if tensor.dim() > 0 and tensor.shape[0] != n:
                raise ValueError(
                    f"loss_fn_inputs[{name!r}] has shape {tuple(tensor.shape)}, expected first dim "
                    f"{n} (= model_input.length) or a per-sequence scalar"
                )
            converted[name] = tensor
        self.loss_fn_inputs = converted

    @classmethod
    def from_sequence(cls, tokens: Sequence[int], per_sequence: dict[str, float] | None = None,
                      **per_token: Sequence[float] | torch.Tensor) -> "Datum":
        """Build a Datum from a full sequence and per-token arrays aligned with ``tokens``.

        ``per_token[k][j]`` describes sequence token ``j`` (e.g. ``weights[j] = 1`` if token j is an
        assistant token, ``logprobs[j]`` = sampler logprob of token j).  This is the single place where
        the causal shift happens: the model input drops the last token, every per-token array drops its
        first entry (token 0 is never predicted), and ``target_tokens = tokens[1:]``.
        ``per_sequence`` values become 0-dim float32 inputs.
        """
        if len(tokens) < 2:
            raise ValueError(f"a training sequence needs at least 2 tokens, got {len(tokens)}")
        inputs: dict[str, torch.Tensor] = {"target_tokens": torch.tensor(list(tokens[1:]), dtype=torch.long)}
        for name, values in per_token.items():
            tensor = _as_tensor(name, values if isinstance(values, torch.Tensor) else list(values))
            if tensor.shape[0] != len(tokens):
                raise ValueError(f"{name} has length {tensor.shape[0]}, expected {len(tokens)} (= len(tokens))")
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32)
            inputs[name] = tensor[1:]
        for name, value in (per_sequence or {}).items():
            inputs[name] = torch.tensor(float(value), dtype=torch.float32)
        return cls(ModelInput.from_ints(tokens[:-1]), inputs)

    @property
    def length(self) -> int:
        return self.model_input.length


@dataclass
class LossPart:
    """One loss's share of a shared `forward_backward` (several losses, one set of micro-batches):
    ``datums`` trained with the registered loss ``loss_fn`` and its ``loss_fn_config``, their
    log-probabilities taken at ``temperature``. ``scale`` multiplies the part's gradient (a
    normaliser known only when the part is handed over); the loss reported for it is unscaled."""

    datums: list[Datum]
    loss_fn: str
    loss_fn_config: dict = field(default_factory=dict)
    temperature: float = 1.0
    scale: float = 1.0


@dataclass(frozen=True)
class AdamParams:
    """Optimizer step parameters (Tinker's defaults; 0 disables weight decay and grad clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        if not self.learning_rate >= 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        for name in ("beta1", "beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.weight_decay < 0 or self.grad_clip_norm < 0:
            raise ValueError("weight_decay and grad_clip_norm must be >= 0")


@dataclass(frozen=True)
class DimuonParams:
    """Optimizer step parameters of Dimuon (Tinker's `DimuonParams`; meshrl.training.optimizers):
    the step size of a direction of Frobenius norm sqrt(rank), the momentum's EMA coefficient and
    the global gradient-norm clip (0 disables it)."""

    learning_rate: float
    beta1: float = 0.9
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.learning_rate) and self.learning_rate >= 0):
            raise ValueError(f"learning_rate must be a finite number >= 0, got {self.learning_rate}")
        if not 0.0 <= self.beta1 < 1.0:
            raise ValueError(f"beta1 must be in [0, 1), got {self.beta1}")
        if not (math.isfinite(self.grad_clip_norm) and self.grad_clip_norm >= 0):
            raise ValueError(f"grad_clip_norm must be a finite number >= 0, got {self.grad_clip_norm}")


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters.  ``stop`` holds strings or token ids; ``top_k=-1`` means disabled."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | tuple[int, ...] = ()
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if any(isinstance(s, str) for s in self.stop) and not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop must be all strings or all token ids, not a mix")


__all__ = [
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ModelInput",
    "SamplingParams",
]
