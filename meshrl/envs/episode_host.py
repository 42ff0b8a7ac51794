"""The env process's side of multi-turn episodes, whatever the environment: open one per episode
from an `EnvSource` (meshrl.envs.hosting), step a batch of them concurrently, each call under a
deadline, check every observation before it reaches the controller, and close them.

An environment can fail an episode but never the step: a reset or step that raises or passes its
deadline, an observation that does not validate (not an Observation, text over the limit, a reward
that is not a finite number, a role the chat cannot take) ends that episode with termination
`env_error` and one line naming the environment and the field; a served server found dead is
restarted for the episodes that follow, and the episodes that failed with it are flagged
(`server_restarted`) so that the controller plays their batch again. Every record is plain data (picklable, JSON-able).

What the controller gets per step (`step`): the observation's message (and `messages`, the turns it
adds: several when the environment answered with several, e.g. one per tool call), reward, done, termination,
success, the error-site markers (`error_kind`, `hint_template_key`, `hint`, `error_text`) and the
context the agent saw before the action (`state_at`, or the messages this host recorded when the
environment keeps no history), for the SDPO and trace-replay channels. An episode that ends with
reward None gets its reward later: `finish` polls the environment's `state.reward` until
`reward_deadline_s`.

With a judge (`task.env.judge`), `finish` also has every episode that played a turn judged, all at
once under the judge's deadline, from what this host recorded: the opening messages are the task,
the rest the transcript, the last reply the answer. The judge's score is mixed into the return
(`judged_return`); a failed judgment drops the episode (`judge_failed`) or leaves it with the
environment's return, as `judge.on_failure` says (both counted).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from meshrl.envs.base import Environment, Observation, TextAction
from meshrl.judges import Judge, mix

log = logging.getLogger(__name__)

ROLES = ("user", "tool", "ipython", "system")
FIRST_ROLES = ROLES + ("assistant",)
"""Roles of the messages a reset may open an episode with (worked examples are assistant turns)."""
_KIND = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class EnvOutputError(ValueError):
    """An environment's output that cannot be used; the message is one line naming the field."""


@dataclass
class _Live:
    env: Environment
    messages: list[dict]
    seen: list[list[dict]] = field(default_factory=list)
    episode_return: float = 0.0
    reward_pending: bool = False
    done: bool = False
    opening: int = 0  # how many of `messages` the environment opened the episode with
    failed: bool = False  # the environment failed it (env_error)
    declared_success: bool | None = None  # the last observation's `metadata['success']`


def _check_message(label: str, where: str, msg: Any, limit: int, roles: tuple[str, ...] = ROLES) -> dict:
    if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or msg.get("role") not in roles:
        raise EnvOutputError(f"env {label}: {where} is not a {{role: {'|'.join(roles)}, content: str}} message")
    if len(msg["content"]) > limit:
        raise EnvOutputError(f"env {label}: {where}.content has {len(msg['content'])} characters, over "
                             f"task.env.max_observation_chars={limit}")
    return {"role": msg["role"], "content": msg["content"]}


def _number(label: str, where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EnvOutputError(f"env {label}: {where} is {value!r}, not a finite number")
    return float(value)


def observation_messages(obs: Observation, label: str, limit: int, roles: tuple[str, ...] = ROLES) -> list[dict]:
    """The turns an observation adds to the chat, checked: `metadata['messages']` when it lists
    several (a reset's opening turns, one tool turn per call), else its one message."""
    given = obs.metadata.get("messages")
    if given is None:
        return [obs.message]
    if not isinstance(given, list) or not given:
        raise EnvOutputError(f"env {label}: observation.metadata.messages is not a non-empty list of messages")
    return [_check_message(label, f"observation.metadata.messages[{i}]", m, limit, roles) for i, m in enumerate(given)]


def check_observation(obs: Any, label: str, limit: int) -> Observation:
    """``obs`` if it is usable, else EnvOutputError naming the field."""
    if not isinstance(obs, Observation):
        raise EnvOutputError(f"env {label}: the observation is a {type(obs).__name__}, not an Observation")
    _check_message(label, "observation.text", obs.message, limit)
    if obs.reward is not None:
        _number(label, "observation.reward", obs.reward)
    for name in ("error_kind", "hint_template_key"):
        value = getattr(obs, name)
        if value is not None and not _KIND.match(value):
            raise EnvOutputError(f"env {label}: observation.{name} {value[:40]!r} is not a short identifier")
    hint = obs.metadata.get("hint")
    if hint is not None and (not isinstance(hint, str) or len(hint) > limit):
        raise EnvOutputError(f"env {label}: observation.metadata.hint is not a string of at most {limit} characters")
    return obs


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


class EpisodeHost:
    """Live episodes by id over one `EnvSource`; `reset`, `step` and `finish` take batches."""

    def __init__(self, source, judge: Judge | None = None):
        self.source, self.rules, self.judge = source, source.rules, judge
        self.live: dict[str, _Live] = {}
        self.pool = cf.ThreadPoolExecutor(max_workers=self.rules.max_parallel)
        self.hung = 0
        self.counts: Counter[str] = Counter()

    def _run(self, calls: list[Callable[[], Any]], timeout_s: float) -> list[tuple[Any, BaseException | None]]:
        """Each call in the pool; (result, None) or (None, the exception; TimeoutError past the deadline)."""
        futures = [self.pool.submit(c) for c in calls]
        cf.wait(futures, timeout=timeout_s)
        out = []
        for f in futures:
            if not f.done():
                self.hung += 1
                out.append((None, TimeoutError(f"no answer within {timeout_s:g}s")))
            elif f.exception() is not None:
                out.append((None, f.exception()))
            else:
                out.append((f.result(), None))
        if self.hung >= max(1, self.rules.max_parallel // 2):  # stuck threads hold the pool: take a new one
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = cf.ThreadPoolExecutor(max_workers=self.rules.max_parallel)
            self.hung = 0
        return out

    def _failed(self, what: str, episode_id: str, error: BaseException) -> str:
        """Log and count an episode the environment failed; its one-line reason. A served server
        found dead is restarted for the episodes that follow."""
        if isinstance(error, EnvOutputError):
            line = str(error)
            self.counts["env/invalid_output"] += 1
        else:
            line = f"env {self.rules.label}: {what} {_one_line(error)}"
            self.counts[f"env/{what}_timeouts" if isinstance(error, TimeoutError) else f"env/{what}_errors"] += 1
        if self.source.recover():
            self.counts["env/server_restarts"] += 1
        log.warning("episode %s failed: %s", episode_id, line)
        return line

    # ---- the endpoints' work ------------------------------------------------------------------
    def reset(self, episodes: list[tuple[str, Any]]) -> list[dict]:
        """Open one episode per (episode_id, spec): ``{"messages": [...]}`` (what the agent sees
        first), or ``{"error": line}`` when the environment failed it."""
        limit = self.rules.max_observation_chars

        def one(episode_id, spec):
            env, kwargs = self.source.open(spec)
            try:
                obs = check_observation(env.reset(episode_id=episode_id, **kwargs), self.rules.label, limit)
                messages = observation_messages(obs, self.rules.label, limit, FIRST_ROLES)
            except BaseException:
                _close(env)
                raise
            return env, messages

        out = []
        restarts = self.counts.get("env/server_restarts", 0)
        done = self._run([lambda e=e, s=s: one(e, s) for e, s in episodes], self.rules.reset_timeout_s)
        for (episode_id, _), (result, error) in zip(episodes, done):
            if error is not None:
                out.append({"error": self._failed("reset", episode_id, error)})
                continue
            env, messages = result
            self.live[episode_id] = _Live(env, list(messages), opening=len(messages))
            out.append({"messages": messages})
        return self._mark_restart(out, restarts)

    def _mark_restart(self, records: list[dict], restarts_before: int) -> list[dict]:
        """Flag the call's failed episodes when their server died and was restarted during it (the
        controller plays such a batch again)."""
        if self.counts.get("env/server_restarts", 0) > restarts_before:
            for r in records:
                if "error" in r or r.get("termination") == "env_error":
                    r["server_restarted"] = True
        return records

    def step(self, actions: list[tuple[str, str]]) -> list[dict]:
        """Advance each (episode_id, reply text) by one turn, concurrently; one record per action."""
        limit = self.rules.max_observation_chars

        def one(episode_id, text):
            ep = self.live[episode_id]
            ep.seen.append([dict(m) for m in ep.messages])
            obs = check_observation(ep.env.step(TextAction(text=text)), self.rules.label, limit)
            observation_messages(obs, self.rules.label, limit)
            return obs, self._context(ep)

        out = []
        restarts = self.counts.get("env/server_restarts", 0)
        done = self._run([lambda e=e, t=t: one(e, t) for e, t in actions], self.rules.step_timeout_s)
        for (episode_id, text), (result, error) in zip(actions, done):
            ep = self.live[episode_id]
            if error is not None:
                line = self._failed("step", episode_id, error)
                ep.done = ep.failed = True
                out.append({"message": None, "messages": [], "reward": 0.0, "done": True, "termination": "env_error",
                            "env_error": line, "success": False, "error_kind": None, "hint_template_key": None,
                            "hint": None, "error_text": None, "context": ep.seen[-1] if ep.seen else ep.messages})
                continue
            obs, context = result
            out.append(self._record(ep, text, obs, context))
        return self._mark_restart(out, restarts)

    def _context(self, ep: _Live) -> list[dict]:
        """What the agent saw before its last action: the environment's own history (`state_at`),
        or the messages recorded here when it keeps none."""
        t = len(ep.seen) - 1
        try:
            return [dict(m) for m in ep.env.state_at(t)]
        except NotImplementedError:
            return ep.seen[t]

    def _record(self, ep: _Live, text: str, obs: Observation, context: list[dict]) -> dict:
        meta, rules = obs.metadata, self.rules
        done = bool(obs.done)
        termination = meta.get("termination") if isinstance(meta.get("termination"), str) else None
        if not done and len(ep.seen) >= rules.max_turns:
            done, termination = True, "max_turns"
        pending = done and obs.reward is None
        reward = 0.0 if obs.reward is None else float(obs.reward)
        ep.episode_return += reward
        ep.reward_pending, ep.done = pending, done
        messages = observation_messages(obs, rules.label, rules.max_observation_chars)
        ep.messages += [{"role": "assistant", "content": text}, *messages]
        ep.declared_success = meta["success"] if isinstance(meta.get("success"), bool) else None
        success = self._success(meta, ep.episode_return) if done and not pending else False
        error_kind = obs.error_kind
        if error_kind is None and not success and rules.default_error_kind and not meta.get("success"):
            error_kind = rules.default_error_kind
        if done and termination is None:
            termination = "success" if success else "done"
        return {"message": messages[0], "messages": messages, "reward": reward, "done": done, "termination": termination,
                "success": success, "reward_pending": pending, "error_kind": error_kind,
                "hint_template_key": obs.hint_template_key, "hint": meta.get("hint"),
                "error_text": meta.get("error_text") if isinstance(meta.get("error_text"), str) else None,
                "tests_passed": meta.get("tests_passed"), "tests_total": meta.get("tests_total"),
                "grading_anomaly": meta.get("grading_anomaly") if isinstance(meta.get("grading_anomaly"), str) else None,
                "context": context}

    def _success(self, meta: dict, episode_return: float) -> bool:
        if isinstance(meta.get("success"), bool):
            return meta["success"]
        threshold = self.rules.success_reward
        return episode_return >= threshold if threshold is not None else episode_return > 0

    def finish(self, episode_ids: list[str]) -> list[dict]:
        """Close episodes: per id, the environment's own record (`trajectory()`) and, for an episode
        whose reward comes late, that reward (`delayed_reward`, with its `success`) or why it was
        dropped (`reward_dropped`); with a judge, the judged return (`judged_return`, with its
        `success` and `judge_score`) or why the episode is dropped (`judge_failed`)."""
        eps = [(i, self.live.pop(i, None)) for i in episode_ids]
        results = self._run([lambda i=i, ep=ep: self._close_episode(i, ep) for i, ep in eps],
                            self.rules.reward_deadline_s + self.rules.step_timeout_s)
        out = []
        for (episode_id, ep), (result, error) in zip(eps, results):
            if error is not None:
                line = self._failed("finish", episode_id, error)
                out.append({"record": {}, "reward_dropped": line} if ep is not None and ep.reward_pending
                           else {"record": {}})
            else:
                if "reward_dropped" in result:  # counted here: the pool's threads would race on the counter
                    self.counts["env/delayed_reward_dropped"] += 1
                out.append(result)
        if self.judge is not None:
            judged = [(ep, end) for (_, ep), end in zip(eps, out)
                      if ep is not None and ep.seen and not ep.failed and "reward_dropped" not in end]
            for (ep, end), update in zip(judged, self._judge([ep for ep, _ in judged])):
                end.update(update)
        return out

    def _judge(self, eps: list[_Live]) -> list[dict]:
        """The judge's verdicts on finished episodes, judged concurrently: per episode its mixed
        return (`judged_return`, `success`, `judge_score`), `judge_failed` with a line, or nothing
        (a failed judgment under `on_failure: verifier`)."""
        cfg = self.judge.cfg
        items = []
        for ep in eps:
            task = "\n\n".join(m["content"] for m in ep.messages[:ep.opening])
            transcript = ep.messages[ep.opening:]
            answers = [m["content"] for m in transcript if m["role"] == "assistant"]
            items.append((task, transcript, answers[-1] if answers else ""))
        started = time.monotonic()
        results = self.judge.score_many(items)
        self.counts["judge/wait_s"] += time.monotonic() - started
        out = []
        for ep, result in zip(eps, results):
            if result.ok:
                total = mix(ep.episode_return, result.reward, cfg.weight)
                declared = {} if ep.declared_success is None else {"success": ep.declared_success}
                out.append({"judged_return": total, "judge_score": result.reward,
                            "success": self._success(declared, total)})
            elif cfg.on_failure == "verifier":
                self.counts["judge/fallbacks"] += 1
                out.append({})
            else:
                self.counts["judge/dropped"] += 1
                out.append({"judge_failed": f"env {self.rules.label}: judge {cfg.endpoint.name}: "
                                            f"{result.failure}: {result.detail}"})
        return out

    def counters(self) -> dict[str, float]:
        """This process's counters (totals since the process started): the episodes', the source's
        (e.g. its tools') and its judge's."""
        judge = ({"judge/fallbacks": 0.0, "judge/dropped": 0.0, "judge/wait_s": 0.0, **self.judge.metrics()}
                 if self.judge else {})
        own = {**self.counts, **getattr(self.source, "counts", {})}  # the episodes' and the source's (its tools')
        return {**judge, **{k: float(v) for k, v in own.items()}}

    def _close_episode(self, episode_id: str, ep: _Live | None) -> dict:
        if ep is None:
            return {"record": {}}
        out: dict[str, Any] = {}
        try:
            if ep.reward_pending:
                late = self._poll_reward(ep.env)
                if late is None:
                    out["reward_dropped"] = (f"env {self.rules.label}: no reward within "
                                             f"task.env.reward_deadline_s={self.rules.reward_deadline_s:g}s")
                else:
                    ep.episode_return += late
                    out.update(delayed_reward=late, success=self._success({}, ep.episode_return))
            try:
                record = dict(ep.env.trajectory())
            except Exception as e:  # noqa: BLE001 -- a record is optional; the episode's data is the controller's
                record = {"trajectory_error": _one_line(e)}
            if record.get("episode_id") not in (None, episode_id):  # the environment's own id, kept beside ours
                record["env_episode_id"] = record["episode_id"]
            out["record"] = {**record, "episode_id": episode_id}  # the run's data files match records by it
        finally:
            _close(ep.env)
        return out

    def _poll_reward(self, env: Environment) -> float | None:
        deadline, wait = time.monotonic() + self.rules.reward_deadline_s, 0.02
        while True:
            value = getattr(env.state, "reward", None)
            if value is not None:
                return _number(self.rules.label, "state.reward", value)
            if time.monotonic() + wait > deadline:
                return None
            time.sleep(wait)
            wait = min(wait * 2, 0.5)

    def close(self) -> None:
        for ep in self.live.values():
            _close(ep.env)
        self.live.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.source.close()
        if self.judge is not None:
            self.judge.close()


def _close(env: Environment) -> None:
    try:
        env.close()
    except Exception as e:  # noqa: BLE001 -- a dead server or a broken env: nothing left to release
        log.debug("closing an environment failed: %s", _one_line(e))
