"""Sampling requests, each sent to the generators on its own the moment it can run: the engine
batches it with every request in flight whatever their parameters (continuous batching in vLLM;
the HF engine runs them one at a time), so concurrent `sample` calls with different seeds,
temperatures, stop tokens and lengths share the engine's batch.

With `generator.lora_slots` the generators apply each version's adapter per request
(`backend.mixes_versions`): every request starts at once beside the others, whatever its version,
in one piece, under its owner's share; the rest of this module's switching, chunking and
anticipation is then idle.

Otherwise the generators hold one weight version at a time. Requests for the version they hold start at
once; a request for another version waits, and from then on no new request starts (even for the
held version) until the requests in flight have finished; then the generators load the waiting
request's version and every waiting request of that version starts, in arrival order. Weights
thus never change under a running request, and no version waits forever behind a stream of
requests for another.

Owners (the tenants of `meshrl serve` with a keys file; a request without one shares nothing)
share the generators: at most ``per_owner`` requests of one owner run at once (the rest wait their
turn, in arrival order, behind nobody else's), and when the generators switch versions the owners
take turns choosing the version: the next load serves the first waiting request of another owner
than the last one's. An owner's request runs in chunks of at most ``chunk_tokens`` sampled tokens
(`serve.limits.sample_chunk_tokens`): a sample that reaches the end of a chunk is continued by a
request of its own (the prompt and the tokens so far, the rest of ``max_tokens``), which waits
like any other, ahead of its owner's new requests, and the pieces are joined into one response.
So one owner's backlog, on its own weight version or on everyone's, delays another's request by
at most one chunk of ``per_owner`` of its running requests, never by all of it, however long
they are.

A version switch costs a weight load (about a second for a 135M model on a CPU), and a client
that samples one request after another sends its next one a moment after the last one's answer.
So when an owner's last request of the held version finishes while another version waits, and
that owner has nothing else waiting (no backlog), the generators keep the version for up to
``hold_s`` for that owner's next request, which then starts at once (anticipation, as a disk
scheduler waits for a process's next read near the last one rather than seek away and back). A
version keeps the generators this way for at most ``turn_s`` from its load while another waits;
an owner with a backlog is never waited for, so a flood is switched away from as soon as its
running chunks end.

Seeds: a request's `seed` seeds its own samples only (sample j of n draws with seed + j; the
continuation of a sample at offset k draws with `continuation_seed`, the chunks' offsets fixed by
``chunk_tokens`` whatever the load), so the same request with the same seed gives the same tokens
whether it runs alone or among others (up to the engine's batch-size-dependent float rounding,
which can flip a near-tie).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from meshrl.api.errors import UserError
from meshrl.api.types import PromptAltTokens, SampledSequence, SampleResponse, SamplingParams, TopkLogprobs
from meshrl.engines import PromptScoring, SampleRequest, Sampled

log = logging.getLogger("meshrl")

MAX_IN_FLIGHT = 256
"""Most requests sent to the generators at once (each waits on a thread of its own)."""
CLOSED = "the sampler is closed"
"""What a request fails with once :meth:`Sampler.close` was called, unless it was already in flight."""
SEED_LIMIT = 2**63
"""Seeds are int64 in the engines: sample j of a request draws with ``seed + j``, below this."""
MAX_TOPK = 64
"""Most top-k entries asked per position (`topk_prompt_logprobs`, `topk_sample_logprobs`) and
most draws (`prompt_alt_tokens_k`)."""
FULL_VOCABULARY_BUDGET = 1 << 22
"""Most (prompt positions x vocabulary) logprobs one request may need: `target_prompt_logprobs` and
`prompt_alt_tokens_k` read the whole next-token distribution at every prompt position."""


@dataclass(frozen=True)
class PromptOptions:
    """What a sample request asks of its prompt and of its sampled positions besides the tokens."""

    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: tuple[tuple[int, ...], ...] | None = None
    prompt_alt_tokens_k: int = 0


@dataclass
class _Request:
    version: int
    prompt: list[int]
    num_samples: int
    params: SamplingParams
    options: PromptOptions
    owner: str | None = None
    future: Future = field(default_factory=Future)

    def max_tokens(self, context: int) -> int:
        """``params.max_tokens``, or what the context leaves after the prompt when None."""
        return self.params.max_tokens if self.params.max_tokens is not None else context - len(self.prompt)


class Sampler:
    """Admits sampling requests to the generators version by version (see the module)."""

    def __init__(self, backend, per_owner: int = MAX_IN_FLIGHT, chunk_tokens: int | None = None,
                 hold_s: float = 0.0, turn_s: float = 0.0):
        self.backend = backend
        self.mixes = backend.mixes_versions
        """The generators sample any version beside the others (each an adapter): nothing waits
        for a version switch, and requests run uncut."""
        self.hold_s = hold_s
        """How long the held version waits for its last owner's next request while another
        version waits (`serve.limits.version_hold_s`; 0: never)."""
        self.turn_s = turn_s
        """The longest a version keeps the generators by waiting so (`serve.limits.version_turn_s`)."""
        self.per_owner = per_owner
        """Most requests of one owner running at once (`serve.limits.max_running_samples`)."""
        self.chunk_tokens = chunk_tokens
        """Most tokens an owner's request samples before its samples are continued by requests of
        their own (`serve.limits.sample_chunk_tokens`; None: in one piece)."""
        self._lock = threading.Lock()
        self._held: int | None = None  # the version the generators hold
        self._in_flight = 0
        self._running: Counter[str | None] = Counter()  # per owner
        self._switching = False
        self._waiting: deque[_Request] = deque()
        self._last_owner: str | None = None  # whose request chose the last version loaded
        self._closed = False
        self._turn_started = 0.0  # when the held version was loaded (time.monotonic)
        self._last_done: str | None = None  # the owner of the request of the held version that finished last
        self._hold_until: float | None = None  # while the held version waits for that owner's next request
        self._holds = 0  # numbers the holds, so that each one's end is acted on once
        self._hold_changed = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(MAX_IN_FLIGHT + 1, thread_name_prefix="api-sampler")
        if hold_s > 0:
            threading.Thread(target=self._watch_holds, name="api-sampler-holds", daemon=True).start()

    def submit(self, version: int, prompt: list[int], num_samples: int, params: SamplingParams,
               options: PromptOptions = PromptOptions(), owner: str | None = None) -> Future:
        """Sample ``num_samples`` continuations of ``prompt`` under weight ``version``; a future of
        a `SampleResponse`. A bad request fails its future with a `UserError`. ``owner`` (a
        tenant) shares the generators with the other owners (see the module)."""
        request = _Request(version, prompt, num_samples, params, options, owner)
        try:
            _check(request, self.backend)
        except UserError as e:
            request.future.set_exception(e)
            return request.future
        with self._lock:
            if self._closed:
                request.future.set_exception(RuntimeError(CLOSED))
            elif self._may_start(request) and (not self._switch_pending() or self._anticipated(request)):
                self._hold_until = None
                self._start(request)
            else:
                self._waiting.append(request)
                self._switch_when_drained()
        return request.future

    def _may_start(self, request: _Request) -> bool:
        """Whether ``request`` may run now: of the version held, its owner (if any) under its share
        (the lock is held)."""
        return ((self.mixes or (request.version == self._held and not self._switching))
                and (request.owner is None or self._running[request.owner] < self.per_owner))

    def _anticipated(self, request: _Request) -> bool:
        """Whether ``request`` is the next request of the owner the held version waits for (the
        lock is held)."""
        return (self._hold_until is not None and time.monotonic() < self._hold_until
                and request.owner == self._last_done and request.version == self._held)

    def _may_hold(self) -> bool:
        """Whether the drained generators may keep the held version a while for the owner whose
        request finished last: it has no backlog, and the version's turn is young (the lock is held)."""
        if self.hold_s <= 0 or self._held is None or self._last_done is None:
            return False
        now = time.monotonic()
        if now - self._turn_started >= self.turn_s or (self._hold_until is not None and now >= self._hold_until):
            return False
        return not any(r.owner == self._last_done for r in self._waiting)

    def _hold(self) -> None:
        """Keep the held version for ``hold_s`` (or what is left of its turn); then switch unless
        the awaited request came (the lock is held)."""
        if self._hold_until is not None:
            return  # holding already
        self._hold_until = time.monotonic() + min(self.hold_s, self.turn_s - (time.monotonic() - self._turn_started))
        self._holds += 1
        self._hold_changed.notify()

    def _watch_holds(self) -> None:
        """The one thread that ends the holds (not a timer per hold: under load, a thread started
        per request starts late): at each hold's end, switch unless the awaited request came."""
        ended = 0  # the number of the last hold whose end was acted on
        with self._lock:
            while not self._closed:
                if self._hold_until is None or self._holds == ended:
                    self._hold_changed.wait()
                elif (left := self._hold_until - time.monotonic()) > 0:
                    self._hold_changed.wait(left)
                else:
                    ended = self._holds
                    self._switch_when_drained()

    def _switch_pending(self) -> bool:
        """Whether a waiting request needs another version (then nothing new starts; the lock is held)."""
        return not self.mixes and any(r.version != self._held for r in self._waiting)

    def _start(self, request: _Request) -> None:
        """Send ``request`` to the generators (the lock is held)."""
        self._in_flight += 1
        self._running[request.owner] += 1
        self._pool.submit(self._run, request)

    def _start_waiting(self) -> None:
        """Start the waiting requests of the held version whose owners are under their share, in
        arrival order (the lock is held)."""
        started = []
        for request in self._waiting:
            if self._may_start(request):
                self._start(request)
                started.append(request)
        if started:
            self._waiting = deque(r for r in self._waiting if r not in started)

    def _switch_when_drained(self) -> None:
        """Once nothing is in flight, load the version a waiting request needs: the first such
        request of an owner other than the one whose request chose the last load, if any, so
        owners take turns (the lock is held)."""
        if not self._switch_pending() or self._in_flight or self._switching or self._closed:
            return
        if self._may_hold():
            self._hold()
            return
        self._hold_until = None
        needing = [r for r in self._waiting if r.version != self._held]
        chosen = next((r for r in needing if r.owner != self._last_owner), needing[0])
        self._last_owner = chosen.owner
        self._switching = True
        self._pool.submit(self._switch, chosen.version)

    def _switch(self, version: int) -> None:
        try:
            self.backend.hold(version)
            failure = None
        except BaseException as e:  # noqa: BLE001 - the requests for that version get it
            failure = e
        mine: list[_Request] = []
        with self._lock:
            self._switching = False
            self._held = None if failure is not None else version
            self._turn_started, self._last_done = time.monotonic(), None
            if failure is None and self._closed:
                failure = RuntimeError(CLOSED)
            if failure is not None:
                mine = [r for r in self._waiting if r.version == version]
                self._waiting = deque(r for r in self._waiting if r.version != version)
            else:
                self._start_waiting()
            self._switch_when_drained()
        for request in mine:
            request.future.set_exception(failure)

    def _run(self, request: _Request) -> None:
        failure, response, continued = None, None, {}
        try:
            response = self._sample(request)
            continued = self._continue(request, response)
        except BaseException as e:  # noqa: BLE001 - the caller's future gets the failure
            failure = e
        finally:
            with self._lock:
                self._in_flight -= 1
                self._running[request.owner] -= 1
                self._last_done = request.owner
                if not self._switch_pending():
                    self._start_waiting()
                self._switch_when_drained()
        # the caller hears only now, so that its next request finds this one's slot free and the
        # held version waiting for it (not a backlog of its own that ends the hold)
        if failure is not None:
            request.future.set_exception(failure)
        elif continued:
            _join(request.future, response, continued)
        else:
            request.future.set_result(response)

    def _chunk(self, request: _Request) -> int:
        """The tokens ``request``'s engine call samples: all of them, or an owner's first chunk
        (versions mixed, no request waits for a chunk to end: none is cut)."""
        tokens = request.max_tokens(self.backend.cfg.model.max_model_len)
        if request.owner is None or self.chunk_tokens is None or self.mixes:
            return tokens
        return min(tokens, self.chunk_tokens)

    def _continue(self, request: _Request, response: SampleResponse) -> dict[int, Future]:
        """Queue a continuation of each sample of ``response`` that filled its chunk and has tokens
        left, ahead of the owner's new requests; their futures, by sample index."""
        chunk, total = self._chunk(request), request.max_tokens(self.backend.cfg.model.max_model_len)
        if chunk == total:
            return {}
        p = request.params
        continuations = {}
        for j, seq in enumerate(response.sequences):
            if seq.stop_reason == "length" and len(seq.tokens) == chunk:
                seed = None if p.seed is None else continuation_seed(p.seed + j, chunk)
                continuations[j] = _Request(request.version, request.prompt + list(seq.tokens), 1,
                                            replace(p, max_tokens=total - chunk, seed=seed),
                                            PromptOptions(topk_sample_logprobs=request.options.topk_sample_logprobs),
                                            request.owner)
        with self._lock:
            if self._closed:
                raise RuntimeError(CLOSED)
            self._waiting.extendleft(reversed(continuations.values()))
        return {j: c.future for j, c in continuations.items()}

    def _sample(self, request: _Request) -> SampleResponse:
        p, o = request.params, request.options
        engine_request = SampleRequest(
            n=request.num_samples, max_tokens=self._chunk(request),
            temperature=p.temperature, top_p=p.top_p, stop_token_ids=_stop_ids(p.stop, self.backend.tokenizer),
            seed=p.seed, topk=o.topk_sample_logprobs)
        scoring = PromptScoring(logprobs=o.prompt_logprobs, topk=o.topk_prompt_logprobs,
                                targets=o.target_prompt_logprobs, alt_k=o.prompt_alt_tokens_k,
                                alt_temperature=p.temperature, alt_seed=p.seed)
        return _response(self.backend.sample(request.prompt, engine_request, scoring, request.version), o)

    def close(self) -> None:
        """Take no more requests and fail those not yet sent; those in flight finish (or fail
        when the generators stop)."""
        with self._lock:
            self._closed = True
            self._hold_changed.notify()
            waiting, self._waiting = list(self._waiting), deque()
        for request in waiting:
            request.future.set_exception(RuntimeError(CLOSED))
        self._pool.shutdown(wait=False)


def continuation_seed(seed: int, offset: int) -> int:
    """The seed of the continuation, at ``offset`` sampled tokens, of a sample drawn with ``seed``."""
    return (seed * 1_000_003 + offset) % SEED_LIMIT


def _join(future: Future, first: SampleResponse, continued: dict[int, Future]) -> None:
    """Settle ``future`` with ``first``, each continued sample followed by its continuation's,
    once every continuation is done (with the first failure, if one fails)."""
    left = [len(continued)]
    lock = threading.Lock()

    def done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            for j, part in continued.items():
                head, tail = first.sequences[j], part.result().sequences[0]
                topk = None if head.topk_logprobs is None else head.topk_logprobs + (tail.topk_logprobs or [])
                first.sequences[j] = SampledSequence(tail.stop_reason, head.tokens + tail.tokens,
                                                     head.logprobs + tail.logprobs, topk)
        except BaseException as e:  # noqa: BLE001 - the caller's future gets the failure
            future.set_exception(e)
        else:
            future.set_result(first)

    for part in continued.values():
        part.add_done_callback(done)


def _response(sampled: Sampled, options: PromptOptions) -> SampleResponse:
    sequences = [SampledSequence("length" if c.finish_reason == "length" else "stop", list(c.tokens),
                                 list(c.logprobs), _pairs(c.topk) if c.topk is not None else None)
                 for c in sampled.completions]
    response = SampleResponse(sequences)
    scores = sampled.prompt
    if scores is None:
        return response
    if options.prompt_logprobs:
        response.prompt_logprobs = [None, *scores.logprobs]
    if options.topk_prompt_logprobs:
        response.topk_prompt_logprobs = [None, *_pairs(scores.topk)]
    if options.target_prompt_logprobs is not None:
        response.target_prompt_logprobs = torch.tensor(scores.targets, dtype=torch.float32).reshape(
            len(options.target_prompt_logprobs), -1)
    if options.prompt_alt_tokens_k:
        ids, logprobs = scores.alt
        k = options.prompt_alt_tokens_k
        response.prompt_alt_tokens = PromptAltTokens(torch.tensor(ids, dtype=torch.int64).reshape(-1, k),
                                                     torch.tensor(logprobs, dtype=torch.float32).reshape(-1, k))
    return response


def _pairs(topk) -> TopkLogprobs:
    ids, logprobs = topk
    return [list(zip(i, v)) for i, v in zip(ids, logprobs)]


def _check(request: _Request, backend) -> None:
    p, o = request.params, request.options
    if not request.prompt:
        raise UserError("prompt: empty")
    vocab = len(backend.tokenizer)
    if any(not 0 <= t < vocab for t in request.prompt):
        raise UserError(f"prompt: token ids must lie in [0, {vocab})")
    if request.num_samples < 1:
        raise UserError(f"num_samples = {request.num_samples}: at least 1")
    if p.seed is not None and not 0 <= p.seed <= SEED_LIMIT - request.num_samples:
        raise UserError(f"sampling_params.seed = {p.seed}: between 0 and 2**63 - num_samples (sample j draws with "
                        "seed + j; the engines' seeds are int64)")
    limit = backend.cfg.model.max_model_len
    if request.max_tokens(limit) < 1:
        raise UserError(f"sampling_params.max_tokens = {p.max_tokens}: at least 1 (and a prompt shorter than the "
                        f"context of {limit})")
    if not (math.isfinite(p.temperature) and p.temperature >= 0) or not 0 < p.top_p <= 1:
        raise UserError(f"sampling_params: temperature {p.temperature} / top_p {p.top_p} out of range")
    if p.top_k not in (-1, 0):
        raise UserError(f"sampling_params.top_k = {p.top_k}: top-k sampling is not supported (use -1)")
    if len(request.prompt) + request.max_tokens(limit) > limit:
        raise UserError(f"prompt ({len(request.prompt)} tokens) + max_tokens ({p.max_tokens}) exceed the "
                        f"model's context of {limit}")
    _stop_ids(p.stop, backend.tokenizer)
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if not 0 <= getattr(o, name) <= MAX_TOPK:
            raise UserError(f"{name} = {getattr(o, name)}: between 0 and {MAX_TOPK}")
    rows = len(request.prompt) - 1
    if o.target_prompt_logprobs is not None:
        shape = (len(o.target_prompt_logprobs), {len(row) for row in o.target_prompt_logprobs})
        if shape[0] != rows or len(shape[1]) != 1 or not min(shape[1]) >= 1:
            raise UserError(f"target_prompt_logprobs: expected [len(prompt) - 1, K] = [{rows}, K >= 1] token ids, "
                            f"got {shape[0]} rows of lengths {sorted(shape[1])}")
        if any(not -1 <= t < vocab for row in o.target_prompt_logprobs for t in row):
            raise UserError(f"target_prompt_logprobs: token ids must lie in [0, {vocab}) (or -1 for none)")
    if (o.target_prompt_logprobs is not None or o.prompt_alt_tokens_k) and rows * vocab > FULL_VOCABULARY_BUDGET:
        raise UserError(f"target_prompt_logprobs / prompt_alt_tokens_k read the whole distribution at each of the "
                        f"prompt's {rows} positions ({rows} x {vocab} logprobs); at most "
                        f"{FULL_VOCABULARY_BUDGET // vocab} positions: shorten the prompt or use topk_prompt_logprobs")


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
