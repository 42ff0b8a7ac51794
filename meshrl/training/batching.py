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
