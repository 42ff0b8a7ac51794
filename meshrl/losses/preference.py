"""Direct Preference Optimisation on sequence log-probabilities (channel 3: teacher trace replay).

With sequence logprobs (sums over response tokens) of the policy pi and the frozen reference
pi_ref, for each (chosen, rejected) pair:

    r_c = beta (log pi(chosen)   - log pi_ref(chosen))          implicit reward of chosen
    r_r = beta (log pi(rejected) - log pi_ref(rejected))        implicit reward of rejected
    L   = -sum_pairs log sigmoid(r_c - r_r)                      (sum-reduced, like the token losses)

dL/d log pi(chosen) = -beta sigmoid(r_r - r_c) < 0 and dL/d log pi(rejected) = +beta sigmoid(r_r - r_c)
> 0, so a gradient step raises the chosen sequence and lowers the rejected one.  Reference logprobs
are constants (detached): a pair's datums may carry them, computed once when the pair was formed
(`REFERENCE_INPUT`, e.g. by the replay term's reference actor, meshrl.actors.reference); without it
the learner computes them with its frozen initial policy on every pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from meshrl.config.base import Section
from meshrl.losses.base import LossOutput, as_weights
from meshrl.losses.registry import ForwardPass, register_loss


REFERENCE_INPUT = "reference_logprob"
"""The per-sequence loss input holding a datum's precomputed reference sequence logprob: the sum of
log pi_ref(token) over its answer tokens (`mask` != 0), at the pass's temperature."""


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of per-token logprobs [B, T] over the response tokens (mask != 0) -> [B]."""
    w, valid = as_weights(mask, token_logprobs)
    values = torch.where(valid, token_logprobs, torch.zeros_like(token_logprobs))
    return (values * w).sum(-1)


def dpo(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    pair_weights: torch.Tensor | None = None,
) -> LossOutput:
    """L = -sum_i w_i log sigmoid(beta [(pc_i - rc_i) - (pr_i - rr_i)]); all inputs [P] sequence
    logprobs; ``pair_weights`` w [P] (constant, default 1) carry the caller's normalisation.

    Metrics: num_pairs, reward_accuracy (fraction with r_c > r_r), chosen_reward, rejected_reward,
    reward_margin (means over pairs), loss_mean.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    inputs = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    shapes = {tuple(t.shape) for t in inputs}
    if len(shapes) != 1:
        raise ValueError(f"all four DPO inputs must have the same shape, got {sorted(shapes)}")
    chosen_reward = beta * (policy_chosen_logps - ref_chosen_logps.detach())
    rejected_reward = beta * (policy_rejected_logps - ref_rejected_logps.detach())
    margin = chosen_reward - rejected_reward
    losses = -F.logsigmoid(margin)
    weights = torch.ones_like(losses) if pair_weights is None else pair_weights.detach().to(losses.dtype)
    loss = (losses * weights).sum()
    n = losses.numel()
    m = margin.detach()
    metrics = {
        "loss": float(loss.detach()),
        "num_pairs": float(n),
        "loss_mean": float(losses.detach().mean()) if n else 0.0,
        "reward_accuracy": float((m > 0).float().mean()) if n else 0.0,
        "chosen_reward": float(chosen_reward.detach().mean()) if n else 0.0,
        "rejected_reward": float(rejected_reward.detach().mean()) if n else 0.0,
        "reward_margin": float(m.mean()) if n else 0.0,
    }
    return LossOutput(loss, metrics)


class DPOParams(Section):
    """DPO's temperature."""

    beta: float = Field(0.1, gt=0)
    """The implicit reward's scale (beta)."""


@register_loss("dpo", kind="preference", params=DPOParams, datums_per_item=2, metric_weight="items")
def dpo_loss(fp: ForwardPass, beta: float = 0.1) -> LossOutput:
    """Datums come in pairs for the same prompt, the chosen answer first and the rejected one second;
    `mask` is 1 on each answer's tokens and the per-sequence `weight` (read from the chosen datum)
    scales the pair's term. The reference is each datum's precomputed `REFERENCE_INPUT` where the
    datums carry it (then the learner runs no reference forward), else the learner's frozen initial
    policy."""
    mask = fp.inputs["mask"]
    policy = sequence_logprobs(fp.logprobs(), mask)
    precomputed = fp.inputs.get(REFERENCE_INPUT)
    reference = precomputed.to(policy.dtype) if precomputed is not None else \
        sequence_logprobs(fp.reference_logprobs(), mask)
    return dpo(policy[0::2], policy[1::2], reference[0::2], reference[1::2], beta=beta,
               pair_weights=fp.inputs["weight"][0::2])
