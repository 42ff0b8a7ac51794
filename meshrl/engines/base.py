"""The engine contract: token ids in, token ids and sampler logprobs out, weights reloadable."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Protocol

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


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


class Engine(Protocol):
    """What the Generator actor needs from an inference engine."""

    holds_weights: bool
    """Whether the engine holds the model it was built from (False while it has dummy weights)."""

    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        """For each prompt, `request.n` completions."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-probability of tokens 1..n-1 of each sequence given its prefix (temperature 1):
        n-1 values per sequence of n tokens, the i-th (from 0) being token i+1's."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the model weights in place (HF parameter names); no request runs meanwhile."""

    def close(self) -> None:
        """Release the engine."""


def cpu_share(replicas: int) -> int:
    """The cores of this process's host one of ``replicas`` engines on it may keep busy. More
    threads than cores makes the spinning OpenMP threads of different replicas take turns (2
    replicas x 2 threads on 2 cores generated ~10x slower than 1 replica)."""
    return max(1, len(os.sched_getaffinity(0)) // replicas)


def make_engine(model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                replicas: int = 1, module: torch.nn.Module | None = None, colocated: bool = False) -> Engine:
    """The engine selected by `generator.backend`, one of ``replicas`` on this host (their threads
    share its cores). Tensor parallelism is checked here, in the process that runs the engine (the
    controller's host may have no GPU). ``module``: a policy in this process whose parameters the HF
    engine samples with (shared storage); the vLLM engine keeps its own copy regardless, and when
    ``colocated`` with the learner on a GPU starts from dummy weights and sleeps between calls."""
    if cfg.tensor_parallel_size > 1 and (cfg.backend != "vllm" or not torch.cuda.is_available()):
        where = "the hf backend" if cfg.backend != "vllm" else "a host without CUDA"
        raise ValueError(f"generator.tensor_parallel_size = {cfg.tensor_parallel_size}: tensor parallelism needs the "
                         f"vllm backend on a CUDA host, not {where}")
    share = cpu_share(replicas)
    # the in-process vLLM engine computes on torch's threads (its own CPU thread binding applies to
    # its worker processes only); set before its worker turns torch.set_num_threads into a no-op
    torch.set_num_threads(share)
    if cfg.backend == "vllm":
        from meshrl.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, cfg, dtype, max_model_len, seed, colocated=colocated)
    from meshrl.engines.hf_engine import HFEngine

    return HFEngine(model_path, cfg.model_copy(update={"torch_threads": min(cfg.torch_threads, share)}), dtype,
                    max_model_len, seed, module=module)
