"""`task.kind: env` without a runtime: its config and episode sets, the check of an environment's source
before anything spawns, and the env host's handling of every way an environment can misbehave (each
fails its own episode in one line, counted; the others go on)."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.run import RunConfig
from meshrl.envs.episode_host import EpisodeHost
from meshrl.envs.hosting import env_source
from meshrl.envs.task_sets import EpisodeSpec, make_task

ENV = "task.kind=env"


def _cfg(*overrides):
    return load_config(RunConfig, None, [ENV, *overrides])


def _faulty(mode, *overrides):
    return _cfg("task.env.factory=meshrl.testing.envs:FaultyEnv", f"task.env.kwargs={{mode: {mode}}}", *overrides)


def _play(cfg, seeds=(0, 1, 2, 3), text="hello there"):
    host = EpisodeHost(env_source(cfg.task.env))
    ids = [f"e{s}" for s in seeds]
    opened = host.reset([(i, EpisodeSpec(i, {"seed": s})) for i, s in zip(ids, seeds)])
    live = [i for i, o in zip(ids, opened) if "messages" in o]
    steps = dict(zip(live, host.step([(i, text) for i in live])))
    ends = dict(zip(ids, host.finish(ids)))
    host.close()
    return dict(zip(ids, opened)), steps, ends, host.counts


@pytest.mark.parametrize("overrides, message", [
    ([], "kind env needs task.env"),
    (["task.env.name=x"], "set factory (an environment class) or url"),
    (["task.env.factory=pkg.mod:X", "task.env.url=http://127.0.0.1:1", "task.env.serve=true"], "cannot be combined with url"),
    (["task.env.factory=pkg.mod.X"], "must look like 'package.module:Name'"),
    (["task.env.url=ftp://host"], "url must start with http"),
    (["task.env.factory=a:B", "task.env.train.seeds=[5, 5]"], "first < stop"),
])
def test_env_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        _cfg(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value).strip()


def test_episode_sets_from_seeds_and_files_and_held_out_disjoint(tmp_path):
    task = make_task(_cfg("task.env.factory=meshrl.testing.envs:VowelChatEnv", "task.env.train.seeds=[0, 10]",
                          "task.env.heldout.seeds=[0, 3]", "task.env.heldout.kwargs={split: test}").task)
    assert [s.kwargs for s in task.heldout()] == [{"split": "test", "seed": i} for i in range(3)]
    assert sorted(s.kwargs["seed"] for s in task.train_batch(0, 10)) == list(range(10))  # one epoch: a permutation
    with pytest.raises(ConfigError, match="task.env.heldout shares 3 episode"):
        make_task(_cfg("task.env.factory=meshrl.testing.envs:VowelChatEnv", "task.env.train.seeds=[0, 10]",
                       "task.env.heldout.seeds=[7, 12]").task)
    good = tmp_path / "held.jsonl"
    good.write_text('{"level": 1}\n\n{"level": 2, "name": "b"}\n')
    task = make_task(_cfg("task.env.factory=meshrl.testing.envs:VowelChatEnv", f"task.env.heldout.file={good}").task)
    assert [(s.id, s.kwargs) for s in task.heldout()] == [("held:1", {"level": 1}), ("held:3", {"level": 2, "name": "b"})]
    for text, message in (('{"level": 1}\n[1, 2]\n', f"{good}:2: malformed line (a JSON list, not an object)"),
                          ("{oops\n", f"{good}:1: malformed line (Expecting property name"),
                          ("\n", f"{good} holds no episode")):
        good.write_text(text)
        with pytest.raises(ConfigError, match=re.escape("task.env.heldout.file: " + message)):
            make_task(_cfg("task.env.factory=meshrl.testing.envs:VowelChatEnv", f"task.env.heldout.file={good}").task)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MISSING = [
    (["task.env.factory=meshrl.testing.no_such_module:Env"], "task.env.factory: cannot import module 'meshrl.testing.no_such_module'"),
    (["task.env.factory=meshrl.testing.envs:NoSuchEnv"], "task.env.factory: module 'meshrl.testing.envs' has no class or function 'NoSuchEnv'"),
    ([f"task.env.url=http://127.0.0.1:{_free_port()}"], "task.env.url: no environment server answers at"),
]


@pytest.mark.parametrize("overrides, message", MISSING)
def test_a_missing_class_module_or_server_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_task(_cfg(*overrides).task)


def test_meshrl_train_on_a_missing_module_exits_2_before_anything_spawns(tmp_path):
    overrides, message = MISSING[0]
    cli = subprocess.run([sys.executable, "-m", "meshrl.cli", "train", ENV, *overrides, f"output.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2, cli.stderr
    assert message in cli.stderr and len(cli.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # no run directory: nothing was started


@pytest.mark.parametrize("mode, field", [
    ("step_raises", "step RuntimeError: the simulator crashed"),
    ("huge_text", "observation.text.content has 1000000 characters, over task.env.max_observation_chars=16000"),
    ("nan_reward", "observation.reward is nan, not a finite number"),
    ("not_observation", "the observation is a dict, not an Observation"),
    ("bad_role", "observation.text is not a {role: user|tool|ipython|system, content: str} message"),
])
def test_a_bad_step_fails_its_own_episode_in_one_line(mode, field, caplog):
    _, steps, _, counts = _play(_faulty(mode))
    for seed in (0, 2):  # the well-behaved episodes end normally
        assert steps[f"e{seed}"]["termination"] == "success" and steps[f"e{seed}"]["reward"] == 0.5
    for seed in (1, 3):
        bad = steps[f"e{seed}"]
        assert bad["termination"] == "env_error" and bad["done"] and bad["reward"] == 0.0
        assert bad["env_error"].startswith("env meshrl.testing.envs:FaultyEnv: ") and field in bad["env_error"]
        assert "\n" not in bad["env_error"]
    assert sum(counts.values()) == 2
    assert sum(f"episode e{s} failed" in r.getMessage() for r in caplog.records for s in (1, 3)) == 2


def test_a_reset_that_raises_fails_only_its_episode():
    opened, steps, _, counts = _play(_faulty("reset_raises"))
    assert opened["e1"]["error"] == "env meshrl.testing.envs:FaultyEnv: reset ValueError: the episode database is down"
    assert "messages" in opened["e0"] and set(steps) == {"e0", "e2"} and counts == {"env/reset_errors": 2}


def test_a_hung_step_is_cut_at_its_deadline():
    import time

    start = time.monotonic()
    _, steps, _, counts = _play(_faulty("step_hangs", "task.env.step_timeout_s=0.5", "task.env.reward_deadline_s=0"))
    assert time.monotonic() - start < 5  # the hung steps sleep 30 s
    assert "step TimeoutError: no answer within 0.5s" in steps["e1"]["env_error"]
    assert steps["e0"]["termination"] == "success" and counts["env/step_timeouts"] == 2


def test_a_late_reward_is_credited_and_a_missing_one_dropped_after_the_deadline():
    _, steps, ends, _ = _play(_faulty("late_reward", "task.env.reward_deadline_s=5"))
    assert steps["e1"]["reward_pending"] and steps["e1"]["reward"] == 0.0 and not steps["e1"]["success"]
    assert ends["e1"]["delayed_reward"] == 1.0 and ends["e1"]["success"] is True
    assert "delayed_reward" not in ends["e0"]
    _, _, ends, counts = _play(_faulty("no_reward", "task.env.reward_deadline_s=0.3"))
    assert ends["e1"]["reward_dropped"] == ("env meshrl.testing.envs:FaultyEnv: no reward within "
                                            "task.env.reward_deadline_s=0.3s")
    assert counts == {"env/delayed_reward_dropped": 2}


def test_the_counts_of_episodes_closed_at_once_add_up():
    """Many episodes whose reward never comes reach their deadline together, in the host's threads;
    each is counted, and the counters are written only by the thread that called the host (a counter
    bumped in the pool's threads lost counts when two bumped it at once)."""
    import threading
    from collections import Counter

    class WritersCounter(Counter):
        writers: set = set()

        def __setitem__(self, key, value):
            self.writers.add(threading.get_ident())
            super().__setitem__(key, value)

    cfg = _faulty("no_reward", "task.env.reward_deadline_s=0.05", "task.env.max_parallel=32")
    host = EpisodeHost(env_source(cfg.task.env))
    host.counts = WritersCounter()
    ids = [f"e{s}" for s in range(64)]
    try:
        host.reset([(i, EpisodeSpec(i, {"seed": s})) for s, i in enumerate(ids)])
        host.step([(i, "hello") for i in ids])
        ends = host.finish(ids)
    finally:
        host.close()
    assert sum("reward_dropped" in e for e in ends) == 32
    assert host.counts == {"env/delayed_reward_dropped": 32} and WritersCounter.writers == {threading.get_ident()}


def test_turn_cap_success_rule_and_recorded_context():
    cfg = _cfg("task.env.factory=meshrl.testing.envs:VowelChatEnv", "task.env.kwargs={turns: 5}", "task.env.max_turns=2",
               "task.env.success_reward=0.9")
    host = EpisodeHost(env_source(cfg.task.env))
    host.reset([("a", EpisodeSpec("a", {"seed": 0}))])
    first = host.step([("a", "aaaa")])[0]
    assert not first["done"] and first["reward"] == 1.0 and first["error_kind"] is None
    second = host.step([("a", "xyz")])[0]
    assert second["done"] and second["termination"] == "max_turns" and second["error_kind"] == "few_vowels"
    assert second["success"]  # a return of 1.0 reaches success_reward 0.9
    # the environment keeps no history: the context is what the host recorded the agent seeing
    assert second["context"] == [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "aaaa"},
                                 {"role": "user", "content": "Once more."}]
    host.close()


def test_the_tutor_example_replays_through_its_own_history():
    cfg = _cfg("task.env.factory=addition_tutor:AdditionTutorEnv", "task.env.python_path=[examples]")
    host = EpisodeHost(env_source(cfg.task.env))
    question = host.reset([("a", EpisodeSpec("a", {"seed": 0, "split": "test"}))])[0]["messages"]
    wrong = host.step([("a", "It is 7.")])[0]
    assert wrong["error_kind"] == "wrong_answer" and wrong["hint_template_key"] == "tutor.wrong_answer"
    assert wrong["context"] == question and "too low" in wrong["message"]["content"]
    answer = int(wrong["error_text"].split()[-1].rstrip("."))
    right = host.step([("a", str(answer))])[0]
    assert right["done"] and right["success"] and right["reward"] == 0.6 and right["termination"] == "success"
    host.close()


def test_a_served_openenv_server_that_dies_fails_its_episodes_and_is_restarted():
    """openenv-core's own server in a child process: killed mid-episode, the episodes on it fail in
    one line each, the server is started again, and the next episodes play on the new one."""
    cfg = _cfg("task.env.factory=meshrl.testing.openenv_envs:VowelEnv", "task.env.serve=true",
               "task.env.step_timeout_s=10")
    source = env_source(cfg.task.env)
    host = EpisodeHost(source)
    try:
        first_pid = source.server.proc.pid
        assert all("messages" in o for o in host.reset([(f"a{i}", EpisodeSpec("x", {"seed": i})) for i in range(2)]))
        ok = host.step([("a0", "aeiou")])[0]
        assert ok["reward"] == 1.0 and not ok["done"]
        os.kill(first_pid, signal.SIGKILL)
        source.server.proc.wait(10)
        failed = host.step([("a0", "more"), ("a1", "more")])
        assert all(r["termination"] == "env_error" and "env meshrl.testing.openenv_envs:VowelEnv: step" in r["env_error"]
                   for r in failed)
        assert host.counts["env/server_restarts"] == 1 and source.server.proc.pid != first_pid
        host.finish(["a0", "a1"])
        assert "messages" in host.reset([("b", EpisodeSpec("b", {"seed": 5}))])[0]
        assert host.step([("b", "aaa")])[0]["reward"] == 1.0
        host.finish(["b"])
    finally:
        pid = source.server.proc.pid
        host.close()
    assert source.server.proc.poll() is not None, f"server {pid} still running"


def test_the_example_configs_load():
    for name in ("env-tutor", "env-tools", "env-judge", "env-openenv"):
        cfg = load_config(RunConfig, f"configs/{name}.yaml", [])
        assert cfg.task.kind == "env" and cfg.task.env.python_path == ["examples"]
    assert json.loads(json.dumps(cfg.task.env.model_dump()))["serve"] is True


class _Client:
    """The mesh client `EpisodeRollout` talks to, in this process: one env rank (a real `EpisodeHost`
    over a real `EnvSource`) and a generator that replies with scripted text (token ids = characters)."""

    version = 3

    def __init__(self, cfg, replies):
        self.host, self.replies, self.turn = EpisodeHost(env_source(cfg.task.env)), replies, 0

    def procs(self, mesh):
        return 1

    def supervised(self, mesh, fn, what):
        return fn()

    def per_rank(self, mesh, endpoint, args_by_rank):
        return {0: getattr(self.host, endpoint)(args_by_rank[0]) if endpoint != "finish"
                else {"episodes": self.host.finish(args_by_rank[0]), "counts": self.host.counters()}}

    def generate(self, prompts, request, timings):
        from meshrl.engines import Completion

        text = self.replies[self.turn]
        self.turn += 1
        return [[Completion(tokens=[ord(c) for c in text], logprobs=[-1.0] * len(text), finish_reason="stop",
                            text=text, meta={"version": self.version, "replica": 0})] for _ in prompts]


def test_the_rollout_credits_late_rewards_and_leaves_failed_episodes_out(smollm_tokenizer):
    """EpisodeRollout over a real env host: the episodes whose reward came late are trained with it;
    those whose environment failed, or whose reward never came, are left out of their groups and
    counted in the step's metrics, with the env processes' counters."""
    from meshrl.controller.episodes import EpisodeRollout
    from meshrl.controller.rollout import Counters
    from meshrl.engines import SampleRequest
    from meshrl.renderers import renderer_for_tokenizer

    renderer = renderer_for_tokenizer(smollm_tokenizer)
    specs = [EpisodeSpec(f"s{i}", {"seed": i}) for i in range(4)]
    for mode, kept_rewards, metrics in (
            ("late_reward", [0.5, 1.0, 0.5, 1.0], {}),
            ("no_reward", [0.5, 0.5], {"episodes/reward_dropped": 2.0, "env/delayed_reward_dropped": 2.0}),
            ("step_raises", [0.5, 0.5], {"episodes/env_error": 2.0, "env/step_errors": 2.0})):
        cfg = _faulty(mode, "task.env.reward_deadline_s=1")
        rollout = EpisodeRollout(_Client(cfg, ["hi"]), renderer, 512, Counters())
        trajectories, step = rollout.collect(specs, 1, SampleRequest(max_tokens=8), "t")
        assert [t.reward for t in trajectories] == kept_rewards, mode
        assert {k: step[k] for k in metrics} == metrics
        assert all(t.info["correct"] for t in trajectories)  # a late reward decides success too
        assert [t.group for t in trajectories] == sorted(t.group for t in trajectories)
