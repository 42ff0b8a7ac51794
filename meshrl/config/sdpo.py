"""Channel 2: SDPO hint self-distillation (and its optional LLM hint generator)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from meshrl.config.base import Section
from meshrl.config.meshes import ChannelMesh
from meshrl.config.teachers import TeacherEndpointConfig

DEFAULT_HINTS: dict[str, str] = {
    "math.wrong_answer": "Hint: {extracted} is not right. The correct answer is {answer}.",
    "math.wrong_format": "Hint: finish with the final result as a plain number. The answer is {answer}.",
    "wrong_answer": "Hint: that answer is not right. The correct answer is {answer}.",
    "wrong_format": "Hint: the answer must be given plainly. The correct answer is {answer}.",
}


DEFAULT_HINT_INSTRUCTION = (
    "You are coaching a student model that just made a mistake. You see the conversation it was "
    "given and the error it caused. Reply with one short hint, at most two sentences, that points "
    "toward the fix without giving the full solution."
)


class HintGeneratorConfig(Section):
    """Optional LLM hint generator for the SDPO channel: ask a model for a short hint given the
    context and an error description."""

    enabled: bool = False
    """Use the LLM hint generator (otherwise hints come from templates only)."""

    endpoint: TeacherEndpointConfig | None = None
    """The OpenAI-compatible endpoint asked for hints; required when enabled."""

    instruction: str = Field(default=DEFAULT_HINT_INSTRUCTION, min_length=1)
    """System instruction sent with every hint request."""

    max_context_chars: int = Field(default=6000, ge=100)
    """The rendered conversation is cut to its last this-many characters."""

    max_error_chars: int = Field(default=1000, ge=10)
    """The error description is cut to this many characters."""

    max_hint_chars: int = Field(default=400, ge=10)
    """Longer hints are cut to this many characters."""

    @model_validator(mode="after")
    def _check_endpoint(self) -> HintGeneratorConfig:
        if self.enabled and self.endpoint is None:
            raise ValueError("enabled hint generator needs an endpoint")
        return self


class SDPOConfig(Section):
    """Channel 2: the policy, re-run without grad on its context plus a hint at the error turn,
    is distilled back into the student on the error-site tokens with a generalized JSD."""

    alpha: float = Field(0.0, ge=0)
    """Weight of the SDPO JSD term in the total loss; 0 disables the channel at zero cost."""

    alpha_warmup_steps: int = Field(0, ge=0)
    """Alpha warm-up: the weight rises linearly from 0 at step 1 to `alpha` at step
    `alpha_warmup_steps + 1`, then stays constant; while it is 0 no site is scored. 0 = `alpha`
    from the first step."""

    teacher: Literal["mesh", "learner"] = "learner"
    """Where the hinted teacher's forward runs: `learner` (the default, the faster one in
    `benchmarks/sdpo_cost.py`) = in the learner's processes, which already hold the current weights
    (no extra mesh, no extra pull; the scoring runs before each optimizer step, on the learner's
    time); `mesh` = its own SDPOTeacherActor mesh (a weight reader that pulls every version, scoring
    in the producer while the learner trains)."""

    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    """Generalized JSD interpolation: 0 = KL(teacher||student), 1 = KL(student||teacher)."""

    temperature: float = Field(1.0, gt=0)
    """Softmax temperature applied to both student and teacher logits."""

    top_k: int = Field(32, ge=0)
    """Teacher tokens kept per position (both distributions renormalised on them); 0 = full vocabulary."""

    max_sites_per_step: int = Field(16, ge=1)
    """Most error sites distilled per step (the budget's ceiling under `cost_share`)."""

    candidates_per_site: float = Field(1.0, ge=1.0)
    """Error sites the hinted teacher scores per site a step may train: with more than 1, the step
    trains those where the teacher and the student disagree most (the mean, over a site's tokens,
    of the sampler's log-probability minus the teacher's: a sampled KL(student || teacher)) and
    drops the rest; 1 = it trains every site it scores."""

    cost_share: float = Field(0.0, ge=0)
    """Adaptive budget: 0 = every step may train `max_sites_per_step` sites; above 0 = after each
    step, the next may train as many as cost about this fraction of the rest of the step's
    seconds, at the channel's measured cost per site (the teacher's scoring when it runs in the
    learner, plus the learner's time on the rows only SDPO reads), between 1 and
    `max_sites_per_step`."""

    min_shared_prefix: int = Field(16, ge=0)
    """Sites whose hinted contexts share at least this many leading tokens (one prompt's samples
    share the prompt) are scored with that prefix forwarded once; 0 = each site forwarded whole."""

    max_sites_per_episode: int = Field(4, ge=1)
    """Most error sites taken from one multi-turn episode: its earliest failing turns (every turn
    whose action did not solve the task is an error site, in a failed or a successful episode)."""

    is_weight_cap: float = Field(0.0, ge=0)
    """SDPO's per-token importance weight min(p/q, cap) on the JSD (0 = off; the paper uses 2)."""

    token_clip: float = Field(10.0, ge=0)
    """Each error-site token's JSD is capped at this many nats before it is averaged (0 = off)."""

    hints: dict[str, str] = DEFAULT_HINTS
    """Hint templates by hint_template_key (environment hints take precedence); fields such as
    {answer} and {extracted} come from the verifier's info and the problem."""

    hint_generator: HintGeneratorConfig = HintGeneratorConfig()
    """Optional LLM hint generator (same OpenAI-compatible client as the teachers)."""

    mesh: ChannelMesh = ChannelMesh()
    """Where the SDPOTeacherActor runs (`teacher: mesh`)."""

    call_timeout_s: float = Field(300.0, gt=0)
    """Deadline for one teacher scoring call."""
