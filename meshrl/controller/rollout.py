"""Rollout strategies: how a batch of tasks becomes scored trajectories. The loop picks one at
start (`rollout_for`) and never asks what kind of task it runs.

- `SingleTurnRollout`: render each problem's prompt, sample G completions per prompt on the
  generator meshes, score each with the rewarder mesh.
- `EpisodeRollout` (meshrl.controller.episodes): G multi-turn episodes per task against the env
  mesh, token-in/token-out.
- `AgentRollout` (meshrl.controller.agents): G runs of an agent program per episode, through an
  OpenAI-compatible endpoint backed by the generator meshes.

A strategy also spawns the mesh that scores its rollouts (rewarder or env).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Protocol

from meshrl.config.meshes import REWARDER

from meshrl.meshes.client import MeshClient, prompts_by_replica
from meshrl.engines import SampleRequest
from meshrl.training.trajectories import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Counters:
    """Things that were skipped or went wrong, counted over the run."""

    prompts_too_long: int = 0
    empty_generations: int = 0
    reward_errors: int = 0
    stale_dropped: int = 0
    """Samples older than max_steps_off_policy when their step trained (never trained on)."""

    def as_metrics(self) -> dict[str, int]:
        return {f"count/{k}": v for k, v in dataclasses.asdict(self).items()}


class RolloutStrategy(Protocol):
    """Turns tasks into scored trajectories; trajectories of task i have ``group == i``."""

    episode_records: list[dict]
    """Per-episode records (turns, outputs, rewards) not yet written out (empty for single turn)."""

    def collect(self, tasks: list, group_size: int, request: SampleRequest, tag: str) -> tuple[list[Trajectory], dict]:
        """``group_size`` scored trajectories per task, sampled with ``request`` (its seed makes
        a retried batch sample the same tokens), and this batch's timing metrics."""


class SingleTurnRollout:
    """One sampled reply per trajectory, graded by the rewarder mesh."""

    def __init__(self, client: MeshClient, renderer, max_model_len: int, counters: Counters):
        self.client, self.renderer, self.max_model_len, self.counters = client, renderer, max_model_len, counters
        self.episode_records: list[dict] = []

    @staticmethod
    def spawn(session, cfg) -> None:
        """The rewarder mesh (`meshes.rewarder`) on ``session`` (a `meshrl.meshes.session.MeshSession`)."""
        from meshrl.actors.rewarder import Rewarder

        session.spawn(REWARDER, Rewarder, cfg.task, cfg.rewarder)

    def _prompts(self, problems: list, max_tokens: int) -> tuple[list, list[list[int]]]:
        """Rendered prompts; problems whose prompt cannot fit with a full response are skipped."""
        limit = self.max_model_len - max_tokens
        kept, prompts = [], []
        for p in problems:
            tokens = self.renderer.build_generation_prompt(list(p.messages))
            if len(tokens) > limit:
                self.counters.prompts_too_long += 1
                log.warning("skipping problem %s: prompt of %d tokens exceeds %d (model.max_model_len - "
                            "max_new_tokens)", p.id, len(tokens), limit)
                continue
            kept.append(p)
            prompts.append(tokens)
        return kept, prompts

    def collect(self, tasks: list, group_size: int, request: SampleRequest, tag: str) -> tuple[list[Trajectory], dict]:
        t0 = time.perf_counter()
        problems, prompts = self._prompts(tasks, request.max_tokens)
        timings: dict[str, float] = {}
        completions = self.client.generate(prompts, dataclasses.replace(request, n=group_size), timings)
        t1 = time.perf_counter()
        trajectories: list[Trajectory] = []
        for g, (problem, prompt, group) in enumerate(zip(problems, prompts, completions)):
            for k, c in enumerate(group):
                if not c.tokens:
                    self.counters.empty_generations += 1
                trajectories.append(Trajectory(
                    id=f"{problem.id}-s{k}", group=g, problem=problem, prompt_tokens=prompt,
                    tokens=list(c.tokens), logprobs=list(c.logprobs), mask=[1] * len(c.tokens),
                    version=c.meta.get("version", self.client.version), response_text=c.text,
                    finish_reason=c.finish_reason,
                ))
        scores = self.client.score([(t.problem, t.response_text) for t in trajectories])
        for t, (reward, info) in zip(trajectories, scores):
            t.reward, t.info = reward, info
            if "error" in info:
                self.counters.reward_errors += 1
                log.warning("reward for %s failed: %s", t.id, info["error"])
        return trajectories, {"timing/generate_s": t1 - t0, "timing/reward_s": time.perf_counter() - t1,
                              **timings, **prompts_by_replica(completions)}


def strategy_for(task) -> type:
    """The strategy class the task asks for (an agent program's, or by ``task.multi_turn``), chosen
    once per run."""
    agent = getattr(task, "agent", None)
    if agent is not None:
        from meshrl.controller.agents import AgentRollout

        return AgentRollout.bound(agent)
    if task.multi_turn:
        from meshrl.controller.episodes import EpisodeRollout

        return EpisodeRollout
    return SingleTurnRollout
