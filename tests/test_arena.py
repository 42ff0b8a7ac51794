"""Flat arena layout, packing, zero-copy views and chunking (pure torch, no Monarch)."""

import pytest
import torch

from meshrl.transport.arena import (
    ArenaLayout,
    allocate_arena,
    chunk_ranges,
    copy_tensor,
    copy_tensors,
    pack_into,
    views,
)


def _state_dict():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(10, 6, generator=g).to(torch.bfloat16)
    return {
        "z.bias": torch.randn(5, generator=g),
        "a.weight": torch.randn(3, 7, generator=g).to(torch.float16),
        "emb": emb,
        "head": emb,  # tied: same storage under two names
        "step": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),  # non-contiguous source
        "mask": torch.tensor([True, False, True]),
    }


def test_layout_is_aligned_sorted_and_deterministic():
    sd = _state_dict()
    layout = ArenaLayout.from_state_dict(sd, alignment=64)
    assert [m.name for m in layout.tensors] == sorted(sd)
    assert all(m.offset % 64 == 0 for m in layout.tensors)
    assert layout.total_bytes % 64 == 0
    reordered = dict(reversed(list(sd.items())))
    assert ArenaLayout.from_state_dict(reordered, alignment=64) == layout
    by_name = {m.name: m for m in layout.tensors}
    assert by_name["a.weight"].dtype == "float16" and by_name["a.weight"].shape == (3, 7)
    assert by_name["a.weight"].nbytes == 3 * 7 * 2


def test_regions_do_not_overlap_and_tied_weights_share_one():
    layout = ArenaLayout.from_state_dict(_state_dict())
    by_name = {m.name: m for m in layout.tensors}
    assert by_name["emb"].offset == by_name["head"].offset
    regions = sorted({(m.offset, m.nbytes) for m in layout.tensors if m.nbytes})
    for (o1, n1), (o2, _) in zip(regions, regions[1:]):
        assert o1 + n1 <= o2
    assert regions[-1][0] + regions[-1][1] <= layout.total_bytes


def test_pack_then_views_roundtrip_bitwise_and_zero_copy():
    sd = _state_dict()
    layout = ArenaLayout.from_state_dict(sd)
    arena = allocate_arena(layout.total_bytes + 100)
    pack_into(arena, sd, layout)
    out = views(arena, layout)
    assert set(out) == set(sd)
    for name, t in sd.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name
    # views alias the arena: writing through one is visible in the arena and in its tied twin
    out["emb"][0, 0] = 42.0
    assert out["head"][0, 0].item() == 42.0
    assert out["emb"].untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_pack_rejects_mismatched_state_dict_and_small_arena():
    sd = _state_dict()
    layout = ArenaLayout.from_state_dict(sd)
    with pytest.raises(ValueError, match="arena holds"):
        pack_into(allocate_arena(layout.total_bytes - 1), sd, layout)
    bad = dict(sd, **{"a.weight": torch.zeros(3, 8, dtype=torch.float16)})
    assert not layout.matches(bad)
    assert layout.matches(sd)
    with pytest.raises(ValueError, match="'a.weight' is float16\\[3, 8\\]"):
        pack_into(allocate_arena(layout.total_bytes), bad, layout)
    with pytest.raises(ValueError, match="power of two"):
        ArenaLayout.from_state_dict(sd, alignment=48)


@pytest.mark.parametrize("total,k", [(1000, 1), (1000, 3), (64 * 8, 8), (100, 16), (10**6 + 7, 16)])
def test_chunk_ranges_cover_the_arena_with_aligned_boundaries(total, k):
    chunks = chunk_ranges(total, k, alignment=64)
    assert 1 <= len(chunks) <= k
    assert chunks[0][0] == 0 and all(n > 0 for _, n in chunks)
    for (o1, n1), (o2, _) in zip(chunks, chunks[1:]):
        assert o1 + n1 == o2 and o2 % 64 == 0
    assert sum(n for _, n in chunks) == total


def test_chunk_ranges_edge_cases():
    assert chunk_ranges(0, 4) == []
    with pytest.raises(ValueError):
        chunk_ranges(100, 0)


def test_copy_tensors_loads_views_in_place_and_rejects_mismatches():
    sd = _state_dict()
    layout = ArenaLayout.from_state_dict(sd)
    arena = allocate_arena(layout.total_bytes)
    pack_into(arena, sd, layout)
    model_state = {name: torch.zeros_like(t) for name, t in sd.items()}
    storages = {name: t.data_ptr() for name, t in model_state.items()}
    copy_tensors(model_state, views(arena, layout))
    for name, t in sd.items():
        assert torch.equal(model_state[name], t) and model_state[name].data_ptr() == storages[name], name
    with pytest.raises(ValueError, match="cannot copy float32\\[5\\] into float16\\[5\\]"):
        copy_tensor(torch.zeros(5, dtype=torch.float16), torch.zeros(5))
    with pytest.raises(KeyError, match="1 tensors have no destination"):
        copy_tensors({}, {"x": torch.zeros(1)})
