"""Multi-turn episodes, token-in/token-out: the generator samples a turn, the env mesh runs it in
the sandbox, the feedback message is appended to the episode's token sequence with the renderer's
bridge (history is never re-tokenised), and so on until the episode ends.

Every episode becomes one Trajectory whose `mask` is 1 exactly on the policy's sampled tokens.
Its info carries what the other channels need: the turns (context, action, token span), and for a
failed episode the error kind, the environment's hint and the span of the failing turn.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from meshrl.controller.rollouts import Trajectory
from meshrl.engines import SampleRequest

log = logging.getLogger(__name__)
ENV = "env"


class CodeTaskSet:
    """Training stream and held-out set of code tasks (the `task` object for `task.kind: code`)."""

    def __init__(self, cfg):
        from meshrl.envs.code_env import tasks_from_config

        self.cfg = cfg
        self.train = tasks_from_config(cfg.env)
        held = cfg.env.model_copy(update={"split": "test", "task_source": "meshrl", "task_limit": None,
                                          "difficulty": None})
        if cfg.heldout_split == "humaneval":
            held = held.model_copy(update={"task_source": "humaneval"})
        self.held = tasks_from_config(held)[: cfg.heldout_limit]
        if not self.train:
            raise ValueError("task.code.env selects no training tasks")

    def train_batch(self, cursor: int, n: int) -> list:
        return [self.train[k % len(self.train)] for k in range(cursor, cursor + n)]

    def heldout(self, n: int | None = None) -> list:
        return self.held if n is None else self.held[:n]


@dataclass
class _Episode:
    id: str
    group: int
    task: object
    rank: int
    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple] = field(default_factory=list)  # (context, action text, start, end)
    reward: float = 0.0
    last: dict = field(default_factory=dict)
    text: str = ""
    finish_reason: str = ""
    termination: str | None = None
    version: int = 1 << 30  # the oldest policy version that sampled any of its turns

    def append(self, tokens, logprobs, sampled: bool) -> tuple[int, int]:
        start = len(self.tokens)
        self.tokens += list(tokens)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(tokens)
        self.mask += [1 if sampled else 0] * len(tokens)
        return start, len(self.tokens)


def run_episodes(loop, tasks: list, group_size: int, request: SampleRequest, tag: str) -> tuple[list[Trajectory], list[dict]]:
    """Play ``group_size`` episodes of each task; returns trajectories and the env's episode records."""
    from meshrl.controller.supervisor import wait_all

    cfg = loop.cfg
    env_mesh = loop.meshes[ENV]
    ranks = loop.meshes.procs_of(ENV)
    timeout = cfg.rewarder.timeout_s
    episodes = [_Episode(f"{tag}-{g}-{k}", g, task, (g * group_size + k) % ranks)
                for g, task in enumerate(tasks) for k in range(group_size)]

    def by_rank(items):
        return {r: [x for x in items if x[0].rank == r] for r in range(ranks)}

    def call(endpoint, per_episode):
        """Call ``endpoint`` on each env rank with its episodes' arguments; results in order."""
        groups = by_rank(per_episode)
        futures = [getattr(env_mesh.slice(procs=r), endpoint).call_one([arg for _, arg in groups[r]])
                   for r in range(ranks) if groups[r]]
        replies = iter(wait_all(futures, timeout, f"{ENV}.{endpoint}", watch=lambda: loop.meshes.dead_process(ENV)))
        out = {}
        for r in range(ranks):
            if groups[r]:
                for (ep, _), value in zip(groups[r], next(replies)):
                    out[ep.id] = value
        return [out[ep.id] for ep, _ in per_episode]

    initial = call("reset", [(ep, (ep.id, ep.task)) for ep in episodes])
    limit = cfg.model.max_model_len - request.max_tokens
    active = []
    for ep, messages in zip(episodes, initial):
        ep.prompt = loop.renderer.build_generation_prompt(messages)
        if len(ep.prompt) > limit:
            loop.counters.prompts_too_long += 1
            ep.termination = "prompt_too_long"
            continue
        active.append(ep)
    turn = 0
    while active:
        prompts = [ep.prompt + ep.tokens for ep in active]
        turn_request = request if request.seed is None else dataclasses.replace(request, seed=request.seed + 7919 * turn)
        completions = loop._generate(prompts, turn_request)
        actions = []
        for ep, group in zip(active, completions):
            c = group[0]
            if not c.tokens:
                loop.counters.empty_generations += 1
            span = ep.append(c.tokens, c.logprobs, sampled=True)
            ep.turns.append([None, c.text, *span])
            ep.text, ep.finish_reason = c.text, c.finish_reason
            ep.version = min(ep.version, c.meta.get("version", loop.version))
            actions.append((ep, (ep.id, c.text, len(c.tokens), c.finish_reason == "length")))
        results = call("step", actions)
        still = []
        for ep, result in zip(active, results):
            ep.turns[-1][0] = result["context"]
            ep.reward += result["reward"]
            ep.last = result
            if result["done"]:
                ep.termination = result["termination"]
                continue
            bridge = loop.renderer.bridge(ep.prompt + ep.tokens, [result["message"]])
            if len(ep.prompt) + len(ep.tokens) + len(bridge) > limit:
                ep.termination = "context_limit"
                continue
            ep.append(bridge, [], sampled=False)
            still.append(ep)
        active = still
        turn += 1
    records = call("finish", [(ep, ep.id) for ep in episodes])
    return [_trajectory(ep) for ep in episodes if ep.prompt and ep.termination != "prompt_too_long"], records


def _trajectory(ep: _Episode) -> Trajectory:
    last = ep.last
    success = bool(last.get("success"))
    info = {"correct": success, "termination": ep.termination, "turns": [tuple(t) for t in ep.turns],
            "tests_passed": last.get("tests_passed"), "tests_total": last.get("tests_total")}
    if not success and ep.turns:
        info.update(error_kind=last.get("error_kind") or "test_failure", hint=last.get("hint"),
                    hint_template_key=last.get("hint_template_key"), error_span=tuple(ep.turns[-1][2:4]))
    return Trajectory(id=ep.id, group=ep.group, problem=ep.task, prompt_tokens=ep.prompt, tokens=ep.tokens,
                      logprobs=ep.logprobs, mask=ep.mask, version=ep.version, response_text=ep.text,
                      finish_reason=ep.finish_reason, reward=ep.reward, info=info)
