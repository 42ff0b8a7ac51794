"""Multi-turn code-execution environment.

The policy writes a function; its code (a fenced ```python block, or a tool call
``{"name": "run_python" | "submit", "arguments": {"code": ...}}``) runs against the task's hidden
tests in the sandbox; the outcome (tests passed, errors, program output) comes back as the next
user/tool turn, until every test passes or the turn limit is hit.

Text in, text out: ``reset`` returns the opening turn(s) and every ``step`` returns the feedback as
one chat message (``Observation.message``) for the runtime to append after the policy's reply --
the runtime keeps its own token stream; the environment never re-renders history. The
environment's own copy of the conversation gives ``state_at(t)``: exactly the messages the agent
had seen before its action at step ``t`` (for teacher replay), and ``trajectory()`` records the
episode (turns, code, outputs, rewards, termination reason) as JSON.

An attempt that tampers with grading (``meshrl.envs.grading.ANOMALIES``: forged replies, exiting
before the tests are over, fake reports) is graded 0; its turn records the anomaly
(``grading_anomaly``) and ``trajectory()`` lists every such turn (``grading_anomalies``), so the
run's owner can see a policy probing the grader.

Rewards (``CodeEnvConfig``): ``tests_weight`` x fraction of hidden tests passed, ``success_bonus``
when all pass, ``exec_success_weight`` when the code ran without an error of its own,
``-turn_limit_penalty`` when the turn limit ends a failed episode and ``-turn_cost`` per extra
turn (the DAPO overlong penalty is the trainer's, for every task: `trainer.advantage`). In
``final`` mode the whole episode reward comes on the last step (earlier steps give 0).
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.config.env import CodeEnvConfig, EnvConfig
from meshrl.envs.code_actions import CodeAction, ParsedAction, _as_action, parse_action
from meshrl.envs.grading import GradeResult, grade
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.tasks import BUNDLED_FILES, CodeTask, load_code_tasks

#: hint templates for the SDPO channel, keyed by ``Observation.hint_template_key``;
#: fields: {error} (first error line), {passed}, {total}, {entry_point}
HINT_TEMPLATES: dict[str, str] = {
    "code.syntax_error": "Your code does not compile ({error}). Check indentation, colons and brackets.",
    "code.import_error": "An import failed ({error}). Only the Python standard library is available.",
    "code.runtime_error": "Your code raised an exception ({error}). Trace which input triggers it and handle that case.",
    "code.test_failure": "Your function returns wrong results for {failed} of {total} hidden tests. Re-read the specification, especially edge cases (empty inputs, negatives, ties).",
    "code.missing_entry_point": "Define a function named `{entry_point}` exactly as in the signature.",
    "code.timeout": "Your code ran too long. Look for an infinite loop or use a faster algorithm.",
    "code.memory_error": "Your code used too much memory. Avoid building huge intermediate data.",
    "code.output_limit": "Your code printed too much. Remove debugging prints inside loops.",
    "code.resource_limit": "Your code hit a sandbox limit (processes, files or disk). Do not spawn processes or write large files.",
    "code.permission_denied": "Your code tried to touch something outside its work directory. Only compute and return the result.",
    "code.file_not_found": "Your code opened a file that does not exist. The function should not read files.",
    "code.network_error": "There is no network in the sandbox. Compute the answer locally.",
    "code.crash": "The interpreter crashed. Avoid ctypes, signals and deep native recursion.",
    "code.wrong_format": "Put the complete function in a ```python code block.",
    "code.tool_not_found": "Only the tools run_python and submit exist; call one with {{\"code\": ...}}.",
    "code.sandbox_error": "The sandbox failed to run the code; try again.",
    "code.grading_anomaly": "Your code interfered with the grader ({error}), so the attempt scores 0. Only define the function and return its result.",
}


def hint_text(key: str | None, **fields: Any) -> str | None:
    """Render the hint template ``key`` with whatever fields are known (missing ones left blank)."""
    if key is None or key not in HINT_TEMPLATES:
        return None

    class _Blank(dict):
        def __missing__(self, k):
            return "?"

    return HINT_TEMPLATES[key].format_map(_Blank(fields))


# ----------------------------------------------------------------------------- the environment


class CodeEnv(Environment):
    """One code task (or a pool to draw from per episode), judged in a sandbox, over several turns."""

    SUPPORTS_CONCURRENT_SESSIONS = False

    def __init__(
        self,
        task: CodeTask | Sequence[CodeTask],
        sandbox: Sandbox | None = None,
        cfg: CodeEnvConfig | None = None,
    ):
        self.tasks: list[CodeTask] = [task] if isinstance(task, CodeTask) else list(task)
        if not self.tasks:
            raise ValueError("CodeEnv needs at least one task")
        self.cfg = cfg or CodeEnvConfig()
        self._own_sandbox = sandbox is None
        self.sandbox = sandbox or Sandbox()
        self._rotation = 0
        self.task: CodeTask = self.tasks[0]
        self._episode_id: str | None = None
        self._messages: list[dict[str, str]] = []
        self._seen: list[list[dict[str, str]]] = []
        self._turns: list[dict[str, Any]] = []
        self._done = False
        self._termination: str | None = None
        self._rewards: list[float] = []
        self._last: GradeResult | None = None
        self._started = False

    # ------------------------------------------------------------------ contract

    def reset(self, seed: int | None = None, episode_id: str | None = None, task_id: str | None = None, **kwargs: Any) -> Observation:
        if kwargs:
            raise TypeError(f"unexpected reset arguments: {sorted(kwargs)}")
        if task_id is not None:
            matches = [t for t in self.tasks if t.task_id == task_id]
            if not matches:
                raise KeyError(f"task '{task_id}' is not in this environment")
            self.task = matches[0]
        elif seed is not None:
            self.task = self.tasks[random.Random(seed).randrange(len(self.tasks))]
        else:
            self.task = self.tasks[self._rotation % len(self.tasks)]
            self._rotation += 1
        self._episode_id = episode_id or uuid.uuid4().hex
        self._messages = []
        if self.cfg.system_prompt:
            self._messages.append({"role": "system", "content": self.cfg.system_prompt})
        user = self.task.prompt.rstrip() + "\n\n" + self.cfg.instructions.format(
            entry_point=self.task.entry_point, max_turns=self.cfg.max_turns
        )
        self._messages.append({"role": "user", "content": user})
        self._seen = []
        self._turns = []
        self._rewards = []
        self._done = False
        self._termination = None
        self._last = None
        self._started = True
        return Observation(
            text=user,
            role="user",
            reward=0.0,
            done=False,
            metadata={
                "task_id": self.task.task_id,
                "episode_id": self._episode_id,
                "messages": [dict(m) for m in self._messages],
                "tests_total": len(self.task.tests),
                "max_turns": self.cfg.max_turns,
            },
        )

    def step(self, action: CodeAction | TextAction | str | dict, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("episode is over; call reset()")
        action = _as_action(action)
        cfg = self.cfg
        t = len(self._turns)
        self._seen.append([dict(m) for m in self._messages])
        self._messages.append({"role": "assistant", "content": action.text})
        parsed = parse_action(action.text)
        result: GradeResult | None = None
        if parsed.code is not None:
            result = grade(
                self.task,
                parsed.code,
                self.sandbox,
                exec_timeout=timeout_s or cfg.exec_timeout_s,
                test_timeout=cfg.test_timeout_s,
            )
            self._last = result
            error_kind = result.error_kind
        else:
            error_kind = parsed.error_kind
        success = result is not None and result.success
        turn_no = t + 1
        if success:
            done, termination = True, "success"
        elif parsed.tool == "submit" and cfg.submit_ends_episode:
            done, termination = True, "submitted"
        elif turn_no >= cfg.max_turns:
            done, termination = True, "max_turns"
        else:
            done, termination = False, None

        passed = result.tests_passed if result else 0
        total = len(self.task.tests)
        frac = passed / total if total else 0.0
        exec_ok = bool(result and result.exec_ok)
        reward = self._reward(frac, exec_ok, success, done, termination, turn_no)

        feedback = self._feedback(parsed, result, success, done, turn_no)
        self._messages.append({"role": cfg.feedback_role, "content": feedback})
        self._rewards.append(reward)
        self._done = done
        self._termination = termination
        hint_key = f"code.{error_kind}" if error_kind else None
        error_text = parsed.error if result is None else result.error_text
        ex = result.exec if result is not None else None
        anomaly = result.anomaly if result is not None else None
        turn = {
            "t": t,
            "action": action.text,
            "tool": parsed.tool,
            "code": parsed.code,
            "tests_passed": passed,
            "tests_total": total,
            "error_kind": error_kind,
            "error_text": error_text,
            "hint_template_key": hint_key,
            "feedback": feedback,
            "reward": reward,
            "done": done,
            "termination": termination,
            "grading_anomaly": anomaly,
            "exec": None if ex is None else {
                "exit_code": ex.exit_code,
                "timed_out": ex.timed_out,
                "killed_signal": ex.killed_signal,
                "wall_s": round(ex.wall_s, 4),
                "cpu_s": ex.cpu_s,
                "layer": ex.layer,
                "truncated": ex.truncated,
                "error_kind": ex.error_kind,
                "stdout": _clip(ex.stdout, cfg.max_feedback_chars),
                "stderr": _clip(ex.stderr, cfg.max_feedback_chars),
            },
            "tests": [] if result is None else [
                {"index": o.index, "passed": o.passed, "kind": o.kind} for o in result.tests
            ],
        }
        self._turns.append(turn)
        return Observation(
            text=feedback,
            role=cfg.feedback_role,
            reward=reward,
            done=done,
            error_kind=error_kind,
            hint_template_key=hint_key,
            metadata={
                "task_id": self.task.task_id,
                "episode_id": self._episode_id,
                "turn": t,
                "tests_passed": passed,
                "tests_total": total,
                "success": success,
                "exec_ok": exec_ok,
                "termination": termination,
                "tool": parsed.tool,
                "code": parsed.code,
                "error_text": error_text,
                "hint": hint_text(hint_key, error=_first_line(error_text), passed=passed, total=total,
                                  failed=total - passed, entry_point=self.task.entry_point),
                "layer": ex.layer if ex is not None else None,
                "grading_anomaly": anomaly,
                "message": {"role": cfg.feedback_role, "content": feedback},
            },
        )

    @property
    def state(self) -> State:
        return State(
            episode_id=self._episode_id,
            step_count=len(self._turns),
            task_id=self.task.task_id,
            done=self._done,
            termination=self._termination,
            messages=[dict(m) for m in self._messages],
            rewards=list(self._rewards),
        )

    def state_at(self, t: int) -> list[dict[str, str]]:
        """Messages the agent had seen before its action at step ``t`` (``t == step_count`` is the
        current context when the episode is still running)."""
        if t < 0:
            raise IndexError(t)
        if t < len(self._seen):
            return [dict(m) for m in self._seen[t]]
        if t == len(self._seen) and not self._done and self._started:
            return [dict(m) for m in self._messages]
        raise IndexError(f"no step {t} in this episode (step_count={len(self._turns)}, done={self._done})")

    def trajectory(self) -> dict[str, Any]:
        t = self.task
        return {
            "episode_id": self._episode_id,
            "task_id": t.task_id,
            "source": t.source,
            "difficulty": t.difficulty,
            "entry_point": t.entry_point,
            "num_turns": len(self._turns),
            "max_turns": self.cfg.max_turns,
            "done": self._done,
            "termination": self._termination,
            "success": self._termination == "success",
            "reward": sum(self._rewards),
            "rewards": list(self._rewards),
            "tests_total": len(t.tests),
            "final_tests_passed": self._turns[-1]["tests_passed"] if self._turns else 0,
            "grading_anomalies": [{"t": x["t"], "anomaly": x["grading_anomaly"]} for x in self._turns
                                  if x["grading_anomaly"]],
            "turns": [dict(x) for x in self._turns],
            "messages": [dict(m) for m in self._messages],
            "layer": self.sandbox.layer,
        }

    def close(self) -> None:
        if self._own_sandbox:
            self.sandbox.close()

    # ------------------------------------------------------------------ rewards and feedback

    def _reward(self, frac: float, exec_ok: bool, success: bool, done: bool, termination: str | None,
                turn_no: int) -> float:
        cfg = self.cfg
        attempt = cfg.tests_weight * frac + (cfg.exec_success_weight if exec_ok else 0.0)
        if cfg.reward_mode == "per_turn":
            r = attempt
            if done:
                r += self._episode_terms(success, termination, turn_no)
            return r
        # final: everything on the last step, judged by the last attempt
        if not done:
            return 0.0
        return attempt + self._episode_terms(success, termination, turn_no)

    def _episode_terms(self, success: bool, termination: str | None, turn_no: int) -> float:
        cfg = self.cfg
        r = -cfg.turn_cost * (turn_no - 1)
        if success:
            r += cfg.success_bonus
        elif termination == "max_turns":
            r -= cfg.turn_limit_penalty
        return r

    def _feedback(self, parsed: ParsedAction, result: GradeResult | None, success: bool, done: bool, turn_no: int) -> str:
        cfg = self.cfg
        left = cfg.max_turns - turn_no
        if result is None:
            if parsed.error_kind == "tool_not_found":
                body = f"Error: {parsed.error}. Call run_python or submit with {{\"code\": \"...\"}}, or reply with a ```python code block."
            else:
                body = f"Error: {parsed.error}. Reply with the complete function `{self.task.entry_point}` in a ```python code block."
            return body + _turns_left(left, done)
        lines: list[str] = []
        total = result.tests_total
        if success:
            lines.append(f"All {total} hidden tests passed.")
        elif not result.loaded and result.complete:
            kind = result.error_kind or "error"
            lines.append(f"Your code failed before any test could run ({kind.replace('_', ' ')}):")
            lines.append(_clip(result.error_text, cfg.max_feedback_chars))
        else:
            lines.append(f"Tests passed: {result.tests_passed}/{total}.")
            if not result.complete:
                lines.append(f"The run was stopped: {result.error_text}.")
            shown = 0
            seen: dict[str, int] = {}
            for o in result.tests:
                if o.passed:
                    continue
                if shown >= 3:
                    lines.append("(more failures not shown)")
                    break
                shown += 1
                text = self._describe_failure(o)
                if o.kind not in ("test_failure", "timeout") and o.error in seen:
                    text = f"- test {o.index + 1}: the same error as test {seen[o.error] + 1}"
                elif o.error:
                    seen.setdefault(o.error, o.index)
                lines.append(text)
        ex = result.exec
        if ex is not None and ex.stdout.strip():
            lines.append("Output of your code:\n" + _clip(ex.stdout, cfg.max_feedback_chars))
        if not success:
            lines.append(_turns_left(left, done).strip())
        return "\n".join(x for x in lines if x)

    def _describe_failure(self, o) -> str:
        test = self.task.tests[o.index]
        if self.cfg.reveal_failed_tests:
            where = f"test {o.index + 1} ({test.describe()})"
        else:
            where = f"test {o.index + 1}"
        if o.kind == "test_failure":
            if self.cfg.reveal_failed_tests and o.got is not None:
                return f"- {where}: wrong answer, got {o.got}"
            return f"- {where}: wrong answer"
        if o.kind == "timeout":
            return f"- {where}: took too long"
        err = (o.error or o.error_type or "error").strip()
        return f"- {where}: " + _clip(err, 600)


def _turns_left(left: int, done: bool) -> str:
    if done:
        return ""
    return f"\nFix the code and reply with the corrected function ({left} attempt{'s' if left != 1 else ''} left)."


def _clip(text: str, limit: int) -> str:
    text = text or ""
    if len(text) <= limit:
        return text.rstrip()
    half = limit // 2
    return text[:half].rstrip() + f"\n... [{len(text) - limit} characters cut] ...\n" + text[-half:].rstrip()


def _first_line(text: str) -> str:
    lines = [x for x in (text or "").strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def tasks_from_config(cfg: EnvConfig) -> list[CodeTask]:
    """The tasks an ``EnvConfig`` selects."""
    if cfg.task_source == "humaneval":
        from meshrl.envs.humaneval import load_humaneval

        return load_humaneval(cfg.task_limit)
    return load_code_tasks(cfg.split, cfg.difficulty, BUNDLED_FILES[cfg.task_source], cfg.task_limit)


def env_from_config(cfg: EnvConfig, sandbox: Sandbox | None = None, task_ids: Sequence[str] | None = None) -> CodeEnv:
    """The CodeEnv an ``EnvConfig`` describes (optionally only the tasks ``task_ids``, looked up
    in every split)."""
    if task_ids:
        cfg = cfg.model_copy(update={"split": "all", "difficulty": None, "task_limit": None})
    tasks = tasks_from_config(cfg)
    if task_ids:
        wanted = set(task_ids)
        tasks = [t for t in tasks if t.task_id in wanted]
        missing = wanted - {t.task_id for t in tasks}
        if missing:
            raise KeyError(f"tasks not found: {sorted(missing)}")
    return CodeEnv(tasks, sandbox or Sandbox(cfg.sandbox), cfg.code)


def make_code_env(env: dict | None = None, task_ids: Sequence[str] | None = None) -> CodeEnv:
    """A CodeEnv from plain JSON settings (an ``EnvConfig`` as a dict): the factory the remote
    server uses, e.g. ``{"split": "test", "code": {"max_turns": 2}}``."""
    return env_from_config(EnvConfig.model_validate(env or {}), task_ids=task_ids)


def run_episode(
    env: Environment,
    respond: Callable[[list[dict[str, str]]], str | TextAction],
    seed: int | None = None,
    episode_id: str | None = None,
    **reset_kwargs: Any,
) -> dict[str, Any]:
    """Play one episode: ``respond(messages)`` is the policy (it sees the whole conversation and
    returns its reply); returns ``env.trajectory()``. For evaluation loops and tests; the RL
    runtime drives ``reset``/``step`` itself with token-level bookkeeping."""
    obs = env.reset(seed=seed, episode_id=episode_id, **reset_kwargs)
    messages = [dict(m) for m in obs.metadata.get("messages", [obs.message])]
    while not obs.done:
        reply = respond([dict(m) for m in messages])
        action = reply if isinstance(reply, TextAction) else CodeAction(text=str(reply))
        obs = env.step(action)
        messages += [{"role": "assistant", "content": action.text}, obs.message]
    return env.trajectory()


def save_trajectories(path: str | Path, trajectories: Iterable[dict[str, Any]], append: bool = True) -> Path:
    """Write trajectory records as JSON lines (appending by default)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a" if append else "w", encoding="utf-8") as f:
        for tr in trajectories:
            f.write(json.dumps(tr, ensure_ascii=False) + "\n")
    return p


def load_trajectories(path: str | Path) -> list[dict[str, Any]]:
    """Read trajectory records written by ``save_trajectories``."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
