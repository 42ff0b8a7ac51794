"""Running an agent program for one episode, always within a deadline, and reading its result.

A subprocess (`task.agent.command`) runs in a process group of its own, gets `OPENAI_BASE_URL`,
`OPENAI_API_KEY` and the episode spec (JSON, on stdin, and in `MESHRL_EPISODE` up to 32 KiB), and prints its
result as the last line of its output; past the deadline the whole group is killed. Its output goes
to a file and only its tail is read, so a flood of output costs no memory. A callable
(`task.agent.callable`) runs in a daemon thread with an `openai.OpenAI` client; past the deadline
it is abandoned (its key is refused from then on).

A result is a JSON number (the reward) or an object with a finite number `reward` and optionally a
boolean `success`; with a grader any JSON value is accepted (the grader reads it).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable

from meshrl.config.agent_task import AgentTaskConfig
from meshrl.config.base import ConfigError
from meshrl.envs.hosting import import_callable

TAIL_BYTES = 64 << 10
ENV_SPEC_BYTES = 32 << 10


class AgentSourceError(ConfigError):
    """A `task.agent` that cannot work: one line naming the key."""


@dataclass
class Outcome:
    """How an episode's program ended: `ok` (``result`` holds what it returned), `timed_out`,
    `crashed` or `bad_result`; ``detail`` says why, in one line."""

    status: str
    result: Any = None
    detail: str = ""


def load_callable(spec: str, key: str, python_path: list[str]) -> Callable:
    """``package.module:fn`` imported after ``python_path``; AgentSourceError naming ``key``."""
    return import_callable(spec, key, python_path, error=AgentSourceError)


def check_agent_source(cfg: AgentTaskConfig) -> None:
    """Before anything is spawned: the callable and the grader import, the command's program (and
    the script a `python` command runs) exists. AgentSourceError naming the key."""
    for key, spec in (("task.agent.callable", cfg.callable), ("task.agent.grader", cfg.grader)):
        if spec is not None:
            load_callable(spec, key, cfg.python_path)
    if cfg.command is not None:
        program = cfg.command[0]
        if program != "python" and shutil.which(program) is None:
            raise AgentSourceError(f"task.agent.command: no program {program!r} found")
        script = cfg.command[1] if program == "python" and len(cfg.command) > 1 else None
        if script is not None and script.endswith(".py") and not os.path.isfile(script):
            raise AgentSourceError(f"task.agent.command: no script {script!r} (relative paths are taken from the "
                                   "working directory)")


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode("utf-8", "replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def read_result(line: str) -> Outcome:
    """The result on a program's last output line."""
    if not line:
        return Outcome("bad_result", detail="it printed no result line")
    try:
        return Outcome("ok", json.loads(line))
    except json.JSONDecodeError:
        return Outcome("bad_result", detail=f"its last line is not JSON: {line[:120]!r}")


def reward_of(result: Any) -> tuple[float, bool | None]:
    """(reward, success or None) of a program's result; ValueError when it is neither a finite
    number nor an object with a finite number `reward` (and a boolean `success`, if any)."""
    reward, success = result, None
    if isinstance(result, dict):
        reward, success = result.get("reward"), result.get("success")
        if success is not None and not isinstance(success, bool):
            raise ValueError(f"success must be true or false, got {success!r}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the result must be a finite number or {{reward: number}}, got {str(result)[:120]}")
    return float(reward), success


def run_command(argv: list[str], base_url: str, api_key: str, episode: dict, timeout_s: float,
                python_path: list[str]) -> Outcome:
    """``argv`` as a subprocess for one episode (see the module's docstring); a first word `python`
    is the interpreter meshrl runs under."""
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:]]
    spec = json.dumps(episode)
    paths = [os.path.abspath(p) for p in python_path] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "PYTHONPATH": os.pathsep.join(paths)}
    if len(spec) <= ENV_SPEC_BYTES:  # the kernel refuses longer variables (E2BIG): stdin carries any size
        env["MESHRL_EPISODE"] = spec
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write(spec.encode())  # from a file: a program that never reads its spec cannot block meshrl
        stdin.seek(0)
        try:
            proc = subprocess.Popen(argv, stdin=stdin, stdout=out, stderr=err, env=env, start_new_session=True)
        except OSError as e:
            return Outcome("crashed", detail=f"cannot start {argv[0]!r} ({type(e).__name__}: {e})")
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome("timed_out", detail=f"no result within {timeout_s:g}s (task.agent.timeout_s)")
        finally:
            _kill_group(proc)
        if code != 0:
            return Outcome("crashed", detail=f"exit status {code}: {_last_line(_tail(err))[:200]}")
        return read_result(_last_line(_tail(out)))


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the program's process group (whatever it started is gone too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(f) -> bytes:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - TAIL_BYTES))
    return f.read()


def run_callable(fn: Callable, base_url: str, api_key: str, episode: dict, timeout_s: float) -> Outcome:
    """``fn(client, episode)`` in a daemon thread for one episode (see the module's docstring)."""
    import openai

    box: dict[str, Any] = {}

    def target() -> None:
        try:
            with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=timeout_s) as client:
                box["result"] = fn(client, dict(episode))
        except BaseException as e:  # noqa: BLE001 - the agent's failure, counted
            box["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"

    thread = threading.Thread(target=target, name="agent-callable", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return Outcome("timed_out", detail=f"no result within {timeout_s:g}s (task.agent.timeout_s)")
    if "error" in box:
        return Outcome("crashed", detail=box["error"])
    try:
        json.dumps(box.get("result"))
    except (TypeError, ValueError):
        return Outcome("bad_result", detail=f"it returned {type(box.get('result')).__name__}, not JSON data")
    return Outcome("ok", box.get("result"))
