"""EnvActor: hosts the multi-turn environments of one env process (one per live episode) and steps a
batch of episodes concurrently, so environments run in parallel in the env mesh while the generator
is free. The environments come from the run's `EnvSource` (meshrl.envs.hosting): the code task's
sandboxed `CodeEnv`, or `task.env`'s class, OpenEnv server or meshrl remote server, with `task.env.judge`'s LLM judge
when one is set; the episode logic (deadlines, checks of what an environment returns, judging) is
`EpisodeHost`'s."""

from __future__ import annotations

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.config.env import EnvConfig
from meshrl.config.env_task import EnvTaskConfig
from meshrl.envs.episode_host import EpisodeHost
from meshrl.envs.hosting import env_source
from meshrl.judges import Judge


class EnvActor(MeshrlActor):
    """Episodes keyed by id; `reset` opens them, `step` advances a batch, `finish` closes them."""

    def __init__(self, spec: EnvConfig | EnvTaskConfig):
        judge = spec.judge if isinstance(spec, EnvTaskConfig) else None
        self.host = EpisodeHost(env_source(spec), Judge(judge) if judge is not None else None)

    def describe(self) -> dict:
        return self.host.source.describe()

    def __cleanup__(self, exc: object) -> None:
        """The actor stops: close its episodes and stop a server it serves."""
        self.host.close()

    @endpoint
    def reset(self, episodes: list[tuple[str, object]]) -> list[dict]:
        """Open one episode per (episode_id, spec); each one's first messages, or its error."""
        return self.host.reset(episodes)

    @endpoint
    def step(self, actions: list[tuple[str, str]]) -> list[dict]:
        """Advance each (episode_id, reply text) by one turn, concurrently."""
        self.fault_point("step")
        return self.host.step(actions)

    @endpoint
    def finish(self, episode_ids: list[str]) -> dict:
        """Close episodes: their records (and late rewards), and this process's env counters."""
        return {"episodes": self.host.finish(episode_ids), "counts": self.host.counters()}
