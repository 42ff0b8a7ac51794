"""GRPOLoop against fake Monarch endpoints: ordering across replicas, counting of bad input,
advantage normalisation in the datums, DAPO dynamic sampling, KL reward shaping, version
bookkeeping, and deadlines."""

import time

import pytest
import torch

from meshrl.actors.rewarder import safe_grade
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.controller.grpo import GRPOLoop
from meshrl.controller.mesh_client import MeshClient, StepError, split_evenly
from meshrl.controller.rollout import Counters, SingleTurnRollout
from meshrl.controller.supervisor import CallTimeout, Supervisor, wait_all
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


class UniformForEvenOperand(FakeRewarder):
    """All-equal rewards for problems whose first operand is even (a group with no signal)."""

    def score(self, items):
        return [(1.0, {"correct": True}) if p.meta["a"] % 2 == 0 else s
                for (p, _), s in zip(items, super().score(items))]


class FakeLearner:
    def __init__(self):
        self.calls = []

    def forward_backward(self, datums, loss_fn, loss_config):
        self.calls.append(("fb", datums, loss_fn, loss_config))
        return {"loss": 0.0, "tokens": float(sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums))}

    def forward(self, datums, reference):
        """Reference logprobs: -1 at every position."""
        self.calls.append(("forward", datums, reference))
        return [[-1.0] * d.length for d in datums]

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


def make_loop(n_generators=2, rewarder=FakeRewarder, **overrides):
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])
    gens = [FakeGenerator(r) for r in range(n_generators)]
    learner = FakeLearner()
    meshes = FakeMeshGroup(generator=Mesh(gens), rewarder=Mesh([rewarder()]), learner=Mesh([learner]))
    client = MeshClient(meshes, Supervisor(meshes, cfg.faults), {m: 5.0 for m in ("generator", "rewarder", "learner", "sync")})
    counters = Counters()
    strategy = SingleTurnRollout(client, FakeRenderer(), cfg.model.max_model_len, counters)
    loop = GRPOLoop(cfg, ArithmeticTask(cfg.task.arithmetic), strategy, client, counters, (2,))
    return loop, gens, learner


def test_split_evenly_keeps_order_and_balance():
    assert split_evenly(list(range(7)), 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert split_evenly([1], 4) == [[1]]


def test_rollout_spreads_prompts_and_counts_bad_input():
    loop, gens, _ = make_loop(**{"trainer.prompts_per_step": 5, "trainer.group_size": 3,
                                 "task.arithmetic.prompt_template": "What is {a} {op} {b}?"})
    loop.strategy.max_model_len = 40
    loop.cfg.generator.sampling.max_new_tokens = 34  # the 6-token prompts just fit
    metrics, trajectories = loop.step()
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
    trajectories, _, _ = loop.collect()
    assert trajectories == [] and loop.counters.prompts_too_long == 5


def _group_advantages(trajectories):
    by_group = {}
    for t in trajectories:
        by_group.setdefault(t.group, []).append(t.reward)
    return [t.reward - sum(by_group[t.group]) / len(by_group[t.group]) for t in trajectories]


def test_train_normalises_by_all_sampled_tokens_and_skips_zero_advantage():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4})
    trajectories, sampled, _ = loop.collect()
    metrics = loop.train(trajectories, sampled)
    kind, datums, loss_fn, loss_config = learner.calls[0]
    assert kind == "fb" and loss_fn == "ppo" and loss_config == {"eps_low": 0.2, "eps_high": 0.2}
    total = sum(len(t.tokens) for t in trajectories)
    expected = [a for t, a in zip(trajectories, _group_advantages(trajectories)) if t.tokens and a != 0]
    # one advantage per sequence, shaped once
    assert all(d.loss_fn_inputs["advantages"].dim() == 0 for d in datums)
    assert sorted(float(d.loss_fn_inputs["advantages"]) for d in datums) == pytest.approx(sorted(expected))
    for d in datums:  # the token weights carry the normaliser: 1 / every sampled token of the step
        weights = d.loss_fn_inputs["mask"]
        assert weights[weights != 0].tolist() == pytest.approx([1 / total] * int((weights != 0).sum()))
        assert int((weights != 0).sum()) == 2  # the two sampled tokens; prompt positions weigh 0
    assert metrics["batch/tokens_total"] == total
    assert learner.calls[1][0] == "opt"


def test_dynamic_sampling_refills_the_batch_with_informative_groups():
    loop, _, learner = make_loop(rewarder=UniformForEvenOperand, **{
        "trainer.prompts_per_step": 4, "trainer.group_size": 4, "trainer.advantage.drop_uniform_groups": "true",
        "trainer.advantage.max_extra_rounds": 5})
    metrics, trained = loop.step()
    groups = {t.group for t in trained}
    assert len(groups) == 4 and metrics["batch/groups"] == 4  # prompts_per_step informative groups
    assert all(len({t.reward for t in trained if t.group == g}) > 1 for g in groups)
    assert metrics["batch/sampling_rounds"] > 1 and loop.cursor == 4 * metrics["batch/sampling_rounds"]
    assert metrics["batch/dropped_uniform_groups"] > 0 and metrics["batch/missing_groups"] == 0
    assert metrics["batch/dropped_uniform_groups"] + metrics["batch/surplus_groups"] + 4 == loop.cursor
    # the dropped groups' tokens are not in the normaliser
    datums = learner.calls[0][1]
    total = sum(len(t.tokens) for t in trained)
    weights = [float(w) for d in datums for w in d.loss_fn_inputs["mask"] if w != 0]
    assert weights == pytest.approx([1 / total] * len(weights), rel=1e-6)


def test_dynamic_sampling_out_of_rounds_trains_on_what_it_has(caplog):
    loop, _, _ = make_loop(rewarder=UniformForEvenOperand, **{
        "trainer.prompts_per_step": 8, "trainer.group_size": 4, "trainer.advantage.drop_uniform_groups": "true",
        "trainer.advantage.max_extra_rounds": 0})
    metrics, trained = loop.step()
    assert metrics["batch/sampling_rounds"] == 1 and 0 < metrics["batch/groups"] < 8
    assert metrics["batch/missing_groups"] == 8 - metrics["batch/groups"]
    assert "dynamic sampling: " in caplog.text and "max_extra_rounds = 0" in caplog.text


def test_kl_shaping_makes_per_token_advantages_against_the_reference():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 3, "trainer.group_size": 4,
                                    "trainer.advantage.kl_coef": 0.5})
    trajectories, sampled, _ = loop.collect()
    metrics = loop.train(trajectories, sampled)
    assert [c[0] for c in learner.calls] == ["forward", "fb", "opt"] and learner.calls[0][2] is True
    datums = learner.calls[1][1]
    trainable = [t for t in trajectories if t.tokens]
    assert len(datums) == len(trainable)  # zero-advantage sequences train too: shaping gives them signal
    # d_t = sampler (-0.5, -1.5) - reference (-1): +0.5, -0.5; mean 0 -> A_t = A - 0.5 d_t
    for d, a in zip(datums, [a for t, a in zip(trajectories, _group_advantages(trajectories)) if t.tokens]):
        sampled_positions = d.loss_fn_inputs["mask"] != 0
        assert d.loss_fn_inputs["advantages"][sampled_positions].tolist() == pytest.approx([a - 0.25, a + 0.25])
    assert metrics["kl/sampler_reference_k1"] == pytest.approx(0.0)


def test_std_normalisation_divides_each_group_by_its_std():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 3, "trainer.group_size": 4,
                                    "trainer.advantage.std_normalize": "true"})
    trajectories, sampled, _ = loop.collect()
    loop.train(trajectories, sampled)
    expected = []
    for t, a in zip(trajectories, _group_advantages(trajectories)):
        group = torch.tensor([u.reward for u in trajectories if u.group == t.group], dtype=torch.float64)
        if t.tokens and a != 0:
            expected.append(a / (float(group.std()) + 1e-6))
    got = sorted(float(d.loss_fn_inputs["advantages"]) for d in learner.calls[0][1])
    assert got == pytest.approx(sorted(expected), rel=1e-5) and len(got) > 0


def test_overlong_shaping_penalises_rewards_before_advantages():
    # every sampled reply is 2 tokens; with max_new_tokens 3 and a 2-token window, a 2-token reply
    # sits 1 token into the window: penalty (3 - 2 - 2) / 2 = -0.5
    loop, _, _ = make_loop(**{"trainer.prompts_per_step": 2, "trainer.group_size": 4,
                              "generator.sampling.max_new_tokens": 3, "trainer.advantage.overlong_cache_tokens": 2})
    plain, _, _ = make_loop(**{"trainer.prompts_per_step": 2, "trainer.group_size": 4,
                               "generator.sampling.max_new_tokens": 3})
    shaped, _, metrics = loop.collect()
    unshaped, _, _ = plain.collect()
    for s, u in zip(shaped, unshaped):
        penalty = -0.5 if u.tokens else 0.0
        assert s.reward == pytest.approx(u.reward + penalty) and s.info["overlong_penalty"] == penalty
    assert metrics["count/overlong_penalised"] == sum(1 for u in unshaped if u.tokens)


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
