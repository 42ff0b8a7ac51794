"""Seeded policy-gradient datums over random tokens, for tests that train a learner a few steps."""

from __future__ import annotations

import torch

from meshrl.types import Datum


def random_datums(seed: int, count: int = 4, length: int = 12, vocab: int = 49152) -> list[Datum]:
    """``count`` datums of ``length`` random tokens: the second half is the completion, with sampler
    logprobs -3 and advantages spread around 0 (datum i gets 0.1 * (i - (count - 1) / 2))."""
    g = torch.Generator().manual_seed(seed)
    half = length // 2
    out = []
    for i in range(count):
        toks = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(Datum.from_sequence(toks, mask=[0] * half + [1] * (length - half), logprobs=[-3.0] * length,
                                       advantages=[0.0] * half + [0.1 * (i - (count - 1) / 2)] * (length - half)))
    return out
