"""How the decoder runs a batch of token sequences: right-padded, packed end to end, or with the
prefixes they share laid as trees.

`prefix_groups` sorts the sequences and groups neighbours whose common prefix is long enough to be
worth sharing (the samples of one prompt, a DPO pair's two sides, a multi-turn episode's steps).
`pack_rows` lays a batch's sequences in rows: each group as one tree (its prefix once, then every
member's rest, with position ids that continue from the prefix and a tree attention mask), the
other sequences whole, one to a row or end to end. `layout` decides, for a padded batch, whether
either saves positions. The decoder then computes each shared prefix once, forward and backward,
and every position's output is the one a whole forward of its sequence gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences whose first ``prefix`` tokens are the same (0: forwarded whole, no sharing)."""

    prefix: int
    members: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_groups(sequences: list[list[int]], first_positions: list[int], min_prefix: int) -> list[PrefixGroup]:
    """Group ``sequences`` by shared prefixes of at least ``min_prefix`` tokens, saving the most
    tokens ((members - 1) x prefix, summed over the groups). A group's prefix ends before every
    member's ``first_positions`` (the first position whose output is wanted: that and every later
    position are computed on top of the prefix). Groups are runs of the sequences in sorted
    order (a run's common prefix is the least of its neighbours'), chosen by dynamic programming;
    the sequences left alone (all of them for a ``min_prefix`` of 0) form one group of prefix 0,
    shortest first."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    n = len(order) if min_prefix > 0 else 0  # 0: no sharing, every sequence alone
    best = [0] * (n + 1)  # best[j]: the most tokens saved grouping order[:j]
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (where the last run of order[:j] starts, its prefix)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)  # order[j - 1] alone
        shared = first_positions[order[j - 1]]
        for i in range(j - 2, -1, -1):  # the run order[i:j]
            shared = min(shared, first_positions[order[i]], common_prefix(sequences[order[i]], sequences[order[i + 1]]))
            if shared < min_prefix:
                break
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], cut[j] = best[i] + (j - 1 - i) * shared, (i, shared)
    groups: list[PrefixGroup] = []
    alone: list[int] = []
    j = n
    while j > 0:
        i, shared = cut[j]
        if shared:
            groups.append(PrefixGroup(shared, order[i:j]))
        else:
            alone.extend(order[i:j])
        j = i
    groups.reverse()
    alone += order[n:]
    if alone:
        groups.append(PrefixGroup(0, sorted(alone, key=lambda i: (len(sequences[i]), i))))
    return groups


def right_padded(sequences: list[list[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, width] token ids right-padded with ``pad_id``, and their attention mask."""
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[b, : len(seq)] = 1
    return ids, mask


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


def affordable_trees(groups: list[PrefixGroup], lengths: list[int], attention_tokens: float) -> list[tuple[int, list[int]]]:
    """``groups``' members (with a shared prefix) as trees no costlier than their sequences whole.
    A row of W positions costs W tokens of the linear layers plus W x W / ``attention_tokens`` of
    attention (the masked pairs are computed too), so a wide tree can cost more than its members
    run whole (long episodes with a short shared prompt). Members join a group's current tree, in
    order, while that adds less than starting a new tree of the same prefix with them; a tree of
    one member is no tree."""
    def cost(width: int) -> float:
        return width + width * width / attention_tokens

    trees = []
    for g in groups:
        if not g.prefix:
            continue
        chunks: list[list[int]] = []
        width = 0
        for b in g.members:
            rest = lengths[b] - g.prefix
            if chunks and cost(width + rest) - cost(width) <= cost(g.prefix + rest):
                chunks[-1].append(b)
                width += rest
            else:
                chunks.append([b])
                width = g.prefix + rest
        trees += [(g.prefix, chunk) for chunk in chunks if len(chunk) > 1]
    return trees


def layout(input_ids: torch.Tensor, lengths: list[int], min_prefix: int, row_tokens: int,
           attention_tokens: float) -> PackedRows | None:
    """How the decoder runs the right-padded ``input_ids`` ([B, T], sequences of ``lengths``): the
    prefixes of at least ``min_prefix`` tokens they share as trees where that costs less
    (`affordable_trees`; ``attention_tokens``: how many query-key pairs of attention cost as much
    as one token through the linear layers, about 6 x the hidden size; ``min_prefix`` 0: no
    trees), and (``row_tokens`` > 0) trees and sequences packed end to end (`pack_rows`); None
    (padded) where neither leaves fewer positions than padding."""
    trees = None
    if min_prefix and len(lengths) > 1:
        rows = [row[:n].tolist() for row, n in zip(input_ids, lengths)]
        trees = affordable_trees(prefix_groups(rows, lengths, min_prefix), lengths, attention_tokens)
    if not (row_tokens or trees):
        return None
    packed = pack_rows(lengths, input_ids.shape[1], row_tokens, trees)
    return packed if packed.source.numel() < input_ids.numel() else None


def attention_tokens(config) -> float:
    """`layout`'s ``attention_tokens`` for an HF model ``config``: a token's linear layers take
    about 12 x hidden^2 multiply-adds a layer, one query-key pair's attention about 2 x hidden."""
    return 6.0 * config.hidden_size
