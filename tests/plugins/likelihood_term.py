"""A loss, a policy-gradient loss and a loss term from outside the package: a run that names this
file in `plugins` can select them in its config (tests/test_terms.py)."""

import torch
from pydantic import Field

from meshrl.config.base import Section
from meshrl.losses import LossOutput, register_loss
from meshrl.losses.base import broadcast_advantages
from meshrl.terms import DatumTerm, register_term
from meshrl.types import Datum


class CappedParams(Section):
    """The importance ratio's cap."""

    cap: float = Field(2.0, gt=0)
    """Ratios above this count as this."""


@register_loss("capped_importance_sampling", kind="policy_gradient", params=CappedParams)
def capped_importance_sampling(fp, cap: float = 2.0) -> LossOutput:
    """L = -sum_t w_t min(p_t / q_t, cap) A_t, with the fraction of capped tokens as a metric."""
    i, valid = fp.inputs, fp.valid
    logprobs = fp.logprobs()
    log_ratio = torch.where(valid, logprobs - i["logprobs"].to(logprobs.dtype), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    capped = torch.clamp(ratio, max=cap)
    loss = -(i["mask"] * capped * broadcast_advantages(i["advantages"], logprobs)).sum()
    count = max(int(valid.sum()), 1)
    return LossOutput(loss, {"capped_fraction": float(((ratio > cap) & valid).sum()) / count})


@register_loss("reply_likelihood", kind="other")
def reply_likelihood(fp) -> LossOutput:
    """L = -sum_t w_t log p_t on the datums' `mask` tokens (their weights carry the term's weight)."""
    loss = -(fp.inputs["mask"] * fp.logprobs()).sum()
    return LossOutput(loss, {"reply_tokens": float(fp.valid.sum())})


class ReplyLikelihoodParams(Section):
    """Which replies the term raises the likelihood of."""

    max_datums: int = Field(4, ge=1)
    """At most this many replies a unit: those with the highest reward, reward above 0."""


@register_term("reply_likelihood", prefix="likelihood")
class ReplyLikelihood(DatumTerm):
    """Raise the likelihood of each unit's best replies (token mean, times the term's weight)."""

    loss = "reply_likelihood"
    Params = ReplyLikelihoodParams

    def make_datums(self, unit, state) -> list[Datum]:
        best = sorted((t for t in unit.sampled if t.tokens and t.reward > 0), key=lambda t: -t.reward)
        return [Datum.from_sequence(t.prompt_tokens + t.tokens, mask=[0] * len(t.prompt_tokens) + [1] * len(t.tokens))
                for t in best[: self.params.max_datums]]
