"""Supervised fine-tuning configuration (`meshrl sft`): the run configuration plus an `sft:` section.

An SFT run's config is a `RunConfig` (the model, the learner and its LoRA settings, the meshes, the
output directory, `trainer.checkpoint` and `trainer.progress`) with the `sft` section beside it; a
run directory written by `meshrl sft` saves both, and `meshrl eval` reads either kind."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.base import Section
from meshrl.config.run import RunConfig


class SFTConfig(Section):
    """`meshrl sft`: supervised fine-tuning (the loss `cross_entropy`) on a JSONL file of
    conversations or on a run's successful trajectories, or offline DPO (the loss `dpo`) on a
    run's teacher preference pairs; exactly one of `data`, `trajectories` and `pairs` is set."""

    data: str | None = None
    """The training conversations: a JSONL file, one JSON object per line with a `messages` list of
    `{role, content}` (tinker-cookbook's `FromConversationFileBuilder` format; roles `system`,
    `user`, `assistant`, `tool`). `meshrl sft DATA` sets it."""

    trajectories: str | None = None
    """A run's `trajectories.jsonl` (docs/outputs.md): train on its successful trajectories (see
    `min_reward`), token in and token out: the recorded prompt and sampled token ids, loss weight on
    the policy's sampled tokens only (`mask`). `meshrl sft --trajectories FILE` sets it."""

    min_reward: float | None = None
    """Which trajectories of `trajectories` count as successful: None = those whose `correct` flag
    is true; a number = those whose `reward` is at least this."""

    pairs: str | None = None
    """A run's `pairs.jsonl` (docs/outputs.md): offline DPO on its teacher preference pairs (those
    not `dropped`), chosen over rejected, against the frozen starting policy. `meshrl sft --pairs
    FILE` sets it."""

    dpo_beta: float = Field(0.1, gt=0)
    """DPO's temperature (beta: the implicit reward's scale) for `pairs`."""

    eval_data: str | None = None
    """Held-out examples in the same format as the training file (`meshrl sft --eval-file`); None =
    hold out `eval_fraction` of it."""

    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the training file's examples held out for the evaluation (NLL; DPO: loss and
    preference accuracy) when `eval_data` is None (at least one example when above 0 and the file
    has two or more); 0 = no held-out evaluation."""

    seed: int = 0
    """Seed of the held-out split and of the training order (each epoch a permutation seeded by it;
    0 keeps the first epoch in the file's order)."""

    batch_size: int = Field(8, ge=1)
    """Examples (conversations, trajectories or pairs) per optimizer step."""

    epochs: int = Field(1, ge=1)
    """Passes over the training examples (ceil(examples / batch_size) steps each), unless `steps` is
    set."""

    steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; None = `epochs` passes."""

    lr_schedule: Literal["constant", "linear"] = "linear"
    """`learner.lr` throughout, or decayed linearly from `learner.lr` towards 0 over the run
    (tinker-cookbook's default)."""

    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant messages of a conversation carry loss weight (their content and end-of-turn
    token); every other token has weight 0."""

    max_length: int | None = Field(None, ge=2)
    """Conversations and trajectories are cut to this many tokens (None = `model.max_model_len`); one
    left with no assistant (sampled) token is skipped, as is a pair whose prompt and longer answer
    exceed it (counted in the log)."""

    eval_every: int = Field(10, ge=0)
    """Held-out evaluation every N steps (0 = only before the first step and after the last)."""


class SFTRunConfig(RunConfig):
    """Everything `meshrl sft` needs: a run configuration and its `sft` section."""

    sft: SFTConfig = SFTConfig()
    """Supervised fine-tuning (`meshrl sft`)."""


def config_class(data: dict) -> type[RunConfig]:
    """The config class of a saved run config (its YAML mapping): `SFTRunConfig` for a run of
    `meshrl sft` (it has an `sft` section), else `RunConfig`."""
    return SFTRunConfig if "sft" in data else RunConfig
