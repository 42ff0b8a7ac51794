"""Turning sum-reduced token losses into means, identically for one batch or many micro-batches.

All loss functions are sums over tokens of w_t * l_t.  A normalised objective is obtained by
passing per-token weights w_t instead of a 0/1 mask; this module computes those weights from
GLOBAL counts (over every micro-batch of the optimizer step, and over data-parallel ranks if the
caller all-reduces the counts), so that summing the micro-batch losses (and accumulating their
gradients) gives exactly the full-batch objective:

  sum           w_t = m_t                                   (no normalisation)
  token_mean    w_t = m_t / N_tok          N_tok = sum over the whole batch of valid tokens (DAPO)
  sequence_mean w_t = m_t / (|o_i| N_seq)  |o_i| = valid tokens of sequence i, N_seq = number of
                                           sequences with >= 1 valid token (GRPO's per-sequence mean)
  fixed_length  w_t = m_t / (L_max N_seq)  constant normaliser (Dr. GRPO), L_max = max_tokens

|o_i| is local to one sequence, so it never needs global information.  For the PPO/IS/CISPO losses,
which are positively homogeneous in w, ``loss(mask=weights)`` equals the weighted mean; the
clip/KL metrics still count tokens with w != 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable

import torch


class Aggregation(str, Enum):
    SUM = "sum"
    TOKEN_MEAN = "token_mean"
    SEQUENCE_MEAN = "sequence_mean"
    FIXED_LENGTH = "fixed_length"


@dataclass(frozen=True)
class GlobalCounts:
    """Normalisers for one optimizer step: total valid tokens and non-empty sequences."""

    num_tokens: float
    num_sequences: int

    @classmethod
    def from_masks(cls, masks: Iterable[torch.Tensor]) -> "GlobalCounts":
        """Counts over every micro-batch mask ([B, T] each) of the step."""
        tokens, sequences = 0.0, 0
        for mask in masks:
            valid = mask.detach() != 0
            tokens += float(valid.sum())
            sequences += int(valid.reshape(valid.shape[0], -1).any(dim=1).sum())
        return cls(tokens, sequences)

    def __add__(self, other: "GlobalCounts") -> "GlobalCounts":
        """Combine counts of two disjoint parts of the batch (e.g. after gathering from ranks)."""
        return GlobalCounts(self.num_tokens + other.num_tokens, self.num_sequences + other.num_sequences)


def local_weights(mask: torch.Tensor, mode: Aggregation | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The part of the weights that each sequence knows by itself: m_t, or m_t / |o_i| for
    ``sequence_mean``. Times :func:`global_scale` they are the weights of ``mode``."""
    m = (mask.detach() != 0).to(dtype)
    if Aggregation(mode) is Aggregation.SEQUENCE_MEAN:
        return m / m.sum(dim=-1, keepdim=True).clamp_min(1.0)
    return m


def global_scale(mode: Aggregation | str, counts: GlobalCounts | None = None, max_tokens: int | None = None) -> float:
    """The step-wide factor of ``mode`` from the GLOBAL counts of the whole step: 1 (``sum``),
    1 / N_tok, 1 / N_seq, or 1 / (L_max N_seq). Applied to the weights, or (when the counts are
    known only after the gradients are accumulated, e.g. streaming minibatches) to the gradients."""
    mode = Aggregation(mode)
    if mode is Aggregation.SUM:
        return 1.0
    if counts is None:
        raise ValueError(f"aggregation {mode.value!r} needs the global counts of the step")
    if mode is Aggregation.TOKEN_MEAN:
        return 1.0 / max(counts.num_tokens, 1.0)
    n_seq = max(counts.num_sequences, 1)
    if mode is Aggregation.SEQUENCE_MEAN:
        return 1.0 / n_seq
    if max_tokens is None or max_tokens < 1:
        raise ValueError("aggregation 'fixed_length' needs max_tokens >= 1")
    return 1.0 / (float(max_tokens) * n_seq)


def aggregation_weights(
    mask: torch.Tensor,
    mode: Aggregation | str,
    counts: GlobalCounts | None = None,
    max_tokens: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Per-token weights [B, T] (``dtype``) implementing ``mode`` for this micro-batch's ``mask``:
    :func:`local_weights` x :func:`global_scale`. ``counts`` must be the GLOBAL counts of the
    whole step (required except for ``sum``)."""
    return local_weights(mask, mode, dtype) * global_scale(mode, counts, max_tokens)
