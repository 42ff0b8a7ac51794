"""Generalized Jensen-Shannon divergence for on-policy (hint) self-distillation (GKD / OPSD / SDPO).

Per token, with S = log_softmax(student_logits / temperature) and T = log_softmax(teacher_logits /
temperature) (the teacher is detached: no gradient ever reaches it):

    beta = 0:       KL(T || S) = sum_v T_v (log T_v - log S_v)          (forward KL)
    beta = 1:       KL(S || T) = sum_v S_v (log S_v - log T_v)          (reverse KL)
    0 < beta < 1:   m = (1 - beta) S + beta T   (computed in log space with logsumexp)
                    JSD_beta = beta KL(T || m) + (1 - beta) KL(S || m)

(The mixture formula tends to 0 at both ends, so the pure KLs are special-cased, as in TRL's GKD.)
An optional per-token clip caps each token's divergence (``token_clip``, SDPO's design uses 10 nats)
so that a few tokens on which the hinted teacher and the student disagree wildly cannot dominate
the step; a capped token contributes its cap and no gradient.
Tokens with ``labels == -100`` are ignored; the default ``reduction="batchmean"`` divides the sum
over valid tokens by their number; ``reduction="sum"`` leaves normalisation to the caller (use it
with a global token count for micro-batch equivalence).  Memory: the full-vocabulary path holds a
few float32 [N, V] tensors for the N rows passed in, so pass the error-site rows only (or use top-k).

Top-k form.  When the teacher only provides its top-k log-probabilities (indices [..., k], values
[..., k]), both distributions are *restricted to the teacher's top-k support and renormalised*:
S_k = log_softmax(student_logits[idx] / temperature), T_k = log_softmax(teacher_values / temperature)
and the same divergence is taken over the k entries.  Why this choice: it is a proper divergence
between two distributions on one support (0 iff they agree there), needs no guess about how the
teacher's remaining mass is spread over V - k tokens, and with k = V equals the full-vocabulary
result.  Its blind spot: the student's mass outside the support is not penalised (only its shape
inside is), which ``student_topk_mass`` in the metrics makes visible.  Dividing normalised
log-probs by the temperature and renormalising over the support gives exactly
softmax(teacher_logits / temperature) restricted to the support, so ``temperature`` stays exact.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field

from meshrl.logprobs import selective_log_softmax
from meshrl.config.base import Section
from meshrl.losses.base import LossOutput, masked_mean
from meshrl.losses.registry import ForwardPass, register_loss

IGNORE_INDEX = -100


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """sum_v p_v (log p_v - log q_v) over the last dim, with 0 log 0 = 0."""
    terms = log_p.exp() * (log_p - log_q)
    return torch.where(torch.isneginf(log_p), torch.zeros_like(terms), terms).sum(-1)


def jsd_per_token(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """Generalized JSD between normalised log-distributions on the last dim (see module docstring)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return _kl(teacher_logp, student_logp)
    if beta == 1.0:
        return _kl(student_logp, teacher_logp)
    mixture = torch.logsumexp(
        torch.stack([student_logp + math.log(1.0 - beta), teacher_logp + math.log(beta)]), dim=0
    )
    return beta * _kl(teacher_logp, mixture) + (1.0 - beta) * _kl(student_logp, mixture)


def _reduce(
    per_token: torch.Tensor,
    valid: torch.Tensor,
    reduction: str,
    token_weights: torch.Tensor | None,
    extra_metrics: dict[str, float],
    token_clip: float = 0.0,
) -> LossOutput:
    if token_clip < 0:
        raise ValueError(f"token_clip must be >= 0 (0 = off), got {token_clip}")
    metrics = {"jsd_mean": masked_mean(per_token, valid)}
    if token_clip > 0:
        metrics["token_clip_frac"] = masked_mean((per_token.detach() > token_clip).to(per_token.dtype), valid)
        per_token = per_token.clamp(max=token_clip)
    values = torch.where(valid, per_token, torch.zeros_like(per_token))
    if token_weights is not None:
        if token_weights.shape != valid.shape:
            raise ValueError(f"token_weights {tuple(token_weights.shape)} must match {tuple(valid.shape)}")
        values = values * token_weights.detach().to(values.dtype)
    total = values.sum()
    count = int(valid.sum())
    if reduction == "batchmean":
        loss = total / max(count, 1)
    elif reduction == "sum":
        loss = total
    else:
        raise ValueError(f"reduction must be 'batchmean' or 'sum', got {reduction!r}")
    metrics.update(extra_metrics, loss=float(loss.detach()), num_tokens=float(count))
    return LossOutput(loss, metrics)


def generalized_jsd_topk(
    student_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    teacher_topk_logprobs: torch.Tensor,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    token_weights: torch.Tensor | None = None,
    token_clip: float = 0.0,
) -> LossOutput:
    """Generalized JSD on the teacher's top-k support (both sides restricted and renormalised).

    ``student_logits`` [..., V]; ``teacher_topk_indices`` / ``teacher_topk_logprobs`` [..., k];
    ``mask`` [...] (bool/float; nonzero = error-site token to distil), default all tokens.
    ``token_weights`` [...] optionally scales each token's divergence (e.g. SDPO's IS weight
    min(exp(logp - logp_old), 2)); it is treated as a constant. ``token_clip`` > 0 caps each
    token's divergence at that value before the weights apply (a capped token gives no gradient;
    `token_clip_frac` reports how many were capped); 0 = off.
    Metrics add teacher_topk_mass (teacher mass on the support, assuming its values are normalised
    full-vocabulary log-probs) and student_topk_mass (student mass on the same support).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if teacher_topk_indices.shape != teacher_topk_logprobs.shape:
        raise ValueError("teacher_topk_indices and teacher_topk_logprobs must have the same shape")
    if teacher_topk_indices.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(
            f"teacher top-k {tuple(teacher_topk_indices.shape)} does not match student logits "
            f"{tuple(student_logits.shape)} on the leading dims"
        )
    dtype = _compute_dtype(student_logits)
    valid = torch.ones(student_logits.shape[:-1], dtype=torch.bool, device=student_logits.device)
    if mask is not None:
        valid = mask.detach() != 0
    student_scaled = student_logits.to(dtype) / temperature
    student_support = student_scaled.gather(-1, teacher_topk_indices.long())
    student_logp = torch.log_softmax(student_support, dim=-1)
    teacher_values = teacher_topk_logprobs.detach().to(dtype)
    teacher_logp = torch.log_softmax(teacher_values / temperature, dim=-1)
    per_token = jsd_per_token(student_logp, teacher_logp, beta)
    with torch.no_grad():
        student_mass = (torch.logsumexp(student_support, -1) - torch.logsumexp(student_scaled, -1)).exp()
        teacher_mass = torch.logsumexp(teacher_values, -1).exp()
    extra = {
        "teacher_topk_mass": masked_mean(teacher_mass, valid),
        "student_topk_mass": masked_mean(student_mass, valid),
    }
    return _reduce(per_token, valid, reduction, token_weights, extra, token_clip)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
    reduction: str = "batchmean",
    token_weights: torch.Tensor | None = None,
    token_clip: float = 0.0,
) -> LossOutput:
    """Generalized JSD between student and (detached) teacher logits [..., V]; labels [...] (-100 = skip).

    ``top_k``: restrict to the teacher's top-k tokens (after temperature) and renormalise both sides;
    identical to :func:`generalized_jsd_topk` fed with the teacher's top-k log-probs.
    ``token_clip``: as in :func:`generalized_jsd_topk`.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student {tuple(student_logits.shape)} and teacher {tuple(teacher_logits.shape)} logits differ in shape"
        )
    if labels.shape != student_logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must match logits {tuple(student_logits.shape)} minus V")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    valid = labels != IGNORE_INDEX
    dtype = _compute_dtype(student_logits)
    if top_k is not None:
        if not 1 <= top_k <= student_logits.shape[-1]:
            raise ValueError(f"top_k must be in [1, V], got {top_k}")
        # Top-k of teacher_logits / temperature has the same indices as at temperature 1.
        teacher_logp1 = torch.log_softmax(teacher_logits.detach().to(dtype), dim=-1)
        values, indices = teacher_logp1.topk(top_k, dim=-1)
        return generalized_jsd_topk(
            student_logits, indices, values, valid, beta, temperature, reduction, token_weights, token_clip
        )
    teacher_logp = torch.log_softmax(teacher_logits.detach().to(dtype) / temperature, dim=-1)
    student_logp = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    per_token = jsd_per_token(student_logp, teacher_logp, beta)
    return _reduce(per_token, valid, reduction, token_weights, {}, token_clip)


class SDPOJSDParams(Section):
    """The generalized JSD of SDPO's hint distillation."""

    beta: float = Field(0.5, ge=0.0, le=1.0)
    """Interpolation: 0 = KL(teacher||student), 1 = KL(student||teacher)."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature applied to both student and teacher logits."""

    is_weight_cap: float = Field(0.0, ge=0)
    """SDPO's per-token importance weight min(p/q, cap) on the JSD (0 = off)."""

    token_clip: float = Field(10.0, ge=0)
    """Each token's divergence is capped at this value (nats) before weighting; 0 = off."""


@register_loss("sdpo_jsd", kind="distillation", params=SDPOJSDParams)
def sdpo_jsd_loss(fp: ForwardPass, beta: float = 0.5, temperature: float = 1.0,
                  is_weight_cap: float = 0.0, token_clip: float = 10.0) -> LossOutput:
    """SDPO hint distillation on error-site tokens. Datum fields: `mask` (per-token weight, non-zero
    exactly on the error site's response tokens), `teacher_topk_indices` / `teacher_topk_logprobs`
    ([T, k]: the hinted teacher's top-k at each of those positions; without indices the logprobs
    cover the full vocabulary, [T, V]) and `logprobs` (the sampler's, for SDPO's optional
    importance weight min(p / q, is_weight_cap); 0 = off); each token's divergence is capped at
    ``token_clip`` (0 = off)."""
    i, valid = fp.inputs, fp.valid
    logits = fp.logits()
    weights = i["mask"][valid]
    if is_weight_cap > 0:
        with torch.no_grad():
            logp = selective_log_softmax(logits, i["target_tokens"][valid], temperature=fp.temperature)
            weights = weights * torch.exp(logp - i["logprobs"][valid]).clamp(max=is_weight_cap)
    teacher = i["teacher_topk_logprobs"][valid]
    if "teacher_topk_indices" not in i:
        labels = torch.zeros(teacher.shape[:-1], dtype=torch.long, device=teacher.device)  # every row counts
        return generalized_jsd(logits, teacher, labels, beta=beta, temperature=temperature, reduction="sum",
                               token_weights=weights, token_clip=token_clip)
    return generalized_jsd_topk(logits, i["teacher_topk_indices"][valid], teacher, beta=beta,
                                temperature=temperature, reduction="sum", token_weights=weights, token_clip=token_clip)
