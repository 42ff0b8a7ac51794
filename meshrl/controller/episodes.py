"""The multi-turn rollout strategy, token-in/token-out: the generator samples a turn, the env mesh runs it
(the code task's sandbox, or an environment of the user's own), the feedback message is appended to
the episode's token sequence with the renderer's bridge (history is never re-tokenised; a step may
add several, e.g. one tool turn per call), and so on
until the episode ends.

Every episode becomes one Trajectory whose `mask` is 1 exactly on the policy's sampled tokens.
Its info carries what the other channels need: the turns (context, action, token span), per turn
its error (kind, the environment's hint and error text; None for a turn with no error), for a
failed episode the error kind and hint of its last turn, and how many of its turns tampered with
grading (`grading_anomalies`; the step counts them as `reward/grading_anomalies`). An episode the
environment failed (`env_error`), or whose late reward never came, is left out of its group and
counted; a late reward that came is added to its episode's return. With an LLM judge, the env host's
judged return replaces the episode's return, and an episode whose judgment failed is left out of its
group when `task.env.judge.on_failure` is `drop` (counted, `episodes/judge_failed`). A batch during
which a served environment server died (and was restarted) is played again once, with the same seeds.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from meshrl.config.meshes import ENV

from meshrl.meshes.client import MeshClient, prompts_by_replica
from meshrl.controller.rollout import Counters
from meshrl.engines import SampleRequest
from meshrl.training.trajectories import Trajectory

log = logging.getLogger(__name__)


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
    turn_errors: list[dict | None] = field(default_factory=list)  # per turn; None: it solved the task
    reward: float = 0.0
    anomalies: int = 0  # turns graded as tampering with the grader
    last: dict = field(default_factory=dict)
    text: str = ""
    finish_reason: str = ""
    termination: str | None = None
    judge_score: float | None = None  # the judge's score in [0, 1], when the episode was judged
    version: int = 1 << 30  # the oldest policy version that sampled any of its turns

    def append(self, tokens, logprobs, sampled: bool) -> tuple[int, int]:
        start = len(self.tokens)
        self.tokens += list(tokens)
        self.logprobs += list(logprobs) if sampled else [0.0] * len(tokens)
        self.mask += [1 if sampled else 0] * len(tokens)
        return start, len(self.tokens)


class EpisodeRollout:
    """``group_size`` episodes per task, stepped together: each turn is one generate call for every
    active episode and one env call per env rank. A failed env mesh is replaced and the whole batch
    of episodes played again (it is seeded, so the retry samples the same tokens)."""

    def __init__(self, client: MeshClient, renderer, max_model_len: int, counters: Counters):
        self.client, self.renderer, self.max_model_len, self.counters = client, renderer, max_model_len, counters
        self.episode_records: list[dict] = []

    @staticmethod
    def spawn(session, cfg) -> None:
        """The env mesh (the code task's sandbox, or `task.env`'s environments, per process) takes
        the rewarder's place in the layout."""
        from meshrl.actors.env_actor import EnvActor
        from meshrl.envs.task_sets import env_spec

        tools = cfg.task.env.tools if cfg.task.kind == "env" else None
        if tools is not None and tools.format != session.renderer.name:
            from meshrl.config.base import ConfigError

            raise ConfigError(f"task.env.tools.format is {tools.format!r} but the model's chat template is "
                              f"{session.renderer.name!r}: set task.env.tools.format={session.renderer.name}")
        spec = cfg.meshes.rewarder
        session.spawn(ENV, EnvActor, env_spec(cfg.task), procs=spec.procs, colocate_with=spec.colocate_with)

    def collect(self, tasks: list, group_size: int, request: SampleRequest, tag: str) -> tuple[list[Trajectory], dict]:
        t0 = time.perf_counter()
        request = dataclasses.replace(request, n=1)
        trajectories, records, extra = self.client.supervised(
            ENV, lambda: self._play(tasks, group_size, request, tag), f"{ENV} episodes")
        self.episode_records.extend(records)
        n = max(len(trajectories), 1)
        return trajectories, {"timing/generate_s": time.perf_counter() - t0,
                              "episodes/mean_turns": sum(len(t.info["turns"]) for t in trajectories) / n,
                              "episodes/success": sum(bool(t.info["correct"]) for t in trajectories) / n,
                              "reward/grading_anomalies": sum(t.info["grading_anomalies"] for t in trajectories),
                              **extra}

    def _env(self, endpoint: str, per_episode: list[tuple["_Episode", object]], counts: Counter | None = None) -> list:
        """``endpoint`` on each env rank with its episodes' arguments; results in episode order. An
        endpoint that also reports its process's counters (`finish`) adds them to ``counts``."""
        by_rank: dict[int, list] = {}
        for ep, arg in per_episode:
            by_rank.setdefault(ep.rank, []).append((ep, arg))
        replies = self.client.per_rank(ENV, endpoint, {r: [a for _, a in items] for r, items in by_rank.items()})
        if counts is not None:
            for reply in replies.values():
                counts.update(reply["counts"])
            replies = {r: reply["episodes"] for r, reply in replies.items()}
        out = {ep.id: value for r, items in by_rank.items() for (ep, _), value in zip(items, replies[r])}
        return [out[ep.id] for ep, _ in per_episode]

    def _play(self, tasks: list, group_size: int, request: SampleRequest, tag: str,
              replay: bool = True) -> tuple[list[Trajectory], list[dict], dict[str, float]]:
        """Play the episodes; their trajectories, the env's records, and the prompts each generator
        replica served and the generators' engine time (over all turns)."""
        ranks = self.client.procs(ENV)
        episodes = [_Episode(f"{tag}-{g}-{k}", g, task, (g * group_size + k) % ranks)
                    for g, task in enumerate(tasks) for k in range(group_size)]
        initial = self._env("reset", [(ep, (ep.id, ep.task)) for ep in episodes])
        restarted = any(o.get("server_restarted") for o in initial)
        limit = self.max_model_len - request.max_tokens
        active = []
        for ep, opened in zip(episodes, initial):
            if "error" in opened:
                ep.termination = "env_error"
                continue
            ep.prompt = self.renderer.build_generation_prompt(opened["messages"])
            if len(ep.prompt) > limit:
                self.counters.prompts_too_long += 1
                ep.termination = "prompt_too_long"
                continue
            active.append(ep)
        turn, served = 0, Counter()
        while active:
            prompts = [ep.prompt + ep.tokens for ep in active]
            turn_request = request if request.seed is None else dataclasses.replace(request, seed=request.seed + 7919 * turn)
            completions = self.client.generate(prompts, turn_request, served)
            served.update(prompts_by_replica(completions))
            actions = []
            for ep, group in zip(active, completions):
                c = group[0]
                if not c.tokens:
                    self.counters.empty_generations += 1
                span = ep.append(c.tokens, c.logprobs, sampled=True)
                ep.turns.append([None, c.text, *span])
                ep.text, ep.finish_reason = c.text, c.finish_reason
                ep.version = min(ep.version, c.meta.get("version", self.client.version))
                actions.append((ep, (ep.id, c.text)))
            results = self._env("step", actions)
            restarted |= any(r.get("server_restarted") for r in results)
            still = []
            for ep, result in zip(active, results):
                ep.turns[-1][0] = result["context"]
                ep.turn_errors.append(_turn_error(result))
                ep.anomalies += bool(result.get("grading_anomaly"))
                ep.reward += result["reward"]
                ep.last = result
                if result["done"]:
                    ep.termination = result["termination"]
                    continue
                bridge = self.renderer.bridge(ep.prompt + ep.tokens, result.get("messages") or [result["message"]])
                if len(ep.prompt) + len(ep.tokens) + len(bridge) > limit:
                    ep.termination = "context_limit"
                    continue
                ep.append(bridge, [], sampled=False)
                still.append(ep)
            active = still
            turn += 1
        env_counts: Counter = Counter()
        closed = self._env("finish", [(ep, ep.id) for ep in episodes], env_counts)
        if restarted and replay:  # a served server died under the batch: played again on its replacement
            log.warning("%s: the environment server was restarted during the batch; playing it again", tag)
            kept, records, extra = self._play(tasks, group_size, request, tag + ".r", replay=False)
            return kept, records, {**extra, "episodes/batches_replayed": 1.0}
        dropped = Counter()
        kept = []
        for ep, end in zip(episodes, closed):
            if "delayed_reward" in end:  # a reward that arrived after the episode ended: its own group's
                ep.reward += end["delayed_reward"]
                ep.last = {**ep.last, "success": end["success"]}
            if "judged_return" in end:  # the judge's score mixed with the return above
                ep.reward, ep.judge_score = end["judged_return"], end["judge_score"]
                ep.last = {**ep.last, "success": end["success"]}
            if ep.termination in ("env_error", "prompt_too_long"):
                dropped[ep.termination] += 1
                continue
            if "reward_dropped" in end or "judge_failed" in end:
                dropped["reward_dropped" if "reward_dropped" in end else "judge_failed"] += 1
                continue
            kept.append(_trajectory(ep))
        extra = {**served, **{f"episodes/{k}": float(v) for k, v in dropped.items()},
                 **{k: float(v) for k, v in env_counts.items()}}
        return kept, [end["record"] for end in closed if end["record"]], extra


def _turn_error(result: dict) -> dict | None:
    """A turn's error as the env step reported it; None for a turn with no error (the turn that
    solved the task, or a turn the environment named no error for)."""
    if result.get("success") or not result.get("error_kind"):
        return None
    return {"error_kind": result["error_kind"], "hint": result.get("hint"),
            "hint_template_key": result.get("hint_template_key"), "error_text": result.get("error_text"),
            "tests_passed": result.get("tests_passed"), "tests_total": result.get("tests_total")}


def _trajectory(ep: _Episode) -> Trajectory:
    last = ep.last
    success = bool(last.get("success"))
    info = {"correct": success, "termination": ep.termination, "turns": [tuple(t) for t in ep.turns],
            "turn_errors": list(ep.turn_errors), "tests_passed": last.get("tests_passed"),
            "grading_anomalies": ep.anomalies, "judge_score": ep.judge_score,
            "tests_total": last.get("tests_total")}
    if not success and ep.turns:
        # a failed episode whose last turn named no error is still a failure (trace replay selects it)
        info.update(error_kind=last.get("error_kind") or "episode_failed", hint=last.get("hint"),
                    hint_template_key=last.get("hint_template_key"))
    return Trajectory(id=ep.id, group=ep.group, problem=ep.task, prompt_tokens=ep.prompt, tokens=ep.tokens,
                      logprobs=ep.logprobs, mask=ep.mask, version=ep.version, response_text=ep.text,
                      finish_reason=ep.finish_reason, reward=ep.reward, info=info)
