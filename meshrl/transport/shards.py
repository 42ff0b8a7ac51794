"""Sharded versions and bounded pulls, as pure layout arithmetic (no Monarch, no I/O).

A version of a store is published by ``world`` ranks, each holding some rows (dim 0) of each
tensor: the rows FSDP2 gave it, or all of a tensor for one rank and none for the others. Every rank
knows the **global layout** (``ArenaLayout`` of the whole tensors, the same on every rank) and
packs its own rows into an arena of its **part layout**; a part's **pieces** say where each of its
byte ranges lands in the global layout. A reader never needs the global arena itself: it fills
**buckets** (groups of whole decoder layers, at most ``bucket_bytes`` unless one layer is larger)
or one bucket holding everything, optionally taking only a slice of each tensor (the rows or
columns a tensor-parallel engine rank loads). ``moves`` turns pieces into the byte copies that
fill a bucket; ``rdma_plan`` turns those into whole-chunk RDMA reads, straight into the bucket
where a chunk lies inside one copy, through a bounded staging buffer otherwise.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, NamedTuple

import torch

from meshrl.transport.arena import ArenaLayout, TensorMeta, copy_tensor, dtype_from_name, views


@dataclass(frozen=True)
class Shard:
    """What one publishing rank holds of one tensor: ``rows`` rows from ``row_start`` (dim 0) of a
    tensor of global ``shape``, published as ``dtype``. ``load()`` returns those rows (any dtype:
    packing converts); it is called once per publish, so a computed value (a merged LoRA weight)
    exists only while it is packed. Tensors with the same non-None ``key`` are one tensor under
    several names (tied weights)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    row_start: int
    rows: int
    load: Callable[[], torch.Tensor]
    key: Hashable | None = None

    @classmethod
    def whole(cls, t: torch.Tensor, dtype: torch.dtype | None = None, key: Hashable | None = None) -> "Shard":
        """All of ``t`` (held by a single rank)."""
        return cls(tuple(t.shape), dtype or t.dtype, 0, t.shape[0] if t.dim() else 1, lambda: t, key)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.shape[1:]) if self.shape else ()


def shards_of(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Shard]:
    """A whole state dict as one rank's shards; names sharing one contiguous storage stay tied."""
    return {name: Shard.whole(t, key=(t.data_ptr(), t.dtype, tuple(t.shape)) if t.is_contiguous() and t.numel()
                              else None)
            for name, t in state_dict.items()}


class Piece(NamedTuple):
    """``nbytes`` at ``src`` in a part's arena are the bytes at ``dst`` in the global layout."""

    src: int
    dst: int
    nbytes: int


def plan_part(shards: Mapping[str, Shard], alignment: int) -> tuple[ArenaLayout, ArenaLayout, tuple[Piece, ...]]:
    """(global layout, this rank's part layout, its pieces) for a rank's ``shards``."""
    for name, s in shards.items():
        if s.shape and not 0 <= s.row_start <= s.row_start + s.rows <= s.shape[0]:
            raise ValueError(f"shard of '{name}': rows [{s.row_start}, {s.row_start + s.rows}) outside "
                             f"its {s.shape[0]} rows")
    whole = ArenaLayout.from_entries([(n, s.dtype, s.shape, s.key) for n, s in shards.items()], alignment)
    part = ArenaLayout.from_entries([(n, s.dtype, s.local_shape, s.key) for n, s in shards.items() if s.rows],
                                    alignment)
    global_meta = {m.name: m for m in whole.tensors}
    pieces, seen = [], set()
    for m in part.tensors:
        if m.nbytes == 0 or m.offset in seen:
            continue
        seen.add(m.offset)
        g = global_meta[m.name]
        pieces.append(Piece(m.offset, g.offset + shards[m.name].row_start * _row_bytes(g), m.nbytes))
    return whole, part, tuple(pieces)


def pack_part(memory: torch.Tensor, part: ArenaLayout, shards: Mapping[str, Shard]) -> None:
    """Write every shard's rows into its region of ``memory`` (converting to the published dtype
    in place: no converted copy of the rank's weights exists); tied names are written once."""
    written: set[int] = set()
    regions = views(memory, part)
    for meta in part.tensors:
        if meta.nbytes == 0 or meta.offset in written:
            continue
        t = shards[meta.name].load()
        if tuple(t.shape) != meta.shape:
            raise ValueError(f"'{meta.name}' holds {list(t.shape)}, its shard says {list(meta.shape)}")
        dst = regions[meta.name]
        if t.dtype == dst.dtype:
            copy_tensor(dst, t)
        else:
            dst.copy_(t.detach())
        written.add(meta.offset)


def _row_bytes(meta: TensorMeta) -> int:
    return meta.nbytes // meta.shape[0] if meta.shape and meta.shape[0] else meta.nbytes


def check_coverage(layout: ArenaLayout, parts: list[tuple[Piece, ...]]) -> str | None:
    """None if the parts' pieces cover every region of ``layout`` exactly once, else what is wrong."""
    regions = {m.offset: m for m in layout.tensors if m.nbytes}
    starts = sorted(regions)
    covered = dict.fromkeys(starts, 0)
    for pieces in parts:
        for p in pieces:
            i = bisect.bisect_right(starts, p.dst) - 1
            meta = regions[starts[i]] if i >= 0 else None
            if meta is None or p.dst + p.nbytes > meta.offset + meta.nbytes:
                return f"a piece of {p.nbytes} bytes at {p.dst} lies outside every tensor"
            covered[meta.offset] += p.nbytes
    for offset, n in covered.items():
        if n != regions[offset].nbytes:
            return f"'{regions[offset].name}' gets {n} of its {regions[offset].nbytes} bytes from the ranks"
    return None


# ------------------------------------------------------------------------------------ slices


@dataclass(frozen=True)
class TensorSlice:
    """``length`` indices from ``start`` along ``dim`` of a tensor: what one tensor-parallel rank loads."""

    dim: int
    start: int
    length: int

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if not 0 <= self.dim < len(shape) or not 0 <= self.start <= self.start + self.length <= shape[self.dim]:
            raise ValueError(f"slice [{self.start}, {self.start + self.length}) of dim {self.dim} is outside "
                             f"a tensor of shape {list(shape)}")
        return shape[: self.dim] + (self.length,) + shape[self.dim + 1:]


# ----------------------------------------------------------------------------------- buckets

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_group(name: str) -> str:
    """The decoder layer a tensor belongs to (``model.layers.3``), or its own name outside layers.
    An engine processes a layer's weights together (vLLM fuses q/k/v and gate/up), so a bucket
    never splits a layer."""
    match = _LAYER.match(name)
    return match.group(1) if match else name


@dataclass(frozen=True)
class Bucket:
    """Tensors a reader receives together: their bucket-local ``layout`` (sliced shapes) and, per
    global region they come from, (global meta, bucket-local meta, slice or None)."""

    layout: ArenaLayout
    sources: dict[int, tuple[TensorMeta, TensorMeta, TensorSlice | None]]

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes


def whole_bucket(layout: ArenaLayout) -> Bucket:
    """Everything, at the global layout's own offsets (a pull into one arena)."""
    return Bucket(layout, {m.offset: (m, m, None) for m in layout.tensors if m.nbytes})


def plan_buckets(layout: ArenaLayout, bucket_bytes: int,
                 slices: Mapping[str, TensorSlice | None] | None = None) -> list[Bucket]:
    """Whole layer groups (tied names with the first name's group) packed in layout order into
    buckets of at most ``bucket_bytes``; a larger group gets a bucket of its own. With ``slices``,
    each named tensor is cut to its slice (names absent from ``slices`` come whole; tied names are
    cut alike)."""
    slices = slices or {}
    group_of_region: dict[int, str] = {}
    groups: dict[str, list[TensorMeta]] = {}
    for m in layout.tensors:
        group = group_of_region.setdefault(m.offset, layer_group(m.name)) if m.nbytes else layer_group(m.name)
        groups.setdefault(group, []).append(m)
    buckets: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for metas in groups.values():
        cuts = _region_cuts(metas, slices)
        regions = {m.offset: m for m in metas if m.nbytes}
        nbytes = sum(_sliced_bytes(m, cuts[offset]) for offset, m in regions.items())
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current += metas
        size += nbytes
    if current:
        buckets.append(current)
    return [_bucket(metas, slices, layout.alignment) for metas in buckets]


def _region_cuts(metas: list[TensorMeta], slices: Mapping[str, TensorSlice | None]) -> dict[int, TensorSlice | None]:
    """The slice of each region: tied names are one tensor, cut alike (by whichever of them has a slice)."""
    cuts: dict[int, TensorSlice | None] = {}
    named: dict[int, str] = {}
    for m in metas:
        if not m.nbytes:
            continue
        sl = slices.get(m.name)
        if sl is not None and cuts.get(m.offset) not in (None, sl):
            raise ValueError(f"tied tensors '{named[m.offset]}' and '{m.name}' are given different slices")
        if sl is not None or m.offset not in cuts:
            cuts[m.offset] = sl
            named[m.offset] = m.name
    return cuts


def _sliced_bytes(meta: TensorMeta, sl: TensorSlice | None) -> int:
    if sl is None or not meta.shape:
        return meta.nbytes
    return meta.nbytes // meta.shape[sl.dim] * sl.length


def _bucket(metas: list[TensorMeta], slices: Mapping[str, TensorSlice | None], alignment: int) -> Bucket:
    cut = _region_cuts(metas, slices)

    def shape(m: TensorMeta) -> tuple[int, ...]:
        sl = cut.get(m.offset) if m.nbytes else slices.get(m.name)
        return sl.shape(m.shape) if sl else m.shape

    entries = [(m.name, dtype_from_name(m.dtype), shape(m), m.offset if m.nbytes else None) for m in metas]
    local = ArenaLayout.from_entries(entries, alignment)
    by_name = {m.name: m for m in local.tensors}
    sources = {}
    for m in metas:
        if m.nbytes and m.offset not in sources:
            sources[m.offset] = (m, by_name[m.name], cut[m.offset])
    return Bucket(local, sources)


# ------------------------------------------------------------------------------------- moves


class Move(NamedTuple):
    """Copy ``rows`` blocks of ``nbytes`` from ``part``'s arena at ``src`` (+ i * ``src_stride``)
    to the bucket at ``dst`` (+ i * ``dst_stride``)."""

    part: int
    src: int
    dst: int
    nbytes: int
    rows: int = 1
    src_stride: int = 0
    dst_stride: int = 0

    @property
    def copied_bytes(self) -> int:
        """Bytes it copies (every block)."""
        return self.rows * self.nbytes

    @property
    def extent(self) -> int:
        """Bytes from ``src`` to the end of the last block."""
        return (self.rows - 1) * self.src_stride + self.nbytes


def moves(bucket: Bucket, parts: list[tuple[Piece, ...]]) -> list[Move]:
    """The copies that fill ``bucket`` from the parts' pieces, sorted by destination; copies that
    are adjacent in both arenas with equal gaps (nothing else lands in the gap) are merged."""
    starts = sorted(bucket.sources)
    out = []
    for part, pieces in enumerate(parts):
        for p in pieces:
            i = bisect.bisect_right(starts, p.dst) - 1
            if i < 0:
                continue
            g, local, sl = bucket.sources[starts[i]]
            if p.dst >= g.offset + g.nbytes:
                continue
            move = _move(part, p, g, local, sl)
            if move is not None:
                out.append(move)
    out.sort(key=lambda m: m.dst)
    merged: list[Move] = []
    for m in out:
        last = merged[-1] if merged else None
        if (last is not None and last.part == m.part and last.rows == m.rows == 1
                and m.src - (last.src + last.nbytes) == m.dst - (last.dst + last.nbytes) >= 0):
            merged[-1] = last._replace(nbytes=m.dst + m.nbytes - last.dst)
        else:
            merged.append(m)
    return merged


def _move(part: int, p: Piece, g: TensorMeta, local: TensorMeta, sl: TensorSlice | None) -> Move | None:
    if not g.shape:
        return Move(part, p.src, local.offset, p.nbytes)
    row = _row_bytes(g)
    r0 = (p.dst - g.offset) // row
    r1 = r0 + p.nbytes // row
    if sl is None:
        return Move(part, p.src, local.offset + r0 * row, p.nbytes)
    if sl.dim == 0:
        a, b = max(r0, sl.start), min(r1, sl.start + sl.length)
        return Move(part, p.src + (a - r0) * row, local.offset + (a - sl.start) * row, (b - a) * row) if a < b else None
    inner = math.prod(g.shape[sl.dim + 1:]) * dtype_from_name(g.dtype).itemsize
    blocks_per_row = math.prod(g.shape[1:sl.dim])
    width, stride = sl.length * inner, g.shape[sl.dim] * inner
    rows = (r1 - r0) * blocks_per_row
    if width == stride:
        return Move(part, p.src, local.offset + r0 * row, p.nbytes)
    return Move(part, p.src + sl.start * inner, local.offset + r0 * blocks_per_row * width, width, rows, stride, width)


# ---------------------------------------------------------------------------------- RDMA plan


@dataclass(frozen=True)
class Wave:
    """Chunks read into one staging buffer (in order, back to back), then ``copies`` (moves whose
    ``src`` is an offset into the staging buffer) into the bucket."""

    chunks: tuple[int, ...]
    copies: tuple[Move, ...]
    nbytes: int


def rdma_plan(chunks: list[tuple[int, int]], part_moves: list[Move], staging_bytes: int
              ) -> tuple[list[tuple[int, int]], list[Wave]]:
    """How to fill a bucket from one part's RDMA ``chunks`` (``(offset, nbytes)`` in the part's
    arena, ascending, contiguous). Returns the direct reads ``(chunk, dst)`` (a chunk that lies
    inside one contiguous move is read straight into the bucket) and the waves of staged reads
    (chunks the moves need only partly, or strided moves' rows), each wave at most
    ``staging_bytes`` unless a single move's chunks exceed it."""
    starts = [o for o, _ in chunks]
    pieces = []  # moves cut at chunk boundaries (contiguous) or at rows fitting the staging budget (strided)
    for m in sorted(part_moves, key=lambda m: m.src):
        if m.rows == 1:
            pos = m.src
            while pos < m.src + m.nbytes:
                c = bisect.bisect_right(starts, pos) - 1
                end = min(m.src + m.nbytes, chunks[c][0] + chunks[c][1])
                pieces.append(m._replace(src=pos, dst=m.dst + pos - m.src, nbytes=end - pos))
                pos = end
        else:
            per = max(1, staging_bytes // max(m.src_stride, 1))
            for r in range(0, m.rows, per):
                n = min(per, m.rows - r)
                pieces.append(m._replace(src=m.src + r * m.src_stride, dst=m.dst + r * m.dst_stride, rows=n))
    direct, waves = [], []
    wave_chunks: dict[int, int] = {}  # chunk -> its staging offset
    wave_moves: list[Move] = []
    size = 0

    def close() -> None:
        nonlocal wave_chunks, wave_moves, size
        if wave_moves:
            copies = tuple(m._replace(src=wave_chunks[_chunk(starts, m.src)] + m.src - chunks[_chunk(starts, m.src)][0])
                           for m in wave_moves)
            waves.append(Wave(tuple(wave_chunks), copies, size))
        wave_chunks, wave_moves, size = {}, [], 0

    for m in pieces:
        first = _chunk(starts, m.src)
        if m.rows == 1 and chunks[first] == (m.src, m.nbytes):
            direct.append((first, m.dst))
            continue
        needed = range(first, _chunk(starts, m.src + m.extent - 1) + 1)
        extra = sum(chunks[c][1] for c in needed if c not in wave_chunks)
        if wave_moves and size + extra > staging_bytes:
            close()
        for c in needed:
            if c not in wave_chunks:
                wave_chunks[c] = size
                size += chunks[c][1]
        wave_moves.append(m)
    close()
    return direct, waves


def _chunk(starts: list[int], offset: int) -> int:
    return bisect.bisect_right(starts, offset) - 1


def apply_move(src: torch.Tensor, dst: torch.Tensor, m: Move) -> None:
    """Copy move ``m`` from the uint8 tensor ``src`` (offsets as in ``m.src``) into ``dst``."""
    if m.rows == 1:
        copy_tensor(dst[m.dst: m.dst + m.nbytes], src[m.src: m.src + m.nbytes])
        return
    out = dst.as_strided((m.rows, m.nbytes), (m.dst_stride, 1), dst.storage_offset() + m.dst)
    out.copy_(src.as_strided((m.rows, m.nbytes), (m.src_stride, 1), src.storage_offset() + m.src))
