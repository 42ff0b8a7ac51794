"""The API's request and response types, with Tinker's names and fields. Training data uses
`meshrl.types` (`Datum`, `ModelInput`, `EncodedTextChunk`, `AdamParams`), which already have
Tinker's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.types import AdamParams, Datum, EncodedTextChunk, ModelInput

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "SampleResponse",
           "SampledSequence", "SamplingParams", "SupportedModel"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: at most ``max_tokens`` new tokens (None = up to the context length) at
    ``temperature`` (0 = greedy), nucleus ``top_p``, ``top_k`` (-1 = off), ``seed`` (None = the
    engine's RNG), stopping at end-of-sequence and at any of the ``stop`` token ids (or
    single-token strings)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[int, ...] | tuple[str, ...] | list | None = None

    def key(self) -> tuple:
        """The parameters as a hashable tuple (requests with equal keys are sampled together)."""
        return (self.max_tokens, self.temperature, self.top_p, self.top_k, self.seed, tuple(self.stop or ()))


@dataclass
class SampledSequence:
    """One sample: its tokens, the sampler's logprob of each, and why it ended (`stop` on a stop
    token or EOS, `length` at max_tokens)."""

    stop_reason: str
    tokens: list[int]
    logprobs: list[float]


@dataclass
class SampleResponse:
    """The samples of one request, and (when asked) the prompt's per-token logprobs: entry i is
    the logprob of prompt token i given the tokens before it, None for the first."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None


@dataclass
class ForwardBackwardOutput:
    """Per datum, the loss function's outputs (``logprobs``: the target tokens' logprobs under the
    weights the pass ran with); metrics keyed ``name:reduction`` (``loss:sum``, ...)."""

    loss_fn_outputs: list[dict[str, torch.Tensor]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class SupportedModel:
    """A model the service trains and samples, by the name clients ask for."""

    model_name: str
    max_context_length: int | None = None
