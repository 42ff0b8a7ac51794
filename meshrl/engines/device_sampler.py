"""Sampling on the device with a seed per row: no generator state, no [rows, vocab] copy to the host.

Each row draws with the Gumbel-max trick: the token is the argmax of its processed log-probs
(temperature, then top-p) plus Gumbel noise, and that noise is a hash of (row seed, step, token id)
computed with integer arithmetic on the device. A row's draws therefore depend only on its own
seed and its logits, not on which rows share its batch or how the batch was padded, and the whole
step is a pure function of tensors (so `torch.compile` and CUDA graphs can capture it). The
log-probability returned is the sampled token's under the processed distribution, as the vLLM
engine's `processed_logprobs` are.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
NOISE_BITS = 24
"""Bits of each uniform draw (a float32 holds 24 exactly): draws lie in (2^-25, 1 - 2^-25)."""


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply) of each element of ``x`` (int64 holding values
    below 2^32; every product stays below 2^59, so nothing overflows)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def row_keys(seeds: torch.Tensor) -> torch.Tensor:
    """32-bit keys of non-negative int64 seeds (both halves of each seed count)."""
    return mix32(mix32((seeds >> 32) & 0x7FFFFFFF) ^ (seeds & MASK32))


def uniform_noise(keys: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 uniforms in (0, 1), a hash of (row key, ``step`` (an int64 scalar
    tensor, so that a compiled step is not specialised on it), token id)."""
    step_keys = mix32(keys ^ mix32((step * 0x9E3779B9 + 0x7F4A7C15) & MASK32))
    cols = mix32(torch.arange(vocab, device=keys.device, dtype=torch.int64) ^ 0x85EBCA6B)
    bits = mix32((mix32(step_keys[:, None] ^ cols[None, :]) + step_keys[:, None]) & MASK32)
    return ((bits >> (32 - NOISE_BITS)).float() + 0.5) / float(1 << NOISE_BITS)


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``scores`` with the tokens outside the nucleus at -inf: the smallest set of most likely
    tokens whose probability reaches ``top_p`` (at least one), as transformers' top-p warper keeps."""
    ascending, order = torch.sort(scores, dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p)
    drop[..., -1:] = False
    return scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution a row is sampled from: ``logits`` / temperature, then top-p
    (temperature 0 = greedy: the logits' own distribution)."""
    scores = logits.float()
    if temperature > 0:
        scores = scores / temperature
        if top_p < 1.0:
            scores = top_p_filter(scores, top_p)
    return torch.log_softmax(scores, dim=-1)


def sample_step(logits: torch.Tensor, keys: torch.Tensor, step: torch.Tensor, temperature: float, top_p: float,
                topk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One decoding step for [rows, vocab] ``logits``: (tokens [rows], their processed log-probs
    [rows], the ``topk`` most likely token ids and log-probs [rows, topk] or None), all on the
    logits' device. Temperature 0 takes the argmax."""
    logp = processed_logprobs(logits, temperature, top_p)
    if temperature > 0:
        gumbel = -torch.log(-torch.log(uniform_noise(keys, step, logp.shape[-1])))
        tokens = (logp + gumbel).argmax(dim=-1)
    else:
        tokens = logp.argmax(dim=-1)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    if not topk:
        return tokens, chosen, None, None
    values, ids = logp.topk(topk, dim=-1)
    return tokens, chosen, ids, values
