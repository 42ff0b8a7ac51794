"""Sandbox throughput: 16 concurrent sandboxed executions, checked for correctness.

For each available layer (bwrap, and the rlimit fallback) it runs rounds of 16 concurrent
executions of two kinds -- a trivial program, and a real grading run (a bundled task's reference
solution against its hidden tests: its sandboxed worker answers the calls, the grader judges) --
checks every result, and reports executions per second; a sequential round gives the
one-at-a-time baseline. ``--before FILE`` keeps another run's result (the commit before a change,
run just before this one on the same machine) beside this one, with the ratio of each figure.

    python benchmarks/sandbox_throughput.py [--rounds 5] [--before OLD.json] [--out benchmarks/results/sandbox_throughput.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from common import RESULTS, write_result


def bench_layer(layer: str, rounds: int, concurrency: int) -> dict:
    from meshrl.config.env import SandboxConfig
    from meshrl.envs.grading import grade_many
    from meshrl.envs.sandbox import Sandbox, SandboxJob, SandboxUnavailable
    from meshrl.envs.tasks import load_code_tasks

    try:
        sb = Sandbox(SandboxConfig(layer=layer, max_parallel=concurrency))
    except SandboxUnavailable as e:
        return {"layer": layer, "available": False, "reason": str(e)}
    out: dict = {"layer": sb.layer, "available": True, "probe": sb.info.describe(), "concurrency": concurrency}
    try:
        # warm-up (page cache, probe)
        sb.run_many([SandboxJob({"a.py": "print(1)"}, ["python", "a.py"])] * concurrency, max_parallel=concurrency)

        def trivial_round(par: int) -> float:
            jobs = [SandboxJob({"a.py": f"print({i} * 3)"}, ["python", "a.py"], timeout_s=30) for i in range(concurrency)]
            t = time.perf_counter()
            res = sb.run_many(jobs, max_parallel=par)
            dt = time.perf_counter() - t
            bad = [i for i, r in enumerate(res) if r.stdout != f"{i * 3}\n" or r.error_kind is not None]
            if bad:
                raise AssertionError(f"{layer}: wrong results for jobs {bad}: {res[bad[0]]}")
            return dt

        tasks = load_code_tasks("all")[:concurrency]

        def grading_round(par: int) -> float:
            t = time.perf_counter()
            res = grade_many([(x, x.reference) for x in tasks], sb, max_parallel=par)
            dt = time.perf_counter() - t
            bad = [x.task_id for x, r in zip(tasks, res) if not r.success]
            if bad:
                raise AssertionError(f"{layer}: references failed: {bad}")
            return dt

        for name, fn in (("trivial", trivial_round), ("grading", grading_round)):
            conc = [fn(concurrency) for _ in range(rounds)]
            seq = fn(1)
            med = statistics.median(conc)
            out[name] = {
                "executions_per_round": concurrency,
                "rounds": rounds,
                "round_s_median": round(med, 4),
                "round_s_all": [round(x, 4) for x in conc],
                "executions_per_s": round(concurrency / med, 2),
                "sequential_executions_per_s": round(concurrency / seq, 2),
                "speedup_vs_sequential": round(seq / med, 2),
                "all_correct": True,
            }
    finally:
        sb.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--layers", default="bwrap,rlimit")
    ap.add_argument("--out", default=str(RESULTS / "sandbox_throughput.json"))
    ap.add_argument("--before", help="another run's result JSON to compare with (e.g. the commit before a change)")
    args = ap.parse_args()
    before = json.loads(open(args.before).read()) if args.before else None

    results = {
        "benchmark": "sandbox_throughput",
        "host": {"platform": platform.platform(), "root": os.geteuid() == 0},
        "layers": [bench_layer(layer, args.rounds, args.concurrency) for layer in args.layers.split(",")],
    }
    for r in results["layers"]:
        if not r.get("available"):
            print(f"[{r['layer']}] unavailable: {r['reason']}")
            continue
        for kind in ("trivial", "grading"):
            k = r[kind]
            print(
                f"[{r['layer']}] {args.concurrency} concurrent {kind} executions: {k['executions_per_s']} executions/s "
                f"(round {k['round_s_median']} s, sequential {k['sequential_executions_per_s']}/s, "
                f"x{k['speedup_vs_sequential']}), all correct"
            )
    if before is not None:
        results["before"] = compare(before, results["layers"])
        for r in results["before"]["layers"]:
            print(f"[{r['layer']}] vs before ({results['before']['commit']}): "
                  + ", ".join(f"{k} x{v['ratio']}" for k, v in r["kinds"].items()))
    write_result("sandbox_throughput", results, args.out)


def compare(before: dict, layers: list[dict]) -> dict:
    """The earlier run's concurrent executions/s beside this run's, and this run's over it."""
    old = {r["layer"]: r for r in before["layers"] if r.get("available")}
    rows = []
    for r in layers:
        if r.get("available") and r["layer"] in old:
            kinds = {k: {"before": old[r["layer"]][k]["executions_per_s"], "after": r[k]["executions_per_s"],
                         "ratio": round(r[k]["executions_per_s"] / old[r["layer"]][k]["executions_per_s"], 2)}
                     for k in ("trivial", "grading")}
            rows.append({"layer": r["layer"], "kinds": kinds})
    return {"commit": before.get("commit"), "date": before.get("date"),
            "load_average_1m": before.get("load_average_1m"), "layers": rows}


if __name__ == "__main__":
    main()
