"""Turning Datums into padded micro-batch tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshrl.types import Datum


@dataclass
class MicroBatch:
    """Right-padded tensors for a group of Datums; padded positions have mask 0."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    inputs: dict[str, torch.Tensor]  # each [B, T], zero-padded
    lengths: list[int]


def pad_datums(datums: list[Datum], pad_id: int) -> MicroBatch:
    """Stack Datums of different lengths; every loss input is padded with zeros (mask 0)."""
    if not datums:
        raise ValueError("empty micro-batch")
    lengths = [d.length for d in datums]
    width = max(lengths)
    ids = torch.full((len(datums), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(datums), width), dtype=torch.long)
    keys = set(datums[0].loss_fn_inputs)
    for d in datums[1:]:
        if set(d.loss_fn_inputs) != keys:
            raise ValueError(f"datums disagree on loss_fn_inputs keys: {sorted(keys)} vs {sorted(d.loss_fn_inputs)}")
    inputs = {
        k: torch.zeros((len(datums), width), dtype=datums[0].loss_fn_inputs[k].dtype) for k in keys
    }
    for i, d in enumerate(datums):
        n = lengths[i]
        ids[i, :n] = d.model_input.to_tensor()
        attention[i, :n] = 1
        for k in keys:
            inputs[k][i, :n] = d.loss_fn_inputs[k]
    return MicroBatch(ids, attention, inputs, lengths)


def split_micro_batches(datums: list[Datum], size: int) -> list[list[Datum]]:
    """Consecutive groups of at most ``size`` Datums, sorted by length to limit padding."""
    order = sorted(range(len(datums)), key=lambda i: datums[i].length)
    ordered = [datums[i] for i in order]
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]
