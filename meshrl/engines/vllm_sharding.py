"""Tensor-parallel weight slices for vLLM: which slice of each HF weight one worker loads, read
from the model vLLM built, and a tensor that stands for the whole HF weight while holding only
that slice, so vLLM's own weight loaders cut it exactly as they cut the whole tensor.

vLLM's linear-layer loaders (``vllm/model_executor/layers/linear.py``: ``weight_loader`` of
ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear and RowParallelLinear, and the
``weight_loader_v2`` unquantized layers use, through ``parameter.py``) take the whole checkpoint
tensor and ``narrow`` it to the worker's rows (column parallel, along the parameter's
``output_dim``) or columns (row parallel, ``input_dim``). :func:`tensor_slices` reproduces that
arithmetic from the layers' own attributes (``tp_rank``, ``tp_size``, ``output_sizes``, the QKV
head counts and ``num_kv_head_replicas``), mapping HF names through the model's
``hf_to_vllm_mapper`` stacking (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``), and checks
the result against the whole tensor's shape. Everything else is loaded whole: replicated layers,
``VocabParallelEmbedding`` / ``ParallelLMHead`` (their loader asserts the full vocabulary),
quantized or packed parameters, names it cannot place (as vLLM's own M2N weight transfer falls
back for what it cannot place). A weight-store reader pulls only the slices
(``WeightPuller.pull_into(slices=...)``) and hands them to the loader as :class:`SlicedWeight`;
on the publishers' host each worker copies its own slices out of their arenas
(:func:`worker_fill_rank`), so no weight bytes pass through vLLM's RPC queue, which every worker
reads.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence

import torch

from meshrl.transport.same_host import HostFill, HostFiller
from meshrl.transport.shards import TensorSlice


def tensor_slices(model: torch.nn.Module, shapes: Mapping[str, Sequence[int]],
                  param_of: Callable[[torch.nn.Module, str], object] = getattr) -> dict[str, TensorSlice]:
    """The slice this worker's vLLM ``model`` loads of each HF weight in ``shapes`` (name -> whole
    shape); weights it loads whole are left out. ``param_of(module, name)`` gives the parameter as
    the loader fills it (by default the live one)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )

    modules = dict(model.named_modules())
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = dict(getattr(mapper, "orig_to_new_stacked", {}) or {})
    out = {}
    for name, shape in shapes.items():
        target, shard_id = name, None
        for old, (new, sid) in stacked.items():
            if old in target:
                target, shard_id = target.replace(old, new, 1), sid
                break
        module_name, _, param_name = target.rpartition(".")
        module = modules.get(module_name)
        param = param_of(module, param_name) if module is not None else None
        if not isinstance(param, torch.Tensor) or getattr(module, "tp_size", 1) <= 1 or _packed(param):
            continue
        cut = None
        if isinstance(module, QKVParallelLinear):
            cut = _qkv(module, param, shard_id)
        elif isinstance(module, MergedColumnParallelLinear):
            cut = _merged(module, param, shard_id)
        elif isinstance(module, ColumnParallelLinear) and shard_id is None:
            cut = _by_rank(module, param, getattr(param, "output_dim", None))
        elif isinstance(module, RowParallelLinear) and shard_id is None:
            cut = _by_rank(module, param, getattr(param, "input_dim", None))
        if cut is not None and _fits(cut, shape, module.tp_size, isinstance(module, RowParallelLinear)):
            out[name] = cut
    return out


def _packed(param: torch.Tensor) -> bool:
    """Quantized, packed or already-sharded storage: its loader does more than a narrow."""
    return any(getattr(param, a, None) is not None for a in ("packed_dim", "packed_factor", "marlin_tile_size")) \
        or any(bool(getattr(param, a, False)) for a in ("is_sharded_weight", "needs_scalar_to_array", "is_transposed"))


def _by_rank(module, param: torch.Tensor, dim: int | None) -> TensorSlice | None:
    if dim is None:
        return None
    size = param.shape[dim]
    return TensorSlice(dim, module.tp_rank * size, size)


def _merged(module, param: torch.Tensor, shard_id) -> TensorSlice | None:
    dim = getattr(param, "output_dim", None)
    if dim is None or not isinstance(shard_id, int):
        return None
    size = module.output_sizes[shard_id] // module.tp_size
    return TensorSlice(dim, module.tp_rank * size, size)


def _qkv(module, param: torch.Tensor, shard_id) -> TensorSlice | None:
    dim = getattr(param, "output_dim", None)
    if dim is None or shard_id not in ("q", "k", "v"):
        return None
    if shard_id == "q":
        return TensorSlice(dim, module.tp_rank * module.num_heads * module.head_size,
                           module.num_heads * module.head_size)
    head = module.head_size if shard_id == "k" else module.v_head_size
    size = module.num_kv_heads * head
    return TensorSlice(dim, (module.tp_rank // module.num_kv_head_replicas) * size, size)


def _fits(cut: TensorSlice, shape: Sequence[int], tp_size: int, row_parallel: bool) -> bool:
    """The slice lies inside the whole tensor (and, for a plain split, tiles it over the ranks)."""
    if not 0 <= cut.dim < len(shape) or cut.start + cut.length > shape[cut.dim]:
        return False
    return not row_parallel or cut.length * tp_size == shape[cut.dim]


class SlicedWeight(torch.Tensor):
    """Stands for a whole HF weight of ``shape`` but holds only ``part``, its slice ``cut``: the one
    narrow vLLM's loader takes of it returns ``part``; any other read raises, so a loader that
    needs more than was pulled fails instead of loading wrong weights. Attributes set on it (vLLM
    sets ``shard_id``) stay on it."""

    @staticmethod
    def __new__(cls, part: torch.Tensor, shape: Sequence[int], cut: TensorSlice, name: str):
        if tuple(part.shape) != cut.shape(tuple(shape)):
            raise ValueError(f"'{name}': a slice of shape {list(part.shape)} is not {cut} of {list(shape)}")
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=part.dtype, device=part.device)
        t.part, t.cut, t.weight_name = part, cut, name
        return t

    def __repr__(self) -> str:
        return f"SlicedWeight({self.weight_name}, {self.cut}, shape={list(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        me = args[0]
        aten = torch.ops.aten
        if func in (aten.detach.default, aten.alias.default):
            return SlicedWeight(me.part, me.shape, me.cut, me.weight_name)
        if func is aten.slice.Tensor:
            dim, start, end, step = (list(args[1:]) + [None] * 4)[:4]
            dim = kwargs.get("dim", 0 if dim is None else dim) % me.dim()
            start = kwargs.get("start", 0 if start is None else start)
            end = kwargs.get("end", me.shape[dim] if end is None else end)
            step = kwargs.get("step", 1 if step is None else step)
            if (dim, start, end - start, step) == (me.cut.dim, me.cut.start, me.cut.length, 1):
                return aten.alias.default(me.part)  # a fresh view: a view op must not return an existing tensor
            asked = f"[{start}, {end}) of dim {dim}"
        else:
            asked = str(func)
        raise RuntimeError(f"vLLM's loader of '{me.weight_name}' read {asked}, but only {me.cut} was pulled")


def sliced_weights(items: Iterable[tuple[str, torch.Tensor]], slices: Mapping[str, TensorSlice],
                   shapes: Mapping[str, Sequence[int]]) -> list[tuple[str, torch.Tensor]]:
    """Pulled ``(name, tensor)`` pairs as vLLM's loaders take them: a sliced weight wrapped in a
    :class:`SlicedWeight` of its whole shape, the others as they are."""
    return [(name, SlicedWeight(t, shapes[name], slices[name], name) if name in slices else t) for name, t in items]


# ------------------------------------------------------------- on each tensor-parallel worker
# Run through ``LLM.collective_rpc`` (``worker`` is vLLM's worker wrapper in each worker process).


def worker_tensor_slices(worker, shapes: Mapping[str, Sequence[int]]) -> dict[str, TensorSlice]:
    """This worker's :func:`tensor_slices` of its own model, read from the parameters as its
    in-place reload fills them (:func:`as_reloaded`)."""
    return tensor_slices(worker.model_runner.get_model(), shapes, as_reloaded)


def as_reloaded(module: torch.nn.Module, name: str):
    """A parameter as vLLM's in-place reload (``reload_weights``) fills it: the checkpoint-format
    original vLLM recorded at load time (``model_loader/reload``) when it did. The live parameter
    may be a kernel-format tensor without the loader's attributes: the CPU backend repacks the
    linear layers' weights after loading."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    recorded = info.restore_metadata[0].get(name) if info is not None else None
    return recorded if recorded is not None else getattr(module, name, None)


class RankPayload(NamedTuple):
    """Pulled weights for one tensor-parallel rank's worker, as :func:`sliced_weights` takes them."""

    items: list[tuple[str, torch.Tensor]]
    slices: dict[str, TensorSlice]
    """The slice each tensor pulled as a slice is (tensors not named here travel whole)."""
    shapes: dict[str, tuple[int, ...]]
    """Those tensors' whole shapes."""


def worker_reload_rank(worker, rank: int, payload: RankPayload) -> bool:
    """On tensor-parallel rank ``rank`` only, reload the pulled weights in place (a slice goes to
    vLLM's loader as a :class:`SlicedWeight` of its whole shape); other ranks do nothing. Returns
    whether this worker loaded."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return False
    worker.reload_weights(weights_iterator=sliced_weights(*payload))
    return True


@functools.cache
def _host_filler() -> HostFiller:
    """This worker process's bucket buffer and segment mappings, kept between fills."""
    return HostFiller()


def worker_fill_rank(worker, rank: int, plan: HostFill, slices: Mapping[str, TensorSlice],
                     shapes: Mapping[str, Sequence[int]]) -> bool:
    """On tensor-parallel rank ``rank`` only, copy the bucket ``plan`` describes straight out of the
    publishers' arenas on this host into this worker's bucket buffer (on its model's device), then
    reload it in place as :func:`worker_reload_rank` does; other ranks do nothing. Returns whether
    this worker loaded."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return False
    device = next(worker.model_runner.get_model().parameters()).device
    items = list(_host_filler().fill(plan, device).items())
    worker.reload_weights(weights_iterator=sliced_weights(*rank_payload(items, slices, shapes)))
    return True


def rank_payload(items: Iterable[tuple[str, torch.Tensor]], slices: Mapping[str, TensorSlice],
                 shapes: Mapping[str, Sequence[int]]) -> RankPayload:
    """Pulled ``(name, tensor)`` pairs for one rank's worker: a tensor of its whole shape travels
    whole (an adapter merged into whole layers, a weight the rank loads whole); one of its slice's
    shape travels as that slice; any other shape is refused."""
    items = list(items)
    cuts, wholes = {}, {}
    for name, t in items:
        whole = tuple(shapes[name]) if name in shapes else tuple(t.shape)
        if tuple(t.shape) == whole:
            continue
        cut = slices.get(name)
        if cut is None or tuple(t.shape) != cut.shape(whole):
            raise ValueError(f"'{name}': a pulled tensor of shape {list(t.shape)} is neither the whole weight "
                             f"{list(whole)} nor this rank's slice {cut}")
        cuts[name], wholes[name] = cut, whole
    return RankPayload(items, cuts, wholes)
