"""Tensor-parallel slices against vLLM's own weight loaders, on the CPU: vLLM's real linear layers
(QKV with grouped KV heads and biases, merged gate/up, row-parallel o/down) are built as one
rank of a tensor-parallel group (its rank and size given to vLLM's parallel-state queries), and
loading the slices a weight-store reader pulls, wrapped as SlicedWeight, leaves every parameter
equal to loading the whole HF tensors; the slices come out of sharded publishers' parts and move
a fraction of the bytes."""

import pytest
import torch

from meshrl.testing.shards import split_rows
from meshrl.transport.arena import views
from meshrl.transport.shards import apply_move, moves, pack_part, plan_buckets, plan_part

pytestmark = pytest.mark.slow  # importing vLLM takes ~20 s

HIDDEN, HEAD, HEADS, KV_HEADS, FFN = 64, 16, 4, 2, 96
LAYER = "model.layers.0"


def hf_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj.weight": (HEADS * HEAD, HIDDEN), "self_attn.k_proj.weight": (KV_HEADS * HEAD, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * HEAD, HIDDEN), "self_attn.q_proj.bias": (HEADS * HEAD,),
              "self_attn.k_proj.bias": (KV_HEADS * HEAD,), "self_attn.v_proj.bias": (KV_HEADS * HEAD,),
              "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD), "mlp.gate_proj.weight": (FFN, HIDDEN),
              "mlp.up_proj.weight": (FFN, HIDDEN), "mlp.down_proj.weight": (HIDDEN, FFN)}
    return {f"{LAYER}.{k}": torch.randn(*s, generator=g) for k, s in shapes.items()}


def build_layer(monkeypatch, rank: int, size: int) -> torch.nn.Module:
    """vLLM's layers of one Llama decoder layer as tensor-parallel rank ``rank`` of ``size``."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.llama import LlamaModel

    for module in (linear, parameter):
        for name, value in (("get_tensor_model_parallel_rank", rank), ("get_tensor_model_parallel_world_size", size)):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda value=value: value)
    root = torch.nn.Module()
    attn, mlp = torch.nn.Module(), torch.nn.Module()
    with set_current_vllm_config(VllmConfig()):
        attn.qkv_proj = linear.QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=True, params_dtype=torch.float32)
        attn.o_proj = linear.RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, params_dtype=torch.float32)
        mlp.gate_up_proj = linear.MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False,
                                                              params_dtype=torch.float32)
        mlp.down_proj = linear.RowParallelLinear(FFN, HIDDEN, bias=False, params_dtype=torch.float32)
    layer = torch.nn.Module()
    layer.self_attn, layer.mlp = attn, mlp
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    root.hf_to_vllm_mapper = LlamaModel.hf_to_vllm_mapper
    for p in root.parameters():
        p.data.fill_(float("nan"))
    return root


def load(model: torch.nn.Module, items) -> None:
    """What a vLLM model's load_weights does with these layers: map HF names through the model's
    stacking (the shard id travels on the tensor) and call each parameter's own weight loader."""
    for name, tensor in model.hf_to_vllm_mapper.apply(items):
        module, _, attr = name.rpartition(".")
        param = getattr(model.get_submodule(module), attr)
        shard_id = getattr(tensor, "shard_id", None)
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("rank,size", [(0, 2), (1, 2), (3, 4)])
def test_slices_loaded_through_vllms_loaders_equal_the_whole_weights(monkeypatch, rank, size):
    from meshrl.engines.vllm_sharding import SlicedWeight, sliced_weights, tensor_slices

    hf = hf_weights(rank)
    whole = build_layer(monkeypatch, rank, size)
    load(whole, list(hf.items()))
    assert not any(torch.isnan(p).any() for p in whole.parameters())

    shapes = {k: tuple(v.shape) for k, v in hf.items()}
    slices = tensor_slices(whole, shapes)
    assert set(slices) == set(hf) - {f"{LAYER}.self_attn.o_proj.bias"}  # every weight here is split
    assert slices[f"{LAYER}.self_attn.o_proj.weight"].dim == 1 and slices[f"{LAYER}.mlp.up_proj.weight"].dim == 0

    # publish the HF weights from 3 sharded ranks, pull this TP rank's slices, load them
    parts = []
    for r in range(3):
        layout, part, pieces = plan_part(split_rows(hf, r, 3), 64)
        arena = torch.empty(part.total_bytes, dtype=torch.uint8)
        pack_part(arena, part, split_rows(hf, r, 3))
        parts.append((arena, pieces))
    (bucket,) = plan_buckets(layout, 1 << 30, slices)
    dst = torch.zeros(bucket.nbytes, dtype=torch.uint8)
    copies = moves(bucket, [p[1] for p in parts])
    for m in copies:
        apply_move(parts[m.part][0], dst, m)
    moved = sum(m.nbytes * m.rows for m in copies)  # only the slices (KV heads are shared by TP 4's rank pairs)
    sliced_bytes = sum(m.nbytes for m in bucket.layout.tensors)
    assert sliced_bytes <= moved <= sliced_bytes + 64 * len(hf)
    assert sliced_bytes <= 0.6 * sum(t.numel() * 4 for t in hf.values())

    sliced = build_layer(monkeypatch, rank, size)
    load(sliced, sliced_weights(views(dst, bucket.layout).items(), slices, shapes))
    for (name, a), (_, b) in zip(whole.named_parameters(), sliced.named_parameters()):
        assert torch.equal(a, b), name

    with pytest.raises(RuntimeError, match="but only TensorSlice"):  # a loader reading outside the slice
        cut = slices[f"{LAYER}.mlp.down_proj.weight"]
        SlicedWeight(torch.zeros(HIDDEN, cut.length), (HIDDEN, FFN), cut, "down").narrow(1, 0, FFN)


def test_each_worker_computes_its_slices_and_loads_only_its_ranks_payload(monkeypatch):
    """The functions the engine runs on every tensor-parallel worker (``collective_rpc``): a
    worker's slices come from its own model; handed rank r's payload, only rank r's worker loads
    it (through its reload, here vLLM's loaders of the layer) and ends equal to loading the whole
    weights; the others leave their weights untouched."""
    import vllm.distributed as distributed

    from meshrl.engines.vllm_sharding import rank_payload, tensor_slices, worker_reload_rank, worker_tensor_slices

    class Worker:  # vLLM's worker wrapper, as far as the functions reach into it
        def __init__(self, model):
            self.model_runner = type("Runner", (), {"get_model": lambda _: model})()
            self.model = model

        def reload_weights(self, weights_iterator):
            load(self.model, list(weights_iterator))

    hf = hf_weights(7)
    shapes = {k: tuple(v.shape) for k, v in hf.items()}
    whole = build_layer(monkeypatch, 1, 2)
    load(whole, list(hf.items()))
    worker = Worker(build_layer(monkeypatch, 1, 2))
    slices = worker_tensor_slices(worker, shapes)
    assert slices == tensor_slices(worker.model, shapes) and set(slices) == set(hf)
    payload = rank_payload([(k, v.narrow(slices[k].dim, slices[k].start, slices[k].length) if k in slices else v)
                            for k, v in hf.items()], slices, shapes)

    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 0)
    assert worker_reload_rank(worker, 1, payload) is False
    assert all(torch.isnan(p).all() for p in worker.model.parameters())
    monkeypatch.setattr(distributed, "get_tensor_model_parallel_rank", lambda: 1)
    assert worker_reload_rank(worker, 1, payload) is True
    for (name, a), (_, b) in zip(whole.named_parameters(), worker.model.named_parameters()):
        assert torch.equal(a, b), name
