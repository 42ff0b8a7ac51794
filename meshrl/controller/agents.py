"""The rollout strategy of `task.kind: agent`: black-box agent programs play the episodes through
an OpenAI-compatible endpoint served, for the batch, from the generator mesh.

Each batch starts the endpoint (meshrl.agents.server) on loopback, gives every episode its own API
key, and runs ``group_size`` programs per episode spec, at most `task.agent.max_parallel` at once,
each within `task.agent.timeout_s` (meshrl.agents.programs). Every completion is sampled by
`MeshClient.sample` with the batch's sampling parameters (the step's policy version: weights change
between batches only) and recorded with its exact prompt and sampled tokens; when an episode's
program has ended its calls are assembled into segments without re-tokenising
(meshrl.agents.transcript), each segment a Trajectory with the episode's reward: the program's result,
or `task.agent.grader`'s verdict on the transcript. An episode whose program timed out, crashed,
returned no usable result, never called the endpoint or whose grader failed is dropped from its
group and counted (`agents/timed_out`, `agents/crashed`, `agents/bad_result`, `agents/no_calls`,
`agents/grader_errors`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from meshrl.agents.programs import Outcome, load_callable, reward_of, run_callable, run_command
from meshrl.agents.server import AgentEndpoint, AgentServer
from meshrl.agents.transcript import EpisodeLog, ServedCall, assemble
from meshrl.config.agent_task import AgentTaskConfig
from meshrl.controller.rollout import Counters
from meshrl.engines import PromptScoring, SampleRequest
from meshrl.meshes.client import MeshClient
from meshrl.training.trajectories import Trajectory

log = logging.getLogger(__name__)


class AgentRollout:
    """``group_size`` agent-program episodes per episode spec, through the endpoint."""

    agent: AgentTaskConfig  # set by `bound`

    def __init__(self, client: MeshClient, renderer, max_model_len: int, counters: Counters):
        self.client, self.renderer, self.max_model_len, self.counters = client, renderer, max_model_len, counters
        self.episode_records: list[dict] = []
        cfg = self.agent
        self.program = load_callable(cfg.callable, "task.agent.callable", cfg.python_path) if cfg.callable else None
        self.grader = load_callable(cfg.grader, "task.agent.grader", cfg.python_path) if cfg.grader else None

    @classmethod
    def bound(cls, agent: AgentTaskConfig) -> type["AgentRollout"]:
        """The strategy class for ``agent`` (`task.agent`)."""
        return type(cls.__name__, (cls,), {"agent": agent})

    @staticmethod
    def spawn(session, cfg) -> None:
        """No mesh of its own: the programs run beside the controller, their completions on the generators."""

    def collect(self, tasks: list, group_size: int, request: SampleRequest, tag: str) -> tuple[list[Trajectory], dict]:
        t0 = time.perf_counter()
        step = self.client.step
        episodes = [(f"{tag}-{g}-{k}", g, spec) for g, spec in enumerate(tasks) for k in range(group_size)]
        keys = [secrets.token_hex(16) for _ in episodes]
        index = {key: i for i, key in enumerate(keys)}
        logs = {key: EpisodeLog(self.agent.max_completions) for key in keys}

        def sample(key: str, call: int, prompt: list[int], max_tokens: int, top: int):
            self.client.step = step  # this request's thread works for the batch's step
            seed = None if request.seed is None else request.seed + 1009 * index[key] + 7919 * call
            part = dataclasses.replace(request, n=1, max_tokens=max_tokens, topk=top, seed=seed)
            return self.client.sample(prompt, part, PromptScoring()).completions[0]

        endpoint = AgentEndpoint(self.renderer, sample, request.max_tokens, self.max_model_len)
        for key in keys:
            endpoint.open(key, logs[key])
        with AgentServer(endpoint) as server, ThreadPoolExecutor(self.agent.max_parallel) as pool:
            futures = [pool.submit(self._run, server.base_url, key, logs[key], episode_id, spec)
                       for key, (episode_id, _, spec) in zip(keys, episodes)]
            outcomes = [f.result() for f in futures]
        counts: Counter = Counter({f"agents/{k}": v for k, v in endpoint.counts.items()})
        trajectories: list[Trajectory] = []
        for (episode_id, group, spec), (outcome, calls) in zip(episodes, outcomes):
            trajectories += self._score(episode_id, group, spec, outcome, calls, counts)
        n = max(len({t.info["episode_id"] for t in trajectories}), 1)
        firsts = [t for t in trajectories if t.info["segment"] == 0]
        return trajectories, {"timing/generate_s": time.perf_counter() - t0,
                              "episodes/success": sum(bool(t.info["correct"]) for t in firsts) / n,
                              "episodes/mean_turns": sum(t.info["calls"] for t in firsts) / n,
                              **{k: float(v) for k, v in counts.items()}}

    def _run(self, base_url: str, key: str, episode: EpisodeLog, episode_id: str, spec) -> tuple[Outcome, list[ServedCall]]:
        """One episode's program run; its calls (the endpoint refuses the episode from then on)."""
        cfg = self.agent
        args = {**spec.kwargs, "episode_id": episode_id}
        if self.program is not None:
            outcome = run_callable(self.program, base_url, key, args, cfg.timeout_s)
        else:
            outcome = run_command(cfg.command, base_url, key, args, cfg.timeout_s, cfg.python_path)
        return outcome, episode.close()

    def _score(self, episode_id: str, group: int, spec, outcome: Outcome, calls: list[ServedCall],
               counts: Counter) -> list[Trajectory]:
        """The episode's trajectories (one per segment), or none: a dropped episode, counted."""
        status, reward, success = outcome.status, 0.0, None
        if status == "ok" and not calls:
            status = "no_calls"
        if status == "ok":
            try:
                reward, success = self._reward(spec, outcome.result, calls)
            except ValueError as e:
                status = "grader_errors" if self.grader is not None else "bad_result"
                outcome.detail = str(e)
        self.episode_records.append({"episode_id": episode_id, "agent_status": status, "agent_detail": outcome.detail,
                                     "agent_result": outcome.result, "calls": len(calls)})
        if status != "ok":
            counts[f"agents/{status}"] += 1
            log.warning("agent %s, episode %s: %s%s", self.agent.label, episode_id, status.replace("_", " "),
                        f" ({outcome.detail})" if outcome.detail else "")
            return []
        if success is None:
            threshold = self.agent.success_reward
            success = reward >= threshold if threshold is not None else reward > 0
        segments = assemble(calls)
        counts["agents/segments"] += len(segments)
        counts["agents/calls"] += len(calls)
        out = []
        for j, seg in enumerate(segments):
            self.counters.empty_generations += sum(1 for _, text, start, end in seg.turns if start == end)
            info = {"correct": success, "termination": "agent_done", "turns": list(seg.turns), "segment": j,
                    "segments": len(segments), "episode_id": episode_id, "calls": len(calls)}
            out.append(Trajectory(id=episode_id if j == 0 else f"{episode_id}.s{j}", group=group, problem=spec,
                                  prompt_tokens=seg.prompt, tokens=seg.tokens, logprobs=seg.logprobs, mask=seg.mask,
                                  version=seg.version, response_text=seg.turns[-1][1], reward=reward, info=info,
                                  finish_reason=seg.finish_reason))
        return out

    def _reward(self, spec, result, calls: list[ServedCall]) -> tuple[float, bool | None]:
        """(reward, success or None): the grader's verdict, else the program's own result; ValueError
        when either is unusable."""
        if self.grader is None:
            return reward_of(result)
        transcript = {"calls": [{"messages": c.messages, "reply": c.text,
                                 "tool_calls": [{"name": t.name, "arguments": t.arguments} for t in c.tool_calls]}
                                for c in calls], "result": result}
        try:
            value = self.grader(dict(spec.kwargs), transcript)
        except Exception as e:  # noqa: BLE001 - the grader's failure, counted
            raise ValueError(f"the grader raised {type(e).__name__}: {e}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"the grader returned {value!r}, not a finite number")
        success = result.get("success") if isinstance(result, dict) and isinstance(result.get("success"), bool) else None
        return float(value), success
