"""The mesh runtime against the single-process reference loop, side by side in one invocation:
same task, model, hyperparameters and number of steps. Reports per-step wall-clock of both
(and the ratio, target <= 1.3) and held-out accuracy per evaluation (learning per step).

    python benchmarks/runtime_vs_reference.py --steps 40

Each side runs in its own subprocess, one after the other, so they never compete for the cores.
Writes benchmarks/results/runtime_vs_reference.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import write_result

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="mesh runtime vs single-process reference")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", default="benchmarks/results/runtime_vs_reference.json")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    ref_json = results / "reference_loop.json"
    run_name = "bench-runtime"

    ref_wall = run([sys.executable, "benchmarks/reference_loop.py", "-c", args.config, "--steps", str(args.steps),
                    "--eval-every", str(args.eval_every), "--out", str(ref_json)])
    mesh_wall = run([sys.executable, "-m", "meshrl.cli", "train", "-c", args.config, f"trainer.steps={args.steps}",
                     f"trainer.eval.every={args.eval_every}", "output.dir=benchmarks/results/runs",
                     f"output.name={run_name}", "trainer.progress=false", "--overwrite"])

    reference = json.loads(ref_json.read_text())
    records = [json.loads(line) for line in (results / "runs" / run_name / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    mesh_step = sum(r["timing/step_s"] for r in train) / len(train)
    ref_step = reference["mean_step_s"]
    mesh_evals = {r["step"]: r["eval/accuracy"] for r in records if r["kind"] == "eval"}
    ref_evals = {e["step"]: e["accuracy"] for e in reference["evals"]}
    stages = {k: sum(r.get(k, 0.0) for r in train) / len(train)
              for k in ("timing/generate_s", "timing/reward_s", "timing/train_s", "timing/sync_s")}
    summary = {
        "steps": args.steps,
        "reference_mean_step_s": ref_step,
        "runtime_mean_step_s": mesh_step,
        "step_time_ratio": mesh_step / ref_step,
        "target_ratio": 1.3,
        "runtime_stage_means_s": stages,
        "runtime_mean_pull_gbps": sum(r["sync/pull_gbps"] for r in train) / len(train),
        "eval_accuracy": {str(s): {"reference": ref_evals.get(s), "runtime": mesh_evals.get(s)}
                          for s in sorted(set(ref_evals) | set(mesh_evals))},
        "wall_s": {"reference": ref_wall, "runtime": mesh_wall},
    }
    write_result("runtime_vs_reference", summary, args.out)
    print(f"per-step wall clock: runtime {mesh_step:.2f}s vs reference {ref_step:.2f}s -> ratio "
          f"{summary['step_time_ratio']:.2f} (target <= 1.3)")
    for step, acc in summary["eval_accuracy"].items():
        print(f"  step {step:>3}: held-out accuracy reference {acc['reference']}, runtime {acc['runtime']}")


if __name__ == "__main__":
    main()
