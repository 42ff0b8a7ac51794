"""Micro-batches shared by several losses: one decoder forward for every loss of an optimizer step.

A step's loss terms (the policy gradient, SDPO's distillation, replay's DPO, ...) train different
datums with different losses, but their sequences often coincide: SDPO's student sequence at an
error site is a trajectory the policy-gradient term trains too (or a prefix of it, for an earlier
turn). :func:`pack_shared` forwards each distinct token sequence once: a datum whose model input
equals, or is a prefix of, another's is read off that row (causal attention makes a prefix's
hidden states those of the prefix alone). Rows are then grouped into micro-batches like
:func:`meshrl.training.batching.split_micro_batches` does (sorted by length, or by their tokens
where the learner shares prefixes, at most ``size`` rows and ``max_tokens`` padded tokens each),
with the rows of one item (e.g. a DPO pair) kept together.

Each micro-batch lists, per loss, its datums there and the row each is read from; the learner
(meshrl.training.policy) runs the decoder once on the rows and hands every loss a view of its own
datums (:class:`SharedForward`), whose logits are gathered from that one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.training.batching import MicroBatch
from meshrl.types import Datum


@dataclass
class SharedBatch:
    """One micro-batch of distinct sequences and, per loss, the datums read off them."""

    rows: list[torch.Tensor]
    """The model inputs forwarded (int64, each a distinct sequence)."""
    views: list[list[tuple[Datum, int]]]
    """Per loss (in the caller's order): its datums in this micro-batch, in their order, each with
    the index of the row it is read from (its model input is that row or a prefix of it)."""


def _rows_of(datums: list[Datum]) -> tuple[list[torch.Tensor], list[int]]:
    """The distinct rows the datums need (longest first) and each datum's row. A datum shares an
    earlier (longer) row when its sequence is a prefix of it; candidates are narrowed by three of
    their tokens at once before a full comparison, so many datums stay cheap."""
    order = sorted(range(len(datums)), key=lambda i: -datums[i].length)
    rows: list[torch.Tensor] = []
    known: dict[tuple[int, ...], int] = {}
    row_of = [0] * len(datums)
    longest = max((d.length for d in datums), default=0)
    table = torch.full((len(datums), longest), -1, dtype=torch.long)  # the rows so far, -1 beyond each
    for i in order:
        tokens = datums[i].model_input.to_tensor()
        key = tuple(tokens.tolist())
        row = known.get(key)
        if row is None:
            n = len(tokens)
            probe = torch.tensor([0, n // 2, n - 1])
            candidates = (table[: len(rows), probe] == tokens[probe]).all(1).nonzero().flatten().tolist()
            row = next((r for r in candidates if len(rows[r]) > n and torch.equal(rows[r][:n], tokens)), None)
            if row is None:
                table[len(rows), :n] = tokens
                rows.append(tokens)
                row = len(rows) - 1
            known[key] = row
        row_of[i] = row
    return rows, row_of


def _components(n_rows: int, items: list[list[int]]) -> list[list[int]]:
    """Groups of rows that must share a micro-batch (union of the rows of each item)."""
    parent = list(range(n_rows))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for item in items:
        for r in item[1:]:
            parent[root(r)] = root(item[0])
    groups: dict[int, list[int]] = {}
    for r in range(n_rows):
        groups.setdefault(root(r), []).append(r)
    return list(groups.values())


def pack_shared(parts: list[list[Datum]], per_item: list[int], size: int, max_tokens: int = 0,
                by_tokens: bool = False) -> list[SharedBatch]:
    """Shared micro-batches for several losses' datums (``parts[k]``, in items of ``per_item[k]``
    consecutive datums): each distinct sequence forwarded once (a datum that is a prefix of
    another's sequence reads that row), at most ``size`` rows per micro-batch and (``max_tokens``
    > 0) at most ``max_tokens`` padded tokens (rows x the longest) unless one group of rows that
    must stay together is larger. Rows are grouped in order of length, or (``by_tokens``) of their
    tokens, which puts the rows that share a prefix together (`learner.shared_prefix_tokens`)."""
    for datums, n in zip(parts, per_item):
        if len(datums) % n:
            raise ValueError(f"{len(datums)} datums do not form items of {n}")
    flat = [(k, i) for k, datums in enumerate(parts) for i in range(len(datums))]
    rows, row_of = _rows_of([parts[k][i] for k, i in flat])
    index = {key: j for j, key in enumerate(flat)}
    items = [[row_of[index[(k, i + j)]] for j in range(per_item[k])]
             for k, datums in enumerate(parts) for i in range(0, len(datums), per_item[k])]
    if by_tokens:
        groups = sorted(_components(len(rows), items), key=lambda g: min(rows[r].tolist() for r in g))
    else:
        groups = sorted(_components(len(rows), items), key=lambda g: max(len(rows[r]) for r in g))
    batches: list[list[int]] = []
    for group in groups:
        batch = batches[-1] if batches else None
        longest = max(len(rows[r]) for r in group + (batch or []))  # the batch's padded length with the group
        count = len(group) + (len(batch) if batch else 0)
        if batch is None or count > size or (max_tokens and count * longest > max_tokens):
            batches.append(list(group))
        else:
            batch.extend(group)
    out = []
    for batch in batches:
        local = {r: j for j, r in enumerate(batch)}
        views = [[(parts[k][i], local[row_of[index[(k, i)]]]) for i in range(len(parts[k]))
                  if row_of[index[(k, i)]] in local] for k in range(len(parts))]
        out.append(SharedBatch([rows[r] for r in batch], views))
    return out


def first_reader_tokens(batch: SharedBatch) -> list[int]:
    """Per loss, the tokens of ``batch``'s rows it is the first (in the losses' order) to read:
    what forwarding and training it adds to the losses before it (its share of the pass)."""
    seen: set[int] = set()
    out = []
    for view in batch.views:
        rows = {r for _, r in view} - seen
        out.append(sum(len(batch.rows[r]) for r in rows))
        seen |= rows
    return out


class SharedForward:
    """One micro-batch's rows on the model: the views of its losses register the positions they
    read (`add`) and the first logits asked for runs the decoder once, with the vocabulary
    projection at every view's positions (``logits(model_call, k)``)."""

    def __init__(self, rows: list[torch.Tensor], pad_id: int, device: torch.device):
        lengths = [len(r) for r in rows]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
        attention = (torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]).long()
        self.mb = MicroBatch(ids, attention, {}, lengths)
        self.width = ids.shape[1]
        self.device = device
        self.selections: list[torch.Tensor] = []
        self._logits: tuple[torch.Tensor, ...] | None = None

    def add(self, rows: list[int], valid: torch.Tensor) -> int:
        """Register a view: its datums read rows ``rows`` and its loss reads the positions where
        ``valid`` ([len(rows), T'], T' <= the rows' width) is true. Returns the view's index."""
        row = torch.tensor(rows, dtype=torch.long, device=valid.device)[:, None]
        flat = row * self.width + torch.arange(valid.shape[1], device=valid.device)[None, :]
        self.selections.append(flat[valid])  # row-major over the view's datums and positions
        return len(self.selections) - 1

    def logits(self, model_call, k: int) -> torch.Tensor:
        """[N, V] logits at view ``k``'s positions; ``model_call(mb, *selections)`` runs the model
        once for every registered view."""
        if self._logits is None:
            out = model_call(self.mb, *self.selections)
            self._logits = out if isinstance(out, tuple) else (out,)
        return self._logits[k]
