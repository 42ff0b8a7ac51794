"""SDPO's alpha warm-up: the channel's weight starts at 0 and rises linearly to alpha, then stays."""

from __future__ import annotations


def warmup_weight(alpha: float, warmup_steps: int, step: int) -> float:
    """The SDPO weight at training step ``step`` (1-based): ``alpha * min(1, (step - 1) / warmup_steps)``,
    so 0 at step 1 and ``alpha`` from step ``warmup_steps + 1`` on; ``warmup_steps`` 0 = ``alpha``
    from the first step."""
    if step < 1 or warmup_steps < 0:
        raise ValueError(f"warmup_weight: step must be >= 1 and warmup_steps >= 0, got {step}, {warmup_steps}")
    if warmup_steps == 0:
        return alpha
    return alpha * min(1.0, (step - 1) / warmup_steps)
