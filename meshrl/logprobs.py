"""Per-token log-probabilities and entropies from logits, without a float32 [B, T, V] tensor.

Math (per position, z = logits / temperature, lse = logsumexp_v z_v):
    log p(y)  = z_y - lse
    entropy H = -sum_v p_v log p_v = lse - sum_v p_v z_v
Gradients (used by the hand-written backward passes, g = upstream grad):
    d log p(y) / d z_v = 1[v = y] - p_v
    d H        / d z_v = -p_v (log p_v + H)
and d/d logits = (d/d z) / temperature.

Memory: the forward and backward passes walk over rows (token positions) in chunks of
``chunk_size``, casting one [chunk, V] slice at a time to float32; nothing of size [B*T, V] is ever
allocated in float32 except the gradient w.r.t. float32 logits (which autograd needs anyway).  The
backward pass recomputes the softmax per chunk instead of saving it.

Causal shift: logits at position t predict token t+1.  :func:`causal_shift` and
:func:`compute_token_logprobs` are the only places in meshrl that perform it on tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CHUNK_SIZE = 1024
"""Rows (token positions) per chunk: peak extra memory is ~4 * chunk_size * V * 4 bytes."""


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for every input dtype except float64, which is kept (for brute-force references)."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


def causal_shift(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align logits [B, T, V] with the tokens they predict: (logits[:, :-1], tokens[:, 1:])."""
    if logits.shape[:2] != tokens.shape[:2]:
        raise ValueError(f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree on [B, T]")
    return logits[:, :-1], tokens[:, 1:]


class _ChunkedRowLogprobs(torch.autograd.Function):
    """log p(target) and entropy for selected rows of a [M, V] logits matrix, chunked over rows."""

    @staticmethod
    def forward(ctx, logits2d, rows, targets, chunk_size: int, temperature: float, with_entropy: bool):
        n = rows.shape[0]
        dtype = _compute_dtype(logits2d)
        logp = torch.empty(n, dtype=dtype, device=logits2d.device)
        entropy = torch.zeros_like(logp)
        lse = torch.empty_like(logp)
        for start in range(0, n, chunk_size):
            sl = slice(start, start + chunk_size)
            z = logits2d.index_select(0, rows[sl]).to(dtype).div_(temperature)
            chunk_lse = torch.logsumexp(z, dim=-1)
            lse[sl] = chunk_lse
            logp[sl] = z.gather(1, targets[sl, None]).squeeze(1) - chunk_lse
            if with_entropy:
                z.sub_(chunk_lse[:, None])  # z is now log p
                entropy[sl] = -(z.exp() * z).nan_to_num_(0.0).sum(-1)  # 0 * log 0 = 0
        ctx.save_for_backward(logits2d, rows, targets, lse, entropy)
        ctx.chunk_size = chunk_size
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits2d, rows, targets, lse, entropy = ctx.saved_tensors
        grad = torch.zeros_like(logits2d)
        if grad_logp is None and grad_entropy is None:
            return grad, None, None, None, None, None
        for start in range(0, rows.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            log_p = logits2d.index_select(0, rows[sl]).to(lse.dtype).div_(ctx.temperature).sub_(lse[sl, None])
            p = log_p.exp()
            g = torch.zeros_like(p)
            if grad_logp is not None:
                g.sub_(p * grad_logp[sl, None])
                g.scatter_add_(1, targets[sl, None], grad_logp[sl, None].to(g.dtype))
            if grad_entropy is not None:
                g.sub_((p * (log_p + entropy[sl, None])).nan_to_num_(0.0) * grad_entropy[sl, None])
            grad.index_copy_(0, rows[sl], g.div_(ctx.temperature).to(grad.dtype))
        return grad, None, None, None, None, None


def _unshifted(logits, targets, chunk_size, temperature, with_entropy):
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}")
    if chunk_size < 1 or temperature <= 0:
        raise ValueError("chunk_size must be >= 1 and temperature > 0")
    logits2d = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1).long()
    rows = torch.arange(flat_targets.shape[0], device=logits.device)
    logp, entropy = _ChunkedRowLogprobs.apply(
        logits2d, rows, flat_targets, chunk_size, float(temperature), with_entropy
    )
    return logp.view(targets.shape), entropy.view(targets.shape)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy) for logits [..., V] and targets [...]; no shift; float32 outputs.

    Differentiable w.r.t. ``logits`` (both outputs), memory O(chunk_size * V) in float32.
    (float64 logits are computed and returned in float64, for brute-force references.)
    """
    return _unshifted(logits, targets, chunk_size, temperature, with_entropy=True)


def selective_log_softmax(
    logits: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """log_softmax(logits / temperature)[..., targets] in float32, chunked (no shift)."""
    return _unshifted(logits, targets, chunk_size, temperature, with_entropy=False)[0]


@dataclass
class TokenLogprobs:
    """Learner-side per-token outputs for a batch; position t refers to token t+1 of the input."""

    logprobs: torch.Tensor  # [B, T-1] float32
    entropy: torch.Tensor | None  # [B, T-1] float32, or None when not requested


def compute_token_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    return_entropy: bool = False,
) -> TokenLogprobs:
    """Log-probability of token t+1 at each position t, from model logits over the input tokens.

    ``logits``: [B, T, V] in any dtype (bf16 is fine); ``tokens``: [B, T] (the model input).
    Returns float32 [B, T-1].  The shifted logits are never copied: rows are read in place from the
    contiguous [B*T, V] view, chunk by chunk.
    """
    if logits.dim() != 3 or tokens.dim() != 2:
        raise ValueError(
            f"expected logits [B, T, V] and tokens [B, T], got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    causal_shift(logits, tokens)  # validates shapes; the shift is applied through row indices below
    batch, length, vocab = logits.shape
    if length < 2:
        raise ValueError("need at least 2 positions to predict a next token")
    logits2d = logits.reshape(batch * length, vocab)
    positions = torch.arange(length - 1, device=logits.device)
    rows = (torch.arange(batch, device=logits.device)[:, None] * length + positions[None, :]).reshape(-1)
    targets = tokens[:, 1:].reshape(-1).long()
    logp, entropy = _ChunkedRowLogprobs.apply(
        logits2d, rows, targets, chunk_size, float(temperature), return_entropy
    )
    shape = (batch, length - 1)
    return TokenLogprobs(logp.view(shape), entropy.view(shape) if return_entropy else None)


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "TokenLogprobs",
    "causal_shift",
    "compute_token_logprobs",
    "selective_log_softmax",
    "token_logprobs_and_entropy",
]


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(indices int32, log-probs float32) of the ``k`` most likely tokens of each row of ``logits``
    [..., V] (temperature 1), on the logits' device; ``k = 0``: (None, the full vocabulary's log-probs)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    if k == 0:
        return None, logp
    values, indices = logp.topk(k, dim=-1)
    return indices.to(torch.int32), values
