"""Fake Monarch endpoints for the GRPO loop: in-process generator, rewarder and learner "meshes"
with optional delays, used by the loop's and the dispatcher's unit tests and by the simulated-latency
mode of `benchmarks/pipeline.py`. The loop, the MeshClient, the producer and the rollout strategy run
for real; only the actors behind the endpoints are stand-ins. As with Monarch, a call returns a future
at once and each fake actor serves its calls one at a time, in order, on a thread of its own."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from meshrl.actors.rewarder import safe_grade
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.controller.rollout import Counters, SingleTurnRollout
from meshrl.controller.runtime import assemble_loop
from meshrl.engines import Completion
from meshrl.envs.arithmetic import ArithmeticTask
from meshrl.meshes.client import MeshClient
from meshrl.meshes.supervisor import Supervisor
from meshrl.terms import check_config


class Future:
    def __init__(self, value=None, hang=False):
        self.value, self.hang = value, hang

    def get(self, timeout=None):
        if self.hang:
            raise TimeoutError
        return self.value


class Reply:
    """The future of a call running on its fake actor's thread: ``get(timeout)`` raises TimeoutError
    until the call has finished, then returns its value or raises its error, as often as asked."""

    def __init__(self, future):
        self.future = future

    def get(self, timeout=None):
        return self.future.result(timeout)


class Extent:
    """A one-host mesh's shape, as Monarch describes it."""

    def __init__(self, n):
        self.labels, self.sizes = ["procs"], [n]


class ValueMesh:
    def __init__(self, values):
        self._values = values
        self.extent = Extent(len(values))

    def values(self):
        return list(self._values)

    def item(self, procs):
        return self._values[procs]


class Gathered:
    """The future of a call on every actor of a fake mesh: a ValueMesh of their replies."""

    def __init__(self, replies):
        self.replies = replies

    def get(self, timeout=None):
        return ValueMesh([r.get(timeout) for r in self.replies])


class Endpoint:
    def __init__(self, actors, name):
        self.actors, self.name = actors, name

    def call_one(self, *args, **kwargs):
        assert len(self.actors) == 1
        actor = self.actors[0]
        if "_lane" not in actor.__dict__:  # the actor's own thread: one message at a time, in order
            actor._lane = ThreadPoolExecutor(1, thread_name_prefix=type(actor).__name__)
        return Reply(actor._lane.submit(getattr(actor, self.name), *args, **kwargs))

    def call(self, *args):
        return Gathered([Endpoint([a], self.name).call_one(*args) for a in self.actors])


class Mesh:
    def __init__(self, actors):
        self.actors = actors
        self.extent = Extent(len(actors))

    def slice(self, procs):
        return Mesh([self.actors[procs]])

    def __getattr__(self, name):
        return Endpoint(self.actors, name)


class FakeGenerator:
    """Answers each prompt with G completions; the answer text is scripted per call."""

    def __init__(self, replica):
        self.replica, self.version, self.seen, self.delay = replica, 0, [], 0.0

    def generate(self, prompts, request):
        from meshrl.actors.generator import GenerationBatch

        time.sleep(self.delay)
        self.seen.append(len(prompts))
        groups = []
        for p in prompts:
            group = []
            for k in range(request.n):
                if k == 0 and len(p) % 2 == 0:
                    group.append(Completion([], [], "stop", "", {"replica": self.replica}))  # an empty generation
                    continue
                text = f"{p[-1] + k}"
                group.append(Completion([p[-1], k], [-0.5, -1.5], "stop", text,
                                        {"version": self.version, "replica": self.replica}))
            groups.append(group)
        return GenerationBatch(groups, self.version, 0.01 * len(prompts), 0, self.replica)  # 'engine' seconds: 10 ms a prompt

    def update_weights(self, version):
        self.version = version
        return {"version": version, "pull_s": 0.1, "transfer_s": 0.1, "bytes": 100, "load_s": 0.01, "transport": "shm"}


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
    def __init__(self, train_s=0.0):
        self.calls, self.train_s = [], train_s
        self.temperatures = []  # (call, the temperature it scores the datums at)

    def forward_backward(self, datums, loss_fn, loss_config, padding=False, temperature=1.0):
        self.calls.append(("fb", datums, loss_fn, loss_config))
        self.temperatures.append(("fb", temperature))
        time.sleep(self.train_s)
        return {"loss": 0.0, "tokens": float(sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums)),
                "seconds": self.train_s}

    def forward_backward_parts(self, parts, padding=False):
        """One shared pass: recorded as ("parts", [(loss name, scale)]), then each part as a forward_backward."""
        self.calls.append(("parts", [(p.loss_fn, p.scale) for p in parts]))
        return [self.forward_backward(p.datums, p.loss_fn, p.loss_fn_config, padding, p.temperature) for p in parts]

    def scale_grads(self, factor):
        self.calls.append(("scale", factor))

    def forward(self, datums, reference, padding=False, temperature=1.0):
        """Reference logprobs: -1 at every position."""
        self.calls.append(("forward", datums, reference))
        self.temperatures.append(("forward", temperature))
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

    def dead_process(self, name):
        return None  # fake actors live in this process


def make_loop(n_generators=2, rewarder=FakeRewarder, learner=None, **overrides):
    """A GRPOLoop over fake meshes; ``overrides`` are dotted config keys. Returns (loop, generator
    fakes, learner fake); set ``delay`` on a generator fake to make its generate calls slow."""
    cfg = load_config(RunConfig, None, [f"{k}={v}" for k, v in overrides.items()])
    gens = [FakeGenerator(r) for r in range(n_generators)]
    learner = learner or FakeLearner()
    meshes = FakeMeshGroup(generator=Mesh(gens), rewarder=Mesh([rewarder()]), learner=Mesh([learner]))
    client = MeshClient(meshes, Supervisor(meshes, cfg.faults), {m: 5.0 for m in ("generator", "rewarder", "learner", "sync")},
                        cfg.meshes.chunks_per_replica)
    counters = Counters()
    renderer = FakeRenderer()
    strategy = SingleTurnRollout(client, renderer, cfg.model.max_model_len, counters)
    check_config(cfg)
    loop = assemble_loop(cfg, ArithmeticTask(cfg.task.arithmetic), strategy, client, counters, renderer)
    return loop, gens, learner
