"""The multi-turn code environment: code extraction, turns, rewards, feedback, error-site markers,
state_at replay, trajectories."""

from __future__ import annotations

import asyncio
import json

import pytest

from meshrl.envs.base import ERROR_KINDS, Observation
from meshrl.envs.code_actions import CodeAction, parse_action
from meshrl.envs.code_env import (
    HINT_TEMPLATES,
    CodeEnv,
    env_from_config,
    hint_text,
    load_trajectories,
    make_code_env,
    run_episode,
    save_trajectories,
)
from meshrl.config.env import CodeEnvConfig, EnvConfig
from meshrl.envs.sandbox import Sandbox
from meshrl.envs.tasks import task_by_id

GOOD = "```python\ndef clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n```"
WRONG = "```python\ndef clamp(x, lo, hi):\n    return x\n```"


@pytest.fixture(scope="module")
def sb():
    s = Sandbox()
    yield s
    s.close()


def env_for(sb, task_id="meshrl/clamp", **cfg):
    return CodeEnv(task_by_id(task_id), sb, CodeEnvConfig(**cfg))


# ----------------------------------------------------------------------------- parsing


def test_parse_fenced_blocks():
    p = parse_action("Here:\n```python\nprint(1)\n```\nand better:\n```py\nprint(2)\n```")
    assert (p.tool, p.code, p.error_kind) == (None, "print(2)\n", None)
    assert parse_action("```\nx = 1\n```").code == "x = 1\n"
    assert parse_action("```python\ndef f():\n    return 1\n").code == "def f():\n    return 1\n"  # unterminated
    assert parse_action("just words").error_kind == "wrong_format"
    assert parse_action("```python\n\n```").error_kind == "wrong_format"


def test_parse_tool_calls():
    p = parse_action('<tool_call>\n{"name": "run_python", "arguments": {"code": "print(3)"}}\n</tool_call>')
    assert (p.tool, p.code) == ("run_python", "print(3)")
    p = parse_action('{"name": "submit", "arguments": "{\\"code\\": \\"x = 1\\"}"}')  # arguments as a JSON string
    assert (p.tool, p.code) == ("submit", "x = 1")
    p = parse_action('```json\n{"function": {"name": "run_python", "arguments": {"code": "y = 2"}}}\n```')
    assert (p.tool, p.code) == ("run_python", "y = 2")
    p = parse_action('<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>')
    assert (p.tool, p.error_kind) == ("bash", "tool_not_found")
    assert parse_action('{"name": "submit", "arguments": {}}').error_kind == "wrong_format"


# ----------------------------------------------------------------------------- episodes


def test_reset_gives_the_task(sb):
    env = env_for(sb, system_prompt="You are a careful programmer.")
    obs = env.reset(episode_id="ep-1")
    assert isinstance(obs, Observation) and obs.reward == 0.0 and not obs.done
    assert "def clamp(" in obs.text and "```python" in obs.text
    assert obs.message == {"role": "user", "content": obs.text}
    assert obs.metadata["messages"][0] == {"role": "system", "content": "You are a careful programmer."}
    assert env.state.episode_id == "ep-1" and env.state.step_count == 0
    assert env.state_at(0) == obs.metadata["messages"]


def test_success_first_turn(sb):
    env = env_for(sb)
    env.reset()
    obs = env.step(CodeAction(text=GOOD))
    assert obs.done and obs.error_kind is None and obs.hint_template_key is None
    assert obs.metadata["tests_passed"] == obs.metadata["tests_total"] == 5
    assert obs.metadata["termination"] == "success" and obs.metadata["layer"] == sb.layer
    assert obs.reward == pytest.approx(1.0 + 0.5 + 0.1)
    assert "All 5 hidden tests passed" in obs.text
    with pytest.raises(RuntimeError):
        env.step(CodeAction(text=GOOD))


def test_fail_then_fix_with_feedback_and_replay(sb):
    env = env_for(sb, max_turns=3)
    first = env.reset()
    o1 = env.step(CodeAction(text=WRONG))
    assert not o1.done and o1.reward == 0.0  # final mode: nothing until the end
    assert o1.error_kind == "test_failure" and o1.hint_template_key == "code.test_failure"
    assert 0 < o1.metadata["tests_passed"] < 5
    assert "Tests passed:" in o1.text and "wrong answer" in o1.text and "2 attempts left" in o1.text
    assert "clamp(15" not in o1.text  # hidden tests stay hidden
    assert o1.metadata["hint"] and "of 5 hidden tests" in o1.metadata["hint"]
    o2 = env.step(GOOD)  # plain strings are accepted too
    assert o2.done and o2.metadata["termination"] == "success"
    # state_at(t): exactly what the agent saw before acting at step t
    assert env.state_at(0) == [{"role": "user", "content": first.text}]
    assert env.state_at(1) == [
        {"role": "user", "content": first.text},
        {"role": "assistant", "content": WRONG},
        {"role": "user", "content": o1.text},
    ]
    with pytest.raises(IndexError):
        env.state_at(2)  # the episode is over
    # the runtime appends obs.message after its own assistant turn: the same list results
    transcript = [first.message]
    for reply, obs in ((WRONG, o1), (GOOD, o2)):
        transcript += [{"role": "assistant", "content": reply}, obs.message]
    assert transcript == env.state.messages


def test_turn_limit_and_penalty(sb):
    env = env_for(sb, max_turns=2, turn_limit_penalty=0.25, exec_success_weight=0.0, success_bonus=0.5)
    env.reset()
    o1 = env.step(WRONG)
    o2 = env.step(WRONG)
    assert not o1.done and o2.done and o2.metadata["termination"] == "max_turns"
    frac = o2.metadata["tests_passed"] / 5
    assert o2.reward == pytest.approx(frac - 0.25)
    tr = env.trajectory()
    assert tr["termination"] == "max_turns" and not tr["success"] and tr["num_turns"] == 2
    assert tr["reward"] == pytest.approx(o2.reward)


def test_per_turn_rewards_and_turn_cost(sb):
    env = env_for(sb, reward_mode="per_turn", turn_cost=0.05)
    env.reset()
    o1 = env.step(WRONG)
    o2 = env.step(GOOD)
    frac = o1.metadata["tests_passed"] / 5
    assert o1.reward == pytest.approx(frac + 0.1)
    assert o2.reward == pytest.approx(1.0 + 0.1 + 0.5 - 0.05)
    assert env.trajectory()["rewards"] == [o1.reward, o2.reward]


def test_submit_ends_the_episode(sb):
    env = env_for(sb, max_turns=5)
    env.reset()
    code = json.dumps({"name": "submit", "arguments": {"code": "def clamp(x, lo, hi):\n    return lo\n"}})
    obs = env.step(code)
    assert obs.done and obs.metadata["termination"] == "submitted" and obs.metadata["tool"] == "submit"
    env.reset()
    run = json.dumps({"name": "run_python", "arguments": {"code": "def clamp(x, lo, hi):\n    return lo\n"}})
    assert not env.step(run).done


def test_format_and_tool_errors_cost_a_turn(sb):
    env = env_for(sb, max_turns=2)
    env.reset()
    o1 = env.step("I would use max and min.")
    assert o1.error_kind == "wrong_format" and o1.hint_template_key == "code.wrong_format"
    assert "```python" in o1.text and not o1.done
    o2 = env.step('<tool_call>{"name": "shell", "arguments": {"code": "ls"}}</tool_call>')
    assert o2.error_kind == "tool_not_found" and o2.done and o2.metadata["termination"] == "max_turns"
    assert o2.reward == pytest.approx(0.0)


@pytest.mark.parametrize(
    "code,kind,snippet",
    [
        ("def clamp(x, lo, hi)\n    return x\n", "syntax_error", "SyntaxError"),
        ("import numpy\ndef clamp(x, lo, hi):\n    return x\n", "import_error", "numpy"),
        ("def clamp(x, lo, hi):\n    return x / 0\n", "runtime_error", "ZeroDivisionError"),
        ("def clip(x, lo, hi):\n    return x\n", "missing_entry_point", "clamp"),
        ("def clamp(x, lo, hi):\n    while True:\n        pass\n", "timeout", "too long"),
        ("while True:\n    pass\n", "timeout", "timeout"),
        ("def clamp(x, lo, hi):\n    return bytearray(8 << 30)\n", "memory_error", "MemoryError"),
        ("print('x' * 10**6)\ndef clamp(x, lo, hi):\n    return x\n", "output_limit", "stopped"),
        ("open('/etc/shadow').read()\n", None, None),
    ],
)
def test_error_kinds_reach_the_observation(sb, code, kind, snippet):
    env = env_for(sb, test_timeout_s=1.0, exec_timeout_s=6.0)
    env.reset()
    obs = env.step(f"```python\n{code}```")
    if kind is None:  # reading outside the sandbox: whichever error the layer gives, never the file
        assert obs.error_kind in ("file_not_found", "permission_denied") and "root:" not in obs.text
        return
    assert obs.error_kind == kind, (obs.error_kind, obs.text)
    assert obs.hint_template_key == f"code.{kind}" and obs.hint_template_key in HINT_TEMPLATES
    assert snippet in obs.text or snippet in obs.metadata["error_text"], obs.text
    assert obs.metadata["tests_passed"] == 0


def test_reveal_failed_tests_option(sb):
    env = env_for(sb, reveal_failed_tests=True)
    env.reset()
    obs = env.step(WRONG)
    assert "clamp(" in obs.text and "got" in obs.text


def test_program_output_is_fed_back(sb):
    env = env_for(sb)
    env.reset()
    obs = env.step("```python\nprint('debug: loaded')\ndef clamp(x, lo, hi):\n    return x\n```")
    assert "debug: loaded" in obs.text


def test_reset_choice_of_task(sb):
    tasks = [task_by_id("meshrl/clamp"), task_by_id("meshrl/factorial"), task_by_id("meshrl/digit_sum")]
    env = CodeEnv(tasks, sb)
    assert env.reset(task_id="meshrl/factorial").metadata["task_id"] == "meshrl/factorial"
    a = env.reset(seed=7).metadata["task_id"]
    assert env.reset(seed=7).metadata["task_id"] == a
    rotation = [env.reset().metadata["task_id"] for _ in range(3)]
    assert sorted(rotation) == sorted(t.task_id for t in tasks)
    with pytest.raises(KeyError):
        env.reset(task_id="meshrl/nope")
    with pytest.raises(RuntimeError):
        CodeEnv(tasks, sb).step(GOOD)


def test_trajectory_is_json_and_complete(sb, tmp_path):
    env = env_for(sb)
    env.reset(episode_id="traj")
    env.step(WRONG)
    env.step(GOOD)
    tr = env.trajectory()
    path = tmp_path / "traj.jsonl"
    path.write_text(json.dumps(tr) + "\n")
    back = json.loads(path.read_text())
    assert back["episode_id"] == "traj" and back["termination"] == "success" and back["success"]
    assert [t["t"] for t in back["turns"]] == [0, 1]
    t0 = back["turns"][0]
    assert t0["code"].startswith("def clamp") and t0["error_kind"] == "test_failure"
    assert t0["exec"]["layer"] == sb.layer and t0["exec"]["exit_code"] == 0
    assert t0["feedback"] == back["messages"][2]["content"]
    assert len(back["messages"]) == 5 and back["layer"] == sb.layer


def test_step_async(sb):
    env = env_for(sb)

    async def main():
        await env.reset_async()
        return await env.step_async(CodeAction(text=GOOD))

    assert asyncio.run(main()).done


def test_humaneval_episode(sb):
    t = task_by_id("HumanEval/2")
    env = CodeEnv(t, sb)
    obs = env.reset()
    assert "def truncate_number" in obs.text
    o = env.step("```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```")
    assert o.done and o.metadata["success"]


def test_factories():
    env = make_code_env({"split": "test", "difficulty": [1], "code": {"max_turns": 1}})
    try:
        assert env.cfg.max_turns == 1 and all(t.difficulty == 1 and t.split == "test" for t in env.tasks)
    finally:
        env.close()
    env = env_from_config(EnvConfig(task_source="humaneval", task_limit=3))
    try:
        assert [t.task_id for t in env.tasks] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    finally:
        env.close()
    with pytest.raises(KeyError):
        make_code_env({}, task_ids=["meshrl/nope"])


def test_hint_templates_cover_error_kinds():
    for kind in ERROR_KINDS:
        assert f"code.{kind}" in HINT_TEMPLATES, kind
    assert hint_text("code.test_failure", failed=2, total=5).startswith("Your function returns wrong results for 2 of 5")
    assert "?" in hint_text("code.syntax_error")  # missing fields do not raise
    assert hint_text(None) is None and hint_text("code.nope") is None


def test_run_episode_and_trajectory_files(sb, tmp_path):
    replies = iter([WRONG, GOOD])
    seen = []

    def policy(messages):
        seen.append(messages)
        return next(replies)

    env = env_for(sb)
    tr = run_episode(env, policy, episode_id="played")
    assert tr["success"] and tr["num_turns"] == 2
    assert seen[1] == env.state_at(1)  # the policy saw exactly what state_at replays
    path = save_trajectories(tmp_path / "runs" / "traj.jsonl", [tr, tr])
    back = load_trajectories(path)
    assert len(back) == 2 and back[0]["episode_id"] == "played" and back[0]["turns"][1]["tests_passed"] == 5


# ----------------------------------------------------------------------------- grading anomalies

FORGER = "```python\nimport os\nos._exit(0)\n```"


def test_an_attempt_that_tampers_is_graded_zero_and_flagged(sb):
    env = env_for(sb, max_turns=2)
    env.reset(episode_id="probe")
    obs = env.step(CodeAction(text=FORGER))
    assert obs.error_kind == "grading_anomaly" and obs.metadata["grading_anomaly"] == "early_exit"
    assert obs.metadata["tests_passed"] == 0 and obs.reward == 0.0 and not obs.metadata["exec_ok"]
    assert obs.hint_template_key == "code.grading_anomaly" and "interfered with the grader" in obs.metadata["hint"]
    obs = env.step(CodeAction(text=GOOD))
    assert obs.metadata["success"] and obs.metadata["grading_anomaly"] is None
    tr = env.trajectory()
    assert tr["grading_anomalies"] == [{"t": 0, "anomaly": "early_exit"}]
    assert [t["grading_anomaly"] for t in tr["turns"]] == ["early_exit", None]


def test_the_rollout_counts_anomalies_per_step(sb):
    """`reward/grading_anomalies` counts the turns that tampered, over the step's episodes, and each
    episode's trajectory carries its own count (its env record lists the turns)."""
    from meshrl.config.env import EnvConfig
    from meshrl.controller.episodes import EpisodeRollout
    from meshrl.controller.rollout import Counters
    from meshrl.engines import Completion, SampleRequest
    from meshrl.envs.episode_host import EpisodeHost
    from meshrl.envs.hosting import CodeEnvSource

    replies = iter([FORGER, WRONG, FORGER, GOOD])  # episode a: forger, forger; episode b: wrong, good
    env_host = EpisodeHost(CodeEnvSource(EnvConfig(sandbox=sb.cfg, code=CodeEnvConfig(max_turns=2))))

    def host(endpoint, args):  # the env mesh's part (EnvActor's endpoints, in process)
        if endpoint == "finish":
            return {"episodes": env_host.finish(args), "counts": dict(env_host.counts)}
        return getattr(env_host, endpoint)(args)

    class Client:
        version = 0

        def supervised(self, mesh, fn, what):
            return fn()

        def procs(self, mesh):
            return 1

        def per_rank(self, mesh, endpoint, by_rank):
            return {r: host(endpoint, a) for r, a in by_rank.items()}

        def generate(self, prompts, request, timings=None):
            return [[Completion([7], [0.0], "stop", next(replies), meta={"replica": 0})] for _ in prompts]

    class Renderer:
        def build_generation_prompt(self, messages):
            return [1, 2]

        def bridge(self, tokens, messages):
            return [3]

    rollout = EpisodeRollout(Client(), Renderer(), 4096, Counters())
    trajectories, metrics = rollout.collect([task_by_id("meshrl/clamp")], 2, SampleRequest(max_tokens=16), "t")
    env_host.close()
    assert metrics["reward/grading_anomalies"] == 2
    assert sorted(t.info["grading_anomalies"] for t in trajectories) == [0, 2]
    flagged = [r for r in rollout.episode_records if r["grading_anomalies"]]
    assert len(flagged) == 1 and [x["anomaly"] for x in flagged[0]["grading_anomalies"]] == ["early_exit"] * 2
