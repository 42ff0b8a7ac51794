"""EnvActor: hosts multi-turn code environments (one CodeEnv per live episode) over one shared
sandbox, and steps a batch of episodes concurrently, so sandboxed executions run in parallel in
the env mesh while the generator is free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.envs.code_actions import CodeAction
from meshrl.envs.code_env import CodeEnv
from meshrl.config.env import EnvConfig
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.tasks import CodeTask


def _observation_record(obs) -> dict:
    """The parts of an Observation the controller needs (plain, picklable)."""
    return {"message": obs.message, "reward": float(obs.reward or 0.0), "done": obs.done,
            "error_kind": obs.error_kind, "hint_template_key": obs.hint_template_key,
            "hint": obs.metadata.get("hint"), "success": bool(obs.metadata.get("success", False)),
            "termination": obs.metadata.get("termination"), "tests_passed": obs.metadata.get("tests_passed"),
            "tests_total": obs.metadata.get("tests_total"), "error_text": obs.metadata.get("error_text"),
            "grading_anomaly": obs.metadata.get("grading_anomaly")}


class EnvActor(MeshrlActor):
    """Episodes keyed by id; `reset` opens them, `step` advances a batch, `finish` closes them."""

    def __init__(self, env_cfg: EnvConfig):
        self.cfg = env_cfg
        self.sandbox = Sandbox(env_cfg.sandbox)
        self.envs: dict[str, CodeEnv] = {}
        self.pool = ThreadPoolExecutor(max_workers=env_cfg.sandbox.max_parallel)

    def describe(self) -> dict:
        return {"layer": self.sandbox.layer}

    @endpoint
    def reset(self, episodes: list[tuple[str, CodeTask]]) -> list[list[dict]]:
        """Open one episode per (episode_id, task); returns each episode's initial messages."""
        out = []
        for episode_id, task in episodes:
            env = CodeEnv(task, self.sandbox, self.cfg.code)
            obs = env.reset(episode_id=episode_id)
            self.envs[episode_id] = env
            out.append(obs.metadata["messages"])
        return out

    @endpoint
    def step(self, actions: list[tuple[str, str]]) -> list[dict]:
        """Advance each (episode_id, reply text) by one turn, concurrently."""
        self.fault_point("step")

        def one(action):
            episode_id, text = action
            env = self.envs[episode_id]
            obs = env.step(CodeAction(text=text))
            record = _observation_record(obs)
            record["context"] = env.state_at(env.state.step_count - 1)
            return record

        return list(self.pool.map(one, actions))

    @endpoint
    def finish(self, episode_ids: list[str]) -> list[dict]:
        """Close episodes; returns their trajectory records (turns, code, outputs, rewards)."""
        records = []
        for episode_id in episode_ids:
            env = self.envs.pop(episode_id, None)
            if env is not None:
                records.append(env.trajectory())
                env.close()
        return records
