"""Preference pairs from agreed-on teacher actions, as token ids, and their `dpo` Datums."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.types import Datum


@dataclass
class PreferenceItem:
    """One preference pair for the same prompt (all token ids)."""

    key: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    version: int | None = None
    """The policy version that sampled the replayed trace, by which the replay term drops a pair
    grown too old before its turn (`replay.pool.max_version_lag`); None where it is not known
    (pairs read from rollout shards, checkpoints that predate it)."""


def dpo_datums(items: list[PreferenceItem], weight: float) -> list[Datum]:
    """Two Datums per pair, chosen then rejected, each answer's tokens masked in and the pair's
    term weighted by ``weight``."""
    datums = []
    for item in items:
        for answer in (item.chosen, item.rejected):
            datums.append(Datum.from_sequence(item.prompt + answer, per_sequence={"weight": weight},
                                              mask=[0] * len(item.prompt) + [1] * len(answer)))
    return datums
