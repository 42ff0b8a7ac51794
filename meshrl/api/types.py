"""Values exchanged with a Tinker-style training and sampling backend (`meshrl.api`).

Plain dataclasses: the HTTP server (`meshrl.serve`) builds `SamplingParams` from requests and reads
the other types from the backend's futures. Training data itself uses `meshrl.types` (`Datum`,
`ModelInput`, `AdamParams`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Generation parameters of one sampling request. ``max_tokens`` None lets the backend stop at
    the context length; ``stop`` None keeps the implicit end-of-sequence stop, ``[]`` disables it;
    ``top_k`` -1 disables top-k."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[int] | list[str] | None = None


@dataclass(frozen=True)
class SampledSequence:
    """One generated continuation: its tokens, their log-probabilities and why it ended."""

    stop_reason: Literal["stop", "length"]
    tokens: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class SampleResponse:
    """The sequences of one sampling request and, when asked for, the prompt's log-probabilities
    (one per prompt token; None for the first, which has no context)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per-datum loss outputs (e.g. ``logprobs``) and metrics keyed ``name:reduction``
    (``loss:sum``), so chunked results can be combined."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SupportedModel:
    """A model the backend serves, by the name clients use for it."""

    model_name: str
    max_context_length: int
