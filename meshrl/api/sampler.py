"""Sampling requests, batched: requests that sample the same weight version with the same
parameters go to the generator replicas as one batch (each prompt with its own seed offset), the
way an RL loop's many concurrent `sample` calls are served efficiently."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from meshrl.api.errors import UserError
from meshrl.api.types import SampledSequence, SampleResponse, SamplingParams
from meshrl.engines import SampleRequest

MAX_BATCH = 64
"""Most prompts sent in one generate call."""


@dataclass
class _Request:
    version: int
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        return self.version, self.num_samples, self.params.key()

    def max_tokens(self, context: int) -> int:
        """``params.max_tokens``, or what the context leaves after the prompt when None."""
        return self.params.max_tokens if self.params.max_tokens is not None else context - len(self.prompt)


class Sampler:
    """One worker thread draining a queue of sampling requests into batched generate calls."""

    def __init__(self, backend):
        self.backend = backend
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="api-sampler", daemon=True)
        self._thread.start()

    def submit(self, version: int, prompt: list[int], num_samples: int, params: SamplingParams,
               prompt_logprobs: bool) -> Future:
        request = _Request(version, prompt, num_samples, params, prompt_logprobs)
        try:
            _check(request, self.backend)
        except UserError as e:
            request.future.set_exception(e)
            return request.future
        self._queue.put(request)
        return request.future

    def _serve(self) -> None:
        held: list[_Request] = []
        while True:
            first = held.pop(0) if held else self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                (batch if nxt.key == first.key else held).append(nxt)
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        first = batch[0]
        p = first.params
        request = SampleRequest(n=first.num_samples, max_tokens=min(r.max_tokens(self.backend.cfg.model.max_model_len)
                                                                for r in batch),
                                temperature=p.temperature, top_p=p.top_p,
                                stop_token_ids=_stop_ids(p.stop, self.backend.tokenizer), seed=p.seed)
        try:
            groups = self.backend.generate(first.version, [r.prompt for r in batch], request)
            wanted = [r for r in batch if r.prompt_logprobs]
            scored = dict(zip(map(id, wanted), self.backend.prompt_logprobs(
                first.version, [r.prompt for r in wanted]))) if wanted else {}
        except BaseException as e:  # noqa: BLE001 - every caller's future gets the failure
            for r in batch:
                r.future.set_exception(e)
            return
        for r, group in zip(batch, groups):
            sequences = [SampledSequence("length" if c.finish_reason == "length" else "stop", list(c.tokens),
                                         list(c.logprobs)) for c in group]
            prompt_lp = [None, *scored[id(r)][-(len(r.prompt) - 1):]] if r.prompt_logprobs and len(r.prompt) > 1 else (
                [None] if r.prompt_logprobs else None)
            r.future.set_result(SampleResponse(sequences, prompt_lp))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


def _check(request: _Request, backend) -> None:
    p = request.params
    if not request.prompt:
        raise UserError("prompt: empty")
    if request.num_samples < 1:
        raise UserError(f"num_samples = {request.num_samples}: at least 1")
    limit = backend.cfg.model.max_model_len
    if request.max_tokens(limit) < 1:
        raise UserError(f"sampling_params.max_tokens = {p.max_tokens}: at least 1 (and a prompt shorter than the "
                        f"context of {limit})")
    if p.temperature < 0 or not 0 < p.top_p <= 1:
        raise UserError(f"sampling_params: temperature {p.temperature} / top_p {p.top_p} out of range")
    if p.top_k not in (-1, 0):
        raise UserError(f"sampling_params.top_k = {p.top_k}: top-k sampling is not supported (use -1)")
    if len(request.prompt) + request.max_tokens(limit) > limit:
        raise UserError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({p.max_tokens}) exceed the "
                        f"model's context of {limit}")
    _stop_ids(p.stop, backend.tokenizer)


def _stop_ids(stop, tokenizer) -> tuple[int, ...]:
    """Stop token ids from ints or single-token strings; UserError for a multi-token string."""
    ids = []
    for item in stop or ():
        if isinstance(item, int):
            ids.append(item)
            continue
        encoded = tokenizer.encode(item, add_special_tokens=False)
        if len(encoded) != 1:
            raise UserError(f"sampling_params.stop: {item!r} is {len(encoded)} tokens; only single-token strings "
                            "or token ids stop generation here")
        ids.append(encoded[0])
    return tuple(ids)
