"""Add actors of your own to the standard GRPO loop, on any launcher, without touching meshrl's code.

`BrevityRewarder` is an ordinary Monarch actor with the Rewarder's constructor and endpoints
(`info`, `score`): it grades with the task's verifier and takes a little off long replies.
`ReplyStats` is a mesh of your own, declared with `MeshDecl`, that keeps statistics of the replies
the loop trains on. `Cluster` starts the job the config's `launch:` section describes (this machine
by default; `launch.launcher=process` puts the meshes on separate host workers), the standard
meshes come up with `BrevityRewarder` in the rewarder's place, and this script drives the loop.

    python examples/custom_rewarder.py                       # the default task and model, 4 steps
    python examples/custom_rewarder.py launch.launcher=process 'launch.hosts={trainer: 1, sampler: 1}' \\
        'launch.place={generator: sampler}' trainer.steps=2
"""

from __future__ import annotations

import sys

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.actors.rewarder import safe_grade
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.envs.task_sets import make_task
from meshrl.launch.compose import Cluster, MeshDecl


class BrevityRewarder(MeshrlActor):
    """The task's reward minus `PENALTY` per word beyond `FREE_WORDS`; the info says how much."""

    PENALTY, FREE_WORDS = 0.01, 8

    def __init__(self, task_cfg, rewarder_cfg):
        self.grade = make_task(task_cfg).grade

    @endpoint
    def score(self, items):
        scored = []
        for problem, response in items:
            reward, info = safe_grade(self.grade, problem, response)
            penalty = self.PENALTY * max(len(response.split()) - self.FREE_WORDS, 0)
            scored.append((reward - penalty, {**info, "brevity_penalty": penalty}))
        return scored


class ReplyStats(MeshrlActor):
    """Counts the replies it is shown and their mean length in words."""

    def __init__(self):
        self.count, self.words = 0, 0

    @endpoint
    def add(self, texts: list[str]) -> dict:
        self.count += len(texts)
        self.words += sum(len(t.split()) for t in texts)
        return {"replies": self.count, "mean_words": self.words / max(self.count, 1)}


def main(overrides: list[str]) -> list[dict]:
    """Train `trainer.steps` steps; one summary per step."""
    cfg = load_config(RunConfig, None, ["trainer.steps=4", *overrides])
    steps = []
    with Cluster(cfg.launch, run_id="custom-rewarder") as cluster:
        stats = cluster.spawn(MeshDecl("reply_stats", ReplyStats))
        rt = cluster.runtime(cfg, actors={"rewarder": BrevityRewarder})
        for _ in range(cfg.trainer.steps):
            record, trained = rt.loop.step()
            reply_stats = stats.add.call_one([t.response_text for t in trained]).get(timeout=60)
            penalty = sum(t.info["brevity_penalty"] for t in trained) / len(trained)
            steps.append({"step": rt.loop.step_index, "reward": record["reward/mean"], "mean_penalty": penalty,
                          "version": rt.loop.version, **reply_stats})
            print(steps[-1], flush=True)
    return steps


if __name__ == "__main__":
    main(sys.argv[1:])
