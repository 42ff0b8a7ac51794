"""The HF engine's fast decoding path (`generator.hf_decode: static`, the default on CUDA).

transformers' `generate` runs with a static KV cache, which on CUDA makes it compile the model's
decoding step (`torch.compile`, mode `reduce-overhead`: CUDA graphs, one launch per step instead of
one per kernel). A graph holds for one batch size and one cache length, so every call is padded to
a bucket: rows to the next power of two (`batch_bucket`), the prompt width to a multiple of
`WIDTH_STEP` (left padding, masked). Sampling is `device_sampler.sample_step` with a seed per row,
so padding rows change no real row's draws; only [rows, steps] tokens and log-probs (and the
top-k when asked) leave the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.engines.device_sampler import row_keys, sample_step

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Batch sizes the decoding step is captured for; larger batches round up to a multiple of the last."""
WIDTH_STEP = 16
"""Prompt widths round up to a multiple of this (the cache length is width + max tokens)."""


def batch_bucket(rows: int) -> int:
    """The captured batch size that holds ``rows`` rows."""
    for size in BATCH_BUCKETS:
        if rows <= size:
            return size
    return -(-rows // BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


def width_bucket(width: int) -> int:
    """The padded prompt width for prompts of at most ``width`` tokens."""
    return -(-width // WIDTH_STEP) * WIDTH_STEP


class SeededSampler:
    """The last logits processor of a greedy `generate`: it samples each row with `sample_step`
    (its seed, the step count), records the token's log-prob (and top-k) on the device, and leaves
    only that token finite, so that generate's argmax takes it."""

    def __init__(self, keys: torch.Tensor, temperature: float, top_p: float, topk: int, sample=sample_step):
        self.keys, self.temperature, self.top_p, self.topk, self.sample = keys, temperature, top_p, topk, sample
        self.step = torch.zeros((), dtype=torch.int64, device=keys.device)
        self.logprobs: list[torch.Tensor] = []
        self.top: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens, chosen, ids, values = self.sample(scores, self.keys, self.step, self.temperature, self.top_p, self.topk)
        self.step += 1
        self.logprobs.append(chosen)
        if ids is not None:
            self.top.append((ids, values))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens[:, None], 0.0)


@dataclass
class Decoded:
    """What leaves the device for the real rows: new tokens, their log-probs, top-k (or None)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor | None
    top_values: torch.Tensor | None


def row_seeds(prompts: int, n: int, seed: int | None, generator: torch.Generator) -> torch.Tensor:
    """An int64 seed per row (prompt-major, ``n`` samples each): sample j of prompt p gets
    (seed + p) * 2^20 + j when the request has a seed, else draws of the engine's ``generator``."""
    if seed is None:
        return torch.randint(0, 1 << 62, (prompts * n,), generator=generator, dtype=torch.int64)
    return torch.tensor([(seed + p) * (1 << 20) + j for p in range(prompts) for j in range(n)], dtype=torch.int64)


@torch.no_grad()
def static_generate(model, device: torch.device, pad_id: int, rows: list[list[int]], seeds: torch.Tensor,
                    max_tokens: int, temperature: float, top_p: float, topk: int, eos: list[int],
                    sample=sample_step) -> Decoded:
    """Sample ``rows`` (token ids) in one bucketed, static-cache `generate` with per-row ``seeds``."""
    real = len(rows)
    padded = rows + [rows[0]] * (batch_bucket(real) - real)
    width = width_bucket(max(len(r) for r in rows))
    ids = torch.full((len(padded), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, r in enumerate(padded):
        ids[i, width - len(r):] = torch.tensor(r)
        attention[i, width - len(r):] = 1
    keys = row_keys(torch.cat([seeds, seeds.new_zeros(len(padded) - real)])).to(device)
    sampler = SeededSampler(keys, temperature, top_p, topk, sample)
    from transformers import LogitsProcessorList

    out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device), max_new_tokens=max_tokens,
                         eos_token_id=eos, pad_token_id=pad_id, do_sample=False, temperature=1.0, top_p=1.0,
                         logits_processor=LogitsProcessorList([sampler]), cache_implementation="static")
    steps = out.shape[1] - width
    logprobs = torch.stack(sampler.logprobs[:steps], dim=1) if steps else torch.zeros((len(padded), 0))
    top_ids = top_values = None
    if topk and steps:
        top_ids = torch.stack([i for i, _ in sampler.top[:steps]], dim=1)[:real].cpu()
        top_values = torch.stack([v for _, v in sampler.top[:steps]], dim=1)[:real].cpu()
    return Decoded(out[:real, width:].cpu(), logprobs[:real].cpu(), top_ids, top_values)
