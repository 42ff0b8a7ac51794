"""A GRPO loop's link to a DiLoCo run (meshrl.diloco), as one of its step hooks
(meshrl.controller.grpo.StepHook): the round its learner's weights come from, the rounds of the
weight versions it published, its rollout-shard writer (`rollout_shards`, or a generation job)
and, for a learner of shards, its rollout source (`ShardRollouts`).

  train / learn    end a round every `inner_steps` steps (the learner's outer-updated weights)
  generate         write every step's groups as a shard; at the end of its round r, wait for the
                   run's round r - `max_rounds_behind`, then follow the run's newest outer state
"""

from __future__ import annotations

import logging
import time

from meshrl.config.run import RunConfig
from meshrl.controller.pipeline import ProductionState, Unit
from meshrl.controller.rollout import Counters
from meshrl.controller.shard_source import ShardSource
from meshrl.meshes.client import MeshClient
from meshrl.diloco.allreduce import DiLoCoError, ObjectStoreAllReduce
from meshrl.diloco.shards import ShardWriter, rollout_record
from meshrl.diloco.store import ObjectStore
from meshrl.replay.pairs import PreferenceItem, preference_record
from meshrl.terms.base import StepOutput
from meshrl.training.trajectories import Trajectory, group_advantages

log = logging.getLogger(__name__)


class DiLoCoFailed(RuntimeError):
    """A DiLoCo join or round failed (no quorum in time, diverged replicas, the store); the
    message is the learner's one-line cause."""


class DiLoCoLink:
    """The loop's DiLoCo state and calls; inert (round 0, no shards) without `diloco.enabled`,
    `rollout_shards` or a split role."""

    def __init__(self, cfg: RunConfig, client: MeshClient):
        self.cfg = cfg
        self.client = client
        d = cfg.diloco
        self.round = 0  # the DiLoCo round the learner's weights come from (set by join)
        self.version_round = {0: 0}  # published weight version -> the round its weights come from
        writes = d.rollout_shards or d.role == "generate"
        self.shards = (ShardWriter(ObjectStore(d.store_url, d.storage_options, d.op_timeout_s), d.run_id,
                                   f"{'gen' if d.role == 'generate' else 'replica'}{d.replica_id}", d.shard_compression)
                       if writes else None)
        self.source = ShardSource(d) if d.role == "learn" else None
        self.follows = d.role == "generate"
        if d.enabled and cfg.trainer.steps % d.inner_steps:
            log.warning("trainer.steps = %d is not a multiple of diloco.inner_steps = %d: the last %d steps end no "
                        "round, so the replicas finish with different weights", cfg.trainer.steps, d.inner_steps,
                        cfg.trainer.steps % d.inner_steps)

    def _call(self, endpoint: str, supervised: bool) -> dict:
        d = self.cfg.diloco
        # a round may wait round_timeout_s for the other replicas, then up- and download
        report = self.client.on_learners(endpoint, supervised=supervised,
                                         timeout_s=d.round_timeout_s + 4 * d.op_timeout_s)
        if "error" in report:
            raise DiLoCoFailed(f"diloco replica {d.replica_id}: {report['error']}")
        return report

    def join(self, published: int) -> None:
        """Bring the learner to the run's newest outer state and take its round (at start, before
        the first publish, and after every learner restore); its weights are those of version
        ``published`` from now on. Nothing without `diloco.enabled`. See meshrl.diloco.replica for
        what a resumed checkpoint keeps."""
        d = self.cfg.diloco
        if not d.enabled:
            return
        report = self._call("diloco_join", supervised=False)
        self.round = int(report["round"])
        self.version_round[published] = self.round
        log.info("diloco replica %d joined run %r at round %d (weights %s%s)", d.replica_id, d.run_id, self.round,
                 report["hash"], ", the checkpoint's kept" if report.get("kept_checkpoint_weights") else "")

    def rollouts(self, counters: Counters) -> ShardRollouts | None:
        """The rollout source of a learner of shards; None for a job that samples."""
        return ShardRollouts(self, counters) if self.source is not None else None

    def due(self, step: int) -> bool:
        """Whether ``step`` ends a round: round r ends at step r * `inner_steps`, so replicas that
        rejoined (or fell behind) meet the others at the same round."""
        d = self.cfg.diloco
        return d.enabled and step >= (self.round + 1) * d.inner_steps

    def before_publish(self, step: int, metrics: dict) -> None:
        """A training step ends the round when it is due: its version carries the outer-updated weights."""
        if self.due(step):
            self.sync(metrics)

    def after_step(self, output: StepOutput, metrics: dict) -> bool:
        """The step's trajectories (and a generation job's teacher pairs) as one rollout shard; a
        generation job then follows the run (True if its weights changed)."""
        if self.shards is not None:
            self.write_shard(output.step, output.trajectories, output.published, metrics, output.pairs)
        return self.follows and self.follow(output.step, output.published, metrics)

    def sync(self, metrics: dict) -> None:
        """End the round: the learner's weights become the round's outer-updated ones."""
        t0 = time.perf_counter()
        report = self._call("diloco_sync", supervised=True)
        self.round = int(report["round"])
        for k, v in report.items():
            metrics[f"diloco/{k}"] = len(v) if k == "participants" else v
        metrics["timing/diloco_s"] = time.perf_counter() - t0

    def follow(self, step: int, published: int, metrics: dict) -> bool:
        """A generation job at the end of ``step``: every `inner_steps` steps (under `enabled`) wait
        for the run to be at most `max_rounds_behind` rounds back, then take its newest outer state;
        whether the weights changed (they must then be published)."""
        d = self.cfg.diloco
        if not d.enabled or step % d.inner_steps:
            return False
        before = self.round
        t0 = time.perf_counter()
        try:
            ObjectStoreAllReduce(self.shards.store, d).wait_round(step // d.inner_steps - d.max_rounds_behind)
        except DiLoCoError as e:
            raise DiLoCoFailed(f"diloco generation job {d.replica_id}: {e} (max_rounds_behind = "
                               f"{d.max_rounds_behind})") from None
        self.join(published)
        metrics.update({"diloco/round": self.round, "diloco/followed": int(self.round != before),
                        "timing/diloco_s": time.perf_counter() - t0})
        return self.round != before

    def published(self, version: int) -> None:
        """Weight version ``version`` carries the current round's weights."""
        self.version_round[version] = self.round

    def take(self, n: int, position: dict, published: int) -> tuple[list[list[Trajectory]], list[PreferenceItem], dict]:
        """A learner of shards: the next ``n`` groups and the teacher pairs of the shards they used
        up (meshrl.controller.shard_source)."""
        return self.source.take(n, position, self.round, published)

    def write_shard(self, step: int, trajectories: list[Trajectory], published: int, metrics: dict,
                    pairs: list[PreferenceItem] = ()) -> None:
        """The step's trajectories as one rollout shard (meshrl.diloco.shards), each stamped with
        the round of the weights that sampled it, and (a generation job with the replay channel)
        the teacher preference pairs that arrived during the step."""
        t0 = time.perf_counter()
        advantages = group_advantages(trajectories, self.cfg.trainer.advantage.std_normalize)
        records = [rollout_record(t, step, a, self.version_round.get(t.version, 0))
                   for t, a in zip(trajectories, advantages)]
        records += [preference_record(item, step, diloco_round=self.round) for item in pairs]
        manifest = self.shards.write(records, step=step, published_version=published, pairs=len(pairs))
        metrics.update({"shards/index": manifest["index"], "shards/records": manifest["count"],
                        "shards/pairs_written": len(pairs), "shards/bytes": manifest["bytes"],
                        "timing/shard_write_s": time.perf_counter() - t0})

    def state_dict(self) -> list:
        return sorted(self.version_round.items())

    def load_state_dict(self, version_rounds: list | None, published: int) -> None:
        self.version_round = {int(v): int(r) for v, r in version_rounds or [(published, 0)]}

    def close(self) -> None:
        if self.shards is not None:
            self.shards.store.close()


class ShardRollouts:
    """The rollout source of a learner of shards (`diloco.role: learn`): units of groups that
    generation jobs wrote (meshrl.controller.shard_source), the teacher pairs of the shards they
    used up under ``unit.extras["pairs"]``; stale groups are dropped and counted."""

    def __init__(self, link: DiLoCoLink, counters: Counters):
        self.link, self.counters = link, counters

    def next_unit(self, st: ProductionState, size: int, published: int) -> Unit:
        groups, pairs, metrics = self.link.take(size, st.source, published)
        self.counters.stale_dropped += metrics["shards/stale_dropped"]
        for i, group in enumerate(groups):
            for t in group:
                t.group = st.units * size + i
        return Unit(st.step, st.units, groups, [t for g in groups for t in g], metrics=metrics,
                    extras={"pairs": pairs})

