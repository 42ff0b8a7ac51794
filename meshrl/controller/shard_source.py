"""Rollouts from the store (`diloco.role: learn`): the learner trains on the groups that generation
jobs (`diloco.role: generate`, meshrl.diloco.shards) wrote, instead of sampling them itself.

Shards are taken in (index, producer) order, so every job's k-th shard comes before any job's
(k+1)-th and no generation job starves another; within a shard, groups in the order written. The
position, ``{producer: [shard index, groups of it already used]}``, lives in the producer's
checkpointed state, so a resumed learner continues with the next unused group. Token ids, sampler
logprobs and masks come back exactly as sampled (never re-tokenised). A group sampled with weights
more than `max_rounds_behind` DiLoCo rounds older than the learner's is dropped, logged and counted;
a bad shard (checksum, decoding, a malformed record) is skipped with a log line and counted. No
new group within `shard_wait_s` is a one-line error, never a hang.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from meshrl.config.diloco import DiLoCoConfig
from meshrl.diloco.shards import Shard, ShardReader
from meshrl.diloco.store import CorruptObject, ObjectStore
from meshrl.replay.pairs import PreferenceItem, item_from_record
from meshrl.training.trajectories import Trajectory

log = logging.getLogger(__name__)


class ShardsTimeout(RuntimeError):
    """No new rollout shard arrived within `diloco.shard_wait_s`."""


def trajectory_from_record(record: dict, producer: str, version: int = 0) -> Trajectory:
    """A shard record (meshrl.diloco.shards.rollout_record) as a Trajectory stamped with the
    learner's ``version`` (its staleness is counted in DiLoCo rounds); the sampler's version and
    the producer go into ``info``. KeyError/TypeError/ValueError on a malformed record."""
    tokens, logprobs, mask = list(record["tokens"]), [float(x) for x in record["logprobs"]], list(record["mask"])
    if not len(tokens) == len(logprobs) == len(mask):
        raise ValueError(f"record {record.get('id')}: tokens, logprobs and mask differ in length")
    info = dict(record.get("info") or {})
    info.update(sampler_version=int(record["version"]), producer=producer)
    return Trajectory(id=f"{producer}/{record['id']}", group=int(record["group"]), problem=None,
                      prompt_tokens=[int(t) for t in record["prompt_tokens"]], tokens=[int(t) for t in tokens],
                      logprobs=logprobs, mask=[int(m) for m in mask], version=version,
                      finish_reason=str(record.get("finish_reason") or ""), reward=float(record["reward"]), info=info)


@dataclass
class ParsedShard:
    groups: list[tuple[int, list[Trajectory]]]
    """(sampling round: its oldest sample's, trajectories) per group, in the order written."""
    pairs: list[PreferenceItem]
    """The teacher preference pairs written with the groups."""


def _parse(shard: Shard) -> ParsedShard:
    groups: dict[int, list[Trajectory]] = {}
    rounds: dict[int, int] = {}
    pairs = []
    for record in shard.records:
        if record.get("kind") == "preference":
            pairs.append(item_from_record(record, f"{shard.producer}/"))
            continue
        t = trajectory_from_record(record, shard.producer)
        groups.setdefault(t.group, []).append(t)
        round_ = int(record.get("diloco_round", 0))
        rounds[t.group] = min(rounds[t.group], round_) if t.group in rounds else round_
    return ParsedShard([(rounds[g], members) for g, members in groups.items()], pairs)


class ShardSource:
    def __init__(self, cfg: DiLoCoConfig, store: ObjectStore | None = None):
        self.cfg = cfg
        self.reader = ShardReader(store or ObjectStore(cfg.store_url, cfg.storage_options, cfg.op_timeout_s),
                                  cfg.run_id)
        self._cache: tuple[tuple[str, int], ParsedShard] | None = None  # the shard being used up, parsed

    @property
    def rejected(self) -> int:
        """Shards skipped because they were bad."""
        return self.reader.rejected

    def _parsed(self, producer: str, index: int) -> ParsedShard | None:
        """Shard (producer, index) parsed; None (logged, counted) if it is bad."""
        if self._cache is not None and self._cache[0] == (producer, index):
            return self._cache[1]
        try:
            shard = self.reader.read(producer, index)
            parsed = _parse(shard)
        except CorruptObject as e:
            self.reader.skip(e)
            return None
        except (KeyError, TypeError, ValueError) as e:
            self.reader.skip(CorruptObject(f"shard {producer}.{index:08d}: malformed record ({type(e).__name__}: {e})"))
            return None
        self._cache = ((producer, index), parsed)
        return parsed

    def _next(self, position: dict[str, list[int]], pairs: list[PreferenceItem]) -> tuple[str, int, ParsedShard,
                                                                                            int] | None:
        """The first shard (in (index, producer) order) with unused groups: (producer, index, the
        shard, groups of it used); None when there is none yet. A shard of pairs and no groups
        is used up at once (its pairs into ``pairs``)."""
        committed = self.reader.committed({p: idx for p, (idx, _) in position.items()})
        for producer, index in sorted(committed, key=lambda s: (s[1], s[0])):
            shard = self._parsed(producer, index)
            pos = position.get(producer)
            used = pos[1] if pos is not None and pos[0] == index else 0
            if shard is None or used >= len(shard.groups):
                if shard is not None and not shard.groups:
                    pairs += shard.pairs
                position[producer] = [index + 1, 0]
                continue
            position[producer] = [index, used]
            return producer, index, shard, used
        return None

    def take(self, n: int, position: dict[str, list[int]], learner_round: int,
             version: int) -> tuple[list[list[Trajectory]], list[PreferenceItem], dict]:
        """The next ``n`` fresh groups, advancing ``position``; waits for new shards up to
        `shard_wait_s` (ShardsTimeout past it). Returns the groups, the teacher pairs of every
        shard whose last group this call used (so a pair is handed out once, with the position
        past its shard), and their metrics."""
        started = time.perf_counter()
        out: list[list[Trajectory]] = []
        pairs: list[PreferenceItem] = []
        stale, shards_met = 0, set()
        last_new = time.monotonic()
        while len(out) < n:
            found = self._next(position, pairs)
            if found is None:
                if time.monotonic() - last_new > self.cfg.shard_wait_s:
                    raise ShardsTimeout(
                        f"diloco.role learn: no new rollout shard under {self.cfg.store_url}/{self.cfg.run_id}/shards "
                        f"within shard_wait_s = {self.cfg.shard_wait_s:g}s ({len(out)} of {n} groups): are the "
                        f"generation jobs (diloco.role generate) running?")
                time.sleep(self.cfg.poll_interval_s)
                continue
            last_new = time.monotonic()
            producer, index, shard, used = found
            shards_met.add((producer, index))
            for round_, group in shard.groups[used:]:
                if len(out) == n:
                    break
                position[producer][1] += 1
                if position[producer][1] == len(shard.groups):
                    pairs += shard.pairs
                if learner_round - round_ > self.cfg.max_rounds_behind:
                    stale += len(group)
                    log.warning("dropping a group of shard %s.%08d sampled at round %d for a learner at round %d "
                                "(diloco.max_rounds_behind = %d)", producer, index, round_, learner_round,
                                self.cfg.max_rounds_behind)
                    continue
                out.append([_copy(t, version) for t in group])
        return out, pairs, {"shards/groups_read": len(out), "shards/pairs_read": len(pairs), "shards/stale_dropped": stale,
                            "shards/read": len(shards_met), "shards/rejected_total": self.rejected,
                            "timing/shard_read_s": time.perf_counter() - started}


def _copy(t: Trajectory, version: int) -> Trajectory:
    """A trajectory of its own stamped ``version`` (the cached shard's objects are not handed out:
    the loop renumbers groups in place)."""
    return Trajectory(**{**vars(t), "version": version, "info": dict(t.info)})
