"""The four ablation arms (baseline, +SDPO, +replay, full) run one after the other with the same
seed, steps and evals, so their cost per step and their learning can be compared side by side.

    python benchmarks/ablation.py --steps 16 --eval-every 8

The replay arms need an OpenAI-compatible teacher at the configs' base_url
(http://127.0.0.1:8001/v1): unless --no-teacher-server is given, this script starts one
(`meshrl teachers serve`, vLLM serving the packaged model) for those arms and stops it after.
On one 2-core machine that server competes with training for the cores, so the replay arms'
step times include the teachers' compute; with hosted teachers they would not.

Writes benchmarks/results/ablation.json and benchmarks/results/ablation.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("baseline", "sdpo", "replay", "full")
NEEDS_TEACHERS = {"replay", "full"}
TEACHER_PORT = 8001  # the port the ablation configs point at
RUNS = Path("benchmarks/results/runs")


def run_arm(arm: str, steps: int, eval_every: int) -> float:
    cmd = [sys.executable, "-m", "meshrl.cli", "train", "-c", f"configs/ablation-{arm}.yaml",
           f"trainer.steps={steps}", f"trainer.eval.every={eval_every}", f"output.dir={RUNS}",
           f"output.name=ablation-{arm}", "trainer.progress=false", "trainer.checkpoint.export_final=false",
           "--overwrite"]
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - started


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarise(arm: str, wall_s: float) -> dict:
    from meshrl.controller.metrics import read_metrics

    records = read_metrics(ROOT / RUNS / f"ablation-{arm}" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    last = train[-1]
    counters = {k: last[k] for k in sorted(last) if k.startswith(("sdpo/", "replay/")) and isinstance(last[k], float)}
    return {
        "wall_s": wall_s,
        "mean_step_s": mean([r["timing/step_s"] for r in train]),
        "mean_train_s": mean([r["timing/train_s"] for r in train]),
        "mean_loss": {k: mean([r.get(k, 0.0) for r in train])
                      for k in ("loss/grpo", "loss/sdpo_jsd", "loss/replay_dpo", "loss/total")},
        "steps_with_nonzero": {k: sum(1 for r in train if r.get(k, 0.0) != 0.0)
                               for k in ("loss/sdpo_jsd", "loss/replay_dpo")},
        "reward_mean": mean([r["reward/mean"] for r in train]),
        "eval_accuracy": {str(r["step"]): r["eval/accuracy"] for r in records if r["kind"] == "eval"},
        "final_counters": counters,
    }


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, s in summary["arms"].items():
        steps = sorted(s["eval_accuracy"], key=int)
        acc_ax.plot([int(x) for x in steps], [100 * s["eval_accuracy"][x] for x in steps], marker="o", label=arm)
    acc_ax.set(xlabel="step", ylabel="held-out greedy accuracy (%)", title="learning per arm")
    acc_ax.legend()
    arms = list(summary["arms"])
    time_ax.bar(arms, [summary["arms"][a]["mean_step_s"] for a in arms])
    time_ax.set(ylabel="mean seconds per step", title="cost per step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description="the four ablation arms side by side")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--no-teacher-server", action="store_true",
                        help="a teacher is already listening on the configs' base_url")
    args = parser.parse_args()
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)

    walls: dict[str, float] = {}
    for arm in [a for a in args.arms if a not in NEEDS_TEACHERS]:
        walls[arm] = run_arm(arm, args.steps, args.eval_every)
    replay_arms = [a for a in args.arms if a in NEEDS_TEACHERS]
    if replay_arms:
        if args.no_teacher_server:
            for arm in replay_arms:
                walls[arm] = run_arm(arm, args.steps, args.eval_every)
        else:
            from meshrl.models.provision import resolve_model
            from meshrl.teachers.serve import LocalTeacherServer

            with LocalTeacherServer(resolve_model("smollm2-135m-instruct"), "smollm2-135m-instruct",
                                    port=TEACHER_PORT):
                for arm in replay_arms:
                    walls[arm] = run_arm(arm, args.steps, args.eval_every)

    summary = {"steps": args.steps, "eval_every": args.eval_every,
               "arms": {arm: summarise(arm, walls[arm]) for arm in args.arms if arm in walls}}
    base = summary["arms"].get("baseline")
    if base:
        for s in summary["arms"].values():
            s["step_time_vs_baseline"] = s["mean_step_s"] / base["mean_step_s"]
    (results / "ablation.json").write_text(json.dumps(summary, indent=1))
    plot(summary, results / "ablation.png")
    for arm, s in summary["arms"].items():
        accs = " -> ".join(f"{100 * v:.1f}%" for _, v in sorted(s["eval_accuracy"].items(), key=lambda kv: int(kv[0])))
        print(f"{arm:>8}: step {s['mean_step_s']:.1f}s (x{s.get('step_time_vs_baseline', 1.0):.2f} baseline), "
              f"accuracy {accs}, loss terms {s['mean_loss']}")
    print(f"wrote {results / 'ablation.json'} and {results / 'ablation.png'}")


if __name__ == "__main__":
    main()
