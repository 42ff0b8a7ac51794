"""The policy-gradient term (GRPO/DAPO): group-relative advantages on the step's groups, trained
piece by piece as they arrive with the registered policy-gradient loss `trainer.loss.name`, then
normalised once per optimizer step by the step-wide count (`trainer.loss.normalize`).

  per piece     group-relative advantages -> Datums (zero-advantage sequences left out unless KL
                shaping gives them signal) -> (KL shaping against the reference policy) ->
                forward_backward, the gradients accumulating on the learner
  per substep   the normaliser over every piece's tokens scales the accumulated gradients
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshrl.losses.aggregation import GlobalCounts, global_scale
from meshrl.losses.registry import get_loss
from meshrl.terms.base import LossTerm, TermContext, add_metrics
from meshrl.training.policy import combine_metrics
from meshrl.training.trajectories import Trajectory, group_advantages, kl_shape_datums, rl_datums


@dataclass
class _Substep:
    """What the term has trained since the last optimizer step."""

    counts: GlobalCounts = GlobalCounts(0.0, 0)
    passes: list[dict] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


class PolicyGradientTerm(LossTerm):
    name, prefix = "grpo", "train"
    sampled = True  # ratios, KL shaping's reference logprobs and the entropy at the sampling temperature

    def __init__(self, ctx: TermContext, weight: float = 1.0, params=None):
        super().__init__(ctx, weight, params)
        self.tc = ctx.cfg.trainer
        self.loss = self.tc.loss.name
        self._config = get_loss(self.loss).config(self.tc.loss.params)
        self.sub = _Substep()

    def loss_config(self) -> dict:
        return dict(self._config)


    def start_step(self, step: int) -> None:
        self.sub = _Substep()  # a failed step's pieces are trained again after the recovery

    def train_piece(self, groups: list[list[Trajectory]]) -> None:
        """forward_backward on one piece of the substep with its sequence-local weights."""
        started = time.perf_counter()
        tc, sub = self.tc, self.sub
        trajectories = [t for g in groups for t in g]
        kl_coef = tc.advantage.kl_coef
        datums, stats = rl_datums(trajectories, group_advantages(trajectories, tc.advantage.std_normalize),
                                  tc.loss.normalize, skip_zero_advantage=kl_coef == 0)
        sub.counts += GlobalCounts(float(stats["tokens_total"]), stats["trainable_trajectories"])
        add_metrics(sub.stats, {f"batch/{k}": v for k, v in stats.items() if k != "tokens_total"})
        if not datums:
            return
        if kl_coef > 0:
            reference = self.client.forward(datums, reference=True, temperature=self.logprob_temperature())
            sub.kl.append(kl_shape_datums(datums, reference, kl_coef)["kl/sampler_reference_k1"])
        sub.passes.append(self.client.forward_backward(datums, self.loss, self.loss_config(),
                                                       self.logprob_temperature()))
        add_metrics(sub.stats, {"timing/train_s": time.perf_counter() - started})

    def finish(self, version: int, metrics: dict) -> float:
        """The step-wide normaliser on the accumulated gradients; the normalised loss."""
        sub, self.sub = self.sub, _Substep()
        scale = global_scale(self.tc.loss.normalize, sub.counts)
        loss = 0.0
        if sub.passes:
            self.client.scale_grads(scale)
            combined = combine_metrics([(p["tokens"], p) for p in sub.passes])
            combined["loss"] *= scale
            loss = combined["loss"]
            add_metrics(metrics, {f"{self.prefix}/{k}": v / self.tc.num_substeps for k, v in combined.items()})
        if sub.kl:
            add_metrics(metrics, {"kl/sampler_reference_k1": sum(sub.kl) / len(sub.kl) / self.tc.num_substeps})
        add_metrics(metrics, {"batch/tokens_total": sub.counts.num_tokens})
        add_metrics(metrics, sub.stats)  # the pieces' datum counts and forward_backward time
        return loss
