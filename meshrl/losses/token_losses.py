"""Token-level, sum-reduced policy losses (the Tinker built-ins).

Notation per token t: p_t = learner probability of the sampled token (``target_logprobs``,
differentiable), q_t = sampler probability (``sampling_logprobs``, constant), rho_t = p_t / q_t,
A_t = advantage (constant; [B] is broadcast over T), w_t = mask (bool, or float weights).

  cross_entropy:        L = -sum_t w_t log p_t
  importance_sampling:  L = -sum_t w_t rho_t A_t
  ppo:                  L = -sum_t w_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)
  cispo:                L = -sum_t w_t sg(clip(rho_t, clip_low, clip_high)) A_t log p_t

No mean is taken: normalisation (token-mean over the global batch, per-sequence mean, ...) is done by
the caller by scaling ``mask`` (see :mod:`meshrl.losses.aggregation`).  Masked positions contribute
exactly zero loss and zero gradient even when their logprobs are garbage (inf/nan-free by ``where``).

Metrics (Python floats): num_tokens counts the tokens with w_t != 0; the others are means over
the tokens that carry a training signal, w_t != 0 and A_t != 0 (a token with advantage 0, such as a
prompt position of a Tinker datum, adds nothing to these losses, so it says nothing about them):
  ratio_mean, ratio_max,
  kl_sampler_learner_k1 = mean(log q - log p)          (KL(q || p) estimated on samples from q)
  kl_sampler_learner_k3 = mean(rho - 1 - log rho)      (unbiased, always >= 0)
  clip_fraction(_low/_high) for ppo and cispo.
The same positions are the LossOutput's ``signal``.
"""

from __future__ import annotations

import torch

from pydantic import Field

from meshrl.advantages import kl_from_log_ratio
from meshrl.config.base import Section
from meshrl.logprobs import DEFAULT_CHUNK_SIZE, token_logprobs_and_entropy
from meshrl.losses.base import LossOutput, as_weights, broadcast_advantages, masked_max, masked_mean
from meshrl.losses.registry import ForwardPass, register_loss


def _check_logprobs(target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor) -> None:
    if target_logprobs.shape != sampling_logprobs.shape:
        raise ValueError(
            f"target_logprobs {tuple(target_logprobs.shape)} and sampling_logprobs "
            f"{tuple(sampling_logprobs.shape)} must have the same shape"
        )


def _log_ratio(target_logprobs, sampling_logprobs, valid) -> torch.Tensor:
    """log rho on valid tokens, 0 elsewhere (so exp() stays finite on padding)."""
    diff = target_logprobs - sampling_logprobs.detach().to(target_logprobs.dtype)
    return torch.where(valid, diff, torch.zeros_like(diff))


def _on_valid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``values`` on valid tokens, exactly 0 elsewhere (padding may hold nan/inf advantages or logprobs)."""
    return torch.where(valid, values, torch.zeros_like(values))


def _ratio_metrics(log_ratio: torch.Tensor, ratio: torch.Tensor, valid: torch.Tensor,
                   signal: torch.Tensor) -> dict[str, float]:
    """num_tokens (``valid``), and the ratio and sampler/learner KL means over ``signal``."""
    lr = log_ratio.detach()
    r = ratio.detach()
    return {
        "num_tokens": float(valid.sum()),
        "ratio_mean": masked_mean(r, signal),
        "ratio_max": masked_max(r, signal),
        "kl_sampler_learner_k1": masked_mean(kl_from_log_ratio(lr, "k1"), signal),
        "kl_sampler_learner_k3": masked_mean(kl_from_log_ratio(lr, "k3"), signal),
    }


def _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask):
    """(w, valid, A, log rho, rho, signal) for the ratio-based losses, each exactly 0 on invalid
    tokens; ``signal`` marks the valid tokens with A != 0."""
    _check_logprobs(target_logprobs, sampling_logprobs)
    w, valid = as_weights(mask, target_logprobs)
    adv = _on_valid(broadcast_advantages(advantages, target_logprobs), valid)
    log_ratio = _log_ratio(target_logprobs, sampling_logprobs, valid)
    return w, valid, adv, log_ratio, torch.exp(log_ratio), valid & (adv != 0)


def _clipped_output(loss, log_ratio, ratio, valid, signal, clipped_low, clipped_high) -> LossOutput:
    """LossOutput with ratio metrics plus clip fractions (of the signal tokens) below, above and in
    total."""
    n = max(int(signal.sum()), 1)
    metrics = {
        "loss": float(loss.detach()),
        **_ratio_metrics(log_ratio, ratio, valid, signal),
        "clip_fraction_high": float((clipped_high & signal).sum()) / n,
        "clip_fraction_low": float((clipped_low & signal).sum()) / n,
        "clip_fraction": float(((clipped_high | clipped_low) & signal).sum()) / n,
    }
    return LossOutput(loss, metrics, signal)


def cross_entropy(
    logits: torch.Tensor,
    target_tokens: torch.Tensor,
    weights: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LossOutput:
    """L = -sum_t w_t log softmax(logits_t)[target_t].

    ``logits`` [..., V] are already aligned with ``target_tokens`` [...] (Datum convention: position
    t predicts ``target_tokens[t]``); computed chunked in float32 via :mod:`meshrl.logprobs`.
    Metrics: nll_sum, weight_sum, nll_mean (weighted), entropy_mean (over w != 0), num_tokens.
    """
    logp, entropy = token_logprobs_and_entropy(logits, target_tokens, chunk_size=chunk_size)
    w, valid = as_weights(weights, logp)
    nll = torch.where(valid, -logp, torch.zeros_like(logp))
    loss = (nll * w).sum()
    weight_sum = float(w.sum())
    return LossOutput(
        loss,
        {
            "loss": float(loss.detach()),
            "nll_sum": float(loss.detach()),
            "weight_sum": weight_sum,
            "nll_mean": float(loss.detach()) / weight_sum if weight_sum else 0.0,
            "entropy_mean": masked_mean(entropy, valid),
            "num_tokens": float(valid.sum()),
        },
    )


def importance_sampling(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor | float,
    mask: torch.Tensor | None = None,
) -> LossOutput:
    """L = -sum_t w_t rho_t A_t.  At rho = 1 its gradient equals REINFORCE's, -sum_t w_t A_t grad log p_t."""
    w, valid, adv, log_ratio, ratio, signal = _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask)
    loss = -(_on_valid(ratio * adv, valid) * w).sum()
    metrics = {"loss": float(loss.detach()), **_ratio_metrics(log_ratio, ratio, valid, signal)}
    return LossOutput(loss, metrics, signal)


def ppo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor | float,
    mask: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> LossOutput:
    """L = -sum_t w_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t).

    DAPO clip-higher is ``eps_high=0.28``.  A token is *clipped* (zero gradient) when A > 0 and
    rho > 1 + eps_high (clip_fraction_high) or A < 0 and rho < 1 - eps_low (clip_fraction_low);
    clip_fraction is their sum, as a fraction of the signal tokens.
    """
    if not (0.0 <= eps_low < 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {eps_low}, {eps_high}")
    w, valid, adv, log_ratio, ratio, signal = _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -(_on_valid(torch.minimum(unclipped, clipped), valid) * w).sum()
    r = ratio.detach()
    clipped_high = (adv > 0) & (r > 1.0 + eps_high)
    clipped_low = (adv < 0) & (r < 1.0 - eps_low)
    return _clipped_output(loss, log_ratio, ratio, valid, signal, clipped_low, clipped_high)


def cispo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor | float,
    mask: torch.Tensor | None = None,
    clip_low: float = 0.0,
    clip_high: float = 4.0,
) -> LossOutput:
    """L = -sum_t w_t sg(clip(rho_t, clip_low, clip_high)) A_t log p_t  (clip bounds are absolute ratios).

    Unlike PPO no token loses its gradient: the IS weight is clipped and detached instead.
    clip_fraction counts the signal tokens whose ratio lies outside [clip_low, clip_high].
    """
    if not 0.0 <= clip_low <= clip_high:
        raise ValueError(f"need 0 <= clip_low <= clip_high, got {clip_low}, {clip_high}")
    w, valid, adv, log_ratio, ratio, signal = _ratio_terms(target_logprobs, sampling_logprobs, advantages, mask)
    coef = ratio.detach().clamp(clip_low, clip_high)
    loss = -(coef * adv * _on_valid(target_logprobs, valid) * w).sum()
    r = ratio.detach()
    return _clipped_output(loss, log_ratio, ratio, valid, signal, r < clip_low, r > clip_high)


# ---- registered forms: Datum fields `logprobs` (sampler), `advantages` (per sequence [B] or per
# token [B, T]) and `mask` (per-token weights carrying the normaliser) --------------------------
def _policy_gradient(loss, fp: ForwardPass, **config) -> LossOutput:
    i = fp.inputs
    return loss(fp.logprobs(), i["logprobs"], i["advantages"], mask=i["mask"], **config)


class PPOParams(Section):
    """The clipped ratio's bounds."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Lower clip: ratio floor 1 - eps_low."""

    eps_high: float = Field(0.2, ge=0.0)
    """Upper clip: ratio ceiling 1 + eps_high (DAPO clip-higher uses 0.28)."""


class CISPOParams(Section):
    """Bounds of the stop-gradient importance weight."""

    clip_low: float = Field(0.0, ge=0.0)
    """Lower bound on the stop-gradient ratio."""

    clip_high: float = Field(4.0, gt=0.0)
    """Upper bound on the stop-gradient ratio."""


@register_loss("importance_sampling", kind="policy_gradient")
def importance_sampling_loss(fp: ForwardPass) -> LossOutput:
    return _policy_gradient(importance_sampling, fp)


@register_loss("ppo", kind="policy_gradient", params=PPOParams)
def ppo_loss(fp: ForwardPass, eps_low: float = 0.2, eps_high: float = 0.2) -> LossOutput:
    return _policy_gradient(ppo, fp, eps_low=eps_low, eps_high=eps_high)


@register_loss("cispo", kind="policy_gradient", params=CISPOParams)
def cispo_loss(fp: ForwardPass, clip_low: float = 0.0, clip_high: float = 4.0) -> LossOutput:
    return _policy_gradient(cispo, fp, clip_low=clip_low, clip_high=clip_high)


@register_loss("cross_entropy", kind="supervised", valid_key="weights")
def cross_entropy_loss(fp: ForwardPass) -> LossOutput:
    """Datum field `weights`: per-token weight of the target token's negative log-likelihood."""
    valid = fp.valid
    return cross_entropy(fp.logits(), fp.inputs["target_tokens"][valid], fp.inputs["weights"][valid])
