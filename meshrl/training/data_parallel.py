"""Data parallelism for the learner: one policy trained by N processes of the learner mesh.

Two modes, chosen by ``learner.data_parallel``:

* ``fsdp2``: the policy is sharded with ``torch.distributed.fsdp.fully_shard`` (one unit per
  decoder layer plus the root); every forward all-gathers a layer's parameters and every backward
  reduce-scatters its gradients, so all ranks must run the same number of forward and backward
  passes (:meth:`DataParallel.padding_passes` tells a rank how many extra, zero-weighted passes to
  run).
* ``ddp``: every rank holds the whole policy; gradients are summed across ranks once, just before
  the optimiser step (:meth:`DataParallel.sum_grads`), so forward and backward passes need no
  coordination.

Both modes *sum* gradients over ranks: losses are sum-reduced with a step-wide normaliser applied
by the caller, so an N-rank step equals the 1-rank step. The process group (gloo on CPU, NCCL on
GPU) is set up inside the learner mesh; the controller hands every rank the rendezvous address.
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

import torch
import torch.distributed as dist

from meshrl.transport.shards import Shard

_BUCKET_BYTES = 64 << 20  # gradients are summed in flat buckets of about this size


@dataclass(frozen=True)
class DataParallelSpec:
    """Where one learner process stands in its data-parallel group (picklable: it travels to the
    learner actors)."""

    rank: int = 0
    world: int = 1
    mode: str = "fsdp2"
    """`fsdp2` or `ddp` (see the module docstring); unused when ``world`` is 1."""
    address: str = ""
    """Rendezvous of the process group, ``tcp://host:port`` (empty when ``world`` is 1)."""
    timeout_s: float = 900.0
    """Deadline of every collective: a rank that never joins raises instead of hanging."""


class ValidLogits(torch.nn.Module):
    """An HF causal LM whose forward returns logits only at the valid positions: the decoder runs
    on the whole padded batch, the vocabulary projection only where a loss needs it. Being one
    module, it is also the root that FSDP2 shards (its hooks then gather the embedding, the final
    norm and the tied head around exactly this computation)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                *selections: torch.Tensor, position_ids: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Logits at each selection's positions: a [B, T] bool mask or flat indices into the
        B x T positions (row-major); one tensor for one selection, else one per selection (the
        decoder runs once for all of them). Packed rows (meshrl.training.prefix_trees.PackedRows)
        come with ``position_ids`` that restart at each sequence and no ``attention_mask``, or,
        laid as trees, with a [R, 1, W, W] boolean ``attention_mask``; no KV cache is kept (with
        one, the decoder would ignore the packing in ``position_ids``)."""
        hidden = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                          position_ids=position_ids, use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        head = self.model.get_output_embeddings()
        logits = tuple(head(flat[s.reshape(-1)] if s.dtype == torch.bool else flat[s]) for s in selections)
        return logits[0] if len(logits) == 1 else logits


class DataParallel:
    """The collectives one learner process takes part in (no-ops for a single process)."""

    def __init__(self, spec: DataParallelSpec | None = None, device: torch.device | None = None):
        self.spec = spec or DataParallelSpec()
        self.rank, self.world = self.spec.rank, self.spec.world
        self.mode = self.spec.mode if self.world > 1 else "single"
        if self.mode not in ("single", "fsdp2", "ddp"):
            raise ValueError(f"learner.data_parallel = {self.mode!r}: expected 'fsdp2' or 'ddp'")
        if self.world > 1 and not dist.is_initialized():
            device = device or torch.device("cpu")
            if device.type == "cuda":  # placement shows each process only its own GPUs
                torch.cuda.set_device(device.index or 0)
            dist.init_process_group(
                "nccl" if device.type == "cuda" else "gloo", init_method=self.spec.address, rank=self.rank,
                world_size=self.world, timeout=datetime.timedelta(seconds=self.spec.timeout_s),
            )
        self.group_id = self._agree_on_id()
        """The same on every rank of this process group, new with every group (names the ranks of
        one learner incarnation, e.g. to the weight store)."""

    def _agree_on_id(self) -> str:
        ids = [uuid.uuid4().hex]
        if self.world > 1:
            dist.broadcast_object_list(ids, src=0)
        return ids[0]

    @property
    def sharded(self) -> bool:
        return self.mode == "fsdp2"

    def wrap(self, module: ValidLogits) -> ValidLogits:
        """Shard ``module`` with FSDP2 (each decoder layer, then the root); other modes return it
        unchanged. Gradients are summed over ranks, not averaged."""
        if not self.sharded:
            return module
        from torch.distributed.fsdp import fully_shard

        for layer in module.model.get_decoder().layers:
            fully_shard(layer)
        fully_shard(module)
        for unit in [module, *module.model.get_decoder().layers]:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM
        return module

    def padding_passes(self, local_passes: int) -> int:
        """How many extra passes this rank must run so that every rank runs as many as the busiest
        one (FSDP2's collectives are matched pass by pass); 0 outside FSDP2."""
        if not self.sharded:
            return 0
        count = torch.tensor([local_passes], dtype=torch.long)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item()) - local_passes

    @torch.no_grad()
    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """DDP: replace every gradient by its sum over ranks (a rank that saw no data contributes
        zeros). A parameter no rank has a gradient for keeps None, as in one process, so the
        optimizer leaves it (and its state) alone: a step that trained nothing moves nothing.
        Other modes: nothing to do (FSDP2 reduced them in backward)."""
        if self.mode != "ddp" or not params:
            return
        has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=params[0].device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
        used = [p for p, anywhere in zip(params, has_grad.tolist()) if anywhere]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in used:
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= _BUCKET_BYTES:
                _all_reduce_flat(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_flat(bucket)

    def local_shards(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype,
                     keys: Mapping[str, Hashable] | None = None,
                     compute: Mapping[str, Callable[[torch.Tensor], torch.Tensor]] | None = None) -> dict[str, Shard]:
        """This rank's rows of every tensor of ``state`` as weight-store shards published as
        ``dtype`` (nothing is copied here): an FSDP2 DTensor's local rows, a whole tensor held by
        rank 0 alone. ``keys``: names with the same key are one tensor (tied weights);
        ``compute[name](rows)`` turns the local rows into what is published (a LoRA merge), when
        they are packed."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor import Shard as DimShard

        keys, compute = keys or {}, compute or {}
        out = {}
        for name, t in state.items():
            shape = tuple(t.shape)
            if isinstance(t, DTensor) and tuple(t.placements) == (DimShard(0),):
                local = t.to_local()
                start = min(self.rank * -(-shape[0] // self.world), shape[0])
                rows = local.shape[0]
            elif isinstance(t, DTensor) and tuple(t.placements) != (Replicate(),):
                raise ValueError(f"'{name}' is sharded as {t.placements}: only dim-0 shards are published")
            else:
                local = t.to_local() if isinstance(t, DTensor) else t
                start, rows = 0, (shape[0] if shape else 1) if self.rank == 0 else 0
            fn = compute.get(name)
            load = (lambda local=local, fn=fn: fn(local)) if fn else (lambda local=local: local)
            out[name] = Shard(shape, dtype, start, rows, load, keys.get(name))
        return out

    def gather_to_first(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors of a (possibly FSDP2-sharded) state dict on rank 0, and an empty dict on
        the other ranks, which never hold more than their shards. Names that share one tensor (tied
        weights) keep sharing one result. Under FSDP2 every rank must call this together. Only
        for a full copy as the output (an HF export, a group of layers at a time): the weight
        store takes every rank's own shards."""
        if not self.sharded:
            return state
        gathered: dict[int, torch.Tensor | None] = {}
        for t in state.values():
            if id(t) not in gathered:
                gathered[id(t)] = self._gather_rows(t)
        return {} if self.rank else {name: gathered[id(t)] for name, t in state.items()}

    def _gather_rows(self, t: torch.Tensor) -> torch.Tensor | None:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(t, DTensor):
            return t
        if tuple(t.placements) != (Shard(0),):
            full = t.full_tensor()  # a layout FSDP2 does not use by default: gather it whole
            return full if self.rank == 0 else None
        # dim-0 shards in torch.chunk order: rank r holds rows [r*c, (r+1)*c) of c = ceil(rows / N)
        local, rows = t.to_local(), t.shape[0]
        chunk = -(-rows // self.world)
        padded = local.new_zeros((chunk, *t.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(padded, parts, dst=0)
        return torch.cat(parts)[:rows] if self.rank == 0 else None

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a result that may be a replicated DTensor (e.g. a gradient norm)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
