"""Sampling sessions: the backend's sampling clients behind the SDK's sampler ids.

A sampler is made from a base model name, from a `tinker://` sampler checkpoint, or from a training
model's current weights (`save_weights_for_sampler` with a sampling-session number). Its id is
`{session_id}:sample:{sampling_session_seq_id}`; creating the same one again (a retried request)
returns the first. It remembers the model name the client knows, which is what `samplers/{id}`
reports and what the SDK loads a tokenizer for.

`asample` answers at once with a request id and one sequence id per sample; the result is the
backend's `SampleResponse` as protobuf, with what the request asked besides the samples (prompt
logprobs, top-k prompt and sample logprobs, target prompt logprobs in the ids' own dense or sparse
layout, alternative draws). Backend calls run on a shared worker pool, never on the
event loop. A request with `record_stability_info` records its samples under their sequence ids
(`stability`) for `stable_reinforce` training in the same session.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

from tinker import types as sdk

from meshrl.api.errors import UserError
from meshrl.serve import wire
from meshrl.serve.catalogue import ModelCatalogue
from meshrl.serve.futures import FutureStore, ProtoResult, failure, run_on
from meshrl.serve.stability import StabilityRecords

@dataclass(frozen=True)
class Sampler:
    """A backend sampling client and what the SDK knows it by."""

    sampler_id: str
    session_id: str
    client: Any
    base_model: str
    model_path: str | None


class Samplers:
    """Every sampling session of the server, by id."""

    def __init__(self, service: Any, catalogue: ModelCatalogue, futures: FutureStore, pool: Executor,
                 timeout_s: float, max_tensor_elements: int):
        self._service = service
        self._catalogue = catalogue
        self._futures = futures
        self._pool = pool
        self._timeout_s = timeout_s
        self._max_tensor_elements = max_tensor_elements
        self._samplers: dict[str, Sampler] = {}
        self._creating: dict[str, asyncio.Future] = {}
        self.stability = StabilityRecords()
        """What the samplers recorded for `stable_reinforce` (requests with `record_stability_info`)."""

    async def create(self, session_id: str, seq_id: int, model_path: str | None, base_model: str | None,
                     known_base_model: str | None) -> str:
        """Create a sampler from a checkpoint path or a base model name (waiting for the backend
        up to the request timeout); its id. ``known_base_model`` names the checkpoint's model when
        this server saved it."""
        sampler_id = f"{session_id}:sample:{seq_id}"
        if sampler_id not in self._creating:
            self._creating[sampler_id] = asyncio.ensure_future(
                self._create(sampler_id, session_id, model_path, base_model, known_base_model))
        creating = self._creating[sampler_id]
        try:
            await asyncio.wait_for(asyncio.shield(creating), self._timeout_s)
        except asyncio.TimeoutError:  # still creating: a retry of this request waits for the same one
            raise TimeoutError(f"creating sampler {sampler_id} took longer than serve.request_timeout_s = "
                               f"{self._timeout_s:g} s") from None
        except Exception:
            del self._creating[sampler_id]  # failed: a retry tries again
            raise
        return sampler_id

    async def _create(self, sampler_id: str, session_id: str, model_path: str | None, base_model: str | None,
                      known_base_model: str | None) -> None:
        if model_path is None and base_model is None:
            raise UserError("create_sampling_session: needs model_path or base_model")
        served = None if base_model is None else self._catalogue.resolve(base_model)
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(
            self._pool, lambda: self._service.create_sampling_client(model_path=model_path, base_model=served))
        self.add(Sampler(sampler_id, session_id, client, base_model or known_base_model or client.base_model,
                         model_path))

    def add(self, sampler: Sampler) -> None:
        self._samplers[sampler.sampler_id] = sampler

    def get(self, sampler_id: str) -> Sampler:
        sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise UserError(f"unknown sampling_session_id {sampler_id!r}")
        return sampler

    def sample(self, request: sdk.SampleRequest, tenant: str | None,
               release: Callable[[], None]) -> tuple[str, list[str]]:
        """Start one sampling request of ``tenant`` (None: an open server's one tenant, which shares
        the generators with nobody; its sizes already checked: `limits.sample`); (request id, one
        sequence id per sample). A bad request fails through its future with a user error.
        ``release`` is called once the request is done with."""
        request_id = self._futures.create()
        sequence_ids = [f"{request_id}:{i}" for i in range(max(request.num_samples, 0))]
        try:
            sampler = self._check(request)
            prompt = wire.model_input(request.prompt, "prompt")
            params = wire.sampling_params(request.sampling_params)
            targets = wire.target_ids(request.target_prompt_logprobs, prompt.length, self._max_tensor_elements)
        except UserError as exc:
            release()
            self._futures.settle(request_id, failure(exc))
            return request_id, sequence_ids
        future: Future = run_on(self._pool, lambda: sampler.client.sample(
            prompt, request.num_samples, params, include_prompt_logprobs=bool(request.prompt_logprobs),
            topk_prompt_logprobs=request.topk_prompt_logprobs, topk_sample_logprobs=request.topk_sample_logprobs,
            target_prompt_logprobs=None if targets is None else targets.rows,
            prompt_alt_tokens_k=request.prompt_alt_tokens_k, owner=tenant))
        future.add_done_callback(lambda _: release())
        def encode(response: Any) -> ProtoResult:
            if len(response.sequences) != request.num_samples:  # the SDK pairs them with sequence_ids
                raise ValueError(f"the backend returned {len(response.sequences)} sequences for "
                                 f"num_samples = {request.num_samples}")
            if request.record_stability_info:
                self.stability.record(sampler.session_id, sequence_ids, prompt.to_ints(), response.sequences)
            return ProtoResult(wire.sample_response(response, request, targets))

        self._futures.track(request_id, future, encode)
        return request_id, sequence_ids

    def _check(self, request: sdk.SampleRequest) -> Sampler:
        if request.sampling_session_id is None:
            raise UserError("asample: sampling_session_id is missing (sample through a sampling session)")
        if request.prompt_logprobs_last_n is not None and not request.prompt_logprobs:
            raise UserError("asample: prompt_logprobs_last_n needs prompt_logprobs")
        return self.get(request.sampling_session_id)

    def ids_of(self, session_id: str) -> list[str]:
        """The ids of a session's open samplers."""
        return [s for s, sampler in self._samplers.items() if sampler.session_id == session_id]

    def close_session(self, session_id: str) -> None:
        """Forget a session's samplers and what they recorded."""
        for sampler_id in self.ids_of(session_id):
            del self._samplers[sampler_id]
            self._creating.pop(sampler_id, None)
        self.stability.close_session(session_id)
