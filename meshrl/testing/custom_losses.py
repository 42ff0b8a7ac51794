"""Custom losses for `forward_backward_custom` tests: module-level, so they pickle by reference
into a learner process."""

from __future__ import annotations

import torch


def importance_sampling_custom(datums, logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The registered `importance_sampling` loss written against per-datum logprobs:
    -sum_t w_t exp(log p_t - log q_t) A."""
    total = torch.zeros(())
    for datum, logp in zip(datums, logprobs):
        inputs = datum.loss_fn_inputs
        w = inputs["mask"]
        ratio = torch.exp(torch.where(w != 0, logp - inputs["logprobs"], torch.zeros_like(logp)))
        total = total - (w * ratio * inputs["advantages"]).sum()
    return total, {"num_datums": len(datums)}
