"""The GRPO loop. A producer thread (meshrl.controller.pipeline) rolls out tasks with the run's
rollout strategy, shapes and filters them and scores SDPO sites, ahead of the learner by at most
`max_steps_off_policy` versions. The learner side takes the step's pieces as they arrive:

  per piece     staleness check from the stamps -> group-relative advantages -> Datums ->
                (KL shaping) -> forward_backward on the registered loss (streaming minibatches)
  per substep   the step-wide normaliser on the accumulated gradients -> the SDPO and replay
                channels' terms -> one optimizer step
  per step      as one replica of a DiLoCo run (`diloco.enabled`), end a round every `inner_steps`
                steps (the learner's weights become the round's outer-updated ones); publish the
                next weight version (synchronous runs also bring every reader to it); with
                `diloco.rollout_shards`, write the step's trained trajectories as one shard

Split jobs (`diloco.role`): a generation job runs the producer only, writes each step's groups as a
shard and follows the DiLoCo run's newest outer state every `inner_steps` steps; a learner of
shards builds its units from those shards instead of sampling. The DiLoCo state and calls live in
meshrl.controller.diloco_link.

The controller only moves tokens and small records; the actors own the engines and the model, and
every mesh call goes through the MeshClient (deadlines, supervision, replicas).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from meshrl.config.run import RunConfig
from meshrl.controller.diloco_link import DiLoCoLink
from meshrl.controller.mesh_client import MeshClient
from meshrl.controller.pipeline import Producer, ProductionState, Unit, shape_and_filter
from meshrl.controller.rollout import Counters, RolloutStrategy
from meshrl.engines import SampleRequest
from meshrl.losses.aggregation import GlobalCounts, global_scale
from meshrl.training.policy import combine_metrics
from meshrl.training.trajectories import Trajectory, group_advantages, kl_shape_datums, rl_datums, uniform_groups

log = logging.getLogger(__name__)


@dataclass
class Substep:
    """What one optimizer step has accumulated so far."""

    groups: int = 0
    counts: GlobalCounts = GlobalCounts(0.0, 0)
    passes: list[dict] = field(default_factory=list)
    sdpo: list = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    stats: dict = field(default_factory=dict)


def _add(metrics: dict, more: dict) -> None:
    for k, v in more.items():
        metrics[k] = metrics.get(k, 0.0) + v


class GRPOLoop:
    """Drives the meshes through GRPO steps (synchronous at K = 0, overlapped at K >= 1)."""

    def __init__(self, cfg: RunConfig, task, strategy: RolloutStrategy, client: MeshClient, counters: Counters,
                 stop_tokens: tuple[int, ...], sdpo=None, replay=None):
        self.cfg = cfg
        self.task = task
        self.strategy = strategy
        self.client = client
        self.counters = counters
        self.stop_tokens = stop_tokens
        self.sdpo = sdpo  # channel 2 (SDPOChannel) or None
        self.replay = replay  # channel 3 (ReplayChannel) or None
        self.step_index = 0  # the step being run (1-based once running)
        self.published = 0  # the latest published weight version
        self.producer = Producer(self, cfg.trainer.steps)
        self.role = cfg.diloco.role
        self.diloco = DiLoCoLink(cfg, client)
        if cfg.trainer.max_steps_off_policy and cfg.trainer.loss.name == "importance_sampling":
            log.warning("trainer.max_steps_off_policy = %d with the unclipped importance_sampling loss: "
                        "consider ppo (stale samples destabilise plain importance sampling)",
                        cfg.trainer.max_steps_off_policy)

    @property
    def version(self) -> int:
        """The latest published weight version."""
        return self.published

    def diloco_join(self) -> None:
        """Bring the learner to the DiLoCo run's newest outer state (DiLoCoLink.join)."""
        self.diloco.join(self.published)

    @property
    def cursor(self) -> int:
        """Data position of the next task to be rolled out."""
        return self.producer.state.cursor

    def sampling_seed(self, cursor: int) -> int:
        """Seed of the round of tasks starting at data position ``cursor``: a rerun of the same step
        (e.g. after a resume) samples exactly the same tokens given the same weights."""
        return (self.cfg.generator.seed * 1_000_003 + cursor * 7919) % (2**31 - 1)

    def _request(self, seed: int | None, greedy: bool = False) -> SampleRequest:
        s = self.cfg.generator.sampling
        return SampleRequest(n=1, max_tokens=s.max_new_tokens, temperature=0.0 if greedy else s.temperature,
                             top_p=1.0 if greedy else s.top_p, stop_token_ids=self.stop_tokens, seed=seed)

    # ---- the producer's work (runs in its thread) -------------------------------------------
    @property
    def unit_size(self) -> int:
        tc = self.cfg.trainer
        return tc.prompts_per_step // (tc.num_substeps * tc.num_minibatches)

    def _sync(self, version: int) -> dict:
        """Every weight reader pulls ``version``; the generators' pull statistics."""
        t0 = time.perf_counter()
        pulls = self.client.sync_readers(version)
        metrics = {"sync/pull_s": max(p["pull_s"] for p in pulls), "sync/load_s": max(p["load_s"] for p in pulls),
                   "timing/sync_s": time.perf_counter() - t0}
        for p in pulls:  # how many generators pulled over each transport (shm, cuda_ipc, rdma)
            key = f"sync/transport/{p['transport']}"
            metrics[key] = metrics.get(key, 0) + 1
        return metrics

    def produce_unit(self, st: ProductionState, version: int) -> Unit:
        """Roll out the next `unit_size` tasks of step ``st.step`` with the latest published weights
        ``version``; updates ``st``. Tasks are sampled with the seeds of their round, so a step cut
        into pieces samples the same tokens as one piece."""
        tc, u = self.cfg.trainer, self.unit_size
        self.client.step = st.step
        if st.units == 0 and self.client.faults is not None:  # a step begins with its rollout
            self.client.faults.before_call(st.step, "*", "step_start")
        if self.diloco.source is not None:
            return self._unit_from_shards(st)
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
        unit = Unit(st.step, st.units, groups, trajectories, metrics=metrics)
        if self.sdpo is not None:
            t0 = time.perf_counter()
            unit.sdpo, counts = self.sdpo.score(trajectories, self.cfg.sdpo.max_sites_per_step - st.sdpo_sites)
            metrics.update(counts)
            metrics["timing/sdpo_s"] = time.perf_counter() - t0
            st.sdpo_sites += len(unit.sdpo)
        st.cursor += u
        st.units += 1
        st.groups += len(groups)
        if st.cursor - st.round_cursor >= tc.prompts_per_step:
            st.round_cursor = st.cursor
        return unit

    def _unit_from_shards(self, st: ProductionState) -> Unit:
        """`diloco.role: learn`: the next `unit_size` groups from the generation jobs' shards."""
        u = self.unit_size
        groups, pairs, metrics = self.diloco.take(u, st.shards, self.published)
        if self.replay is not None:  # ShardPairs: the DPO term from the generation jobs' teacher pairs
            self.replay.add(pairs)
        self.counters.stale_dropped += metrics["shards/stale_dropped"]
        for i, group in enumerate(groups):
            for t in group:
                t.group = st.units * u + i
        unit = Unit(st.step, st.units, groups, [t for g in groups for t in g], metrics=metrics)
        st.units += 1
        st.groups += len(groups)
        return unit

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
                _add(metrics, {f"staleness/{s}": 1})
            fresh.append(group)
        return fresh

    def _minibatch(self, sub: Substep, groups: list[list[Trajectory]]) -> None:
        """forward_backward on one piece of the substep with its sequence-local weights."""
        tc = self.cfg.trainer
        started = time.perf_counter()
        trajectories = [t for g in groups for t in g]
        sub.groups += len(groups)
        kl_coef = tc.advantage.kl_coef
        datums, stats = rl_datums(trajectories, group_advantages(trajectories, tc.advantage.std_normalize),
                                  tc.loss.normalize, skip_zero_advantage=kl_coef == 0)
        sub.counts += GlobalCounts(float(stats["tokens_total"]), stats["trainable_trajectories"])
        _add(sub.stats, {f"batch/{k}": v for k, v in stats.items() if k != "tokens_total"})
        if not datums:
            return
        if kl_coef > 0:
            sub.kl.append(kl_shape_datums(datums, self.client.forward(datums, reference=True), kl_coef)
                          ["kl/sampler_reference_k1"])
        loss = tc.loss
        config = ({"eps_low": loss.eps_low, "eps_high": loss.eps_high} if loss.name == "ppo"
                  else {"clip_high": loss.cispo_clip_high} if loss.name == "cispo" else {})
        sub.passes.append(self.client.forward_backward(datums, loss.name, config))
        _add(sub.stats, {"timing/train_s": time.perf_counter() - started})

    def _channel_term(self, datums: list, loss_fn: str, config: dict, prefix: str, metrics: dict) -> float:
        """Train a channel's Datums (their weights carry the channel's weight); the weighted loss."""
        if not datums:
            return 0.0
        fb = self.client.forward_backward(datums, loss_fn, config)
        _add(metrics, {f"{prefix}/{k}": v for k, v in fb.items() if k != "loss"})
        return fb["loss"]

    def _finish_substep(self, sub: Substep, metrics: dict) -> None:
        """The step-wide normaliser, the channel terms, one optimizer step."""
        tc = self.cfg.trainer
        t0 = time.perf_counter()
        scale = global_scale(tc.loss.normalize, sub.counts)
        grpo = 0.0
        if sub.passes:
            self.client.scale_grads(scale)
            combined = combine_metrics([(p["tokens"], p) for p in sub.passes])
            combined["loss"] *= scale
            grpo = combined["loss"]
            _add(metrics, {f"train/{k}": v / tc.num_substeps for k, v in combined.items()})
        terms = {"loss/grpo": grpo}
        if sub.kl:
            terms["kl/sampler_reference_k1"] = sum(sub.kl) / len(sub.kl)
        if self.sdpo is not None:
            weighted = self._channel_term(self.sdpo.weighted(sub.sdpo), "sdpo_jsd", self.sdpo.loss_config(), "sdpo",
                                          metrics)
            terms["loss/sdpo_jsd"] = weighted / self.cfg.sdpo.alpha
            grpo += weighted
        if self.replay is not None:
            dpo_datums, counts = self.replay.datums(self.published)
            metrics.update(counts)
            weighted = self._channel_term(dpo_datums, "dpo", {"beta": self.cfg.replay.dpo_beta}, "dpo", metrics)
            terms["loss/replay_dpo"] = weighted / self.cfg.replay.beta
            grpo += weighted
        terms["loss/total"] = grpo
        _add(metrics, {k: v / tc.num_substeps for k, v in terms.items()})
        opt = self.client.optim_step(self.cfg.learner.adam_params())
        metrics.update({f"train/{k}": v for k, v in opt.items()})
        _add(metrics, {"batch/groups": sub.groups, "batch/tokens_total": sub.counts.num_tokens,
                       "timing/train_s": time.perf_counter() - t0})
        _add(metrics, sub.stats)  # the pieces' datum counts and forward_backward time

    def _publish(self, version: int, metrics: dict) -> None:
        t0 = time.perf_counter()
        pub = self.client.publish(version)
        self.diloco.published(version)
        self.published = version
        metrics.update({"version": version, "sync/bytes": pub["bytes"], "sync/publish_s": pub["publish_s"],
                        "timing/publish_s": time.perf_counter() - t0})
        if self.cfg.trainer.max_steps_off_policy == 0:  # synchronous: readers follow at once
            metrics.update(self._sync(version))
            metrics["sync/pull_gbps"] = pub["bytes"] / max(metrics["sync/pull_s"], 1e-9) / 1e9
        self.producer.publish(version)

    def step(self) -> tuple[dict, list[Trajectory]]:
        """One training step; returns its metrics and the trajectories trained on."""
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        self.step_index += 1
        t = self.step_index
        self.client.step = t
        if self.client.faults is not None:
            self.client.faults.before_call(t, "*", "step_start")
        self.producer.start()
        metrics: dict[str, Any] = {"timing/learner_idle_s": 0.0}
        per_substep = tc.prompts_per_step // tc.num_substeps
        sub, pending, trained, sampled, index, updates = Substep(), [], [], [], 0, 0
        while True:
            waited = time.perf_counter()
            unit = self.producer.feed.take(t, index, self.producer.alive)
            metrics["timing/learner_idle_s"] += time.perf_counter() - waited
            if unit is None:
                break
            index += 1
            _add(metrics, {k: v for k, v in unit.metrics.items() if not k.startswith(("sdpo/", "sync/"))})
            metrics.update({k: v for k, v in unit.metrics.items() if k.startswith(("sdpo/", "sync/"))})
            sampled += unit.sampled
            if self.replay is not None and unit.sampled and self.role != "learn":
                self.replay.submit(unit.sampled, min(s.version for s in unit.sampled))
            if self.role == "generate":  # a generation job writes its groups and trains nothing
                trained += unit.groups
                continue
            pending += self._fresh(unit.groups, t, metrics)
            sub.sdpo += unit.sdpo
            while len(pending) >= self.unit_size:
                piece, pending = pending[: self.unit_size], pending[self.unit_size :]
                trained += piece
                self._minibatch(sub, piece)
                if sub.groups >= per_substep:
                    self._finish_substep(sub, metrics)
                    sub, updates = Substep(), updates + 1
        if self.role == "generate":
            self.producer.feed.release(t)
            return self._end_generation_step(t, trained, sampled, metrics, t0)
        if pending:
            trained += pending
            self._minibatch(sub, pending)
        if sub.groups or sub.sdpo or updates == 0:  # every step makes at least one optimizer update
            self._finish_substep(sub, metrics)
        self.producer.feed.release(t)
        metrics["batch/sampling_rounds"] = rounds = -(-index // (tc.num_substeps * tc.num_minibatches))
        if tc.advantage.drop_uniform_groups and len(trained) < tc.prompts_per_step:
            log.warning("dynamic sampling: %d of %d groups informative after %d rounds "
                        "(trainer.advantage.max_extra_rounds = %d); step %d trains on those",
                        len(trained), tc.prompts_per_step, rounds, tc.advantage.max_extra_rounds, t)
        if self.diloco.due(t):  # before publishing: version t carries the outer-updated weights
            self.diloco.sync(metrics)
        self._publish(t, metrics)
        trajectories = [x for g in trained for x in g]
        if self.diloco.shards is not None:
            self.diloco.write_shard(t, trajectories, self.published, metrics)
        self._step_metrics(metrics, trajectories, sampled)
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics, trajectories

    def _end_generation_step(self, t: int, groups: list[list[Trajectory]], sampled: list[Trajectory],
                             metrics: dict, t0: float) -> tuple[dict, list[Trajectory]]:
        """A generation job's step: its groups as one shard, then (every `inner_steps` steps, under
        `diloco.enabled`) the run's newest outer state, published to the generators if it is new;
        the producer may then start the next step (admission counts written steps here)."""
        trajectories = [x for g in groups for x in g]
        pairs = []
        if self.replay is not None:  # the teachers' pairs that arrived go into the shard
            metrics.update(self.replay.drain(self.published))
            pairs = self.replay.take(len(self.replay.buffer))
        self.diloco.write_shard(t, trajectories, self.published, metrics, pairs)
        if self.diloco.follow(t, self.published, metrics):
            self._publish(t, metrics)
        self.producer.publish(t)
        self._step_metrics(metrics, trajectories, sampled)
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics, trajectories

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
        """Greedy success rate (accuracy) on the held-out tasks, with the latest published weights."""
        t0 = time.perf_counter()
        with self.producer.paused():
            self.client.step = self.step_index
            if self.client.version < self.published:
                self._sync(self.published)
            held = self.task.heldout(self.cfg.trainer.eval.size)
            trajectories, _ = self.strategy.collect(held, 1, self._request(None, greedy=True), f"eval{self.version}")
        n = max(len(trajectories), 1)
        return {"eval/accuracy": sum(bool(t.info.get("correct")) for t in trajectories) / n,
                "eval/reward_mean": sum(t.reward for t in trajectories) / n,
                "eval/n": len(trajectories), "timing/eval_s": time.perf_counter() - t0}

    # ---- state --------------------------------------------------------------------------------
    def stop_producer(self) -> None:
        self.producer.stop()

    def state_dict(self) -> dict:
        """Training state for checkpoints: step, version, counters, channel state and the producer's
        position and every rolled-out unit not yet trained (taken between units)."""
        with self.producer.paused():
            state = {"version": self.published, "step_index": self.step_index,
                     "counters": dataclasses.asdict(self.counters), "producer": self.producer.state_dict(),
                     "version_rounds": self.diloco.state_dict()}
        if self.sdpo is not None:
            state["sdpo"] = self.sdpo.state_dict()
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore (the producer is stopped first and starts again with the next step)."""
        self.producer.stop()
        self.published = int(state["version"])
        self.step_index = int(state["step_index"])
        self.diloco.load_state_dict(state.get("version_rounds"), self.published)
        for k, v in state["counters"].items():
            setattr(self.counters, k, v)
        if "producer" in state:
            self.producer.load_state_dict(state["producer"])
        else:
            self.producer = Producer(self, self.cfg.trainer.steps)
        self.producer.publish(self.published)
        if self.sdpo is not None and "sdpo" in state:
            self.sdpo.load_state_dict(state["sdpo"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])

    def close(self) -> None:
        self.producer.stop(wait=False)
        self.diloco.close()
