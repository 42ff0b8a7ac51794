"""Task sets: the training stream and the held-out set a run draws from, built from `task:`.

Every task set offers ``train_batch(cursor, n)``, ``heldout(n)`` and ``multi_turn`` (which rollout
strategy it needs). Training order comes from one place, :class:`SeededStream`: an endless,
resumable stream (the cursor is part of a checkpoint) whose epochs are permutations seeded by
`trainer.seed`.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from meshrl.config.agent_task import AgentTaskConfig
from meshrl.config.base import ConfigError
from meshrl.config.env_task import EnvTaskConfig, EpisodeSetConfig
from meshrl.config.task import CodeTaskConfig, TaskConfig
from meshrl.jsonl import read_objects


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


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode of an environment of the user's own: the keyword arguments of its `reset`."""

    id: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        """What SDPO hint templates may use of the episode: its reset arguments."""
        return self.kwargs


def _episode_specs(cfg: EpisodeSetConfig, key: str) -> list[EpisodeSpec]:
    """The episodes of a set: its seeds, or its file's lines (ConfigError naming the line)."""
    if cfg.file is None:
        first, stop = cfg.seeds
        stop = stop if cfg.limit is None else min(stop, first + cfg.limit)
        return [EpisodeSpec(f"seed{i}", {**cfg.kwargs, "seed": i}) for i in range(first, stop)]
    path = Path(cfg.file)
    try:
        lines = read_objects(path, ConfigError)
    except OSError as e:
        raise ConfigError(f"{key}.file: cannot read {path} ({type(e).__name__})") from None
    except ConfigError as e:
        raise ConfigError(f"{key}.file: {e}") from None
    specs = [EpisodeSpec(f"{path.stem}:{n}", spec) for n, spec in lines][:cfg.limit]
    if not specs:
        raise ConfigError(f"{key}.file: {path} holds no episode")
    return specs


class EnvTaskSet:
    """Training stream and held-out set of an environment of the user's own (`task.kind: env`):
    episode specs from seeds or a JSONL file, the two sets disjoint. Making it checks the
    environment's source (the factory imports, the URL answers) before anything is spawned."""

    multi_turn = True
    key = "task.env"

    def __init__(self, cfg: EnvTaskConfig | AgentTaskConfig, data_seed: int = 0):
        self.cfg = cfg
        train = _episode_specs(cfg.train, f"{self.key}.train")
        self.held = _episode_specs(cfg.heldout, f"{self.key}.heldout")
        shared = {_key(s) for s in train} & {_key(s) for s in self.held}
        if shared:
            raise ConfigError(f"{self.key}.heldout shares {len(shared)} episode(s) with {self.key}.train "
                              f"(e.g. {sorted(shared)[0]}): held-out episodes must never be trained on")
        self.stream = SeededStream(train, data_seed)
        self.check_source()

    def check_source(self) -> None:
        from meshrl.envs.hosting import check_env_source

        check_env_source(self.cfg)

    def train_batch(self, cursor: int, n: int) -> list:
        return [spec for _, spec in self.stream.batch(cursor, n)]

    def heldout(self, n: int | None = None) -> list:
        return self.held if n is None else self.held[:n]


class AgentTaskSet(EnvTaskSet):
    """The episode specs an agent program plays (`task.kind: agent`), as for an environment; making
    it checks that the program can start (its callable and grader import, its command exists)."""

    key = "task.agent"

    @property
    def agent(self) -> AgentTaskConfig:
        """The agent program's settings (the rollout strategy is chosen by them)."""
        return self.cfg

    def check_source(self) -> None:
        from meshrl.agents.programs import check_agent_source

        check_agent_source(self.cfg)


def _key(spec: EpisodeSpec) -> str:
    return json.dumps(spec.kwargs, sort_keys=True)


def env_spec(cfg: TaskConfig):
    """What the env mesh hosts for a multi-turn task: the code task's settings, or `task.env`."""
    return cfg.env if cfg.kind == "env" else cfg.code.env


def make_task(cfg: TaskConfig, data_seed: int = 0):
    """The task set named by `task.kind`; ``data_seed`` (`trainer.seed`) orders its training stream."""
    if cfg.kind == "arithmetic":
        from meshrl.envs.arithmetic import ArithmeticTask

        return ArithmeticTask(cfg.arithmetic, data_seed)
    if cfg.kind == "code":
        return CodeTaskSet(cfg.code, data_seed)
    if cfg.kind == "env":
        return EnvTaskSet(cfg.env, data_seed)
    if cfg.kind == "agent":
        return AgentTaskSet(cfg.agent, data_seed)
    raise ValueError(f"task.kind = {cfg.kind!r}: no such task")
