"""Weight sync benchmark: publish + pull + load of SmolLM2-135M between two Monarch processes on one
host, over the weight store's chunked RDMA reads (TCP fallback on CPU; transport rdma, so the sweep
over chunk counts measures RDMA even on one host; benchmarks/weight_transports.py compares it with
the shared-memory copy).

A publisher actor (the learner's role) publishes its model's ``state_dict()``; a puller actor (a
generator's role) pulls it into its own arena and ``load_state_dict``s the zero-copy views into its
own HF model (and, for comparison, byte-copies them into its parameters with ``copy_tensors``).
For each chunk count K it reports publish, pull and load times, the effective pull
bandwidth (bytes / whole pull, lease RPCs included) and its ratio to a same-run memcpy (``memcpy_gbps``) of
the same bytes in the puller process. Results go to ``benchmarks/results/weight_sync.json``.

    python benchmarks/weight_sync.py                     # real weights, K = 1, 4, 8, 16, 32, 64
    python benchmarks/weight_sync.py --synthetic         # random bf16 weights, same shapes
    python benchmarks/weight_sync.py --device cuda       # models and arenas on the GPU (a GPU host)
    MONARCH_RDMA_TCP_FALLBACK_PARALLELISM=4 python benchmarks/weight_sync.py   # Monarch knobs via env
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from monarch.actor import Actor, endpoint, this_host  # noqa: E402
from monarch.config import get_global_config  # noqa: E402

from meshrl.transport.arena import copy_tensors  # noqa: E402
from meshrl.config.weight_sync import WeightSyncConfig  # noqa: E402
from meshrl.transport.weight_store import WeightPublisher, WeightPuller, silence_tcp_fallback_warning  # noqa: E402

MODEL = "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results" / "weight_sync.json"


def smollm2_135m_config():
    """SmolLM2-135M's architecture (used for random weights when the checkpoint is unavailable)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    )  # fmt: skip


def build_model(source: str | None):
    """The HF model from a checkpoint directory, or random bf16 weights with SmolLM2-135M shapes."""
    from transformers import AutoModelForCausalLM

    if source is None:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(smollm2_135m_config(), dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)


def memcpy_gbps(nbytes: int, repeats: int, device: str = "cpu") -> dict:
    """Copy rate of ``nbytes`` between two preallocated, pre-touched uint8 tensors on ``device``,
    with torch's (parallel) ``copy_`` and, on the CPU, numpy's single-threaded ``copyto`` (on a GPU:
    a device-to-device copy, synchronised). ``median_gbps``, the reference a pull is compared with,
    is the faster method's median. Run it in the puller's process."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if src.is_cuda:
        methods = {"torch_copy": lambda: (dst.copy_(src), torch.cuda.synchronize(src.device))}
    else:
        methods = {"torch_copy": lambda: dst.copy_(src), "numpy_copyto": lambda: np.copyto(dst.numpy(), src.numpy())}
    rates: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, copy in methods.items():
            started = time.perf_counter()
            copy()
            rates[name].append(nbytes / (time.perf_counter() - started) / 1e9)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    return {"median_gbps": max(medians.values()), "best_gbps": max(max(r) for r in rates.values()),
            "median_gbps_by_method": medians}  # fmt: skip


def fingerprint(state_dict: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-tensor float64 sums: identical bits give identical sums (a cheap cross-process check)."""
    return {name: t.double().sum().item() for name, t in state_dict.items()}


class Learner(Actor):
    def __init__(self, source: str | None, config: WeightSyncConfig, device: str = "cpu"):
        silence_tcp_fallback_warning()
        self.model = build_model(source).to(device)
        self.config = config
        self.publishers: dict[int, WeightPublisher] = {}

    @endpoint
    def fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model.state_dict())

    @endpoint
    def publish(self, chunks: int, version: int) -> dict:
        cfg = self.config.model_copy(update={"num_chunks": chunks})
        publisher = self.publishers.setdefault(chunks, WeightPublisher(f"bench-k{chunks}", cfg))
        stats = publisher.publish(self.model.state_dict(), version)
        return {"seconds": stats.seconds, "pack_s": stats.pack_seconds, "register_s": stats.register_seconds,
                "nbytes": stats.nbytes}  # fmt: skip


class Generator(Actor):
    def __init__(self, source: str | None, config: WeightSyncConfig, device: str = "cpu"):
        silence_tcp_fallback_warning()
        self.device = device
        self.model = build_model(source).to(device)
        self.config = config
        self.pullers: dict[int, WeightPuller] = {}

    @endpoint
    def pull_and_load(self, chunks: int, version: int) -> dict:
        puller = self.pullers.setdefault(chunks, WeightPuller(f"bench-k{chunks}", self.config))
        result = puller.pull(min_version=version)
        assert result.version == version, (result.version, version)
        started = time.perf_counter()
        self.model.load_state_dict(result.tensors, strict=True)
        loaded = time.perf_counter()
        copy_tensors(self.model.state_dict(), result.tensors)
        return {"seconds": result.stats.seconds, "transfer_s": result.stats.transfer_seconds,
                "nbytes": result.stats.nbytes, "load_state_dict_s": loaded - started,
                "copy_load_s": time.perf_counter() - loaded}  # fmt: skip

    @endpoint
    def fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model.state_dict())

    @endpoint
    def memcpy_gbps(self, nbytes: int, repeats: int) -> dict:
        return memcpy_gbps(nbytes, repeats, self.device)


def resolve_source(synthetic: bool) -> tuple[str | None, str]:
    if synthetic:
        return None, "random bf16 weights with SmolLM2-135M shapes (--synthetic)"
    try:
        from meshrl.models.provision import resolve_model

        path = resolve_model(MODEL)
    except Exception as e:  # the benchmark stays runnable without the model cache
        first_line = (str(e).splitlines() or [type(e).__name__])[0]
        return None, f"random bf16 weights with SmolLM2-135M shapes ({MODEL} unavailable: {first_line})"
    return str(path), f"{MODEL} checkpoint at {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", default="1,4,8,16,32,64", help="comma-separated chunk counts K to sweep")
    parser.add_argument("--repeats", type=int, default=5, help="publish+pull rounds per K (the first is cold)")
    parser.add_argument("--synthetic", action="store_true", help="random weights instead of the checkpoint")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both models and the weight store's arenas live (cuda: the first GPU)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    chunk_counts = [int(k) for k in args.chunks.split(",")]

    silence_tcp_fallback_warning()
    load_before = os.getloadavg()[0]
    source, weights = resolve_source(args.synthetic)
    print(f"weights: {weights}", flush=True)
    config = WeightSyncConfig(transport="rdma", arena_device=args.device)  # the chunk count only matters to RDMA
    learner_procs = this_host().spawn_procs(per_host={"procs": 1}, name="learner")
    generator_procs = this_host().spawn_procs(per_host={"procs": 1}, name="generator")
    learner = learner_procs.spawn("learner", Learner, source, config, args.device)
    generator = generator_procs.spawn("generator", Generator, source, config, args.device)
    try:
        rows, version, nbytes = [], 0, 0
        for chunks in chunk_counts:
            rounds = []
            for _ in range(args.repeats):
                version += 1
                published = learner.publish.call_one(chunks, version).get(timeout=300)
                pulled = generator.pull_and_load.call_one(chunks, version).get(timeout=300)
                rounds.append((published, pulled))
                nbytes = published["nbytes"]
            warm = rounds[1:] or rounds
            pull_s = statistics.median(p["seconds"] for _, p in warm)
            rows.append({
                "chunks": chunks,
                "publish_s": statistics.median(p["seconds"] for p, _ in warm),
                "pack_s": statistics.median(p["pack_s"] for p, _ in warm),
                "register_s": statistics.median(p["register_s"] for p, _ in warm),
                "pull_s": pull_s,
                "pull_gbps": nbytes / pull_s / 1e9,
                "best_pull_gbps": max(nbytes / p["seconds"] / 1e9 for _, p in warm),
                "transfer_s": statistics.median(p["transfer_s"] for _, p in warm),
                "cold_pull_s": rounds[0][1]["seconds"],
                "cold_transfer_s": rounds[0][1]["transfer_s"],
                "load_state_dict_s": statistics.median(p["load_state_dict_s"] for _, p in warm),
                "copy_load_s": statistics.median(p["copy_load_s"] for _, p in warm),
            })  # fmt: skip
            print(f"K={chunks:3d}: pull {pull_s:.3f}s = {rows[-1]['pull_gbps']:.2f} GB/s", flush=True)
        same = learner.fingerprint.call_one().get(timeout=300) == generator.fingerprint.call_one().get(timeout=300)
        memcpy = generator.memcpy_gbps.call_one(nbytes, 7).get(timeout=300)
    finally:
        learner_procs.stop().get(timeout=60)
        generator_procs.stop().get(timeout=60)

    for row in rows:
        row["ratio_to_memcpy"] = row["pull_gbps"] / memcpy["median_gbps"]
    best = max(rows, key=lambda r: r["pull_gbps"])
    report = {
        "weights": weights,
        "device": args.device,
        "nbytes": nbytes,
        "generator_weights_match_learner": same,
        "memcpy_gbps": memcpy,
        "transport": config.transport,
        "default_chunks": config.num_chunks,
        "repeats": args.repeats,
        "sweep": rows,
        "rdma_backend_config": {k: v for k, v in get_global_config().items() if k.startswith("rdma")},
        "load_average_1m": {"start": load_before, "end": os.getloadavg()[0]},
    }
    from common import write_result  # imported here: actor processes import this module too

    write_result(Path(args.out).stem, report, args.out)

    print(f"\n{nbytes / 1e6:.0f} MB per version; memcpy {memcpy['median_gbps']:.2f} GB/s (median, same bytes)")
    print("load: model.load_state_dict(views) / copy_tensors(model.state_dict(), views)")
    header = ("K", "publish s", "pull s", "pull GB/s", "vs memcpy", "cold pull s", "load s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (4, 10, 8, 10, 10, 12, 13))))
    for r in rows:
        print(f"{r['chunks']:>4} {r['publish_s']:>10.3f} {r['pull_s']:>8.3f} {r['pull_gbps']:>10.2f} "
              f"{r['ratio_to_memcpy']:>10.2f} {r['cold_pull_s']:>12.3f} "
              f"{r['load_state_dict_s']:>6.3f}/{r['copy_load_s']:.3f}")  # fmt: skip
    print(f"host load average (1 min) {load_before:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    print(f"best: K={best['chunks']} {best['pull_gbps']:.2f} GB/s; weights identical after load: {same}")


if __name__ == "__main__":
    main()
