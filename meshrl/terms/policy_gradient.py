"""The policy-gradient term (GRPO/DAPO): group-relative advantages on the step's groups, trained
piece by piece as they arrive with the registered policy-gradient loss `trainer.loss.name`, then
normalised once per optimizer step by the step-wide count (`trainer.loss.normalize`).

  per piece     group-relative advantages -> Datums (zero-advantage sequences left out unless KL
                shaping gives them signal) -> (KL shaping against the reference policy) ->
                forward_backward, the gradients accumulating on the learner; the substep's last
                piece is held for the step's shared pass with the other terms (meshrl.terms.base)
  per substep   the normaliser over every piece's tokens scales the streamed pieces' accumulated
                gradients, and the held piece's loss in the shared pass
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshrl.losses.aggregation import GlobalCounts, global_scale
from meshrl.losses.registry import get_loss
from meshrl.terms.base import LossTerm, TermContext, add_metrics
from meshrl.training.policy import combine_metrics
from meshrl.training.trajectories import Trajectory, group_advantages, kl_shape_datums, rl_datums
from meshrl.types import LossPart


@dataclass
class _Substep:
    """What the term has trained since the last optimizer step."""

    counts: GlobalCounts = GlobalCounts(0.0, 0)
    groups: int = 0
    passes: list[dict] = field(default_factory=list)
    held: list = field(default_factory=list)
    """The datums of the substep's last piece, trained in the step's shared pass."""
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
        self.per_substep = self.tc.prompts_per_step // self.tc.num_substeps
        self.sub = _Substep()
        self.done = _Substep()  # the substep being finished, until the shared pass reports its last piece

    def loss_config(self) -> dict:
        return dict(self._config)

    def start_step(self, step: int) -> None:
        self.sub = _Substep()  # a failed step's pieces are trained again after the recovery

    def train_piece(self, groups: list[list[Trajectory]]) -> None:
        """One piece of the substep with its sequence-local weights: forward_backward at once
        while more pieces of the substep are to come (streaming), else (the substep's last piece)
        held for the step's shared pass with the other terms."""
        started = time.perf_counter()
        tc, sub = self.tc, self.sub
        trajectories = [t for g in groups for t in g]
        kl_coef = tc.advantage.kl_coef
        datums, stats = rl_datums(trajectories, group_advantages(trajectories, tc.advantage.std_normalize),
                                  tc.loss.normalize, skip_zero_advantage=kl_coef == 0)
        sub.counts += GlobalCounts(float(stats["tokens_total"]), stats["trainable_trajectories"])
        sub.groups += len(groups)
        add_metrics(sub.stats, {f"batch/{k}": v for k, v in stats.items() if k != "tokens_total"})
        if not datums:
            return
        if kl_coef > 0:
            reference = self.client.forward(datums, reference=True, temperature=self.logprob_temperature())
            sub.kl.append(kl_shape_datums(datums, reference, kl_coef)["kl/sampler_reference_k1"])
        if sub.groups >= self.per_substep:
            sub.held += datums
        else:
            sub.passes.append(self.client.forward_backward(datums, self.loss, self.loss_config(),
                                                           self.logprob_temperature()))
        add_metrics(sub.stats, {"timing/train_s": time.perf_counter() - started})

    def finish(self, version: int, metrics: dict) -> LossPart | float:
        """The step-wide normaliser on the streamed pieces' accumulated gradients (before any other
        term's), and the held piece as the term's part of the shared pass, at that scale."""
        sub, self.sub = self.sub, _Substep()
        scale = global_scale(self.tc.loss.normalize, sub.counts)
        if sub.passes:
            self.client.scale_grads(scale)
        if sub.kl:
            add_metrics(metrics, {"kl/sampler_reference_k1": sum(sub.kl) / len(sub.kl) / self.tc.num_substeps})
        add_metrics(metrics, {"batch/tokens_total": sub.counts.num_tokens})
        add_metrics(metrics, sub.stats)  # the pieces' datum counts and forward_backward time
        self.done = sub
        return self.part(sub.held, scale) if sub.held else self._report(scale, metrics)

    def trained(self, part: LossPart, result: dict, metrics: dict) -> float:
        self.done.passes.append(result)
        return self._report(part.scale, metrics)

    def _report(self, scale: float, metrics: dict) -> float:
        """The substep's normalised loss and its passes' combined metrics."""
        sub, self.done = self.done, _Substep()
        if not sub.passes:
            return 0.0
        combined = combine_metrics([(p["tokens"], p) for p in sub.passes])
        combined["loss"] *= scale
        add_metrics(metrics, {f"{self.prefix}/{k}": v / self.tc.num_substeps for k, v in combined.items()})
        return combined["loss"]
