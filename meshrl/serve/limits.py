"""What one request, and one tenant, may ask of the server (`serve.limits`), checked before any
work is done for the request.

Every check raises `OverLimit` (a `UserError`, so a request the SDK polls for fails with category
`user`) naming the field, the value and the limit; a direct call answers with its HTTP status
(413 for a body too large, 429 for a tenant over its quota of work in flight, which the SDK retries
after a pause, 400 otherwise). Sampling parameters are checked here too, at the edge, against the
ranges the engines take (a seed past int64 makes a vLLM step raise and takes the engine down for
every request in it), so a request the engines would choke on never reaches them.

Request bodies are read through `read_body`: the size is checked while the body arrives, and a
zstd body is inflated through `inflate`, which stops as soon as the output passes its limit.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import zstandard
from tinker import types as sdk

from meshrl.api.clients import CHECKPOINT_NAME
from meshrl.api.errors import UserError
from meshrl.api.sampler import MAX_TOPK, SEED_LIMIT
from meshrl.config.serve import ServeLimits

TOKEN_LIMIT = 2**31
"""Token ids are int32 on the wire and in the engines."""
MAX_TEMPERATURE = 100.0
MAX_STOP_CHARS = 256
_INFLATE_CHUNK = 1 << 20


class OverLimit(UserError):
    """A request over a limit (or malformed past use); ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def at_most(where: str, value: int, limit: int, key: str) -> None:
    """OverLimit unless ``value`` <= ``limit`` (the setting ``serve.limits.<key>``)."""
    if value > limit:
        raise OverLimit(f"{where} = {value}: over the limit of {limit} (serve.limits.{key})")


async def read_body(chunks: AsyncIterator[bytes], declared_length: str | None, limit: int) -> bytes:
    """A request body read from ``chunks``, refused (413) as soon as it passes ``limit`` bytes, or
    at once when its Content-Length says it would."""
    if declared_length is not None and declared_length.isdigit() and int(declared_length) > limit:
        raise OverLimit(f"request body of {declared_length} bytes: over the limit of {limit} "
                        "(serve.limits.max_body_bytes)", 413)
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            raise OverLimit(f"request body: over the limit of {limit} bytes (serve.limits.max_body_bytes)", 413)
    return bytes(body)


ZstdError = zstandard.ZstdError


def zstd_reader(body: bytes):
    """A reader of ``body``'s zstd stream that inflates only as much as is read from it."""
    return zstandard.ZstdDecompressor().stream_reader(body)


def inflate(body: bytes, limit: int, where: str) -> bytes:
    """A zstd body inflated chunk by chunk, refused (413) as soon as the output passes ``limit``."""
    out = bytearray()
    try:
        with zstd_reader(body) as reader:
            while chunk := reader.read(_INFLATE_CHUNK):
                out += chunk
                if len(out) > limit:
                    raise OverLimit(f"{where}: inflates past {limit} bytes (serve.limits.max_decompressed_bytes)",
                                    413)
    except zstandard.ZstdError as exc:
        raise UserError(f"{where}: not valid zstd ({exc})") from None
    return bytes(out)


def checkpoint_name(where: str, name: str | None) -> None:
    """A checkpoint name from the whitelist (`CHECKPOINT_NAME`: no ``.``, ``..`` or ``/``)."""
    if name is None:
        return
    if not re.fullmatch(CHECKPOINT_NAME, name):
        shown = name if len(name) <= 64 else name[:61] + "..."
        raise OverLimit(f"{where}.path = {shown!r}: a checkpoint name is 1 to 128 letters, digits and _ . -, not "
                        "starting with a dot")


def metadata(where: str, value: Any, limits: ServeLimits) -> None:
    """What a client keeps on the server (``user_metadata``, names) no larger, as JSON, than
    ``max_metadata_bytes``."""
    if value is None:
        return
    try:
        size = len(json.dumps(value, separators=(",", ":"), default=str))
    except RecursionError:
        raise OverLimit(f"{where}: nests too deep") from None
    at_most(f"{where} (bytes as JSON)", size, limits.max_metadata_bytes, "max_metadata_bytes")


def lora(where: str, config: sdk.LoraConfig, limits: ServeLimits) -> None:
    """A LoRA rank within ``max_lora_rank`` and a seed the learner's RNG takes."""
    if config.rank < 1:
        raise OverLimit(f"{where}.lora_config.rank = {config.rank}: at least 1")
    at_most(f"{where}.lora_config.rank", config.rank, limits.max_lora_rank, "max_lora_rank")
    if config.seed is not None and not 0 <= config.seed < SEED_LIMIT:
        raise OverLimit(f"{where}.lora_config.seed = {config.seed}: between 0 and 2**63 - 1")


def sample(req: sdk.SampleRequest, limits: ServeLimits) -> None:
    """Every size and parameter of an `asample` request within its limits and the engines' ranges."""
    if req.num_samples < 1:
        raise OverLimit(f"asample: num_samples = {req.num_samples}, expected >= 1")
    at_most("asample: num_samples", req.num_samples, limits.max_num_samples, "max_num_samples")
    tokens = [t for chunk in req.prompt.chunks for t in getattr(chunk, "tokens", ())]
    at_most("asample: prompt length", len(tokens), limits.max_prompt_tokens, "max_prompt_tokens")
    if any(not 0 <= t < TOKEN_LIMIT for t in tokens):
        raise OverLimit("asample: prompt: token ids must lie in [0, 2**31)")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if not 0 <= getattr(req, name) <= MAX_TOPK:
            raise OverLimit(f"asample: {name} = {getattr(req, name)}: between 0 and {MAX_TOPK}")
    if req.prompt_logprobs_last_n is not None and req.prompt_logprobs_last_n < 0:
        raise OverLimit(f"asample: prompt_logprobs_last_n = {req.prompt_logprobs_last_n}: at least 0")
    sampling_params(req.sampling_params, req.num_samples, limits)


def sampling_params(params: sdk.SamplingParams, num_samples: int, limits: ServeLimits) -> None:
    """Length, seed, temperature, top-p / top-k and stop sequences within the engines' ranges."""
    where = "asample: sampling_params"
    if params.max_tokens is not None:
        if params.max_tokens < 1:
            raise OverLimit(f"{where}.max_tokens = {params.max_tokens}: at least 1")
        at_most(f"{where}.max_tokens", params.max_tokens, limits.max_sample_tokens, "max_sample_tokens")
    if params.seed is not None and not 0 <= params.seed <= SEED_LIMIT - num_samples:
        raise OverLimit(f"{where}.seed = {params.seed}: between 0 and 2**63 - num_samples (sample j draws with "
                        "seed + j)")
    if not (math.isfinite(params.temperature) and 0 <= params.temperature <= MAX_TEMPERATURE):
        raise OverLimit(f"{where}.temperature = {params.temperature}: between 0 and {MAX_TEMPERATURE:g}")
    if not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        raise OverLimit(f"{where}.top_p = {params.top_p}: in (0, 1]")
    if not -1 <= params.top_k < TOKEN_LIMIT:
        raise OverLimit(f"{where}.top_k = {params.top_k}: -1 (off) or a count of tokens")
    stop = [params.stop] if isinstance(params.stop, str) else list(params.stop or ())
    at_most(f"{where}.stop (number of sequences)", len(stop), limits.max_stop_sequences, "max_stop_sequences")
    for item in stop:
        if isinstance(item, str) and not 0 < len(item) <= MAX_STOP_CHARS:
            raise OverLimit(f"{where}.stop: a stop string of {len(item)} characters: 1 to {MAX_STOP_CHARS}")
        if isinstance(item, int) and not 0 <= item < TOKEN_LIMIT:
            raise OverLimit(f"{where}.stop: token id {item} outside [0, 2**31)")


class Quota:
    """Work in flight per tenant, at most ``limit`` each (``key``: the setting that says so).
    Thread-safe: work is taken on the event loop and given back from the backend's threads."""

    def __init__(self, what: str, limit: int, key: str):
        self._what, self._limit, self._key = what, limit, key
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def take(self, tenant: str) -> Callable[[], None]:
        """One unit of ``tenant``'s quota (OverLimit 429 when it has none left); the function that
        gives it back, once however often it is called."""
        with self._lock:
            if self._held[tenant] >= self._limit:
                raise OverLimit(f"{self._held[tenant]} {self._what} of this tenant are in flight: the limit is "
                                f"{self._limit} (serve.limits.{self._key}); retry once some have finished", 429)
            self._held[tenant] += 1
        given_back = threading.Event()

        def give_back() -> None:
            with self._lock:
                if not given_back.is_set():
                    given_back.set()
                    self._held[tenant] -= 1

        return give_back
