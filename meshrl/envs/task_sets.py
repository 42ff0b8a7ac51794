"""Task sets: the training stream and the held-out set a run draws from, built from `task:`.

Every task set offers ``train_batch(cursor, n)``, ``heldout(n)`` and ``multi_turn`` (which rollout
strategy it needs). Training order comes from one place, :class:`SeededStream`: an endless,
resumable stream (the cursor is part of a checkpoint) whose epochs are permutations seeded by
`trainer.seed`.
"""

from __future__ import annotations

import functools
import random
from typing import Sequence

from meshrl.config.task import CodeTaskConfig, TaskConfig


class SeededStream:
    """Items ``cursor .. cursor+n`` of an endless stream over ``items``: epoch e is a permutation
    seeded by (seed, e). Seed 0 keeps the first epoch in the items' own order."""

    def __init__(self, items: Sequence, seed: int):
        if not items:
            raise ValueError("a training stream needs at least one item")
        self.items, self.seed = items, seed

    def batch(self, cursor: int, n: int) -> list[tuple[int, object]]:
        """(stream position, item) for positions ``cursor .. cursor+n``."""
        out = []
        for k in range(cursor, cursor + n):
            epoch, pos = divmod(k, len(self.items))
            out.append((k, self.items[self._order(epoch)[pos]]))
        return out

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> tuple[int, ...]:
        order = list(range(len(self.items)))
        if epoch or self.seed:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return tuple(order)


class CodeTaskSet:
    """Training stream and held-out set of code tasks (multi-turn episodes in the sandbox)."""

    multi_turn = True

    def __init__(self, cfg: CodeTaskConfig, data_seed: int = 0):
        from meshrl.envs.code_env import tasks_from_config

        self.cfg = cfg
        train = tasks_from_config(cfg.env)
        if not train:
            raise ValueError("task.code.env selects no training tasks")
        self.stream = SeededStream(train, data_seed)
        bundled = "meshrl" if cfg.env.task_source == "humaneval" else cfg.env.task_source
        source = "humaneval" if cfg.heldout_split == "humaneval" else bundled
        held = cfg.env.model_copy(update={"split": "test", "task_source": source, "task_limit": None,
                                          "difficulty": None})
        self.held = tasks_from_config(held)[: cfg.heldout_limit]

    def train_batch(self, cursor: int, n: int) -> list:
        return [task for _, task in self.stream.batch(cursor, n)]

    def heldout(self, n: int | None = None) -> list:
        return self.held if n is None else self.held[:n]


def make_task(cfg: TaskConfig, data_seed: int = 0):
    """The task set named by `task.kind`; ``data_seed`` (`trainer.seed`) orders its training stream."""
    if cfg.kind == "arithmetic":
        from meshrl.envs.arithmetic import ArithmeticTask

        return ArithmeticTask(cfg.arithmetic, data_seed)
    if cfg.kind == "code":
        return CodeTaskSet(cfg.code, data_seed)
    raise ValueError(f"task.kind = {cfg.kind!r}: no such task")
