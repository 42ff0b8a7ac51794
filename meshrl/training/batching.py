"""Turning Datums into padded micro-batch tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.types import Datum


@dataclass
class MicroBatch:
    """Right-padded tensors for a group of Datums; padded positions are zero in every input."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    inputs: dict[str, torch.Tensor]  # per-position fields [B, T, ...] zero-padded; per-sequence fields [B]
    lengths: list[int]


def pad_datums(datums: list[Datum], pad_id: int) -> MicroBatch:
    """Stack Datums of different lengths; every per-position loss input is padded with zeros."""
    if not datums:
        raise ValueError("empty micro-batch")
    keys = set(datums[0].loss_fn_inputs)
    for d in datums[1:]:
        if set(d.loss_fn_inputs) != keys:
            raise ValueError(f"datums disagree on loss_fn_inputs keys: {sorted(keys)} vs {sorted(d.loss_fn_inputs)}")
    lengths = [d.length for d in datums]
    ids = torch.nn.utils.rnn.pad_sequence([d.model_input.to_tensor() for d in datums], batch_first=True,
                                          padding_value=pad_id)
    attention = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
    inputs = {}
    for k in sorted(keys):
        values = [d.loss_fn_inputs[k] for d in datums]
        if any(v.dim() == 0 for v in values):
            if not all(v.dim() == 0 for v in values):
                raise ValueError(f"loss_fn_inputs[{k!r}] is per-sequence in some datums and per-position in others")
            inputs[k] = torch.stack(values)
        else:
            inputs[k] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=0)
    return MicroBatch(ids, attention, inputs, lengths)


def split_micro_batches(datums: list[Datum], size: int, per_item: int = 1, max_tokens: int = 0,
                        by_tokens: bool = False) -> list[list[Datum]]:
    """Micro-batches of at most ``size`` Datums (at least one item), sorted by length to limit
    padding, or (``by_tokens``) by their tokens, to put shared prefixes together, and
    (``max_tokens`` > 0) of at most ``max_tokens`` padded tokens (Datums x the
    longest) unless one item alone is longer. Datums come in items of ``per_item`` consecutive
    Datums (e.g. a DPO pair) that stay together and in order."""
    if len(datums) % per_item:
        raise ValueError(f"{len(datums)} datums do not form items of {per_item}")
    items = [datums[i : i + per_item] for i in range(0, len(datums), per_item)]
    if by_tokens:
        items.sort(key=lambda item: min(d.model_input.to_ints() for d in item))
    else:
        items.sort(key=lambda item: max(d.length for d in item))
    per_batch = max(1, size // per_item)
    batches: list[list[list[Datum]]] = []
    for item in items:
        batch = batches[-1] if batches else None
        longest = max(d.length for d in item + [d for it in (batch or []) for d in it])  # the padded length
        if (batch is None or len(batch) == per_batch
                or (max_tokens and (len(batch) + 1) * per_item * longest > max_tokens)):
            batches.append([item])
        else:
            batch.append(item)
    return [[d for item in batch for d in item] for batch in batches]


@dataclass
class PackedRows:
    """A padded micro-batch's sequences laid end to end in a few rows (`learner.packed_row_tokens`),
    and (`learner.shared_prefix_tokens`) sequences with a common prefix laid as one tree: the
    prefix once, then each sequence's rest after it. A row's unused tail is pad tokens.

    Without trees (``mask`` None) each sequence's position ids restart at 0, which is what keeps
    its attention inside it (the HF decoders here turn position ids that restart, with no 2D
    attention mask, into a block-diagonal causal mask). With trees, a rest's position ids
    continue from its prefix and ``mask`` says what each position attends to: the positions
    before it in its own branch and in its tree's prefix."""

    source: torch.Tensor
    """[R, W] long: the padded micro-batch's flat position (row-major over [B, T]) each packed
    position holds (a shared prefix: its first sequence's), -1 in a row's tail."""
    position_ids: torch.Tensor
    """[R, W] long: positions within each packed sequence (and within a row's tail)."""
    target: torch.Tensor
    """[B * T] long: the packed flat position (row-major over [R, W]) of each padded position, -1
    for padding (the positions of a shared prefix map to the one packed copy)."""
    width: int
    """T, the padded micro-batch's width (what flat selections of it are counted in)."""
    mask: torch.Tensor | None = None
    """[R, 1, W, W] bool, whether query position q attends to key position k (trees only)."""

    def input_ids(self, padded: torch.Tensor, pad_id: int) -> torch.Tensor:
        """The packed token ids ([R, W]) of ``padded`` ([B, T]) on its device."""
        source = self.source.to(padded.device)
        return torch.where(source >= 0, padded.reshape(-1)[source.clamp(min=0)], pad_id)

    def index(self, selection: torch.Tensor) -> torch.Tensor:
        """A selection of the padded micro-batch (a [B, T'] bool mask, T' <= T, or flat indices into
        B x T) as flat indices into the packed rows, in the same order."""
        if selection.dtype == torch.bool:
            b, t = selection.nonzero(as_tuple=True)
            selection = b * self.width + t
        packed = self.target.to(selection.device)[selection]
        if bool((packed < 0).any()):
            raise ValueError("a loss selected a padding position of a packed micro-batch")
        return packed


def pack_rows(lengths: list[int], width: int, row_tokens: int,
              trees: list[tuple[int, list[int]]] | None = None) -> PackedRows:
    """Lay sequences of ``lengths`` (rows of a [B, ``width``] padded micro-batch) in rows. Each
    ``trees`` entry ``(prefix, members)`` lays its members as one tree: their first ``prefix``
    tokens (the same in all of them) once, then each member's rest; every other sequence is laid
    alone. ``row_tokens`` > 0: trees and sequences end to end in rows of at most ``row_tokens``
    tokens, or as wide as the largest if that is more: as few rows as the tokens need, filled
    evenly (largest first, each into the emptiest row, a new row when it fits in none), so the
    rows' common width wastes little. ``row_tokens`` 0: each in a row of its own."""
    in_tree = {b for _, members in (trees or []) for b in members}
    segments = [(prefix, members) for prefix, members in (trees or [])]
    segments += [(0, [b]) for b in range(len(lengths)) if b not in in_tree]
    sizes = [prefix + sum(lengths[b] - prefix for b in members) for prefix, members in segments]
    capacity = max(row_tokens, max(sizes))
    fill: list[int] = [0] * (-(-sum(sizes) // capacity) if row_tokens else 0)
    place = [(0, 0)] * len(segments)  # (packed row, offset) per segment
    for s in sorted(range(len(segments)), key=lambda i: -sizes[i]):
        row = min(range(len(fill)), key=fill.__getitem__) if fill else 0
        if not fill or fill[row] + sizes[s] > capacity:
            fill.append(0)
            row = len(fill) - 1
        place[s] = (row, fill[row])
        fill[row] += sizes[s]
    packed_width = max(fill)
    source = torch.full((len(fill), packed_width), -1, dtype=torch.long)
    positions = torch.zeros((len(fill), packed_width), dtype=torch.long)
    target = torch.full((len(lengths) * width,), -1, dtype=torch.long)
    segment = -1 - torch.arange(packed_width).repeat(len(fill), 1)  # a tail position: a segment of its own
    branch = torch.zeros((len(fill), packed_width), dtype=torch.long)  # 0: a tree's prefix
    for s, ((prefix, members), (row, offset)) in enumerate(zip(segments, place)):
        base = row * packed_width
        source[row, offset : offset + prefix] = torch.arange(members[0] * width, members[0] * width + prefix)
        positions[row, offset : offset + prefix] = torch.arange(prefix)
        segment[row, offset : offset + sizes[s]] = s
        at = offset + prefix
        for m, b in enumerate(members):
            n = lengths[b] - prefix
            source[row, at : at + n] = torch.arange(b * width + prefix, b * width + lengths[b])
            positions[row, at : at + n] = torch.arange(prefix, lengths[b])
            branch[row, at : at + n] = m + 1
            target[b * width : b * width + prefix] = torch.arange(base + offset, base + offset + prefix)
            target[b * width + prefix : b * width + lengths[b]] = torch.arange(base + at, base + at + n)
            at += n
    for row, used in enumerate(fill):
        positions[row, used:] = torch.arange(packed_width - used)
    mask = None
    if any(prefix for prefix, _ in segments):
        order = torch.arange(packed_width)
        mask = ((segment[:, :, None] == segment[:, None, :]) & (order[:, None] >= order[None, :])
                & ((branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])))[:, None]
    return PackedRows(source, positions, target, width, mask)
