"""Rewarder actor: verifiable rewards for finished rollouts.

A grader that raises or returns garbage never takes the step down: the item scores 0 and the
failure is reported in its info (and counted by the controller).
"""

from __future__ import annotations

import importlib
import math
import traceback
from typing import Callable

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.config.run import RewarderConfig
from meshrl.config.task import TaskConfig
from meshrl.envs.arithmetic import Problem
from meshrl.envs.task_sets import make_task


def load_reward_fn(spec: str) -> Callable[[Problem, str], tuple[float, dict]]:
    """Import `package.module:function`; one-line error naming the spec if it cannot be found."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rewarder.reward_fn = {spec!r}: cannot import ({e})") from None
    if not callable(fn):
        raise ValueError(f"rewarder.reward_fn = {spec!r}: not callable")
    return fn


def safe_grade(grade, problem: Problem, response: str) -> tuple[float, dict]:
    """Call a grader; exceptions and non-finite rewards become reward 0 with an `error` info."""
    try:
        reward, info = grade(problem, response)
        reward = float(reward)
        if not math.isfinite(reward):
            return 0.0, {"error": f"non-finite reward {reward!r}"}
        return reward, dict(info)
    except Exception as e:  # noqa: BLE001 - any grader failure is data, not a crash
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return 0.0, {"error": f"grader raised {last}"}


class Rewarder(MeshrlActor):
    """Scores (problem, response text) pairs with the task's verifier."""

    def __init__(self, task_cfg: TaskConfig, cfg: RewarderConfig):
        self.grade = load_reward_fn(cfg.reward_fn) if cfg.reward_fn else make_task(task_cfg).grade

    @endpoint
    def score(self, items: list[tuple[Problem, str]]) -> list[tuple[float, dict]]:
        self.fault_point("score")
        return [safe_grade(self.grade, problem, response) for problem, response in items]
