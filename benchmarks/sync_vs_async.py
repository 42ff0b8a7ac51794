"""The default task trained synchronously (K = 0) and asynchronously (K = 1), one run after the
other: held-out accuracy per step and against wall-clock time, in one PNG.

    python benchmarks/sync_vs_async.py [--steps 32] [--runs-dir runs]

Each run is `meshrl train` with configs/default.yaml (plus `trainer.max_steps_off_policy`), so the
K = 0 run is also the default job. Writes benchmarks/results/sync_vs_async.{json,png}.
"""

from __future__ import annotations

import argparse
import os
import sys

from common import RESULTS, write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run(k: int, steps: int, runs_dir: str) -> dict:
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training

    cfg = load_config(RunConfig, "configs/default.yaml", [
        f"trainer.steps={steps}", f"trainer.max_steps_off_policy={k}", "trainer.progress=false",
        f"output.dir={runs_dir}", f"output.name=sync-vs-async-k{k}"])
    run_dir = make_run_dir(cfg, overwrite=True)
    result = run_training(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    elapsed = {r["step"]: r["elapsed_s"] for r in train}
    return {"max_steps_off_policy": k, "wall_s": result["wall_s"], "mean_step_s": result["mean_step_s"],
            "eval": [{"step": e["step"], "accuracy": e["eval/accuracy"], "elapsed_s": elapsed.get(e["step"], 0.0)}
                     for e in evals],
            "reward_mean": [r["reward/mean"] for r in train], "run_dir": str(run_dir)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        label = "synchronous (K=0)" if r["max_steps_off_policy"] == 0 else f"async K={r['max_steps_off_policy']}"
        steps = [e["step"] for e in r["eval"]]
        acc = [100 * e["accuracy"] for e in r["eval"]]
        axes[0].plot(steps, acc, marker="o", label=label)
        axes[1].plot([e["elapsed_s"] / 60 for e in r["eval"]], acc, marker="o", label=label)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("wall-clock minutes (evaluation included)")
    for ax in axes:
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("default task (2-digit addition, SmolLM2-135M, 2-core CPU): synchronous vs asynchronous")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs-dir", default="runs")
    args = parser.parse_args()
    rows = []
    for k in (0, 1):
        rows.append(run(k, args.steps, args.runs_dir))
        print(f"K={k}: " + " -> ".join(f"{e['accuracy']:.1%} (step {e['step']})" for e in rows[-1]["eval"])
              + f"; mean step {rows[-1]['mean_step_s']:.1f}s, wall {rows[-1]['wall_s']:.0f}s")
    write_result("sync_vs_async", {"kind": "sync_vs_async", "steps": args.steps, "rows": rows})
    plot(rows, RESULTS / "sync_vs_async.png")
    print(f"wrote {RESULTS / 'sync_vs_async.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
