"""Sharded publishing against today's rank-0 gather, on one CPU host: N learner processes (gloo)
hold a synthetic bf16 decoder model of ``--params`` parameters (default 2.08 B, ~4.2 GB) sharded
with FSDP2 (``fully_shard`` per layer and the root, built on the meta device and materialised
shard by shard, so no process ever holds the whole model), for N in ``--procs`` (1 2 4).

Per N, in the same processes:

* **sharded publish** (the weight store's path): every rank packs its own rows into its arena
  (``DataParallel.local_shards`` -> ``WeightPublisher.publish_shards``); the version appears once
  all ranks announced their part. Per rank: seconds, bytes packed, and the peak extra memory during
  the publish, as the **RSS high-water mark** (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before) minus the RSS before; shared-memory arena pages count in RSS.
* **pull**: a reader (this process) pulls each version bucket by bucket (``--bucket-mib``, whole
  layers) from the ranks' shared memory into a loader; the throughput is the bytes copied over
  the summed bucket-fill time, against a memcpy of one bucket's bytes in the same process, measured
  before the publish and after the pulls. The first pull maps the ranks' segments (cold); the others reuse the mappings
  and the bucket (the reader forgets the version it holds between rounds, so each round copies
  again). One more, untimed pull checks every tensor bit for bit against the values the ranks
  were built with.
* **gather** (today's path, `DataParallel.gather_to_first`): rank 0 receives every other rank's
  rows; seconds, bytes received and each rank's peak extra memory, measured the same way. The old
  publish then packed that whole copy into an arena of the full model on rank 0; that pack is
  **not run** here for N > 1 (it would need a further full copy on top of the gathered one, beyond
  this machine's memory budget). With N = 1 there is nothing to gather and the old publish is the
  sharded publish with one rank.

    python benchmarks/sharded_publish.py                          # N = 1, 2, 4; 3 pulls each
    python benchmarks/sharded_publish.py --params 2e8 --procs 1 2 --repeats 2

Memory: the ranks' shards (the model once) plus their arenas (the model once more) plus one bucket
in the reader, then, for the gather, the whole model again on rank 0 once
the arenas are freed. The script refuses to start when MemAvailable is below what that needs, with
~0.6 GB per process and a 2 GiB margin.

Results: ``benchmarks/results/sharded_publish.json``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))
sys.path.insert(0, _HERE)

import argparse  # noqa: E402
import gc  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from common import write_result  # noqa: E402
from monarch.actor import Actor, current_rank, endpoint, this_host  # noqa: E402
from weight_sync import memcpy_gbps  # noqa: E402

from meshrl.config.weight_sync import WeightSyncConfig  # noqa: E402
from meshrl.training.data_parallel import DataParallel, DataParallelSpec  # noqa: E402
from meshrl.training.memory import reset_peak, resident_gib  # noqa: E402
from meshrl.transport.weight_store import WeightPublisher, WeightPuller, silence_tcp_fallback_warning  # noqa: E402

STORE = "bench-sharded"
MARGIN = 2 << 30
PROCESS_BYTES = 600 << 20  # a learner process before its shard (torch, Monarch)
HIDDEN, FFN, VOCAB = 2048, 8192, 32000


def layer_params() -> int:
    return 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN + 2 * HIDDEN


def layers_for(params: float) -> int:
    return max(1, round((params - 2 * VOCAB * HIDDEN - HIDDEN) / layer_params()))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.ModuleDict({n: torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
                                              for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.mlp = torch.nn.ModuleDict({"gate_proj": torch.nn.Linear(HIDDEN, FFN, bias=False),
                                        "up_proj": torch.nn.Linear(HIDDEN, FFN, bias=False),
                                        "down_proj": torch.nn.Linear(FFN, HIDDEN, bias=False)})
        self.input_layernorm = torch.nn.RMSNorm(HIDDEN)
        self.post_attention_layernorm = torch.nn.RMSNorm(HIDDEN)


class Model(torch.nn.Module):
    """HF-named decoder weights (``model.layers.N.*``, an untied head), no forward: only the
    weights move here."""

    def __init__(self, layers: int):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.model.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.model.norm = torch.nn.RMSNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)


def value_indices(model: torch.nn.Module) -> dict[str, int]:
    """Every weight name -> the number its values are built from (tied names share the first's)."""
    first: dict[int, int] = {}
    return {name: first.setdefault(id(p), len(first))
            for name, p in sorted(model.named_parameters(remove_duplicate=False))}


def expected_rows(index: int, start: int, rows: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Rows [start, start + rows) of weight number ``index``: value (r*31 + c*7 + index*13) mod 251,
    minus 125, over 128 at row r, column c (exact in bf16, the same whatever rank holds them).
    A row depends on r only through (r*31 + index*13) mod 251, so 251 distinct rows are built and
    gathered."""
    cols = shape[1] if len(shape) > 1 else 1
    k = (torch.arange(251)[:, None] + torch.arange(cols)[None, :] * 7) % 251
    table = ((k - 125).to(torch.float32) / 128).to(torch.bfloat16)
    which = (torch.arange(start, start + rows) * 31 + index * 13) % 251
    return table[which].reshape((rows, *shape[1:]))


def rss() -> int:
    return round(resident_gib()["rss_gib"] * 2**30)


def measured(fn):
    """``fn()``'s result, its seconds, and the RSS high-water mark during it above the RSS before."""
    gc.collect()
    reset_peak()
    before = resident_gib()["rss_gib"]
    started = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - started
    return out, seconds, round((resident_gib()["peak_rss_gib"] - before) * 2**30)


class Rank(Actor):
    """One learner process: its FSDP2 shard of the synthetic model, a sharded publisher, the gather."""

    def __init__(self, world: int, address: str, layers: int, config: WeightSyncConfig):
        silence_tcp_fallback_warning()
        torch.set_num_threads(1)
        self.rank = current_rank().rank
        self.dp = DataParallel(DataParallelSpec(self.rank, world, "fsdp2", address, 1800.0))
        with torch.device("meta"):
            model = Model(layers).to(torch.bfloat16)
        if world > 1:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        model.to_empty(device="cpu")
        self.model = model
        self.keys = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
        indices, filled = value_indices(model), set()
        with torch.no_grad():
            for name, shard in sorted(self._shards().items()):
                if not shard.rows or indices[name] in filled:
                    continue
                filled.add(indices[name])
                local = shard.load()
                for start in range(0, shard.rows, 4096):  # bounded temporaries
                    n = min(4096, shard.rows - start)
                    local[start: start + n].copy_(expected_rows(indices[name], shard.row_start + start, n, shard.shape))
        self.publisher = WeightPublisher(STORE, config, rank=self.rank, world=world, group=self.dp.group_id)

    def _shards(self):
        return self.dp.local_shards(self.model.state_dict(), torch.bfloat16, self.keys)

    @endpoint
    def describe(self) -> dict:
        local = [p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters()]
        return {"rank": self.rank, "rss_bytes": rss(), "shard_bytes": sum(t.numel() * t.element_size() for t in local)}

    @endpoint
    def publish(self, version: int) -> dict:
        stats, seconds, extra = measured(lambda: self.publisher.publish_shards(self._shards(), version))
        return {"rank": self.rank, "seconds": seconds, "pack_s": stats.pack_seconds, "part_bytes": stats.nbytes,
                "version_bytes": stats.total_bytes, "peak_extra_bytes": extra}

    @endpoint
    def close_publisher(self) -> None:
        self.publisher.close()
        gc.collect()

    @endpoint
    def gather(self) -> dict:
        state = self.model.state_dict()
        full, seconds, extra = measured(lambda: self.dp.gather_to_first(state))
        received = sum(t.numel() * t.element_size() for t in {id(t): t for t in full.values()}.values())
        del full
        gc.collect()
        return {"rank": self.rank, "seconds": seconds, "peak_extra_bytes": extra, "whole_bytes_held": received}


class Reader:
    """This process as a weight reader: bucketed pulls into a loader that keeps nothing (with
    ``check``, one that compares every tensor with the values the ranks were built with)."""

    def __init__(self, config: WeightSyncConfig, indices: dict[str, int]):
        self.puller = WeightPuller(STORE, config)
        self.indices = indices
        self.checked: set[str] = set()

    def pull(self, version: int, check: bool) -> dict:
        self.puller._publish_id = None  # forget the version held, so this round copies it again (warm)
        result = self.puller.pull_into(self._check if check else (lambda items: None), version, exact=True)
        s = result.stats
        return {"seconds": s.seconds, "transfer_s": s.transfer_seconds, "read_bytes": s.read_bytes,
                "bytes": s.nbytes, "buckets": s.buckets, "transport": s.transport,
                "gbps": s.read_bytes / s.transfer_seconds / 1e9}

    def _check(self, items) -> None:
        for name, t in items:
            for start in range(0, t.shape[0], 4096):
                n = min(4096, t.shape[0] - start)
                if not torch.equal(t[start: start + n], expected_rows(self.indices[name], start, n, tuple(t.shape))):
                    raise AssertionError(f"pulled '{name}' rows {start}..{start + n} differ from the learners'")
            self.checked.add(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def run(world: int, layers: int, repeats: int, config: WeightSyncConfig) -> dict:
    """One N: build, publish once, pull ``repeats`` times, close, gather."""
    with torch.device("meta"):
        indices = value_indices(Model(layers))
    procs = this_host().spawn_procs(per_host={"procs": world}, name=f"learner{world}")
    try:
        ranks = procs.spawn("rank", Rank, world, f"tcp://127.0.0.1:{free_port()}", layers, config)
        held = sorted(ranks.describe.call().get(timeout=1800).values(), key=lambda r: r["rank"])
        bucket = config.pull_bucket_mib << 20
        memcpy = [memcpy_gbps(bucket, 5)["median_gbps"]]
        published = sorted(ranks.publish.call(1).get(timeout=1800).values(), key=lambda r: r["rank"])
        reader = Reader(config, indices)
        pulls = [reader.pull(1, check=False) for _ in range(repeats)]
        reader.pull(1, check=True)  # one more, untimed: every tensor against the values built
        assert reader.checked == set(indices), sorted(set(indices) - reader.checked)[:3]
        del reader
        gc.collect()
        ranks.close_publisher.call().get(timeout=600)
        memcpy.append(memcpy_gbps(bucket, 5)["median_gbps"])  # with the arenas freed: the peak stays lower
        gathered = sorted(ranks.gather.call().get(timeout=1800).values(), key=lambda r: r["rank"]) \
            if world > 1 else None
    finally:
        procs.stop().get(timeout=120)
    version_bytes = published[0]["version_bytes"]
    warm = pulls[1:] or pulls
    pull_gbps = statistics.median(p["gbps"] for p in warm)
    memcpy_median = statistics.median(memcpy)
    rank0 = published[0]["peak_extra_bytes"]
    bound = version_bytes / world + bucket
    return {
        "procs": world,
        "held": held,
        "publish": published,
        "publish_s": max(p["seconds"] for p in published),
        "rank0_publish_extra_bytes": rank0,
        "rank0_extra_bound_bytes": bound,
        "rank0_extra_within_bound": rank0 <= bound,
        "pulls": pulls,
        "pull_s": statistics.median(p["seconds"] for p in warm),
        "cold_pull_s": pulls[0]["seconds"],
        "pull_gbps": pull_gbps,
        "memcpy_gbps": memcpy,
        "pull_vs_memcpy": pull_gbps / memcpy_median,
        "pull_checked_tensors": len(indices),
        "gather": gathered,
        "gather_s": max(g["seconds"] for g in gathered) if gathered else None,
        "rank0_gather_extra_bytes": gathered[0]["peak_extra_bytes"] if gathered else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=2.08e9, help="synthetic model size (parameters)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], help="learner process counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed pulls per process count (the first is cold)")
    parser.add_argument("--bucket-mib", type=int, default=512, help="weight_sync.pull_bucket_mib of the reader")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/sharded_publish.json)")
    args = parser.parse_args(argv)
    silence_tcp_fallback_warning()
    layers = layers_for(args.params)
    with torch.device("meta"):
        params = sum(p.numel() for p in Model(layers).parameters())
    model_bytes = params * 2
    need = 2 * model_bytes + (args.bucket_mib << 20) + max(args.procs) * PROCESS_BYTES + MARGIN
    if mem_available() < need:
        print(f"MemAvailable {mem_available() / 2**30:.1f} GiB < {need / 2**30:.1f} GiB needed for a "
              f"{params / 1e9:.2f}B-parameter model: free memory or lower --params", file=sys.stderr)
        return 2
    config = WeightSyncConfig(pull_bucket_mib=args.bucket_mib, max_arenas=2, transfer_timeout_s=600,
                              rpc_timeout_s=120)
    rows = []
    for world in args.procs:
        print(f"N = {world}: {params / 1e9:.2f}B parameters ({model_bytes / 2**30:.2f} GiB bf16), {layers} layers",
              flush=True)
        rows.append(run(world, layers, args.repeats, config))
        row = rows[-1]
        print(f"  publish {row['publish_s']:.2f} s, rank 0 extra {row['rank0_publish_extra_bytes'] / 2**30:.2f} GiB "
              f"(bound {row['rank0_extra_bound_bytes'] / 2**30:.2f}); pull {row['pull_s']:.2f} s "
              f"{row['pull_gbps']:.2f} GB/s = {row['pull_vs_memcpy']:.2f}x memcpy; gather {row['gather_s']}",
              flush=True)
    write_result("sharded_publish", {
        "params": params, "model_bytes": model_bytes, "layers": layers, "hidden": HIDDEN, "ffn": FFN,
        "vocab": VOCAB, "bucket_mib": args.bucket_mib, "repeats": args.repeats,
        "memory_measure": "RSS high-water mark (VmHWM, reset via /proc/self/clear_refs) above the RSS just before",
        "rows": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
