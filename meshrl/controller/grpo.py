"""The synchronous GRPO loop: tasks -> G scored rollouts each (the run's rollout strategy) ->
reward shaping -> DAPO dynamic sampling -> group-relative advantages -> Datums -> the learner's
registered losses (channel 1, and the SDPO and replay channels when enabled) -> one optimizer
step -> publish -> every weight reader pulls.

The controller only moves tokens and small records; the actors own the engines and the model, and
every mesh call goes through the MeshClient (deadlines, supervision, replicas).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from meshrl.advantages import DynamicSamplingBatch
from meshrl.config.run import RunConfig
from meshrl.controller.mesh_client import MeshClient
from meshrl.controller.rollout import Counters, RolloutStrategy
from meshrl.engines import SampleRequest
from meshrl.training.trajectories import (Trajectory, group_advantages, groups_of, kl_shape_datums, rl_datums,
                                          shape_overlong, uniform_groups)

log = logging.getLogger(__name__)


class GRPOLoop:
    """Drives the meshes through synchronous GRPO steps."""

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
        self.cursor = 0
        self.step_index = 0  # the step being run (1-based once running)

    @property
    def version(self) -> int:
        """The latest weight version published and pulled by every reader."""
        return self.client.version

    def sampling_seed(self, cursor: int) -> int:
        """Seed of the batch starting at data position ``cursor``: a rerun of the same step (e.g.
        after a resume) samples exactly the same tokens given the same weights."""
        return (self.cfg.generator.seed * 1_000_003 + cursor * 7919) % (2**31 - 1)

    def _request(self, seed: int | None, greedy: bool = False) -> SampleRequest:
        s = self.cfg.generator.sampling
        return SampleRequest(n=1, max_tokens=s.max_new_tokens, temperature=0.0 if greedy else s.temperature,
                             top_p=1.0 if greedy else s.top_p, stop_token_ids=self.stop_tokens, seed=seed)

    # ---- stages -----------------------------------------------------------------------------
    def _round(self, offset: int) -> tuple[list[Trajectory], dict]:
        """One batch of `prompts_per_step` tasks from the stream, rolled out, scored and shaped;
        group ids start at ``offset``."""
        tc = self.cfg.trainer
        cursor = self.cursor
        tasks = self.task.train_batch(cursor, tc.prompts_per_step)
        self.cursor += tc.prompts_per_step
        trajectories, timing = self.strategy.collect(tasks, tc.group_size, self._request(self.sampling_seed(cursor)),
                                                     f"train{cursor}")
        for t in trajectories:
            t.group += offset
        if tc.advantage.overlong_cache_tokens:
            timing["count/overlong_penalised"] = shape_overlong(
                trajectories, self.cfg.generator.sampling.max_new_tokens, tc.advantage.overlong_cache_tokens)
        return trajectories, timing

    def collect(self) -> tuple[list[Trajectory], list[Trajectory], dict]:
        """The step's trajectories to train on, every trajectory sampled in the step, and metrics.

        With `drop_uniform_groups` (DAPO dynamic sampling), groups whose rewards are all equal are
        dropped and up to `max_extra_rounds` further batches are rolled out until
        `prompts_per_step` informative groups are in (extra ones beyond that are counted, unused)."""
        adv = self.cfg.trainer.advantage
        sampled, metrics, offset = [], {}, 0
        batch = DynamicSamplingBatch(self.cfg.trainer.prompts_per_step, max_rounds=1 + adv.max_extra_rounds)
        while True:
            trajectories, timing = self._round(offset)
            offset += self.cfg.trainer.prompts_per_step
            sampled += trajectories
            for k, v in timing.items():
                metrics[k] = metrics.get(k, 0.0) + v
            if not adv.drop_uniform_groups:
                return sampled, sampled, metrics
            groups = [[trajectories[i] for i in members] for members in groups_of(trajectories).values()]
            batch.add(groups, [[t.reward for t in g] for g in groups])
            if batch.is_full or batch.out_of_rounds:
                break
        if not batch.is_full:
            log.warning("dynamic sampling: %d of %d groups informative after %d rounds "
                        "(trainer.advantage.max_extra_rounds = %d); training on those",
                        len(batch.groups), batch.target_groups, batch.rounds, adv.max_extra_rounds)
        metrics.update({"batch/sampling_rounds": batch.rounds, "batch/dropped_uniform_groups": batch.dropped,
                        "batch/surplus_groups": batch.surplus,
                        "batch/missing_groups": batch.target_groups - len(batch.groups)})
        return [t for g in batch.groups for t in g], sampled, metrics

    def _loss_config(self) -> dict:
        loss = self.cfg.trainer.loss
        if loss.name == "ppo":
            return {"eps_low": loss.eps_low, "eps_high": loss.eps_high}
        if loss.name == "cispo":
            return {"clip_high": loss.cispo_clip_high}
        return {}

    def _channel_term(self, datums: list, loss_fn: str, config: dict, weight: float, prefix: str,
                      metrics: dict) -> float:
        """Train a channel's Datums (their weights carry ``weight``); returns the weighted loss and
        logs the unweighted term."""
        if not datums:
            return 0.0
        fb = self.client.forward_backward(datums, loss_fn, config)
        metrics.update({f"{prefix}/{k}": v for k, v in fb.items() if k != "loss"})
        return fb["loss"]

    def train(self, trajectories: list[Trajectory], sampled: list[Trajectory]) -> dict:
        """One optimizer step: channel 1 on ``trajectories`` (ppo / importance sampling / cispo),
        the enabled channels on everything ``sampled``; loss/total = grpo + alpha*jsd + beta*dpo."""
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        kl_coef = tc.advantage.kl_coef
        advantages = group_advantages(trajectories, tc.advantage.std_normalize)
        datums, stats = rl_datums(trajectories, advantages, tc.loss.normalize, skip_zero_advantage=kl_coef == 0)
        metrics: dict[str, Any] = {f"batch/{k}": v for k, v in stats.items()}
        if kl_coef > 0 and datums:
            metrics.update(kl_shape_datums(datums, self.client.forward(datums, reference=True), kl_coef))
        grpo_loss = 0.0
        if datums:
            fb = self.client.forward_backward(datums, tc.loss.name, self._loss_config())
            metrics.update({f"train/{k}": v for k, v in fb.items()})
            grpo_loss = fb["loss"]
        metrics["loss/grpo"] = total = grpo_loss
        if self.sdpo is not None:
            sdpo_datums, counts = self.sdpo.datums(sampled)
            metrics.update(counts)
            weighted = self._channel_term(sdpo_datums, "sdpo_jsd", self.sdpo.loss_config(), self.cfg.sdpo.alpha,
                                          "sdpo", metrics)
            metrics["loss/sdpo_jsd"] = weighted / self.cfg.sdpo.alpha
            total += weighted
        if self.replay is not None:
            dpo_datums, counts = self.replay.datums(self.version)
            metrics.update(counts)
            weighted = self._channel_term(dpo_datums, "dpo", {"beta": self.cfg.replay.dpo_beta}, self.cfg.replay.beta,
                                          "dpo", metrics)
            metrics["loss/replay_dpo"] = weighted / self.cfg.replay.beta
            total += weighted
        metrics["loss/total"] = total
        opt = self.client.optim_step(self.cfg.learner.adam_params())
        metrics.update({f"train/{k}": v for k, v in opt.items()})
        metrics["timing/train_s"] = time.perf_counter() - t0
        return metrics

    def sync_weights(self) -> dict:
        """Publish the learner's weights as the next version and have every reader pull them."""
        t0 = time.perf_counter()
        pub = self.client.publish(self.version + 1)
        t1 = time.perf_counter()
        pulls = self.client.sync_readers(pub["version"])
        t2 = time.perf_counter()
        pull_s = max(p["pull_s"] for p in pulls)
        return {
            "version": self.version,
            "sync/publish_s": pub["publish_s"],
            "sync/pull_s": pull_s,
            "sync/load_s": max(p["load_s"] for p in pulls),
            "sync/bytes": pub["bytes"],
            "sync/pull_gbps": pub["bytes"] / max(pull_s, 1e-9) / 1e9,
            "timing/sync_s": t2 - t0,
            "timing/publish_s": t1 - t0,
        }

    def evaluate(self) -> dict:
        """Greedy success rate (accuracy) on the held-out tasks."""
        t0 = time.perf_counter()
        held = self.task.heldout(self.cfg.trainer.eval.size)
        trajectories, _ = self.strategy.collect(held, 1, self._request(None, greedy=True), f"eval{self.version}")
        n = max(len(trajectories), 1)
        return {"eval/accuracy": sum(bool(t.info.get("correct")) for t in trajectories) / n,
                "eval/reward_mean": sum(t.reward for t in trajectories) / n,
                "eval/n": len(trajectories), "timing/eval_s": time.perf_counter() - t0}

    def step(self) -> tuple[dict, list[Trajectory]]:
        """One full synchronous GRPO step; returns its metrics and the trajectories trained on."""
        t0 = time.perf_counter()
        self.step_index += 1
        self.client.step = self.step_index
        if self.client.faults is not None:
            self.client.faults.before_call(self.step_index, "*", "step_start")
        trajectories, sampled, metrics = self.collect()
        n = max(len(sampled), 1)
        rewards = [t.reward for t in sampled]
        mean = sum(rewards) / n
        gen_tokens = sum(t.sampled_tokens for t in sampled)
        metrics.update({
            "reward/mean": mean,
            "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(bool(t.info.get("correct")) for t in sampled) / n,
            "gen/tokens": gen_tokens,
            "gen/tokens_per_s": gen_tokens / max(metrics["timing/generate_s"], 1e-9),
            "gen/mean_length": gen_tokens / n,
            "gen/stopped_fraction": sum(t.finish_reason == "stop" for t in sampled) / n,
            "batch/uniform_groups": len(uniform_groups(sampled)),
            "batch/trajectories": len(trajectories),
            "batch/groups": len({t.group for t in trajectories}),
        })
        if self.replay is not None:
            self.replay.submit(sampled, self.version)
        metrics.update(self.train(trajectories, sampled))
        metrics.update(self.sync_weights())
        metrics.update(self.counters.as_metrics())
        metrics.update(self.client.sup.metrics())
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics, trajectories

    def state_dict(self) -> dict:
        """Controller-side training state for checkpoints (JSON-able)."""
        state = {"cursor": self.cursor, "version": self.version, "step_index": self.step_index,
                 "counters": dataclasses.asdict(self.counters)}
        if self.sdpo is not None:
            state["sdpo"] = self.sdpo.state_dict()
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.client.version = int(state["version"])
        self.step_index = int(state["step_index"])
        for k, v in state["counters"].items():
            setattr(self.counters, k, v)
        if self.sdpo is not None and "sdpo" in state:
            self.sdpo.load_state_dict(state["sdpo"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])
