"""The run configuration: every component's section composed into one object."""

from __future__ import annotations

from pydantic import Field, model_validator

from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.config.base import Section
from meshrl.config.replay import ReplayConfig
from meshrl.config.sdpo import SDPOConfig
from meshrl.config.serve import ServeConfig
from meshrl.config.diloco import DiLoCoConfig
from meshrl.config.faults import FaultsConfig
from meshrl.config.generation import GeneratorConfig
from meshrl.config.launch import LaunchConfig
from meshrl.config.learner import LearnerConfig
from meshrl.config.meshes import LEARNER, MeshesConfig
from meshrl.config.model import ModelConfig
from meshrl.config.task import TaskConfig
from meshrl.config.trainer import TrainerConfig


class OutputConfig(Section):
    """Where results go."""

    dir: str = "runs"
    """Parent directory of run directories."""

    name: str | None = None
    """Run directory name under `dir`; None = `<task>-<timestamp>`."""

    tensorboard: bool = False
    """Also write TensorBoard event files (needs the `tensorboard` package)."""

    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs `wandb` and a login)."""


class RewarderConfig(Section):
    """The Rewarder actor mesh: verifiable rewards."""

    timeout_s: float = Field(120.0, gt=0)
    """Deadline for scoring one batch of rollouts."""

    reward_fn: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Custom verifier as `package.module:function`, called as fn(problem, response_text) ->
    (reward, info dict); None uses the task's own grader."""


class RunConfig(Section):
    """Everything `meshrl train` and `meshrl serve` need."""

    plugins: list[str] = []
    """Python modules (`pkg.module`) or files (`path/to/file.py`) imported before the run starts, in
    the controller and in every learner process: they register losses
    (`meshrl.losses.register_loss`) and loss terms (`meshrl.terms.register_term`) that
    `trainer.loss.name` and `trainer.terms` can then name."""

    model: ModelConfig = ModelConfig()
    """The policy model."""

    task: TaskConfig = TaskConfig()
    """Training and evaluation problems."""

    generator: GeneratorConfig = GeneratorConfig()
    """Sampling engine."""

    learner: LearnerConfig = LearnerConfig()
    """Optimisation."""

    rewarder: RewarderConfig = RewarderConfig()
    """Reward computation."""

    trainer: TrainerConfig = TrainerConfig()
    """The training loop."""

    meshes: MeshesConfig = MeshesConfig()
    """Process layout."""

    weight_sync: WeightSyncConfig = WeightSyncConfig()
    """Learner -> generator weight transfer."""

    sdpo: SDPOConfig = SDPOConfig()
    """Channel 2: SDPO hint self-distillation."""

    replay: ReplayConfig = ReplayConfig()
    """Channel 3: N-teacher trace replay (DPO over the delayed channel)."""

    faults: FaultsConfig = FaultsConfig()
    """Failure handling and fault injection."""

    output: OutputConfig = OutputConfig()
    """Results."""

    launch: LaunchConfig = LaunchConfig()
    """Where the hosts come from (this machine, host workers, SLURM, Kubernetes)."""

    serve: ServeConfig = ServeConfig()
    """`meshrl serve`: the Tinker-protocol HTTP server."""

    diloco: DiLoCoConfig = DiLoCoConfig()
    """DiLoCo across replicas (separate jobs) through an object store."""

    @property
    def _sharded_learner(self) -> bool:
        """More than one learner process under FSDP2: no process holds all the weights."""
        return self.meshes.learner.procs > 1 and self.learner.data_parallel == "fsdp2"

    @model_validator(mode="after")
    def _check_data_parallel(self) -> "RunConfig":
        if self._sharded_learner and self.diloco.enabled:
            raise ValueError("diloco.enabled with learner.data_parallel = 'fsdp2' is not supported: use "
                             "learner.data_parallel = 'ddp' for a data-parallel DiLoCo replica")
        return self

    @model_validator(mode="after")
    def _check_agent_channels(self) -> "RunConfig":
        """An agent program's episodes name no error sites and keep no per-turn contexts a teacher
        could answer: SDPO and trace replay need an environment (`task.kind: env`)."""
        if self.task.kind == "agent" and (self.sdpo.alpha > 0 or self.replay.beta > 0):
            key = "sdpo.alpha" if self.sdpo.alpha > 0 else "replay.beta"
            raise ValueError(f"task.kind = agent with {key} > 0 is not supported: an agent program's episodes carry "
                             "no error sites or turn contexts for SDPO or trace replay (GRPO trains on them)")
        return self

    @model_validator(mode="after")
    def _check_diloco_role(self) -> "RunConfig":
        """A generation job trains nothing and a learner of shards samples nothing: SDPO, which
        scores the job's own samples with the policy being trained, needs both and is refused
        there. The replay channel splits: a generation job replays its samples to the teachers and
        writes their pairs into its shards; a learner of shards trains its DPO term on them."""
        role = self.diloco.role
        if role != "train" and self.sdpo.alpha > 0:
            raise ValueError(f"diloco.role = {role!r} with sdpo.alpha > 0 is not supported: the SDPO channel needs "
                             "a job that both samples and trains (role train)")
        teachers = self.replay.teachers
        if self.replay.beta > 0 and role != "learn" and len(teachers.teachers) < teachers.agreement_k:
            raise ValueError(f"replay.beta = {self.replay.beta} needs at least replay.teachers.agreement_k = "
                             f"{teachers.agreement_k} teachers, got {len(teachers.teachers)}")
        return self

    @model_validator(mode="after")
    def _check_lora_slots(self) -> "RunConfig":
        """Adapters applied by the engine (multi-LoRA) need vLLM and adapters on the wire."""
        gen = self.generator
        if not gen.lora_slots:
            return self
        if gen.backend != "vllm":
            raise ValueError("generator.lora_slots > 0 needs generator.backend = 'vllm' (the engine applies the adapters)")
        if not (self.learner.lora.enabled and self.learner.lora.sync == "adapter"):
            raise ValueError("generator.lora_slots > 0 needs learner.lora.enabled = true and learner.lora.sync = 'adapter'")
        if self.serve.limits.max_lora_rank > gen.lora_max_rank:
            raise ValueError(f"serve.limits.max_lora_rank = {self.serve.limits.max_lora_rank} is over generator.lora_max_rank = "
                             f"{gen.lora_max_rank}: `meshrl serve` would create adapters its generators cannot apply")
        return self

    @model_validator(mode="after")
    def _check_generator_in_learner(self) -> "RunConfig":
        """A generator co-located with the learner samples with the learner's own parameters: they
        must not change under a generation (no steps off policy, one optimizer step per step) and
        each learner process must hold all of them."""
        if self.meshes.generator.colocate_with != LEARNER:
            return self
        tc = self.trainer
        if tc.max_steps_off_policy:
            raise ValueError(f"trainer.max_steps_off_policy = {tc.max_steps_off_policy}: a generator co-located "
                             "with the learner (meshes.generator.colocate_with) needs 0")
        if tc.num_substeps > 1:
            raise ValueError(f"trainer.num_substeps = {tc.num_substeps}: a generator co-located with the learner "
                             "(meshes.generator.colocate_with) needs 1 (an optimizer step would change the weights "
                             "it is sampling with)")
        if self._sharded_learner:
            raise ValueError("learner.data_parallel = 'fsdp2' shards the weights a co-located generator "
                             "(meshes.generator.colocate_with) samples with: use 'ddp'")
        return self
