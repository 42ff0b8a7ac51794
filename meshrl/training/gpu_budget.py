"""The device a learner or engine process computes on, and its share of that GPU's memory.

Two meshes may share a GPU (`meshes.<mesh>.devices` naming the same GPU, each with a
`gpu_memory_fraction`); the placement's bootstrap hands each process its fraction in
`MEMORY_FRACTION_ENV`, and `claim_device` caps PyTorch's allocator at it, so that neither process
takes memory the other was promised.
"""

from __future__ import annotations

import os

import torch

MEMORY_FRACTION_ENV = "MESHRL_GPU_MEMORY_FRACTION"
"""The share of its GPU's memory a process may allocate, set by the placement's bootstrap."""


def memory_fraction() -> float | None:
    """This process's GPU memory share (None = no budget: the GPU is its mesh's alone)."""
    value = os.environ.get(MEMORY_FRACTION_ENV)
    return float(value) if value else None


def claim_device() -> torch.device:
    """`cuda` (the first GPU this process sees) when there is one, with the allocator capped at
    `memory_fraction()`, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    fraction = memory_fraction()
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return torch.device("cuda")
