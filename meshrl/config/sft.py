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
    """`meshrl sft`: supervised fine-tuning on a JSONL file of conversations, with the loss
    `cross_entropy` on the assistant turns."""

    data: str | None = None
    """The training conversations: a JSONL file, one JSON object per line with a `messages` list of
    `{role, content}` (tinker-cookbook's `FromConversationFileBuilder` format; roles `system`,
    `user`, `assistant`, `tool`). `meshrl sft DATA` sets it."""

    eval_data: str | None = None
    """Held-out conversations in the same format (`meshrl sft --eval-file`); None = hold out
    `eval_fraction` of `data`."""

    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of `data` held out for the NLL evaluation when `eval_data` is None (at least one
    conversation when above 0 and `data` has two or more); 0 = no held-out evaluation."""

    seed: int = 0
    """Seed of the held-out split and of the training order (each epoch a permutation seeded by it;
    0 keeps the first epoch in the file's order)."""

    batch_size: int = Field(8, ge=1)
    """Conversations per optimizer step."""

    epochs: int = Field(1, ge=1)
    """Passes over the training conversations (ceil(conversations / batch_size) steps each), unless
    `steps` is set."""

    steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; None = `epochs` passes."""

    lr_schedule: Literal["constant", "linear"] = "linear"
    """`learner.lr` throughout, or decayed linearly from `learner.lr` towards 0 over the run
    (tinker-cookbook's default)."""

    train_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """Which assistant messages carry loss weight (their content and end-of-turn token); every
    other token has weight 0."""

    max_length: int | None = Field(None, ge=2)
    """Conversations are cut to this many tokens (None = `model.max_model_len`); one left with no
    assistant token is skipped (counted in the log)."""

    eval_every: int = Field(10, ge=0)
    """Held-out NLL every N steps (0 = only before the first step and after the last)."""


class SFTRunConfig(RunConfig):
    """Everything `meshrl sft` needs: a run configuration and its `sft` section."""

    sft: SFTConfig = SFTConfig()
    """Supervised fine-tuning (`meshrl sft`)."""


def config_class(data: dict) -> type[RunConfig]:
    """The config class of a saved run config (its YAML mapping): `SFTRunConfig` for a run of
    `meshrl sft` (it has an `sft` section), else `RunConfig`."""
    return SFTRunConfig if "sft" in data else RunConfig
