"""DiLoCo across replicas that share only an object store, on the synthetic supervised task
(benchmarks.diloco_toy), each replica a separate process launched by an executor.

Two parts:

* Round time split. ``--replicas`` replicas of a wide student (``--hidden``, default 65536 hidden
  units: ~1.2M parameters, a ~4.7 MB fp32 delta) run ``--split-rounds`` rounds through a
  file:// store (and with ``--s3`` through a loopback moto S3 server, a real S3 protocol
  endpoint); each round's time is split into compute (H inner steps), upload, wait (listing the
  others' commits until the round is sealed), download (every sealed delta read back and
  verified, its own included: all replicas average exactly the bytes in the store) and the outer
  step; bytes up/down per replica and round. The split comes from DiLoCoSync's report; sync is
  the whole of it, measured once.
  Medians over replicas and rounds 2.. (round 1 also waits for replicas still starting).
* Convergence. ``--replicas`` replicas with H = ``--inner-steps`` against one model trained on the
  same samples (the replicas' batches concatenated, AdamW, a synchronisation every step), final
  eval MSE (the label noise puts the floor at ~0.010), with the outer optimizer of
  ``--outer-lr/--outer-momentum`` and, for reference, the DiLoCo paper's 0.7 / 0.9.

    python benchmarks/diloco.py                       # file:// store, local processes
    python benchmarks/diloco.py --s3 --executor monarch

Results: ``benchmarks/results/diloco.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.diloco_toy import train_single  # noqa: E402
from meshrl.diloco.executors import ExecutorError, LocalProcessExecutor, ReplicaSpec  # noqa: E402

from common import RESULTS as RESULTS_DIR, write_result  # noqa: E402

RESULTS = RESULTS_DIR / "diloco.json"
SPLIT = ("compute_s", "upload_s", "wait_s", "download_s", "outer_s", "sync_s", "round_s")
"""Seconds per replica and round: compute (H inner steps) + sync (upload, wait, download, outer step,
and the leader's outer-state upload) = round."""


def make_executor(kind: str, work_dir: Path):
    if kind == "monarch":
        from meshrl.diloco.executors.monarch_job import MonarchJobExecutor
        from meshrl.launch.process import replica_job

        return MonarchJobExecutor(work_dir, replica_job)
    return LocalProcessExecutor(work_dir)


def run_replicas(args, work: Path, url: str, options: dict, **kwargs) -> list[dict]:
    """Every replica's result dict (ExecutorError naming the first failure)."""
    spec = ReplicaSpec("benchmarks.diloco_toy:run_replica",
                       {"store_url": url, "storage_options": options, "inner_steps": args.inner_steps,
                        "batch_size": args.batch_size, "lr": args.lr, "poll_interval_s": 0.02, **kwargs})
    with make_executor(args.executor, work) as ex:
        ex.launch_replicas(spec, args.replicas)
        results = ex.collect(timeout_s=args.timeout_s)
    failed = [r for r in results.values() if r.result is None]
    if failed:
        raise ExecutorError(f"replica {failed[0].replica} {failed[0].status.state}: {failed[0].error} (logs in {work})")
    out = [results[i].result for i in range(args.replicas)]
    if any(o["hashes"] != out[0]["hashes"] for o in out):
        raise ExecutorError(f"the replicas' weights differ after some round (logs in {work})")
    return out


def round_split(args, work: Path, store: str, url: str, options: dict) -> dict:
    t0 = time.perf_counter()
    out = run_replicas(args, work, url, options, rounds=args.split_rounds, hidden=args.hidden,
                       outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    wall = time.perf_counter() - t0
    reports = [{**rep, "sync_s": rep["round_s"], "round_s": rep["compute_s"] + rep["round_s"]}
               for o in out for rep in o["rounds"] if rep["round"] >= 2]
    row = {"store": store, "executor": args.executor, "replicas": args.replicas, "params": out[0]["params"],
           "rounds": args.split_rounds, "inner_steps": args.inner_steps, "wall_s": wall}
    row.update({k: statistics.median(rep[k] for rep in reports) for k in SPLIT})
    row["bytes_up"] = statistics.median(rep["bytes_up"] for rep in reports)
    row["bytes_down"] = statistics.median(rep["bytes_down"] for rep in reports)
    return row


def convergence(args, work: Path) -> dict:
    steps = args.conv_rounds * args.inner_steps
    t0 = time.perf_counter()
    single = train_single(steps, args.batch_size, args.lr, streams=args.replicas, eval_every=args.inner_steps)
    rows = [{"run": "one model, sync every step", "syncs": steps, "samples": single["samples"],
             "final_eval": single["eval"][-1], "eval": single["eval"], "wall_s": time.perf_counter() - t0}]
    for name, lr, mom in ((f"DiLoCo outer {args.outer_lr}/{args.outer_momentum}", args.outer_lr, args.outer_momentum),
                          ("DiLoCo outer 0.7/0.9 (paper)", 0.7, 0.9)):
        t0 = time.perf_counter()
        out = run_replicas(args, work / name.split()[2], f"file://{work}/store-{lr}-{mom}", {},
                           rounds=args.conv_rounds, outer_lr=lr, outer_momentum=mom)
        rows.append({"run": f"{name}, {args.replicas} replicas, H={args.inner_steps}", "syncs": len(out[0]["rounds"]),
                     "samples": sum(o["samples"] for o in out), "final_eval": out[0]["eval"][-1], "eval": out[0]["eval"],
                     "bytes_per_round": statistics.median(out[0]["bytes"]), "wall_s": time.perf_counter() - t0})
    for row in rows:
        row["ratio_to_one_model"] = row["final_eval"] / rows[0]["final_eval"]
    return {"rounds": args.conv_rounds, "inner_steps": args.inner_steps, "batch_size": args.batch_size,
            "lr": args.lr, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--executor", choices=("local", "monarch"), default="local")
    p.add_argument("--s3", action="store_true", help="also run the round split over a loopback moto S3 server")
    p.add_argument("--inner-steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=65536, help="student width of the round-split runs")
    p.add_argument("--split-rounds", type=int, default=6)
    p.add_argument("--conv-rounds", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="diloco-bench-") as tmp:
        work = Path(tmp)
        splits = [round_split(args, work / "file", "file", f"file://{work}/store-split", {})]
        if args.s3:
            from meshrl.testing.s3_server import MotoS3Server

            with MotoS3Server() as s3:
                splits.append(round_split(args, work / "s3", "s3 (moto, loopback)", s3.url("split"), s3.storage_options))
        conv = convergence(args, work / "conv")

    print(f"\nround time split, {args.replicas} replicas via {args.executor}, {splits[0]['params']:,} params, "
          f"H={args.inner_steps} (medians, rounds 2..{args.split_rounds})")
    print(f"{'store':22}" + "".join(f"{k[:-2]:>10}" for k in SPLIT) + f"{'MB up':>9}{'MB down':>9}")
    for row in splits:
        print(f"{row['store']:22}" + "".join(f"{row[k]:>10.3f}" for k in SPLIT)
              + f"{row['bytes_up'] / 1e6:>9.2f}{row['bytes_down'] / 1e6:>9.2f}")
    print(f"\nconvergence: {args.replicas} x {conv['rounds'] * args.inner_steps} steps x {args.batch_size} samples")
    print(f"{'run':48}{'syncs':>7}{'samples':>9}{'eval MSE':>10}{'ratio':>8}{'bytes/round':>13}")
    for row in conv["rows"]:
        print(f"{row['run']:48}{row['syncs']:>7}{row['samples']:>9}{row['final_eval']:>10.5f}"
              f"{row['ratio_to_one_model']:>8.3f}{row.get('bytes_per_round', 0):>13,.0f}")

    write_result("diloco", {"kind": "diloco", "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
                            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                            "round_split": splits, "convergence": conv}, args.out)


if __name__ == "__main__":
    main()
