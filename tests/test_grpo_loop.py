"""GRPOLoop against fake Monarch endpoints: ordering across replicas, counting of bad input,
advantage normalisation in the datums, version bookkeeping, and deadlines."""

import time

import pytest
import torch

from meshrl.actors.rewarder import safe_grade
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.controller.grpo import GRPOLoop, StepError, split_evenly, wait_all
from meshrl.controller.supervisor import CallTimeout, Supervisor
from meshrl.engines import Completion
from meshrl.envs.arithmetic import ArithmeticTask


class Future:
    def __init__(self, value=None, hang=False):
        self.value, self.hang = value, hang

    def get(self, timeout=None):
        if self.hang:
            raise TimeoutError
        return self.value


class ValueMesh:
    def __init__(self, values):
        self._values = values

    def values(self):
        return list(self._values)


class Endpoint:
    def __init__(self, actors, name):
        self.actors, self.name = actors, name

    def call_one(self, *args):
        assert len(self.actors) == 1
        return Future(getattr(self.actors[0], self.name)(*args))

    def call(self, *args):
        return Future(ValueMesh([getattr(a, self.name)(*args) for a in self.actors]))


class Mesh:
    def __init__(self, actors):
        self.actors = actors

    def slice(self, procs):
        return Mesh([self.actors[procs]])

    def __getattr__(self, name):
        return Endpoint(self.actors, name)


class FakeGenerator:
    """Answers each prompt with G completions; the answer text is scripted per call."""

    def __init__(self, replica):
        self.replica, self.version, self.seen = replica, 0, []

    def generate(self, prompts, request):
        from meshrl.actors.generator import GenerationBatch

        self.seen.append(len(prompts))
        groups = []
        for p in prompts:
            group = []
            for k in range(request.n):
                if k == 0 and len(p) % 2 == 0:
                    group.append(Completion([], [], "stop", ""))  # an empty generation
                    continue
                text = f"{p[-1] + k}"
                group.append(Completion([p[-1], k], [-0.5, -1.5], "stop", text, {"version": self.version}))
            groups.append(group)
        return GenerationBatch(groups, self.version, 0.01, 0)

    def update_weights(self, version):
        self.version = version
        return {"version": version, "pull_s": 0.1, "transfer_s": 0.1, "bytes": 100, "load_s": 0.01}


class FakeRewarder:
    def score(self, items):
        def grade(problem, response):
            if response.endswith("3"):
                raise ValueError("grader bug")
            return (1.0, {"correct": True}) if int(response) % 2 else (0.0, {"correct": False})

        return [safe_grade(grade, p, r) for p, r in items]


class FakeLearner:
    def __init__(self):
        self.calls = []

    def forward_backward(self, datums, loss_fn, loss_config):
        self.calls.append(("fb", datums, loss_fn, loss_config))
        return {"loss": 0.0, "tokens": float(sum(int(d.loss_fn_inputs["mask"].sum()) for d in datums))}

    def optim_step(self, adam):
        self.calls.append(("opt", adam))
        return {"grad_norm": 1.0}

    def publish(self, version):
        return {"version": version, "bytes": 100, "publish_s": 0.01, "pack_s": 0.01}


class FakeRenderer:
    """Prompt tokens = one token per word of the user message plus its length."""

    def build_generation_prompt(self, messages):
        words = messages[-1]["content"].split()
        return list(range(len(words))) + [len(words)]

    def get_stop_sequences(self):
        return [2]


class FakeMeshGroup(dict):
    def procs_of(self, name):
        return len(self[name].actors)

    def cohabitants(self, name):
        return [name]


def make_loop(n_generators=2, **overrides):
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])
    gens = [FakeGenerator(r) for r in range(n_generators)]
    learner = FakeLearner()
    meshes = FakeMeshGroup(generator=Mesh(gens), rewarder=Mesh([FakeRewarder()]), learner=Mesh([learner]))
    loop = GRPOLoop(cfg, ArithmeticTask(cfg.task.arithmetic), FakeRenderer(), meshes, Supervisor(meshes, cfg.faults))
    return loop, gens, learner


def test_split_evenly_keeps_order_and_balance():
    assert split_evenly(list(range(7)), 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert split_evenly([1], 4) == [[1]]


def test_rollout_spreads_prompts_and_counts_bad_input():
    loop, gens, _ = make_loop(**{"trainer.prompts_per_step": 5, "trainer.group_size": 3,
                                 "task.arithmetic.prompt_template": "What is {a} {op} {b}?"})
    loop.cfg.model.max_model_len = 40
    loop.cfg.generator.sampling.max_new_tokens = 34  # the 6-token prompts just fit
    trajectories, metrics = loop.rollout()
    assert sum(g.seen[0] for g in gens) == 5 and all(g.seen for g in gens)
    assert len(trajectories) == 15
    assert [t.group for t in trajectories] == [g for g in range(5) for _ in range(3)]
    empties = [t for t in trajectories if not t.tokens]
    assert loop.counters.empty_generations == len(empties) > 0
    errors = [t for t in trajectories if "error" in t.info]
    assert errors and all(t.reward == 0.0 for t in errors)
    assert loop.counters.reward_errors == len(errors)
    assert metrics["gen/tokens"] == sum(len(t.tokens) for t in trajectories)

    loop.cfg.generator.sampling.max_new_tokens = 35  # now every 6-token prompt is one too long
    trajectories, _ = loop.rollout()
    assert trajectories == [] and loop.counters.prompts_too_long == 5


def test_train_normalises_by_all_sampled_tokens_and_skips_zero_advantage():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4})
    trajectories, _ = loop.rollout()
    metrics = loop.train(trajectories)
    kind, datums, loss_fn, loss_config = learner.calls[0]
    assert kind == "fb" and loss_fn == "ppo" and loss_config == {"eps_low": 0.2, "eps_high": 0.2}
    total = sum(len(t.tokens) for t in trajectories)
    by_group = {}
    for t in trajectories:
        by_group.setdefault(t.group, []).append(t.reward)
    expected = []
    for t in trajectories:
        adv = t.reward - sum(by_group[t.group]) / len(by_group[t.group])
        if t.tokens and adv != 0:
            expected.append(adv / total)
    got = sorted(float(d.loss_fn_inputs["advantages"][d.loss_fn_inputs["mask"] > 0][0]) for d in datums)
    assert got == pytest.approx(sorted(expected))
    for d in datums:  # prompt positions carry no advantage, completion positions one constant
        adv = d.loss_fn_inputs["advantages"]
        assert torch.all(adv[d.loss_fn_inputs["mask"] == 0] == 0)
    assert metrics["batch/tokens_total"] == total
    assert learner.calls[1][0] == "opt"


def test_sync_advances_version_on_every_generator():
    loop, gens, _ = make_loop()
    assert loop.sync_weights()["version"] == 1
    assert loop.sync_weights()["version"] == 2
    assert [g.version for g in gens] == [2, 2]


def test_sync_refuses_a_generator_left_on_an_old_version():
    loop, gens, _ = make_loop()
    gens[1].update_weights = lambda v: {"version": v - 1, "pull_s": 0, "transfer_s": 0, "bytes": 0, "load_s": 0}
    with pytest.raises(StepError, match=r"versions \[0\], expected 1"):
        loop.sync_weights()


class ArrivesAtDeadline(Future):
    def get(self, timeout=None):
        time.sleep(timeout)
        return self.value


@pytest.mark.parametrize("watch", [None, lambda: None])
def test_wait_all_takes_replies_that_arrived_while_an_earlier_one_used_the_deadline(watch):
    assert wait_all([ArrivesAtDeadline(1), Future(2)], 0.2, "generator.generate", watch=watch) == [1, 2]


def test_wait_all_deadline_names_the_call():
    with pytest.raises(CallTimeout, match="generator.generate timed out after 2s"):
        wait_all([Future(1), Future(hang=True)], 2, "generator.generate")
