"""Which model the run trains and serves."""

from __future__ import annotations

from typing import Literal

from meshrl.config.base import Section


class ModelConfig(Section):
    """The policy model shared by the learner, generators and the SDPO teacher."""

    name_or_path: str = "smollm2-135m-instruct"
    """A cached model name (`smollm2-135m-instruct`, the packaged default; `tiny`, a random 2-layer
    test model) or a local HF model directory containing config.json."""

    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype for inference (generators, SDPO teacher) and for autocast in the learner; the learner
    keeps float32 master weights either way."""

    max_model_len: int = 1024
    """Longest sequence (prompt + response) any component will handle; longer prompts are skipped
    and counted."""
