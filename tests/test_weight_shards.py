"""Sharded versions as layout arithmetic (pure torch, no Monarch): ranks' parts assemble into the
whole state dict bit for bit, buckets keep decoder layers whole and bounded, tensor-parallel
slices come out equal to narrowing the whole tensor, and RDMA plans read whole chunks into place
or through bounded staging."""

import pytest
import torch

from meshrl.testing.shards import split_rows
from meshrl.transport.arena import ArenaLayout, allocate_arena, chunk_ranges, views
from meshrl.transport.shards import (
    Piece,
    TensorSlice,
    apply_move,
    check_coverage,
    layer_group,
    moves,
    pack_part,
    plan_buckets,
    plan_part,
    rdma_plan,
    shards_of,
    whole_bucket,
)

ALIGN = 64


def state_dict() -> dict[str, torch.Tensor]:
    """A small decoder-shaped model: tied embedding/head, layers with 2-D and 1-D weights, a
    tensor with fewer rows than ranks, mixed dtypes."""
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(37, 8, generator=g)
    sd = {"model.embed_tokens.weight": emb, "lm_head.weight": emb, "model.norm.weight": torch.randn(8, generator=g),
          "model.tiny": torch.randn(3, 5, generator=g)}
    for i in range(3):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = torch.randn(16, 8, generator=g)
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = torch.randn(8, 24, generator=g)
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(8, generator=g).to(torch.bfloat16)
    sd["model.layers.2.conv"] = torch.randn(6, 4, 5, generator=g)
    return sd


def publish(sd, world, dtype=None):
    """Every rank's (layout, part arena, pieces), as the publishers pack them."""
    parts = []
    for rank in range(world):
        layout, part, pieces = plan_part(split_rows(sd, rank, world, dtype), ALIGN)
        arena = allocate_arena(max(part.total_bytes, ALIGN))
        pack_part(arena, part, split_rows(sd, rank, world, dtype))
        parts.append((layout, arena, pieces, part))
    assert len({p[0] for p in parts}) == 1  # every rank computes the same global layout
    return parts


def assemble(parts, bucket, size=None) -> torch.Tensor:
    dst = torch.zeros(size or bucket.nbytes, dtype=torch.uint8)
    for m in moves(bucket, [p[2] for p in parts]):
        apply_move(parts[m.part][1], dst, m)
    return dst


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parts_of_any_world_assemble_into_the_whole_state_dict_bitwise(world):
    sd = state_dict()
    parts = publish(sd, world)
    layout = parts[0][0]
    assert layout == ArenaLayout.from_state_dict(sd, ALIGN)
    assert check_coverage(layout, [p[2] for p in parts]) is None
    got = views(assemble(parts, whole_bucket(layout)), layout)
    for name, t in sd.items():
        assert torch.equal(got[name], t), name
    assert got["lm_head.weight"].data_ptr() == got["model.embed_tokens.weight"].data_ptr()
    part_bytes = [p[1].numel() for p in parts]
    assert max(part_bytes) <= layout.total_bytes // world + len(sd) * 2 * ALIGN + 200  # each rank ~1/N


def test_shards_convert_to_the_published_dtype_when_packed():
    sd = {k: v for k, v in state_dict().items() if v.dtype == torch.float32}
    parts = publish(sd, 2, torch.bfloat16)
    layout = parts[0][0]
    got = views(assemble(parts, whole_bucket(layout)), layout)
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in sd.items())


def test_coverage_names_a_missing_part_and_the_tensor_it_leaves_short():
    parts = publish(state_dict(), 2)
    problem = check_coverage(parts[0][0], [parts[0][2]])
    assert problem is not None and "of its" in problem and "bytes from the ranks" in problem
    bad = (Piece(0, parts[0][0].total_bytes + 64, 8),)
    assert "outside every tensor" in check_coverage(parts[0][0], [bad])


def test_a_whole_state_dict_is_one_part_whose_pieces_are_the_identity():
    sd = state_dict()
    layout, part, pieces = plan_part(shards_of(sd), ALIGN)
    assert part == layout and all(p.src == p.dst for p in pieces)
    assert len(moves(whole_bucket(layout), [pieces])) == 1  # one contiguous copy: chunks read in place


def test_layer_groups_and_buckets_keep_layers_whole_and_bounded():
    assert layer_group("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert layer_group("model.norm.weight") == "model.norm.weight"
    sd = state_dict()
    layout = ArenaLayout.from_state_dict(sd, ALIGN)
    layer_bytes = max(sum(m.nbytes for m in layout.tensors if layer_group(m.name) == f"model.layers.{i}")
                      for i in range(3))
    for bucket_bytes in (1, layer_bytes + ALIGN * 8, 10**9):
        buckets = plan_buckets(layout, bucket_bytes)
        names = [[m.name for m in b.layout.tensors] for b in buckets]
        assert sorted(n for ns in names for n in ns) == sorted(sd)
        for ns in names:  # a layer never spans buckets; the tied pair travels together
            others = [o for o in names if o is not ns]
            assert not {layer_group(n) for n in ns} & {layer_group(n) for o in others for n in o}
            assert ("lm_head.weight" in ns) == ("model.embed_tokens.weight" in ns)
        for b in buckets:
            groups = {layer_group(m.name) for m in b.layout.tensors}
            assert b.nbytes <= bucket_bytes + ALIGN * len(b.layout.tensors) or len(groups - {"lm_head.weight"}) <= 1
    assert len(plan_buckets(layout, 10**9)) == 1 and len(plan_buckets(layout, 1)) == len(
        {layer_group(n) for n in sd} - {"model.embed_tokens.weight"})


@pytest.mark.parametrize("world", [1, 2, 4])
def test_buckets_filled_from_sharded_parts_hold_the_whole_tensors(world):
    sd = state_dict()
    parts = publish(sd, world)
    for bucket in plan_buckets(parts[0][0], 700):
        got = views(assemble(parts, bucket), bucket.layout)
        assert all(torch.equal(got[n], sd[n]) for n in got)


SLICES = {
    "model.layers.1.self_attn.q_proj.weight": TensorSlice(0, 8, 8),  # column-parallel: rows of rank 1 of 2
    "model.layers.1.mlp.down_proj.weight": TensorSlice(1, 12, 12),  # row-parallel: columns of rank 1 of 2
    "model.layers.2.conv": TensorSlice(1, 1, 2),  # a middle dim
    "model.layers.0.mlp.down_proj.weight": TensorSlice(1, 0, 24),  # all columns: a whole copy
    "model.embed_tokens.weight": TensorSlice(0, 19, 18),
    "lm_head.weight": TensorSlice(0, 19, 18),
}


@pytest.mark.parametrize("world", [1, 3])
def test_slices_equal_narrowing_the_whole_tensor_and_move_only_their_bytes(world):
    sd = state_dict()
    parts = publish(sd, world)
    buckets = plan_buckets(parts[0][0], 10**9, SLICES)
    got = views(assemble(parts, buckets[0]), buckets[0].layout)
    for name, t in sd.items():
        sl = SLICES.get(name)
        assert torch.equal(got[name], t if sl is None else t.narrow(sl.dim, sl.start, sl.length)), name
    moved = sum(m.nbytes * m.rows for m in moves(buckets[0], [p[2] for p in parts]))
    assert moved < sum(t.numel() * t.element_size() for t in {id(t): t for t in sd.values()}.values())
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        plan_buckets(parts[0][0], 10**9, {"model.norm.weight": TensorSlice(0, 4, 5)})
    one_name = plan_buckets(parts[0][0], 10**9, {"model.embed_tokens.weight": TensorSlice(1, 2, 3)})[0]
    got = views(assemble(parts, one_name), one_name.layout)  # a tied pair is one tensor: sliced alike
    assert torch.equal(got["lm_head.weight"], sd["lm_head.weight"][:, 2:5]) and got["lm_head.weight"].data_ptr() \
        == got["model.embed_tokens.weight"].data_ptr()
    with pytest.raises(ValueError, match="are given different slices"):
        plan_buckets(parts[0][0], 10**9, {"lm_head.weight": TensorSlice(0, 0, 1),
                                          "model.embed_tokens.weight": TensorSlice(0, 1, 1)})


def read_rdma(part_arena, chunks, plan, dst, staging_bytes):
    """Execute an rdma_plan the way the puller does, a chunk read being a whole-chunk copy."""
    direct, waves = plan
    for c, d in direct:
        o, n = chunks[c]
        dst[d: d + n] = part_arena[o: o + n]
    for wave in waves:
        assert wave.nbytes <= staging_bytes or len(wave.copies) == 1
        staging = torch.zeros(wave.nbytes, dtype=torch.uint8)
        offset = 0
        for c in wave.chunks:
            o, n = chunks[c]
            staging[offset: offset + n] = part_arena[o: o + n]
            offset += n
        for m in wave.copies:
            apply_move(staging, dst, m)
    return sum(chunks[c][1] for c, _ in direct) + sum(w.nbytes for w in waves)


@pytest.mark.parametrize("world,num_chunks,staging", [(1, 7, 512), (2, 5, 256), (3, 16, 100), (4, 1, 10**6)])
def test_rdma_plans_read_whole_chunks_into_place_or_through_bounded_staging(world, num_chunks, staging):
    sd = state_dict()
    parts = publish(sd, world)
    layout = parts[0][0]
    for bucket in [whole_bucket(layout), *plan_buckets(layout, 900, SLICES)]:
        dst = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for i, (_, arena, part_pieces, _) in enumerate(parts):
            chunks = chunk_ranges(max((p.src + p.nbytes for p in part_pieces), default=0), num_chunks, ALIGN)
            part_moves = [m for m in moves(bucket, [p[2] for p in parts]) if m.part == i]
            read_rdma(arena, chunks, rdma_plan(chunks, part_moves, staging), dst, staging)
        assert torch.equal(dst, assemble(parts, bucket))


def test_one_part_pulled_whole_reads_every_chunk_in_place():
    sd = state_dict()
    layout, part, pieces = plan_part(shards_of(sd), ALIGN)
    chunks = chunk_ranges(max(p.src + p.nbytes for p in pieces), 8, ALIGN)  # as the publisher cuts them
    direct, waves = rdma_plan(chunks, moves(whole_bucket(layout), [pieces]), 64)
    assert sorted(c for c, _ in direct) == list(range(len(chunks))) and not waves


def test_a_ranks_payload_marks_its_slices_and_refuses_other_shapes():
    """What a tensor-parallel worker is handed: a tensor of its slice's shape travels as that
    slice, one of the whole shape (a merged adapter layer, a weight loaded whole) whole, and any
    other shape is refused naming the weight."""
    from meshrl.engines.vllm_sharding import rank_payload

    shapes = {"q.weight": (8, 4), "norm.weight": (4,)}
    cuts = {"q.weight": TensorSlice(0, 4, 4)}
    payload = rank_payload([("q.weight", torch.ones(4, 4)), ("norm.weight", torch.ones(4))], cuts, shapes)
    assert [n for n, _ in payload.items] == ["q.weight", "norm.weight"]
    assert payload.slices == {"q.weight": cuts["q.weight"]} and payload.shapes == {"q.weight": (8, 4)}
    merged = rank_payload([("q.weight", torch.ones(8, 4)), ("lora.weight", torch.ones(2, 2))], cuts, shapes)
    assert [n for n, _ in merged.items] == ["q.weight", "lora.weight"] and merged.slices == merged.shapes == {}
    with pytest.raises(ValueError, match=r"'q.weight': a pulled tensor of shape \[2, 4\] is neither the whole weight "
                                         r"\[8, 4\] nor this rank's slice"):
        rank_payload([("q.weight", torch.ones(2, 4))], cuts, shapes)
