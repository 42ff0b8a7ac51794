"""The engine contract: token ids in, token ids and sampler logprobs out, weights reloadable."""

from __future__ import annotations

import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import ContextManager, Iterable, Protocol

import torch

from meshrl.config.generation import GeneratorConfig


@dataclass(frozen=True)
class SampleRequest:
    """Sampling parameters for one batch of prompts."""

    n: int = 1
    """Samples per prompt."""
    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-request seed (each prompt p gets seed + p) for reproducible sampling; None = engine RNG."""
    topk: int = 0
    """Also return the ``topk`` most likely tokens at each sampled position, with their logprobs
    under the distribution sampled from (0 = none)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class PromptScoring:
    """What a sample request also wants to know of its prompt, under the model at temperature 1,
    at every position i = 1..len(prompt)-1 (position 0 has no context)."""

    logprobs: bool = False
    """The logprob of each prompt token."""
    topk: int = 0
    """The ``topk`` most likely tokens at each position, with their logprobs."""
    targets: tuple[tuple[int, ...], ...] | None = None
    """``len(prompt) - 1`` rows of token ids whose logprobs to return (row i at position i + 1;
    -1 = nothing asked in that cell)."""
    alt_k: int = 0
    """Draws from the next-token distribution at each position, at ``alt_temperature``."""
    alt_temperature: float = 1.0
    alt_seed: int | None = None
    """Seed of the draws (None = fresh randomness)."""

    @property
    def needs_full_vocabulary(self) -> bool:
        """Whether the whole next-token distribution is needed (targets, draws), not just a top-k."""
        return self.targets is not None or self.alt_k > 0

    @property
    def wanted(self) -> bool:
        return self.logprobs or self.topk > 0 or self.needs_full_vocabulary


TopK = tuple[list[list[int]], list[list[float]]]
"""Token ids and their logprobs, one row of k per position, most likely first."""


@dataclass
class PromptScores:
    """The answers to a `PromptScoring`, one row per prompt position 1..len(prompt)-1."""

    logprobs: list[float] | None = None
    topk: TopK | None = None
    targets: list[list[float]] | None = None
    """Logprob of each cell of `PromptScoring.targets`, 0.0 where it asked nothing (-1)."""
    alt: TopK | None = None
    """`PromptScoring.alt_k` drawn token ids and their logprobs (temperature 1) per position."""


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    tokens: list[int]
    """Generated token ids, including the stop token when the model stopped on one."""
    logprobs: list[float]
    """Log-probability of each generated token under the distribution it was sampled from."""
    finish_reason: str
    """`stop` (stop token or EOS) or `length` (hit max_tokens)."""
    text: str = ""
    """Decoded text of `tokens` (for verifiers and logs only; never re-tokenised for training)."""
    meta: dict = field(default_factory=dict)
    topk: TopK | None = None
    """With `SampleRequest.topk`: the most likely tokens at each sampled position."""


@dataclass
class Sampled:
    """One prompt's answer to `Engine.submit`: its completions, and the prompt's scores when asked."""

    completions: list[Completion]
    prompt: PromptScores | None = None


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter on local disk (a PEFT adapter directory) that an engine applies per request
    (`generator.lora_slots`)."""

    id: int
    """Unique per adapter in the engine's life (vLLM's `lora_int_id`, > 0)."""
    path: Path
    rank: int
    modules: frozenset[str]
    """The kinds of module it adapts (`q_proj`, ...)."""


class Engine(Protocol):
    """What the Generator actor needs from an inference engine."""

    holds_weights: bool
    """Whether the engine holds the model it was built from (False while it has dummy weights)."""

    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        """For each prompt, `request.n` completions."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of tokens 1..n-1 of each sequence given its prefix (temperature 1):
        n-1 values per sequence of n tokens, the i-th (from 0) being token i+1's."""

    def submit(self, prompt: list[int], request: SampleRequest, scoring: PromptScoring,
               adapter: Adapter | None = None) -> Future:
        """Start sampling ``request.n`` completions of one prompt (and scoring it as ``scoring``
        asks), with ``adapter`` applied if given (vLLM with `generator.lora_slots` only); a future
        of a `Sampled`. The vLLM engine admits it at its next step, beside the requests already
        running (continuous batching); the HF engine runs it before returning."""

    def paused(self) -> ContextManager[None]:
        """Within it no request runs: requests running on entry finish first (under the weights
        they started with), requests submitted meanwhile wait and start after it. Weight updates
        run inside it, so a request never sees weights change under it."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model weights in place (HF parameter names); no request runs meanwhile
        (it pauses the engine itself; the caller may hold `paused` around several loads)."""

    def close(self) -> None:
        """Release the engine."""


def cpu_share(replicas: int) -> int:
    """The cores of this process's host one of ``replicas`` engines on it may keep busy. More
    threads than cores makes the spinning OpenMP threads of different replicas take turns (2
    replicas x 2 threads on 2 cores generated ~10x slower than 1 replica)."""
    return max(1, len(os.sched_getaffinity(0)) // replicas)


def make_engine(model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                replicas: int = 1, module: torch.nn.Module | None = None, colocated: bool = False,
                lora_modules: Iterable[str] = ()) -> Engine:
    """The engine selected by `generator.backend`, one of ``replicas`` on this host (their threads
    share its cores). Tensor parallelism (vLLM's worker processes, on CUDA or CPU hosts) needs the
    vllm backend. ``module``: a policy in this process whose parameters the HF
    engine samples with (shared storage); the vLLM engine keeps its own copy regardless, and when
    ``colocated`` with the learner on a GPU starts from dummy weights and sleeps between calls.
    ``lora_modules``: with `generator.lora_slots`, the kinds of module adapters adapt."""
    if cfg.tensor_parallel_size > 1 and cfg.backend != "vllm":
        raise ValueError(f"generator.tensor_parallel_size = {cfg.tensor_parallel_size}: tensor parallelism needs the "
                         f"vllm backend, not {cfg.backend}")
    share = cpu_share(replicas)
    # the in-process vLLM engine computes on torch's threads (its own CPU thread binding applies to
    # its worker processes only); set before its worker turns torch.set_num_threads into a no-op
    torch.set_num_threads(share)
    if cfg.backend == "vllm":
        from meshrl.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, dtype, max_model_len, seed, colocated=colocated, lora_modules=lora_modules)
    from meshrl.engines.hf_engine import HFEngine

    return HFEngine(model_path, cfg.model_copy(update={"torch_threads": min(cfg.torch_threads, share)}), dtype,
                    max_model_len, seed, module=module)
