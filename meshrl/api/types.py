"""The API's request and response types, with Tinker's names and fields. Training data uses
`meshrl.types` (`Datum`, `ModelInput`, `EncodedTextChunk`, `AdamParams`), which already have
Tinker's shape."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshrl.types import AdamParams, Datum, EncodedTextChunk, ModelInput

__all__ = ["AdamParams", "Datum", "EncodedTextChunk", "ForwardBackwardOutput", "ModelInput", "PromptAltTokens",
           "SampleResponse", "SampledSequence", "SamplingParams", "SupportedModel", "TopkLogprobs"]


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


TopkLogprobs = list[list[tuple[int, float]] | None]
"""Per position, the most likely tokens as (token id, logprob), most likely first; None where
nothing was computed (a prompt's first token)."""


@dataclass
class SampledSequence:
    """One sample: its tokens, the sampler's logprob of each, and why it ended (`stop` on a stop
    token or EOS, `length` at max_tokens); with `topk_sample_logprobs`, the most likely tokens at
    each sampled position (logprobs of the distribution sampled from)."""

    stop_reason: str
    tokens: list[int]
    logprobs: list[float]
    topk_logprobs: TopkLogprobs | None = None


@dataclass
class PromptAltTokens:
    """`prompt_alt_tokens_k` draws at every prompt position after the first: [len(prompt) - 1, k]
    token ids (int64; row i holds alternatives to prompt token i + 1, drawn with replacement at the
    request's temperature) and their logprobs under the model (float32, temperature 1)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor


@dataclass
class SampleResponse:
    """The samples of one request, and what was asked of its prompt (temperature 1): per-token
    logprobs (entry i is the logprob of prompt token i given the tokens before it, None for the
    first), the top-k tokens at each position (None first), the logprobs of the asked target ids
    ([len(prompt) - 1, K] float32, 0.0 where the request had -1) and alternative draws."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: TopkLogprobs | None = None
    target_prompt_logprobs: torch.Tensor | None = None
    prompt_alt_tokens: PromptAltTokens | None = None


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
