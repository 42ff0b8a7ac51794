"""MCP tools with a real fastmcp server process (examples/calculator_mcp_server.py): listed at start,
called under a deadline, over stdio and streamable HTTP; the server (HTTP, and stdio) SIGKILLed by its
PID in the middle of an episode, the episode failed (counted), the server restarted, the next
episodes served, and no server process left after the host closes."""

import json
import os
import signal
import socket
import sys
from pathlib import Path

import psutil
import pytest

from meshrl.config.env_task import EnvTaskConfig
from meshrl.envs.episode_host import EpisodeHost
from meshrl.envs.hosting import FactorySource
from meshrl.envs.task_sets import EpisodeSpec

ROOT = Path(__file__).resolve().parent.parent
SERVER = str(ROOT / "examples" / "calculator_mcp_server.py")

pytestmark = pytest.mark.slow  # each test starts real server processes (a few seconds each)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def _host(mcp: dict, **tools) -> EpisodeHost:
    cfg = EnvTaskConfig(factory="calculator_tools:MultiplyEnv", kwargs={"examples": [], "own_tool": False},
                        python_path=[str(ROOT / "examples")], max_turns=4,
                        tools={"mcp": {**mcp, "start_timeout_s": 60}, "call_timeout_s": 1.0, **tools})
    return EpisodeHost(FactorySource(cfg))


def test_stdio_mcp_tools_are_listed_in_the_prompt_and_called_with_a_deadline():
    host = _host({"command": [sys.executable, SERVER]})
    try:
        first = host.reset([("e0", EpisodeSpec("s0", {"seed": 0}))])[0]["messages"]
        tools = [n for n in ("calculator", "wait") if f'"name": "{n}"' in first[0]["content"]]
        assert first[0]["role"] == "system" and tools == ["calculator", "wait"]
        a, b = (int(x) for x in first[-1]["content"][len("What is "):-1].split(" * "))
        step = host.step([("e0", _call("calculator", expression=f"{a} * {b}") + _call("wait", seconds=5))])[0]
        assert step["messages"] == [{"role": "user", "content": f"<tool_response>\n{a * b}\n</tool_response>\n"
                                     "<tool_response>\nerror: timed out: tool wait gave no answer within 1s\n</tool_response>"}]
        final = host.step([("e0", f"It is {a * b}.")])[0]
        assert final["done"] and final["success"] and final["reward"] == 1.0
        record = host.finish(["e0"])[0]["record"]
        assert [c["name"] for c in record["tool_calls"]] == ["calculator", "wait"]
        assert host.counters()["tools/calls"] == 2 and host.counters()["tools/timed_out"] == 1
    finally:
        host.close()


def test_an_http_mcp_server_killed_mid_episode_is_restarted_and_the_episode_failed():
    port = _free_port()
    host = _host({"url": f"http://127.0.0.1:{port}/mcp", "command": [sys.executable, SERVER, "--port", str(port)]})
    try:
        mcp = host.source.tools.mcp
        pid = mcp.pid
        assert psutil.pid_exists(pid)
        host.reset([("e0", EpisodeSpec("s0", {"seed": 0})), ("e1", EpisodeSpec("s1", {"seed": 1}))])
        ok = host.step([("e0", _call("calculator", expression="2 * 21")), ("e1", _call("calculator", expression="6 * 7"))])
        assert [r["messages"][0]["content"] for r in ok] == ["<tool_response>\n42\n</tool_response>"] * 2
        os.kill(pid, signal.SIGKILL)  # the server dies in the middle of both episodes
        dead = host.step([("e0", _call("calculator", expression="1 + 1"))])[0]
        assert dead["termination"] == "env_error" and dead["server_restarted"] and "MCP" in dead["env_error"]
        assert host.counters()["tools/mcp_restarts"] == 1 and host.counters()["env/step_errors"] == 1
        restarted = mcp.pid
        assert restarted != pid and psutil.pid_exists(restarted)
        # the other live episode and a new one go on with the restarted server
        later = host.step([("e1", _call("calculator", expression="6 * 8"))])[0]
        assert later["messages"][0]["content"] == "<tool_response>\n48\n</tool_response>"
        host.reset([("e2", EpisodeSpec("s2", {"seed": 2}))])
        assert host.step([("e2", _call("calculator", expression="3 * 3"))])[0]["messages"][0]["content"].count("9") == 1
        host.finish(["e0", "e1", "e2"])
    finally:
        host.close()
    assert not psutil.pid_exists(restarted)  # the restarted server stopped with the host


def _stdio_server_pids() -> list[int]:
    return [p.pid for p in psutil.Process().children(recursive=True)
            if any("calculator_mcp_server.py" in part for part in p.cmdline())]


def test_a_stdio_mcp_server_killed_mid_episode_is_started_again():
    host = _host({"command": [sys.executable, SERVER]})
    try:
        host.reset([("e0", EpisodeSpec("s0", {"seed": 0}))])
        assert host.step([("e0", _call("calculator", expression="2 * 21"))])[0]["messages"][0]["content"].count("42") == 1
        (pid,) = _stdio_server_pids()
        os.kill(pid, signal.SIGKILL)
        dead = host.step([("e0", _call("calculator", expression="1 + 1"))])[0]
        assert dead["termination"] == "env_error" and dead["server_restarted"]
        assert host.counters()["tools/mcp_restarts"] == 1
        (restarted,) = _stdio_server_pids()
        assert restarted != pid
        host.reset([("e1", EpisodeSpec("s1", {"seed": 1}))])
        assert host.step([("e1", _call("calculator", expression="6 * 7"))])[0]["messages"][0]["content"].count("42") == 1
        host.finish(["e0", "e1"])
    finally:
        host.close()
    assert not _stdio_server_pids()
