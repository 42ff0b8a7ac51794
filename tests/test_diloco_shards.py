"""Rollout shards in an object store (meshrl.diloco.shards): committed shards are read back exactly,
only once their manifest exists; a cursor yields only new shards; a bad shard is skipped, logged and
counted; a restarted producer continues its numbering. On the local filesystem and on a real S3
endpoint (moto on loopback)."""

import json
import logging
import zlib

import pytest

from meshrl.cli import main
from meshrl.diloco.shards import ShardReader, ShardWriter, rollout_record
from meshrl.diloco.store import ObjectStore
from meshrl.training.trajectories import Trajectory


def _records(step, n=3):
    return [{"step": step, "version": step - 1 + (i % 2), "tokens": [step, i, 7], "logprobs": [-0.5, -1.25, 0.0],
             "reward": i / 2} for i in range(n)]


def _check_roundtrip(store):
    a = ShardWriter(store, "run", "replica0")
    b = ShardWriter(store, "run", "replica1", compression="none")
    written = {("replica0", 0): _records(1), ("replica1", 0): _records(1, 2), ("replica0", 1): _records(2, 4)}
    m0 = a.write(written["replica0", 0], step=1)
    b.write(written["replica1", 0], step=1)
    a.write(written["replica0", 1], step=2)
    assert m0["count"] == 3 and m0["policy_versions"] == [0, 1] and m0["step"] == 1 and m0["index"] == 0
    assert m0["compression"] == "zlib" and m0["bytes"] < m0["raw_bytes"]

    reader = ShardReader(store, "run")
    cursor = {}
    got = {(s.producer, s.index): s.records for s in reader.shards(cursor)}
    assert got == written and cursor == {"replica0": 2, "replica1": 1}
    assert list(reader.shards(cursor)) == []  # nothing new
    b.write(_records(2), step=2)
    new = list(reader.shards(cursor))
    assert [(s.producer, s.index, s.manifest["step"]) for s in new] == [("replica1", 1, 2)]
    assert new[0].records == _records(2) and cursor == {"replica0": 2, "replica1": 2}
    assert len(list(reader.records())) == 3 + 2 + 4 + 3 and reader.rejected == 0
    # a producer that starts again continues its numbering
    assert ShardWriter(store, "run", "replica0").write(_records(3), step=3)["index"] == 2


def test_shards_roundtrip_cursor_and_restart_on_local_files(tmp_path):
    _check_roundtrip(ObjectStore(f"file://{tmp_path}"))


def test_shards_roundtrip_on_s3():
    from meshrl.testing.s3_server import MotoS3Server

    with MotoS3Server() as s3:
        store = ObjectStore(s3.url("store"), s3.storage_options, timeout_s=30)
        _check_roundtrip(store)
        store.close()


def test_a_bad_shard_is_skipped_logged_and_counted_and_the_cli_reports_it(tmp_path, caplog, capsys):
    store = ObjectStore(f"file://{tmp_path}")
    w = ShardWriter(store, "run", "replica0")
    for step in (1, 2, 3, 4):
        w.write(_records(step), step=step)
    shards = tmp_path / "run" / "shards"
    obj = shards / json.loads((shards / "replica0.00000001.json").read_text())["object"]
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in shard 1's records
    obj.write_bytes(bytes(data))
    (shards / "replica0.00000002.json").write_text('{"producer": "replica0", "ind')  # a truncated manifest
    # shard 3: a consistent checksum over records that are not what the manifest counts
    manifest3 = json.loads((shards / "replica0.00000003.json").read_text())
    payload = zlib.compress(b'{"a": 1}\n')
    (shards / manifest3["object"]).write_bytes(payload)
    from meshrl.diloco.store import sha256

    manifest3.update(sha256=sha256(payload), bytes=len(payload))
    (shards / "replica0.00000003.json").write_text(json.dumps(manifest3))
    # an uncommitted object (a writer that died before its manifest) is not a shard
    (shards / "replica0.00000009.deadbeef.jsonl.zlib").write_bytes(b"partial")

    reader = ShardReader(store, "run")
    cursor = {}
    with caplog.at_level(logging.WARNING, logger="meshrl.diloco"):
        good = list(reader.shards(cursor))
    assert [s.index for s in good] == [0] and good[0].records == _records(1)
    assert reader.rejected == 3 and cursor == {"replica0": 4}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all("\n" not in line for line in lines)
    assert "checksum mismatch" in lines[0] and "not JSON" in lines[1] and "1 records, the manifest says 3" in lines[2]
    assert list(reader.shards(cursor)) == [] and reader.rejected == 3  # the cursor is past the bad ones

    assert main(["shards", f"file://{tmp_path}", "--run-id", "run"]) == 1
    out = capsys.readouterr().out
    assert "4 shards" in out and "1 good (3 records), 3 bad" in out and out.count("BAD:") == 3


def test_rollout_record_keeps_token_ids_and_drops_unserialisable_info(tmp_path):
    t = Trajectory(id="p1-s0", group=3, problem=object(), prompt_tokens=[1, 2], tokens=[5, 6, 2], logprobs=[-0.1, -0.2, 0.0],
                   mask=[1, 1, 0], version=4, finish_reason="stop", reward=1.0, info={"correct": True, "x": object()})
    record = rollout_record(t, step=5, advantage=0.5, diloco_round=2)
    assert record == {"step": 5, "id": "p1-s0", "group": 3, "version": 4, "prompt_tokens": [1, 2], "tokens": [5, 6, 2],
                      "logprobs": [-0.1, -0.2, 0.0], "mask": [1, 1, 0], "reward": 1.0, "advantage": 0.5,
                      "diloco_round": 2, "finish_reason": "stop", "info": {"correct": True}}
    store = ObjectStore(f"file://{tmp_path}")
    ShardWriter(store, "r", "replica0").write([record])
    assert list(ShardReader(store, "r").records()) == [record]


def test_producer_names_are_checked(tmp_path):
    with pytest.raises(ValueError, match="producer"):
        ShardWriter(ObjectStore(f"file://{tmp_path}"), "run", "a.b")
