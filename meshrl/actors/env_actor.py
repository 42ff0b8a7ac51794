"""EnvActor: hosts multi-turn code environments (one CodeEnv per live episode) over one shared
sandbox, and steps a batch of episodes concurrently, so sandboxed executions run in parallel in
the env mesh while the generator is free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.envs.code_env import CodeAction, CodeEnv, tasks_from_config
from meshrl.envs.config import EnvConfig
from meshrl.envs.sandbox import Sandbox


def _observation_record(obs) -> dict:
    """The parts of an Observation the controller needs (plain, picklable)."""
    return {"message": obs.message, "reward": float(obs.reward or 0.0), "done": obs.done,
            "error_kind": obs.error_kind, "hint_template_key": obs.hint_template_key,
            "hint": obs.metadata.get("hint"), "success": bool(obs.metadata.get("success", False)),
            "termination": obs.metadata.get("termination"), "tests_passed": obs.metadata.get("tests_passed"),
            "tests_total": obs.metadata.get("tests_total")}


class EnvActor(MeshrlActor):
    """Episodes keyed by id; `reset` opens them, `step` advances a batch, `finish` closes them."""

    def __init__(self, env_cfg: EnvConfig):
        self.cfg = env_cfg
        self.sandbox = Sandbox(env_cfg.sandbox)
        self.tasks = {t.task_id: t for t in tasks_from_config(env_cfg.model_copy(update={"split": "all"}))}
        self.envs: dict[str, CodeEnv] = {}
        self.pool = ThreadPoolExecutor(max_workers=env_cfg.sandbox.max_parallel)

    def describe(self) -> dict:
        return {"layer": Sandbox.probe(self.cfg.sandbox).layer, "tasks": len(self.tasks)}

    @endpoint
    def reset(self, episodes: list[tuple[str, str]]) -> list[list[dict]]:
        """Open one episode per (episode_id, task_id); returns each episode's initial messages."""
        out = []
        for episode_id, task_id in episodes:
            env = CodeEnv(self.tasks[task_id], self.sandbox, self.cfg.code)
            obs = env.reset(episode_id=episode_id, task_id=task_id)
            self.envs[episode_id] = env
            out.append(obs.metadata["messages"])
        return out

    @endpoint
    def step(self, actions: list[tuple[str, str, int, bool]]) -> list[dict]:
        """Advance each (episode_id, reply text, reply tokens, truncated) by one turn, concurrently."""
        self.fault_point("step")

        def one(action):
            episode_id, text, num_tokens, truncated = action
            env = self.envs[episode_id]
            obs = env.step(CodeAction(text=text, num_tokens=num_tokens, truncated=truncated))
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
