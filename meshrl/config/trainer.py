"""Controller (training loop) configuration."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section


class LossConfig(Section):
    """The policy-gradient term's loss (GRPO/DAPO family)."""

    name: str = Field("ppo", min_length=1)
    """A registered loss of kind `policy_gradient`: `ppo` (clipped ratio), `importance_sampling`
    (p/q weighted), `cispo`, `dro`, `gspo`, `stable_reinforce` (docs/losses.md), or one that a
    module in `plugins` registers (`meshrl.losses.register_loss(..., kind="policy_gradient")`)."""

    params: dict[str, Any] = {}
    """The loss's parameters, checked against the typed parameters it was registered with (`ppo`
    and `gspo`: `eps_low`, `eps_high`, both 0.2 by default, DAPO clip-higher uses eps_high 0.28;
    `cispo`: `clip_low` 0, `clip_high` 4; `dro`: `beta` 0.05; `stable_reinforce`: `truncation` 2);
    unset ones take their defaults."""

    normalize: Literal["token_mean", "sequence_mean", "sum"] = "token_mean"
    """How token losses are aggregated: `token_mean` divides by all valid tokens of the step's batch
    (DAPO), `sequence_mean` averages per-sequence token means, `sum` keeps the raw sum."""


class TermConfig(Section):
    """One loss term of a module in `plugins` (`meshrl.terms.register_term`), added to the step's loss."""

    name: str = Field(min_length=1)
    """The registered term."""

    weight: float = Field(1.0, gt=0)
    """Its weight in the step's loss."""

    params: dict[str, Any] = {}
    """Its parameters, checked against the typed parameters it was registered with."""


class AdvantageConfig(Section):
    """Group-relative credit assignment."""

    std_normalize: bool = False
    """Divide group-centred rewards by the group's std (+eps); off = Dr.GRPO/Tinker default."""

    drop_uniform_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no signal) from
    channel 1, and roll out more tasks until `prompts_per_step` informative groups are in. The
    SDPO and replay channels still see every sampled trajectory."""

    max_extra_rounds: int = Field(2, ge=0)
    """With drop_uniform_groups: most extra rounds (each a further `prompts_per_step` tasks from the
    stream) rolled out to reach `prompts_per_step` informative groups; if they are not enough the
    step trains on those it has (logged, `batch/missing_groups`)."""

    overlong_cache_tokens: int = Field(0, ge=0)
    """DAPO overlong reward shaping for every task (0 = off): each sampled turn of L tokens adds
    0 while L <= Lmax - this, ((Lmax - this) - L) / this up to Lmax, and -1 past it, where Lmax is
    `generator.sampling.max_new_tokens`; applied before advantages (and dynamic sampling)."""

    kl_coef: float = Field(0.0, ge=0)
    """KL-as-reward shaping against the frozen reference policy (the initial weights), never a
    loss term: each sampled token's advantage becomes A + kl_coef * (mean(d) - d_t) with
    d_t = log q_t - log p_ref_t (q = the sampler) and the mean over the piece being trained (the
    whole step unless it is streamed in `num_substeps x num_minibatches` pieces); 0 = off (no
    reference forward at all)."""


class EvalConfig(Section):
    """Greedy held-out evaluation."""

    every: int = Field(10, ge=0)
    """Evaluate every N steps (0 = never during training); also at the start and the end."""

    size: int = Field(200, ge=1)
    """Held-out problems per evaluation (at most the task's held-out set)."""

    at_start: bool = True
    """Evaluate before the first step."""


class CheckpointConfig(Section):
    """Atomic run checkpoints (learner state + controller state + channel state)."""

    every: int = Field(10, ge=0)
    """Write a checkpoint every N steps (0 = only at the end)."""

    keep: int = Field(2, ge=1)
    """Complete checkpoints kept on disk (older ones are deleted)."""

    export_final: bool = True
    """At the end, also export the policy as a standard HF model directory (LoRA merged)."""


class TrainerConfig(Section):
    """The GRPO loop run by the controller: a producer rolls out tasks, the learner trains on them."""

    steps: int = Field(40, ge=1)
    """Training steps to run; each publishes one weight version after `num_substeps` optimizer
    updates."""

    prompts_per_step: int = Field(8, ge=1)
    """Distinct problems (groups) per step: Tinker's `batch_size` / `groups_per_batch`."""

    group_size: int = Field(8, ge=1)
    """Samples per problem (the GRPO group)."""

    num_substeps: int = Field(1, ge=1)
    """Optimizer updates per step: the step's groups are split into this many equal parts, in
    order, and each part is trained on once with its own normaliser and optimizer step."""

    num_minibatches: int = Field(1, ge=1)
    """Streaming minibatches per substep: the producer rolls out a substep's tasks in this many
    pieces and the learner runs `forward_backward` on each piece as soon as it is scored, while the
    next piece is generated; the substep's optimizer step follows the last piece (the same update as
    one batch)."""

    max_steps_off_policy: int = Field(0, ge=0)
    """Staleness bound K: generation of step s's tasks is admitted only while the latest published
    weight version v satisfies s - 1 - v <= K, so every sample is trained at most K versions after
    the one that sampled it (checked again from the stamps when training; a violation is dropped
    and counted). 0 = synchronous: generation and training take turns across steps (within a step
    they still overlap through streaming minibatches). K >= 1 overlaps them; keep the clipped `ppo`
    loss then (plain importance sampling destabilises at staleness 3)."""

    seed: int = 0
    """Seed of the training data order: each epoch of the task's training stream is a permutation
    seeded by it (0 keeps the first epoch in the task's own order)."""

    loss: LossConfig = LossConfig()
    """Policy-gradient loss."""

    terms: list[TermConfig] = []
    """Loss terms of your own beside the built-in ones (policy gradient; `sdpo` and `replay`, each
    on when its weight is above 0), in this order after them."""

    advantage: AdvantageConfig = AdvantageConfig()
    """Advantage computation."""

    eval: EvalConfig = EvalConfig()
    """Held-out evaluation."""

    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpointing and resume."""

    progress: bool = True
    """Show a progress bar on the terminal."""

    @model_validator(mode="after")
    def _check_pieces(self) -> "TrainerConfig":
        pieces = self.num_substeps * self.num_minibatches
        if self.prompts_per_step % pieces:
            raise ValueError(f"prompts_per_step = {self.prompts_per_step} must be a multiple of num_substeps x "
                             f"num_minibatches = {pieces}")
        return self
