"""Tinker's other policy-gradient built-ins: `dro`, `gspo` and `stable_reinforce`.

Notation of :mod:`meshrl.losses.token_losses` (p_t learner, q_t sampler, rho_t = p_t / q_t, A_t
advantage, w_t = mask); like the others these are sums over tokens, never means.

  dro:   L = -sum_t w_t [A_t log p_t - beta/2 (log p_t - log q_t)^2]
  gspo:  per sequence b, s_b = exp(mean over t in M_b of log rho_t), where M_b are the tokens its
         ``ratio_mask`` marks; every token's ratio r_t = sg(s_b) p_t / sg(p_t) takes s_b's value and
         log p_t's gradient (GSPO-token), and
         L = -sum_t w_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
  stable_reinforce (meshrl's stand-in, see `stable_reinforce_loss`):
         L = -sum_t w_t sg(min(rho_t, truncation)) A_t log p_t

`dro` and `gspo` are Tinker's documented definitions (tinker-docs.thinkingmachines.ai/tinker/
losses/dro and .../gspo; the formulas and their sources are in docs/losses.md). Tinker does not
publish StableReinforce's objective, only that it needs information recorded at sampling time.

Metrics as in `token_losses`: means over the tokens that carry a training signal, which for `dro`
with beta > 0 is every token it reads (the penalty trains tokens whose advantage is 0).
"""

from __future__ import annotations

import torch
from pydantic import Field

from meshrl.config.base import Section
from meshrl.losses.base import LossOutput
from meshrl.losses.registry import ForwardPass, register_loss
from meshrl.losses.token_losses import (PPOParams, _clipped_output, _on_valid, _policy_gradient, _ratio_metrics,
                                        _ratio_terms, cispo)


def dro(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor | float,
    mask: torch.Tensor | None = None,
    beta: float = 0.05,
) -> LossOutput:
    """L = -sum_t w_t [A_t log p_t - beta/2 (log p_t - log q_t)^2] (Direct Reward Optimization:
    Richemond et al. 2024; Kimi k1.5). The advantage is the caller's (DRO's soft advantage)."""
    if beta < 0:
        raise ValueError(f"need beta >= 0, got {beta}")
    w, valid, adv, log_ratio, ratio, signal = _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask)
    objective = adv * _on_valid(target_logprobs, valid) - 0.5 * beta * log_ratio**2
    loss = -(objective * w).sum()
    if beta > 0:
        signal = valid
    metrics = {"loss": float(loss.detach()), **_ratio_metrics(log_ratio, ratio, valid, signal)}
    return LossOutput(loss, metrics, signal)


def gspo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor | float,
    mask: torch.Tensor | None = None,
    ratio_mask: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> LossOutput:
    """GSPO-token (Zheng et al. 2025, as Tinker implements it): the sequence ratio s_b is the
    geometric mean of rho_t over the tokens of ``ratio_mask`` (default: every token the mask
    keeps), without gradient; each token's ratio r_t = s_b p_t / sg(p_t);
    L = -sum_t w_t min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t).

    The last dimension is the sequence (a 1-D input is one sequence); a sequence whose ratio mask
    marks nothing gets s = 1. ratio_mean / ratio_max report s; clip fractions count the signal
    tokens whose s lies outside the bounds on the side their advantage makes binding.
    """
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    w, valid, adv, log_ratio, _, signal = _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask)
    in_ratio = valid
    if ratio_mask is not None:
        if ratio_mask.shape != target_logprobs.shape:
            raise ValueError(f"ratio_mask has shape {tuple(ratio_mask.shape)}, expected {tuple(target_logprobs.shape)}")
        in_ratio = valid & (ratio_mask.detach() != 0)
    count = in_ratio.sum(-1, keepdim=True).clamp_min(1)
    sequence_log_ratio = (log_ratio.detach() * in_ratio).sum(-1, keepdim=True) / count
    logp = _on_valid(target_logprobs, valid)
    ratio = torch.exp(sequence_log_ratio + logp - logp.detach())
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -(_on_valid(torch.minimum(ratio * adv, clipped), valid) * w).sum()
    s = ratio.detach()
    return _clipped_output(loss, log_ratio, ratio, valid, signal, (adv < 0) & (s < 1.0 - eps_low),
                           (adv > 0) & (s > 1.0 + eps_high))


# ---- registered forms: the policy-gradient datums (`logprobs`, `advantages`, `mask`) -------------
class DROParams(Section):
    """The weight of DRO's quadratic penalty."""

    beta: float = Field(0.05, ge=0.0)
    """beta in beta/2 (log p - log q)^2 (Tinker's documented example value)."""


class StableReinforceParams(Section):
    """The truncation of the importance weight."""

    truncation: float = Field(2.0, gt=0.0)
    """C in the stop-gradient weight min(p/q, C) (truncated importance sampling)."""


@register_loss("dro", kind="policy_gradient", params=DROParams)
def dro_loss(fp: ForwardPass, beta: float = 0.05) -> LossOutput:
    return _policy_gradient(dro, fp, beta=beta)


@register_loss("gspo", kind="policy_gradient", params=PPOParams)
def gspo_loss(fp: ForwardPass, eps_low: float = 0.2, eps_high: float = 0.2) -> LossOutput:
    """Datum field `sequence_ratio_mask` (optional): the tokens whose ratio forms the sequence
    ratio; without it, the tokens of `mask`."""
    return _policy_gradient(gspo, fp, ratio_mask=fp.inputs.get("sequence_ratio_mask"), eps_low=eps_low,
                            eps_high=eps_high)


@register_loss("stable_reinforce", kind="policy_gradient", params=StableReinforceParams)
def stable_reinforce_loss(fp: ForwardPass, truncation: float = 2.0) -> LossOutput:
    """REINFORCE with a truncated, stop-gradient importance weight against the sampler's own
    logprobs (truncated importance sampling, Yao et al. 2025): L = -sum_t w_t sg(min(rho_t, C))
    A_t log p_t, which is `cispo` with bounds [0, C]. Tinker's StableReinforce objective is not
    published; this is meshrl's stand-in for it. Through `meshrl serve`, `logprobs` and `mask` are
    not the client's: they are what the sampler recorded for the sequences the datum's provenance
    names (`meshrl.serve.stability`)."""
    return _policy_gradient(cispo, fp, clip_low=0.0, clip_high=truncation)
