"""The GRPO loop. A producer thread (meshrl.controller.pipeline) rolls out tasks with the run's
rollout strategy (or takes them from a rollout source, e.g. the shards of a DiLoCo learner),
shapes and filters them and hands every unit to the loss terms' `produce`, ahead of the learner by
at most `max_steps_off_policy` versions. The learner side takes the step's pieces as they arrive:

  per unit      every loss term's `receive` (meshrl.terms); the staleness check from the stamps
  per piece     the terms' `train_piece` (the policy-gradient term: advantages -> Datums ->
                forward_backward on its registered loss, streaming minibatches)
  per substep   every term's `finish` (the step-wide normaliser; each term's datums), one shared
                forward_backward for all the terms' datums, then one optimizer step
  per step      the step hooks' `before_publish` (a DiLoCo round ends here), publish the next
                weight version (synchronous runs also bring every reader to it), then the terms'
                `end_step` and the hooks' `after_step` (rollout shards; a generation job follows the
                run's outer state)

A loop whose terms train nothing (a DiLoCo generation job) makes no optimizer step and publishes
only when a hook says the weights changed. The loop knows no term, source or hook by name.

The controller only moves tokens and small records; the actors own the engines and the model, and
every mesh call goes through the MeshClient (deadlines, supervision, replicas).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Protocol

from meshrl.config.meshes import GENERATOR
from meshrl.config.run import RunConfig
from meshrl.controller.evaluate import eval_request, evaluate_tasks
from meshrl.controller.pipeline import Producer, ProductionState, Unit, shape_and_filter
from meshrl.controller.rollout import Counters, RolloutStrategy
from meshrl.engines import SampleRequest
from meshrl.meshes.client import MeshClient
from meshrl.terms.base import LossTerm, StepOutput, add_metrics, finish_terms
from meshrl.training.trajectories import Trajectory, uniform_groups

log = logging.getLogger(__name__)


class RolloutSource(Protocol):
    """Where units come from instead of sampling the task (a DiLoCo learner of shards)."""

    def next_unit(self, st: ProductionState, size: int, published: int) -> Unit:
        """The next ``size`` groups of step ``st.step`` (``st.source`` is the source's position,
        checkpointed with the producer); ``published`` is the learner's newest weight version."""


class StepHook(Protocol):
    """What joins a step's end beside the loss terms (a DiLoCo run's rounds and shards)."""

    def join(self, published: int) -> None:
        """At start and after every learner restore, before weight version ``published`` goes out."""

    def before_publish(self, step: int, metrics: dict) -> None:
        """A training step is about to publish its weights."""

    def published(self, version: int) -> None:
        """Weight version ``version`` was published."""

    def after_step(self, output: StepOutput, metrics: dict) -> bool:
        """The step's output; True if the learner's weights changed and must be published (a loop
        that trains publishes every step anyway)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, published: int) -> None: ...

    def close(self) -> None: ...


class GRPOLoop:
    """Drives the meshes through GRPO steps (synchronous at K = 0, overlapped at K >= 1)."""

    def __init__(self, cfg: RunConfig, task, strategy: RolloutStrategy, client: MeshClient, counters: Counters,
                 stop_tokens: tuple[int, ...], terms: list[LossTerm], source: RolloutSource | None = None,
                 hooks: tuple[StepHook, ...] = ()):
        """``terms``: the step's loss terms in order (meshrl.terms); ``source``: units come from it
        instead of sampling ``task``; ``hooks``: see `StepHook`."""
        self.cfg = cfg
        self.task = task
        self.strategy = strategy
        self.client = client
        self.counters = counters
        self.stop_tokens = stop_tokens
        self.terms = list(terms)
        self.source = source
        self.hooks = tuple(hooks)
        self.trains = any(term.trains for term in self.terms)
        self.step_index = 0  # the step being run (1-based once running)
        self.published = 0  # the latest published weight version
        self.sampled: list[Trajectory] = []  # everything the last step sampled (its trained groups and the rest)
        self.producer = Producer(self, cfg.trainer.steps)
        self._initial_terms = self._term_states()  # what a run started over from step 0 restores
        if cfg.trainer.max_steps_off_policy and cfg.trainer.loss.name == "importance_sampling":
            log.warning("trainer.max_steps_off_policy = %d with the unclipped importance_sampling loss: "
                        "consider ppo (stale samples destabilise plain importance sampling)",
                        cfg.trainer.max_steps_off_policy)

    @property
    def version(self) -> int:
        """The latest published weight version."""
        return self.published

    def join(self) -> None:
        """Bring the learner to the state the step hooks hold (a DiLoCo run's newest outer state)."""
        for hook in self.hooks:
            hook.join(self.published)

    @property
    def cursor(self) -> int:
        """Data position of the next task to be rolled out."""
        return self.producer.state.cursor

    def sampling_seed(self, cursor: int) -> int:
        """Seed of the round of tasks starting at data position ``cursor``: a rerun of the same step
        (e.g. after a resume) samples exactly the same tokens given the same weights."""
        return (self.cfg.generator.seed * 1_000_003 + cursor * 7919) % (2**31 - 1)

    def _request(self, seed: int | None) -> SampleRequest:
        s = self.cfg.generator.sampling
        return SampleRequest(n=1, max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                             stop_token_ids=self.stop_tokens, seed=seed)

    # ---- the producer's work (runs in its thread) -------------------------------------------
    @property
    def unit_size(self) -> int:
        tc = self.cfg.trainer
        return tc.prompts_per_step // (tc.num_substeps * tc.num_minibatches)

    def _sync(self, version: int) -> dict:
        """Every weight reader pulls ``version``; the generators' pull statistics (`sync/pulled_bytes`:
        what they received together, a tensor-parallel generator only its workers' slices) and the
        seconds each other reader mesh took (`sync/<mesh>_s`, e.g. SDPO's teacher)."""
        t0 = time.perf_counter()
        by_mesh = self.client.sync_readers(version)
        pulls = by_mesh[GENERATOR]
        metrics = {"sync/pull_s": max(p["pull_s"] for p in pulls), "sync/load_s": max(p["load_s"] for p in pulls),
                   "sync/pulled_bytes": sum(p["bytes"] for p in pulls), "timing/sync_s": time.perf_counter() - t0}
        for p in pulls:  # how many generators pulled over each transport (shm, cuda_ipc, rdma)
            key = f"sync/transport/{p['transport']}"
            metrics[key] = metrics.get(key, 0) + 1
        metrics.update({f"sync/{mesh}_s": max(p["mesh_s"] for p in ps) for mesh, ps in by_mesh.items()
                        if mesh != GENERATOR and ps})
        return metrics

    def produce_unit(self, st: ProductionState, version: int) -> Unit:
        """The next unit of step ``st.step`` (its rollouts with the latest published weights
        ``version``, or the rollout source's), handed to every term's `produce`; updates ``st``."""
        self.client.step = st.step
        if st.units == 0 and self.client.faults is not None:  # a step begins with its rollout
            self.client.faults.before_call(st.step, "*", "step_start")
        if self.source is not None:
            unit = self.source.next_unit(st, self.unit_size, self.published)
        else:
            unit = self._sample_unit(st, version)
        for term in self.terms:
            term.produce(unit, st)
        st.units += 1
        st.groups += len(unit.groups)
        return unit

    def _sample_unit(self, st: ProductionState, version: int) -> Unit:
        """Roll out the next `unit_size` tasks with the latest published weights ``version``.
        Tasks are sampled with the seeds of their round, so a step cut into pieces samples the same
        tokens as one piece."""
        tc, u = self.cfg.trainer, self.unit_size
        metrics: dict[str, Any] = {}
        # the newest weights published (a generation job admits steps without publishing weights)
        version = min(version, self.published)
        if self.client.version < version:
            metrics.update(self._sync(version))
        tasks = self.task.train_batch(st.cursor, u)
        seed = self.sampling_seed(st.round_cursor) + (st.cursor - st.round_cursor)
        trajectories, timing = self.strategy.collect(tasks, tc.group_size, self._request(seed), f"train{st.cursor}")
        metrics.update(timing)
        for t in trajectories:
            t.group += st.units * u
        groups = shape_and_filter(trajectories, self.cfg, metrics)
        room = tc.prompts_per_step - st.groups
        if len(groups) > room:
            metrics["batch/surplus_groups"] = len(groups) - room
            groups = groups[:room]
        st.cursor += u
        if st.cursor - st.round_cursor >= tc.prompts_per_step:
            st.round_cursor = st.cursor
        return Unit(st.step, st.units, groups, trajectories, metrics=metrics)

    def step_complete(self, st: ProductionState) -> bool:
        """A step is complete with `prompts_per_step` groups, or after its rounds are spent (one
        round, plus `max_extra_rounds` under dynamic sampling)."""
        tc = self.cfg.trainer
        rounds = 1 + (tc.advantage.max_extra_rounds if tc.advantage.drop_uniform_groups else 0)
        return st.groups >= tc.prompts_per_step or st.units >= rounds * tc.num_substeps * tc.num_minibatches

    # ---- the learner side -------------------------------------------------------------------
    def _fresh(self, groups: list[list[Trajectory]], step: int, metrics: dict) -> list[list[Trajectory]]:
        """Groups whose every sample is at most K versions older than the policy being updated
        (step - 1); others are dropped and counted. Records the staleness histogram."""
        k = self.cfg.trainer.max_steps_off_policy
        fresh = []
        for group in groups:
            staleness = [step - 1 - t.version for t in group]
            if max(staleness) > k:
                self.counters.stale_dropped += len(group)
                log.warning("dropping a group sampled at version %d for step %d (max_steps_off_policy = %d)",
                            min(t.version for t in group), step, k)
                continue
            for s in staleness:
                add_metrics(metrics, {f"staleness/{s}": 1})
            fresh.append(group)
        return fresh

    def _optimizer_step(self, groups: int, metrics: dict) -> None:
        """Every term's `finish` (the policy-gradient term first: its normaliser scales only its
        own streamed gradients) and one shared pass over the parts they hand over, then one
        optimizer step."""
        tc = self.cfg.trainer
        t0 = time.perf_counter()
        weighted = finish_terms(self.terms, self.published, metrics, self.client)
        weights = {term.name: term.weight for term in self.terms}
        losses = {f"loss/{name}": loss / weights[name] if weights[name] else 0.0 for name, loss in weighted.items()}
        losses["loss/total"] = sum(weighted.values())
        add_metrics(metrics, {k: v / tc.num_substeps for k, v in losses.items()})
        opt = self.client.optim_step(self.cfg.learner.adam_params())
        metrics.update({f"train/{k}": v for k, v in opt.items()})
        add_metrics(metrics, {"batch/groups": groups, "timing/train_s": time.perf_counter() - t0})

    def _train_piece(self, piece: list[list[Trajectory]]) -> None:
        for term in self.terms:
            term.train_piece(piece)

    def _publish(self, version: int, metrics: dict) -> None:
        t0 = time.perf_counter()
        pub = self.client.publish(version)
        for hook in self.hooks:
            hook.published(version)
        self.published = version
        metrics.update({"version": version, "sync/bytes": pub["bytes"], "sync/publish_s": pub["publish_s"],
                        "timing/publish_s": time.perf_counter() - t0})
        if self.cfg.trainer.max_steps_off_policy == 0:  # synchronous: readers follow at once
            metrics.update(self._sync(version))
            metrics["sync/pull_gbps"] = pub["bytes"] / max(metrics["sync/pull_s"], 1e-9) / 1e9
        self.producer.publish(version)

    def step(self) -> tuple[dict, list[Trajectory]]:
        """One training step; returns its metrics and the trajectories trained on (a loop that
        trains nothing: every group it kept)."""
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        self.step_index += 1
        t = self.step_index
        self.client.step = t
        if self.client.faults is not None:
            self.client.faults.before_call(t, "*", "step_start")
        self.producer.start()
        for term in self.terms:
            term.start_step(t)
        metrics: dict[str, Any] = {"timing/learner_idle_s": 0.0}
        per_substep = tc.prompts_per_step // tc.num_substeps
        pending, trained, sampled, index, updates, substep_groups = [], [], [], 0, 0, 0
        while True:
            waited = time.perf_counter()
            unit = self.producer.feed.take(t, index, self.producer.alive)
            metrics["timing/learner_idle_s"] += time.perf_counter() - waited
            if unit is None:
                break
            index += 1
            add_metrics(metrics, {k: v for k, v in unit.metrics.items() if not k.startswith(("sdpo/", "sync/"))})
            metrics.update({k: v for k, v in unit.metrics.items() if k.startswith(("sdpo/", "sync/"))})
            sampled += unit.sampled
            for term in self.terms:
                term.receive(unit)
            if not self.trains:  # the step's groups are its output, untrained
                trained += unit.groups
                continue
            pending += self._fresh(unit.groups, t, metrics)
            while len(pending) >= self.unit_size:
                piece, pending = pending[: self.unit_size], pending[self.unit_size :]
                trained += piece
                self._train_piece(piece)
                substep_groups += len(piece)
                if substep_groups >= per_substep:
                    self._optimizer_step(substep_groups, metrics)
                    substep_groups, updates = 0, updates + 1
        if self.trains:
            if pending:
                trained += pending
                self._train_piece(pending)
                substep_groups += len(pending)
            # every step makes at least one optimizer update
            if substep_groups or any(term.pending() for term in self.terms) or updates == 0:
                self._optimizer_step(substep_groups, metrics)
        self.producer.feed.release(t)
        if self.trains:
            metrics["batch/sampling_rounds"] = rounds = -(-index // (tc.num_substeps * tc.num_minibatches))
            if tc.advantage.drop_uniform_groups and len(trained) < tc.prompts_per_step:
                log.warning("dynamic sampling: %d of %d groups informative after %d rounds "
                            "(trainer.advantage.max_extra_rounds = %d); step %d trains on those",
                            len(trained), tc.prompts_per_step, rounds, tc.advantage.max_extra_rounds, t)
            for hook in self.hooks:  # before publishing: version t carries e.g. DiLoCo's outer-updated weights
                hook.before_publish(t, metrics)
            self._publish(t, metrics)
        output = StepOutput(t, self.published, [x for g in trained for x in g])
        for term in self.terms:
            term.end_step(output, metrics)
        changed = [hook.after_step(output, metrics) for hook in self.hooks]
        if not self.trains:
            if any(changed):
                self._publish(t, metrics)
            self.producer.publish(t)  # admission counts the steps written
        self._step_metrics(metrics, output.trajectories, sampled)
        self.sampled = sampled
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics, output.trajectories

    def _step_metrics(self, metrics: dict, trajectories: list[Trajectory], sampled: list[Trajectory]) -> None:
        n = max(len(sampled), 1)
        rewards = [t.reward for t in sampled]
        metrics.setdefault("batch/datums", 0)  # a step with no signal trains no policy-gradient datum
        mean = sum(rewards) / n
        gen_tokens = sum(t.sampled_tokens for t in sampled)
        metrics.update({
            "reward/mean": mean,
            "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(bool(t.info.get("correct")) for t in sampled) / n,
            "gen/tokens": gen_tokens,
            "gen/mean_length": gen_tokens / n,
            "gen/stopped_fraction": sum(t.finish_reason == "stop" for t in sampled) / n,
            "batch/uniform_groups": len(uniform_groups(sampled)),
            "batch/trajectories": len(trajectories),
            "batch/missing_groups": self.cfg.trainer.prompts_per_step - metrics.get("batch/groups", 0),
        })
        if "timing/generate_s" in metrics:  # not in a learner of shards: it samples nothing
            metrics["gen/tokens_per_s"] = gen_tokens / max(metrics["timing/generate_s"], 1e-9)
        served = [v for k, v in metrics.items() if k.startswith("gen/prompts/replica")]
        if served:  # 1/N when the generator replicas shared the step's prompts evenly
            metrics["gen/replica_max_share"] = max(served) / sum(served)
        metrics.update(self.counters.as_metrics())
        metrics.update(self.client.sup.metrics())

    def evaluate(self) -> dict:
        """Greedy success rate (accuracy) on the held-out tasks, with the latest published weights
        (meshrl.controller.evaluate: the evaluation `meshrl eval` makes too)."""
        t0 = time.perf_counter()
        with self.producer.paused():
            self.client.step = self.step_index
            if self.client.version < self.published:
                self._sync(self.published)
            held = self.task.heldout(self.cfg.trainer.eval.size)
            metrics, _ = evaluate_tasks(self.strategy, held, eval_request(self.cfg.generator.sampling, self.stop_tokens),
                                        f"eval{self.version}")
        return {**metrics, "timing/eval_s": time.perf_counter() - t0}

    # ---- state --------------------------------------------------------------------------------
    def stop_producer(self) -> None:
        self.producer.stop()

    def state_dict(self) -> dict:
        """Training state for checkpoints: step, version, counters, the producer's position and every
        rolled-out unit not yet trained (taken between units), the terms' and hooks' state."""
        with self.producer.paused():
            state = {"version": self.published, "step_index": self.step_index,
                     "counters": dataclasses.asdict(self.counters), "producer": self.producer.state_dict(),
                     "hooks": [hook.state_dict() for hook in self.hooks]}
        state["terms"] = self._term_states()
        return state

    def _term_states(self) -> dict:
        terms = {term.name: term.state_dict() for term in self.terms}
        return {name: value for name, value in terms.items() if value is not None}

    def start_over_state(self) -> dict:
        """What a run started over from step 0 loads (its learner was lost before the first
        checkpoint): version 0 and every term as it was built (e.g. the replay inbox's dedupe
        horizon back at the start, so the rerun steps' teacher results are not dropped as stale or
        duplicate); the run's counters carry on."""
        return {"version": 0, "step_index": 0, "counters": dataclasses.asdict(self.counters),
                "terms": self._initial_terms}

    def load_state_dict(self, state: dict) -> None:
        """Restore (the producer is stopped first and starts again with the next step)."""
        self.producer.stop()
        self.published = int(state["version"])
        self.step_index = int(state["step_index"])
        for hook, hook_state in zip(self.hooks, state.get("hooks") or [None] * len(self.hooks)):
            hook.load_state_dict(hook_state, self.published)
        for k, v in state["counters"].items():
            setattr(self.counters, k, v)
        if "producer" in state:
            self.producer.load_state_dict(state["producer"])
        else:
            self.producer = Producer(self, self.cfg.trainer.steps)
        self.producer.publish(self.published)
        for term in self.terms:
            if term.name in state.get("terms", {}):
                term.load_state_dict(state["terms"][term.name])

    def close(self) -> None:
        """Stop the producer; close the hooks and terms the loop was given."""
        self.producer.stop(wait=False)
        for part in (*self.hooks, *self.terms):
            part.close()
