"""Learner actor: owns the PolicyTrainer (model + optimiser) and the weight publisher."""

from __future__ import annotations

import math
from pathlib import Path

from monarch.actor import current_rank, current_size, endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.actors.generator import POLICY_STORE
from meshrl.transport import in_process
from meshrl.config.weight_sync import WeightSyncConfig
from meshrl.config.diloco import DiLoCoConfig
from meshrl.transport.weight_store import WeightPublisher, silence_tcp_fallback_warning
from meshrl.config.learner import LearnerConfig
from meshrl.config.model import ModelConfig
from meshrl.diloco.allreduce import DiLoCoError
from meshrl.diloco.replica import ModelSync
from meshrl.diloco.store import StoreError
from meshrl.plugins import import_plugins
from meshrl.training.checkpoint import export_hf, load_learner, save_learner
from meshrl.training.data_parallel import DataParallelSpec
from meshrl.training.policy import CustomLoss, PolicyTrainer
from meshrl.training.tenants import LoraTenants
from meshrl.types import AdamParams, Datum, DimuonParams, LossPart


class Learner(MeshrlActor):
    """Tinker-style training endpoints over one HF policy. A mesh of N learners trains one policy
    data-parallel (``learner.data_parallel``): the controller calls every rank with its share of
    the datums (``padding`` datums only keep an idle rank in step); under FSDP2 every rank
    publishes its own shards, otherwise rank 0 publishes. With
    ``diloco.enabled`` the learner is one replica of a DiLoCo run (meshrl.diloco): it syncs its
    trainable parameters through the object store when the controller calls `diloco_sync`."""

    def __init__(
        self,
        model_path: str,
        model_cfg: ModelConfig,
        learner_cfg: LearnerConfig,
        sync_cfg: WeightSyncConfig,
        store: str = POLICY_STORE,
        dist_address: str = "",
        share_in_process: bool = False,
        publish_to_store: bool = True,
        diloco_cfg: DiLoCoConfig | None = None,
        plugins: list[str] = (),
    ):
        """``share_in_process``: offer the policy module to co-located readers
        (meshrl.transport.in_process; a publish then only marks the version). ``publish_to_store``
        False: no reader pulls from the weight store, so none is created. ``diloco_cfg`` (enabled):
        this learner is one replica of a DiLoCo run (meshrl.diloco.replica). ``plugins``: modules
        imported first (`plugins`: the losses they register are trainable here)."""
        import_plugins(list(plugins))
        silence_tcp_fallback_warning()
        parallel = DataParallelSpec(rank=current_rank().rank, world=math.prod(current_size().values()),
                                    mode=learner_cfg.data_parallel, address=dist_address,
                                    timeout_s=learner_cfg.call_timeout_s)
        self.trainer = PolicyTrainer(Path(model_path), learner_cfg, model_cfg.dtype, parallel)
        # under FSDP2 every rank publishes its own shards; otherwise rank 0 holds the whole policy
        sharded = self.trainer.dp.sharded
        self.publisher = WeightPublisher(store, sync_cfg, rank=parallel.rank if sharded else 0,
                                         world=parallel.world if sharded else 1, group=self.trainer.dp.group_id) \
            if publish_to_store and (sharded or parallel.rank == 0) else None
        self.store = store if share_in_process else None
        if share_in_process:
            in_process.share(store, self.trainer.model, self.trainer.inference_state_dict)
        self.diloco: ModelSync | None = None
        if diloco_cfg is not None and diloco_cfg.enabled:  # FSDP2 is refused by RunConfig
            # data-parallel ranks hold identical weights: the first uploads, the others follow the seals;
            # a generation job's learner only follows the run's outer states
            self.diloco = ModelSync(diloco_cfg, self.trainer.model,
                                    writer=parallel.rank == 0 and diloco_cfg.role != "generate")

    def describe(self) -> dict:
        tenants = self.trainer.tenants
        return {"trainable_params": sum(p.numel() for p in self.trainer.model.parameters() if p.requires_grad),
                "rank": self.trainer.dp.rank, "data_parallel": self.trainer.dp.mode,
                "adapters": sorted(tenants.states) if tenants else [], "active_adapter": tenants and tenants.active,
                "weight_store": self.publisher is not None, "shares_in_process": self.store is not None}

    def _tenants(self) -> LoraTenants:
        if self.trainer.tenants is None:
            raise ValueError("LoRA adapters need learner.lora.enabled = true")
        return self.trainer.tenants

    # ---- LoRA tenants (meshrl.training.tenants): every other endpoint acts on the active adapter
    @endpoint
    def add_adapter(self, name: str, rank: int, alpha: float | None = None, seed: int | None = None,
                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = False,
                    optimizer: str = "adamw") -> dict:
        """A new, inactive LoRA adapter with its own ``optimizer`` (``adamw`` or ``dimuon``) and
        its state (``train_unembed``: on the unembedding too; untied models only):
        ``{name, seed, params}``."""
        return self._tenants().add(name, rank, alpha, seed, train_mlp, train_attn, train_unembed, optimizer)

    @endpoint
    def use_adapter(self, name: str) -> dict:
        """Make ``name`` the adapter every other endpoint trains, scores and publishes: ``{name, steps_applied}``."""
        return self._tenants().use(name)

    @endpoint
    def remove_adapter(self, name: str) -> None:
        """Delete an inactive adapter and its optimiser state."""
        self._tenants().remove(name)

    @endpoint
    def save_adapter(self, name: str, directory: str) -> dict:
        """Write the adapter (PEFT format), its AdamW state and step count: ``{path, steps_applied}``."""
        return self._tenants().save(name, Path(directory))

    @endpoint
    def load_adapter(self, name: str, directory: str, with_optimizer: bool, optimizer: str | None = None) -> dict:
        """Load a saved adapter into ``name`` (created, or rebuilt if its LoRA config differs), with
        its optimizer and state, or with a fresh ``optimizer`` (default: the adapter's own):
        ``{name, rank, steps_applied, optimizer, optimizer_type}``."""
        return self._tenants().load(name, Path(directory), with_optimizer, optimizer)

    @endpoint
    def snapshot_adapter(self, name: str, root: str, mark: int, wait: bool = False) -> dict:
        """Copy the adapter's state now (after `optim_step` or a load) and write it under ``root``
        as snapshot ``mark`` in the background (``wait``: before replying): ``{durable}``, the mark of
        its newest snapshot on disk."""
        return self._tenants().snapshot(name, Path(root), mark, wait)

    @endpoint
    def restore_adapter(self, name: str, root: str) -> dict:
        """Load the adapter's newest snapshot under ``root`` (created if new), with its AdamW state
        and step count: ``{name, rank, steps_applied, optimizer, mark}``."""
        return self._tenants().restore(name, Path(root))

    @endpoint
    def forward_backward(self, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                         padding: bool = False, outputs: bool = False, temperature: float = 1.0) -> dict:
        """Accumulate the gradients of the registered loss ``loss_fn`` (meshrl.losses) over
        ``datums``, their log-probabilities at the sampling ``temperature``; with ``outputs`` also
        each datum's target-token logprobs at every position."""
        self.fault_point("forward_backward")
        return self.trainer.forward_backward(datums, loss_fn, loss_fn_config, padding, outputs, temperature)

    @endpoint
    def forward_loss(self, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                     padding: bool = False, temperature: float = 1.0) -> dict:
        """The registered loss ``loss_fn`` on ``datums`` without grad (nothing accumulates): its
        loss and metrics, and each datum's target-token logprobs at every position
        (``logprobs``; Tinker's `forward` returns them all, also where the loss reads none)."""
        return self.trainer.forward_backward(datums, loss_fn, loss_fn_config, padding, outputs=True,
                                             temperature=temperature, backward=False)

    @endpoint
    def forward_backward_parts(self, parts: list[LossPart], padding: bool = False) -> list[dict]:
        """Several losses, each on its own datums, in one set of shared micro-batches (one decoder
        forward per micro-batch for all of them): each part's metrics."""
        self.fault_point("forward_backward")
        return self.trainer.forward_backward_parts(parts, padding)

    @endpoint
    def forward_backward_custom(self, datums: list[Datum], fn: CustomLoss, padding: bool = False) -> dict:
        """Accumulate the gradients of ``fn(datums, logprobs) -> (loss, metrics)`` (a picklable function)."""
        self.fault_point("forward_backward")
        return self.trainer.forward_backward_custom(datums, fn, padding)

    @endpoint
    def forward(self, datums: list[Datum], reference: bool = False, padding: bool = False,
                temperature: float = 1.0) -> list[list[float]]:
        """Logprobs of each datum's target tokens under the current weights (or the frozen
        reference policy) at the sampling ``temperature``, without grad."""
        return [lp.tolist() for lp in self.trainer.forward(datums, reference, padding, temperature)]

    @endpoint
    def topk_logprobs(self, datums: list[Datum], k: int, padding: bool = False, min_prefix: int = 0) -> list[tuple]:
        """Per datum, the current weights' top-``k`` next-token log-probs at its `mask` positions
        and its own tokens' log-probs there (no grad; SDPO's teacher in the learner's processes),
        each prefix of at least ``min_prefix`` tokens that datums share forwarded once."""
        self.fault_point("topk_logprobs")
        return self.trainer.topk_logprobs(datums, k, padding, min_prefix)

    @endpoint
    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradients by ``factor`` (a normaliser known only afterwards)."""
        self.trainer.scale_grads(factor)

    @endpoint
    def optim_step(self, adam: AdamParams | DimuonParams) -> dict:
        """Apply the accumulated gradients with the active adapter's (or the policy's) optimizer:
        ``adam`` holds that optimizer's parameters."""
        return self.trainer.optim_step(adam)

    @endpoint
    def save_checkpoint(self, directory: str) -> dict:
        """Write the full training state (weights or adapter, optimiser, RNG) into ``directory``."""
        save_learner(self.trainer, Path(directory))
        if self.diloco is not None and self.trainer.dp.rank == 0:
            self.diloco.save(Path(directory))
        return {"steps_applied": self.trainer.steps_applied}

    @endpoint
    def load_checkpoint(self, directory: str) -> dict:
        """Restore a `save_checkpoint` directory (under DiLoCo, call `diloco_join` next)."""
        out = load_learner(self.trainer, Path(directory))
        if self.diloco is not None:
            self.diloco.load(Path(directory))
        return out

    # ---- DiLoCo across replicas (meshrl.diloco): a failed round answers {"error": one line}
    def _diloco(self, what: str, method) -> dict:
        if self.diloco is None:
            return {"error": f"{what}: this learner was not spawned with diloco.enabled"}
        try:
            return method(self.diloco)
        except (DiLoCoError, StoreError) as e:
            return {"error": f"{what}: {e}"}

    @endpoint
    def diloco_join(self) -> dict:
        """Take the run's newest outer state (this replica's weights become the run's initial
        state if there is none; after `load_checkpoint`, see meshrl.diloco.replica):
        ``{round, hash, rejoined, kept_checkpoint_weights}``."""
        return self._diloco("diloco join", ModelSync.join)

    @endpoint
    def diloco_sync(self) -> dict:
        """End the current DiLoCo round: the trainable parameters become the round's outer-updated
        weights. The round's report (round, participants, split times, bytes, hash)."""
        return self._diloco("diloco round", ModelSync.step)

    @endpoint
    def export(self, directory: str) -> str:
        """Save the policy as a standard HF model directory (LoRA merged)."""
        return str(export_hf(self.trainer, Path(directory)))

    @endpoint
    def publish(self, version: int) -> dict:
        """Publish the current weights (the active LoRA adapter merged, or that adapter only) as
        ``version``. Under FSDP2 every rank publishes its own shards (the version is visible once
        all did; nothing is gathered); otherwise rank 0 publishes. ``bytes``: the whole version's."""
        self.fault_point("publish")
        if self.store is not None:
            in_process.set_version(self.store, version)
        if self.publisher is None:
            shared = {"version": version, "bytes": 0, "publish_s": 0.0, "pack_s": 0.0}
            return shared if self.store is not None and self.trainer.dp.rank == 0 else {}
        stats = self.publisher.publish_shards(self.trainer.sync_shards(), version)
        return {"version": stats.version, "bytes": stats.total_bytes, "part_bytes": stats.nbytes,
                "publish_s": stats.seconds, "pack_s": stats.pack_seconds}
