"""Rollout shards in the object store: producers (RL replicas) write batches of records (JSONL,
zlib optional) that any reader (another replica, an offline learner, an audit) can list and verify.

Layout under ``<store_url>/<run_id>/shards/``::

    <producer>.<index>.json                 the manifest, written last and write-once: the commit
    <producer>.<index>.<uuid>.jsonl[.zlib]  the records, one JSON object a line

A shard is visible only once its manifest exists (count, sha256 and size of the object, producer,
index, policy version range, the producer's own fields); its object was written atomically before.
Indices count up per producer, so a cursor ``{producer: next index}`` picks up only new shards. A
reader verifies every shard (checksum, decoding, record count) and skips a bad one with one log
line, counted in ``ShardReader.rejected``.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from meshrl.diloco.store import CorruptObject, ObjectStore, sha256
from meshrl.training.records import token_record

log = logging.getLogger("meshrl.diloco")

PRODUCER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
MANIFEST = re.compile(r"^(?P<producer>[A-Za-z0-9][A-Za-z0-9_-]*)\.(?P<index>\d{8})\.json$")


def _prefix(run_id: str) -> str:
    return f"{run_id}/shards"


@dataclass
class Shard:
    producer: str
    index: int
    manifest: dict
    records: list[dict] = field(default_factory=list)


class ShardWriter:
    """Writes ``producer``'s shards under ``run_id``, numbering them on from the last committed one
    (a restarted producer continues its sequence)."""

    def __init__(self, store: ObjectStore, run_id: str, producer: str, compression: str = "zlib"):
        if not PRODUCER.match(producer):
            raise ValueError(f"shard producer {producer!r}: letters, digits, '_' and '-' only")
        if compression not in ("none", "zlib"):
            raise ValueError(f"shard compression {compression!r}: expected 'none' or 'zlib'")
        self.store, self.prefix, self.producer, self.compression = store, _prefix(run_id), producer, compression
        mine = [int(m["index"]) for n in store.list(self.prefix) if (m := MANIFEST.match(n))
                and m["producer"] == producer]
        self.next_index = max(mine, default=-1) + 1

    def write(self, records: list[dict], **meta) -> dict:
        """Commit ``records`` as the producer's next shard; ``meta`` (JSON values, e.g. ``step``)
        goes into the manifest. Returns the manifest."""
        raw = "".join(json.dumps(r, separators=(",", ":"), sort_keys=True) + "\n" for r in records).encode()
        data = zlib.compress(raw, 6) if self.compression == "zlib" else raw
        versions = [r["version"] for r in records if isinstance(r.get("version"), int)]
        while True:
            index = self.next_index
            name = f"{self.producer}.{index:08d}"
            obj = f"{self.prefix}/{name}.{uuid.uuid4().hex[:12]}.jsonl" + (".zlib" if self.compression == "zlib" else "")
            self.store.put(obj, data)
            manifest = {**meta, "producer": self.producer, "index": index, "count": len(records),
                        "object": obj.rsplit("/", 1)[-1], "sha256": sha256(data), "bytes": len(data),
                        "raw_bytes": len(raw), "compression": self.compression,
                        "policy_versions": [min(versions), max(versions)] if versions else None}
            if self.store.create_json(f"{self.prefix}/{name}.json", manifest):
                self.next_index = index + 1
                return manifest
            # another writer with this producer name committed this index first
            log.warning("shard %s was already committed by another writer named %r: trying the next index",
                        name, self.producer)
            self.store.delete(obj)
            self.next_index = index + 1


class ShardReader:
    """Lists, verifies and reads the committed shards of ``run_id``."""

    def __init__(self, store: ObjectStore, run_id: str):
        self.store, self.prefix = store, _prefix(run_id)
        self.rejected = 0
        """Shards skipped so far because their manifest or records were bad."""

    def committed(self, cursor: dict[str, int] | None = None) -> list[tuple[str, int]]:
        """(producer, index) of every committed shard, in order; with ``cursor`` only those at or
        past ``cursor[producer]``."""
        cursor = cursor or {}
        found = [(m["producer"], int(m["index"])) for n in self.store.list(self.prefix) if (m := MANIFEST.match(n))]
        return sorted(s for s in found if s[1] >= cursor.get(s[0], 0))

    def skip(self, reason: Exception) -> None:
        """A bad shard: one log line, counted in `rejected`."""
        self.rejected += 1
        log.warning("skipping %s", reason)

    def read(self, producer: str, index: int) -> Shard:
        """The shard's manifest and records, verified; CorruptObject if anything does not match."""
        name = f"{producer}.{index:08d}"
        manifest = self.store.get_json(f"{self.prefix}/{name}.json")
        if manifest is None:
            raise CorruptObject(f"shard {name}: no manifest")
        try:
            obj, want, count = str(manifest["object"]), str(manifest["sha256"]), int(manifest["count"])
            compression = manifest.get("compression", "none")
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptObject(f"shard {name}: malformed manifest ({type(e).__name__}: {e})") from None
        if manifest.get("producer") != producer or manifest.get("index") != index or not obj.startswith(name + "."):
            raise CorruptObject(f"shard {name}: the manifest names another shard")
        data = self.store.get(f"{self.prefix}/{obj}")
        if data is None:
            raise CorruptObject(f"shard {name}: records object {obj} missing")
        if sha256(data) != want:
            raise CorruptObject(f"shard {name}: checksum mismatch ({len(data)} bytes)")
        try:
            raw = zlib.decompress(data) if compression == "zlib" else data
            records = [json.loads(line) for line in raw.decode().splitlines() if line]
        except (zlib.error, UnicodeDecodeError, ValueError) as e:
            raise CorruptObject(f"shard {name}: undecodable records ({type(e).__name__})") from None
        if len(records) != count:
            raise CorruptObject(f"shard {name}: {len(records)} records, the manifest says {count}")
        return Shard(producer, index, manifest, records)

    def shards(self, cursor: dict[str, int] | None = None) -> Iterator[Shard]:
        """The committed shards (past ``cursor``, which is advanced past each shard met, bad ones
        included), verified; a bad one is skipped with a log line and counted."""
        for producer, index in self.committed(cursor):
            if cursor is not None:
                cursor[producer] = max(cursor.get(producer, 0), index + 1)
            try:
                yield self.read(producer, index)
            except CorruptObject as e:
                self.skip(e)

    def records(self, cursor: dict[str, int] | None = None) -> Iterator[dict]:
        """Every record of the good shards past ``cursor`` (advanced as in :meth:`shards`)."""
        for shard in self.shards(cursor):
            yield from shard.records


def rollout_record(trajectory, step: int, advantage: float | None = None, diloco_round: int = 0) -> dict:
    """One trajectory (meshrl.training.trajectories.Trajectory) as a shard record: its token
    record (meshrl.training.records.token_record: token ids in and out exactly as sampled, the
    sampler's logprobs, mask, reward, policy version, group, JSON-serialisable `info`), its
    group-relative advantage, the DiLoCo round of the weights that sampled it and the step."""
    return {"step": step, **token_record(trajectory), "advantage": advantage, "diloco_round": diloco_round}
