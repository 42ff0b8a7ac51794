"""Weight pull per transport on one host: the shared-memory copy (``transport: shm``) against RDMA
chunk reads (``transport: rdma``, Monarch's TCP fallback on CPU), between two Monarch processes.

With ``--arena-device cuda`` the arenas live in GPU memory: the local copy is then CUDA IPC and the
memcpy a device-to-device copy on the reader's GPU (needs a CUDA host; scripts/gpu_check.py runs it).

Cases: (a) SmolLM2-135M's state dict (the checkpoint if cached, else random weights with its shapes),
(b) a synthetic bf16 state dict of ``--synthetic-params`` parameters (default 2B, ~4 GB) in
``--tensors`` tensors. Each case gets fresh processes: an owner publishes a new version per round
(auto transport: shared memory plus RDMA buffers over it, 2 pooled arenas), a reader pulls it with
one transport and then the other. Every pull is compared with a memcpy of the same bytes in the
reader's process, measured before and after the pulls. The reader's final weights are checked
bitwise (sha256) against the owner's. Memory: the owner holds two arenas and the reader one, so a
case needs ~3x its bytes; a synthetic case that would not fit in MemAvailable (less a 2 GiB margin)
is shrunk to the largest that fits, and the report says so.

    python benchmarks/weight_transports.py                  # both cases, 4 rounds per transport
    python benchmarks/weight_transports.py --synthetic-params 1e9 --repeats 3
    python benchmarks/weight_transports.py --arena-device cuda --cases smollm2 --transports shm

Results: ``benchmarks/results/weight_sync_transports.json``.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
_HERE = os.path.dirname(os.path.abspath(__file__))
# actor processes unpickle helpers from weight_sync.py by module name
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_HERE, os.environ.get("PYTHONPATH")]))
sys.path.insert(0, _HERE)

import argparse  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from monarch.actor import Actor, endpoint, this_host  # noqa: E402
from weight_sync import build_model, memcpy_gbps, resolve_source  # noqa: E402

from meshrl.transport.arena import ArenaLayout  # noqa: E402
from meshrl.transport.weight_store import WeightPublisher, WeightPuller, silence_tcp_fallback_warning  # noqa: E402
from meshrl.config.weight_sync import WeightSyncConfig  # noqa: E402

RESULTS = Path(_HERE) / "results" / "weight_sync_transports.json"
STORE = "bench-transports"
TRANSPORTS = ("shm", "rdma")
#: what a pull by the local copy reports as its transport, by arena device
LOCAL_COPY = {"cpu": "shm", "cuda": "cuda_ipc"}
COLS = 4096
MARGIN = 2 << 30


def synthetic_state_dict(params: int, tensors: int, version: int) -> dict[str, torch.Tensor]:
    """``tensors`` bf16 matrices of ~params/tensors values. Each is one random row (seeded by
    version and index) broadcast over its rows, so the owner holds only the rows while the arena
    gets every byte."""
    rows = max(1, round(params / tensors / COLS))
    sd = {}
    for i in range(tensors):
        g = torch.Generator().manual_seed(version * 100_003 + i)
        sd[f"layers.{i:03d}.weight"] = torch.randn(1, COLS, generator=g).to(torch.bfloat16).expand(rows, COLS)
    return sd


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's bytes in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().view(torch.uint8).cpu().numpy())
    return h.hexdigest()


class Owner(Actor):
    """The learner's role: publishes one version per call (auto transport: shared memory and RDMA)."""

    def __init__(self, case: dict, config: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.case = case
        self.model = build_model(case["source"]) if case["kind"] == "smollm2" else None
        self.publisher = WeightPublisher(STORE, config)

    def _state_dict(self, version: int) -> dict[str, torch.Tensor]:
        if self.model is not None:
            return self.model.state_dict()
        return synthetic_state_dict(self.case["params"], self.case["tensors"], version)

    @endpoint
    def nbytes(self) -> int:
        return ArenaLayout.from_state_dict(self._state_dict(0), self.publisher.config.alignment).total_bytes

    @endpoint
    def publish(self, version: int) -> dict:
        stats = self.publisher.publish(self._state_dict(version), version)
        return {"seconds": stats.seconds, "pack_s": stats.pack_seconds, "nbytes": stats.nbytes}

    @endpoint
    def digest(self, version: int) -> tuple[str, int]:
        sd = self._state_dict(version)
        return digest(sd), len(sd)

    @endpoint
    def close(self) -> None:
        self.publisher.close()


class Reader(Actor):
    """A generator's role: one puller at a time (its arena freed before the next transport's)."""

    def __init__(self, config: WeightSyncConfig):
        silence_tcp_fallback_warning()
        self.config = config
        self.puller: WeightPuller | None = None
        self.result = None

    @endpoint
    def pull(self, transport: str, version: int) -> dict:
        if self.puller is None or self.puller.config.transport != transport:
            self._drop()
            self.puller = WeightPuller(STORE, self.config.model_copy(update={"transport": transport}))
        self.result = self.puller.pull(min_version=version)
        stats = self.result.stats
        expected = LOCAL_COPY[self.config.arena_device] if transport == "shm" else transport
        assert self.result.version == version and stats.transport == expected, (self.result.version, stats)
        return {"seconds": stats.seconds, "transfer_s": stats.transfer_seconds, "nbytes": stats.nbytes}

    @endpoint
    def digest(self) -> str:
        return digest(self.result.tensors)

    @endpoint
    def release(self) -> None:
        self._drop()

    def _drop(self) -> None:
        self.puller = self.result = None
        gc.collect()

    @endpoint
    def memcpy_gbps(self, nbytes: int, repeats: int) -> dict:
        return memcpy_gbps(nbytes, repeats, self.config.arena_device)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


class MemoryWatch:
    """Lowest MemAvailable seen while the benchmark runs (sampled every 0.2 s)."""

    def __init__(self) -> None:
        self.lowest = mem_available()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.lowest = min(self.lowest, mem_available())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.lowest


def run_case(case: dict, repeats: int, transports: list[str], arena_device: str) -> dict:
    config = WeightSyncConfig(max_arenas=2, arena_device=arena_device)
    owner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="owner")
    reader_procs = this_host().spawn_procs(per_host={"procs": 1}, name="reader")
    owner = owner_procs.spawn("owner", Owner, case, config)
    reader = reader_procs.spawn("reader", Reader, config)
    try:
        version, result = 0, {"transports": {}}
        nbytes = owner.nbytes.call_one().get(timeout=600)
        memcpy = [reader.memcpy_gbps.call_one(nbytes, 5).get(timeout=600)]
        for transport in transports:
            rounds = []
            for _ in range(repeats):
                version += 1
                published = owner.publish.call_one(version).get(timeout=600)
                rounds.append((published, reader.pull.call_one(transport, version).get(timeout=600)))
                assert published["nbytes"] == nbytes
            warm = [p for _, p in rounds[1:] or rounds]
            published_digest, result["tensors"] = owner.digest.call_one(version).get(timeout=600)
            same = reader.digest.call_one().get(timeout=600) == published_digest
            reader.release.call_one().get(timeout=60)
            row = result["transports"][transport] = {
                "pull_s": statistics.median(p["seconds"] for p in warm),
                "transfer_s": statistics.median(p["transfer_s"] for p in warm),
                "best_pull_s": min(p["seconds"] for p in warm),
                "cold_pull_s": rounds[0][1]["seconds"],
                "publish_s": statistics.median(p["seconds"] for p, _ in rounds[1:] or rounds),
                "rounds_pull_s": [p["seconds"] for _, p in rounds],
                "bitwise_identical": same,
            }
            print(f"  {transport}: pull {row['pull_s']:.3f}s, cold {row['cold_pull_s']:.3f}s, same {same}", flush=True)
        owner.close.call_one().get(timeout=60)
        memcpy.append(reader.memcpy_gbps.call_one(nbytes, 5).get(timeout=600))
    finally:
        owner_procs.stop().get(timeout=60)
        reader_procs.stop().get(timeout=60)
    reference = statistics.median(m["median_gbps"] for m in memcpy)
    for row in result["transports"].values():
        row["pull_gbps"] = nbytes / row["pull_s"] / 1e9
        row["transfer_gbps"] = nbytes / row["transfer_s"] / 1e9
        row["pull_vs_memcpy"] = row["pull_gbps"] / reference
        row["transfer_vs_memcpy"] = row["transfer_gbps"] / reference
    return {**case, **result, "nbytes": nbytes, "memcpy_gbps": reference, "memcpy_runs": memcpy, "repeats": repeats,
            "arena_device": arena_device}


def synthetic_case(params: int, tensors: int) -> dict:
    """The synthetic case, shrunk (by whole halvings) until ~3x its bytes fit in MemAvailable."""
    requested, fitted = params, params
    while 3 * 2 * fitted > mem_available() - MARGIN and fitted > 1e8:
        fitted //= 2
    rows = max(1, round(fitted / tensors / COLS))
    note = f"{tensors} bf16 tensors of {rows}x{COLS}, each one random row broadcast over its rows"
    if fitted != requested:
        note += f"; shrunk from {requested / 1e9:g}B params: {3 * 2 * requested / 2**30:.1f} GiB did not fit"
    return {"name": f"synthetic-{rows * COLS * tensors / 1e9:.2f}B-bf16", "kind": "synthetic", "params": fitted,
            "requested_params": requested, "tensors": tensors, "weights": note}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=4, help="rounds per transport (the first is cold)")
    parser.add_argument("--synthetic-params", type=float, default=2e9)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--cases", default="smollm2,synthetic")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated, of shm and rdma")
    parser.add_argument("--arena-device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides' arenas live (cuda: the local copy is CUDA IPC)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    transports = args.transports.split(",")
    if not set(transports) <= set(TRANSPORTS):
        parser.error(f"--transports: expected some of {','.join(TRANSPORTS)}, got {args.transports}")

    silence_tcp_fallback_warning()
    load_before, watch = os.getloadavg()[0], MemoryWatch()
    available_before = mem_available()
    cases = []
    for kind in args.cases.split(","):
        if kind == "smollm2":
            source, weights = resolve_source(synthetic=False)
            case = {"name": "smollm2-135m", "kind": "smollm2", "source": source, "weights": weights}
        else:
            case = synthetic_case(int(args.synthetic_params), args.tensors)
        print(f"{case['name']}: {case['weights']}", flush=True)
        cases.append(run_case(case, args.repeats, transports, args.arena_device))
        gc.collect()
    report = {
        "cases": cases,
        "load_average_1m": {"start": load_before, "end": os.getloadavg()[0]},
        "mem_available_gib": {"start": available_before / 2**30, "lowest": watch.stop() / 2**30},
    }
    from common import write_result  # imported here: actor processes import this module too

    write_result(Path(args.out).stem, report, args.out)

    print("\npull = lease + transfer + release (median of warm rounds); memcpy = same bytes in the reader")
    header = ("case", "transport", "MB", "pull s", "pull GB/s", "vs memcpy", "xfer vs memcpy", "cold s", "memcpy GB/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (22, 9, 7, 7, 9, 9, 14, 7, 11))))
    for c in cases:
        for transport, r in c["transports"].items():
            print(f"{c['name']:>22} {transport:>9} {c['nbytes'] / 1e6:>7.0f} {r['pull_s']:>7.3f} "
                  f"{r['pull_gbps']:>9.2f} {r['pull_vs_memcpy']:>9.2f} {r['transfer_vs_memcpy']:>14.2f} "
                  f"{r['cold_pull_s']:>7.2f} {c['memcpy_gbps']:>11.2f}")  # fmt: skip
    print(f"load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}; MemAvailable lowest "
          f"{report['mem_available_gib']['lowest']:.1f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
