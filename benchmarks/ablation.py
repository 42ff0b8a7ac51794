"""The four ablation arms (baseline, +SDPO, +replay, full) run one after the other with the same
seeds, steps and evals, on the default arithmetic task and on the multi-turn code task, so their
cost per step and their learning can be compared side by side.

    python benchmarks/ablation.py --steps 16 --eval-every 8 --tasks arithmetic code --seeds 0 1
    python benchmarks/ablation.py --quick      # 6 steps, evals every 3 on 100 problems (20 code tasks)

A seed sets `trainer.seed` (the data order) and `generator.seed` (sampling). The code task runs with
`task.kind=code`, two turns per episode and the `code` canonicaliser for the teachers.

The replay arms need an OpenAI-compatible teacher at the configs' base_url
(http://127.0.0.1:8001/v1): unless --no-teacher-server is given, this script starts one
(`meshrl teachers serve`, vLLM serving the packaged model) for those arms and stops it after.
On one 2-core machine that server competes with training for the cores, so the replay arms'
step times include the teachers' compute; with hosted teachers they would not.

Writes benchmarks/results/ablation.json and benchmarks/results/ablation.png. The JSON accumulates:
the runs recorded there with the same steps, evals and eval sizes are kept unless this invocation
reruns them (each run carries the commit, date and load it ran at), so `make bench`'s quick run of
the arithmetic task's seed 0 refreshes those four arms and keeps the code task's and seed 1's;
`--resume` reruns none of the recorded ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
ARMS = ("baseline", "sdpo", "replay", "full")
NEEDS_TEACHERS = {"replay", "full"}
TEACHER_PORT = 8001  # the port the ablation configs point at
RUNS = Path("benchmarks/results/runs")


TASK_OVERRIDES = {
    "arithmetic": [],
    # two-turn code episodes are long: a token budget per learner micro-batch keeps the SDPO arms'
    # logits within this machine's memory (16 such sequences at once ran the learner to 17 GB)
    "code": ["task.kind=code", "task.code.env.code.max_turns=2", "learner.micro_batch_tokens=4096"],
}


def run_name(arm: str, task: str, seed: int) -> str:
    return f"ablation-{arm}-{task}-s{seed}"


def run_arm(arm: str, task: str, seed: int, args: argparse.Namespace) -> float:
    overrides = [f"trainer.seed={seed}", f"generator.seed={seed}", *TASK_OVERRIDES[task]]
    if task == "code":
        overrides.append(f"task.code.heldout_limit={args.code_eval_size}")
        if arm in NEEDS_TEACHERS:
            overrides.append("replay.teachers.canonicaliser=code")
    else:
        overrides.append(f"trainer.eval.size={args.eval_size}")
    cmd = [sys.executable, "-m", "meshrl.cli", "train", "-c", f"configs/ablation-{arm}.yaml",
           f"trainer.steps={args.steps}", f"trainer.eval.every={args.eval_every}", f"output.dir={RUNS}",
           f"output.name={run_name(arm, task, seed)}", "trainer.progress=false",
           "trainer.checkpoint.export_final=false", *overrides, "--overwrite"]
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.perf_counter() - started


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def complete(arm: str, task: str, seed: int, args: argparse.Namespace) -> bool:
    """Whether the arm's run directory holds a finished run with ``args``' steps and evals."""
    from meshrl.metrics.records import read_metrics

    path = ROOT / RUNS / run_name(arm, task, seed) / "metrics.jsonl"
    if not path.exists():
        return False
    records = read_metrics(path)
    evals = {r["step"] for r in records if r["kind"] == "eval"}
    return (sum(r["kind"] == "train" for r in records) == args.steps
            and evals == set(range(0, args.steps + 1, args.eval_every)) | {args.steps})


def summarise(arm: str, task: str, seed: int, wall_s: float | None) -> dict:
    """The run's figures; ``wall_s`` None for a run kept by --resume (its process was not timed)."""
    from meshrl.metrics.records import read_metrics

    records = read_metrics(ROOT / RUNS / run_name(arm, task, seed) / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    last = train[-1]
    counters = {k: last[k] for k in sorted(last) if k.startswith(("sdpo/", "replay/")) and isinstance(last[k], float)}
    return {
        "arm": arm, "task": task, "seed": seed, "wall_s": wall_s,
        "mean_step_s": mean([r["timing/step_s"] for r in train]),
        "mean_train_s": mean([r["timing/train_s"] for r in train]),
        "mean_loss": {k: mean([r.get(k, 0.0) for r in train])
                      for k in ("loss/grpo", "loss/sdpo_jsd", "loss/replay_dpo", "loss/total")},
        "steps_with_nonzero": {k: sum(1 for r in train if r.get(k, 0.0) != 0.0)
                               for k in ("loss/sdpo_jsd", "loss/replay_dpo")},
        "reward_mean": mean([r["reward/mean"] for r in train]),
        "eval_accuracy": {str(r["step"]): r["eval/accuracy"] for r in records if r["kind"] == "eval"},
        "final_counters": counters,
        # recoveries during the run (e.g. a learner killed for memory and resumed): its step times
        # include the recovery and the steps redone
        "faults": [f"{r['mesh']} lost at step {r['step']}, {r['action']}"
                   + (f" of step {r['resumed_from_step']}" if "resumed_from_step" in r else "")
                   for r in records if r["kind"] == "fault"],
    }


def mean_curve(runs: list[dict]) -> tuple[list[int], list[float]]:
    """Held-out accuracy per eval step, averaged over the seeds that evaluated there."""
    steps = sorted({int(k) for r in runs for k in r["eval_accuracy"]})
    return steps, [100 * mean([r["eval_accuracy"][str(x)] for r in runs if str(x) in r["eval_accuracy"]])
                   for x in steps]


def by_arm(runs: list[dict], task: str) -> dict[str, list[dict]]:
    return {arm: [r for r in runs if r["arm"] == arm and r["task"] == task]
            for arm in ARMS if any(r["arm"] == arm and r["task"] == task for r in runs)}


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = summary["tasks"]
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(5 * (len(tasks) + 1), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        arms = by_arm(summary["runs"], task)
        for arm, runs in arms.items():
            steps, acc = mean_curve(runs)
            style = ARMS.index(arm)  # arms with the same curve stay visible: each its own marker and dashes
            ax.plot(steps, acc, marker="osD^"[style], linestyle=("-", "--", "-.", ":")[style], markersize=9 - 2 * style,
                    label=f"{arm} ({len(runs)} seed{'s' if len(runs) > 1 else ''})")
        ax.set(xlabel="step", ylabel="held-out greedy accuracy (%), mean over seeds", title=f"{task} task")
        ax.set_ylim(0, max([5.0] + [a for runs in arms.values() for a in mean_curve(runs)[1]]) * 1.1)
        ax.grid(alpha=0.3)
        if arms:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not run yet", ha="center", va="center", transform=ax.transAxes)
    time_ax = axes[0][-1]
    width = 0.8 / len(tasks)
    shown = [a for a in ARMS if any(r["arm"] == a for r in summary["runs"])]
    for t, task in enumerate(tasks):
        arms = by_arm(summary["runs"], task)
        if not arms:
            continue
        time_ax.bar([shown.index(arm) + t * width for arm in arms], [mean([r["mean_step_s"] for r in rs])
                                                                    for rs in arms.values()], width, label=task)
    time_ax.set_xticks([i + width * (len(tasks) - 1) / 2 for i in range(len(shown))], shown)
    time_ax.set(ylabel="mean seconds per step", title="cost per step")
    time_ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description="the four ablation arms side by side")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-size", type=int, default=200, help="held-out arithmetic problems per eval")
    parser.add_argument("--code-eval-size", type=int, default=40, help="held-out code tasks per eval")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--tasks", nargs="+", choices=tuple(TASK_OVERRIDES), default=list(TASK_OVERRIDES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--code-seeds", nargs="+", type=int,
                        help="seeds of the code task, when fewer than --seeds (its steps cost 2-3x)")
    parser.add_argument("--quick", action="store_true", help="6 steps, evals every 3 on 100 problems / 20 code tasks")
    parser.add_argument("--no-teacher-server", action="store_true",
                        help="a teacher is already listening on the configs' base_url")
    parser.add_argument("--resume", action="store_true",
                        help="keep the arms already recorded in benchmarks/results/ablation.json with these steps "
                             "and evals, or whose run directory holds such a complete run; only the others run")
    parser.add_argument("--report-only", action="store_true",
                        help="with --resume: write the JSON and PNG of the complete runs found, run nothing")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.eval_size, args.code_eval_size = 6, 3, 100, 20

    seeds = {task: (args.code_seeds if task == "code" and args.code_seeds else args.seeds) for task in args.tasks}
    plan = [(arm, task, seed) for task in args.tasks for seed in seeds[task] for arm in args.arms]
    recorded = recorded_runs(args)
    done: dict[tuple, dict] = {}
    if args.resume:
        done.update({key: run for key, run in recorded.items() if key in plan})
        done.update({key: summarise(*key, None) for key in plan if key not in done and complete(*key, args)})
        print(f"kept {len(done)} runs: {sorted(run_name(*k) for k in done)}", flush=True)
    if args.report_only:
        record(plan, done, recorded, args)
        return

    def run(key: tuple) -> None:
        wall_s = run_arm(*key, args)
        done[key] = {**summarise(*key, wall_s), **run_provenance(), "task_overrides": TASK_OVERRIDES[key[1]]}
        record(plan, done, recorded, args)  # a partial set is kept if a later arm fails or the session ends

    for key in [k for k in plan if k[0] not in NEEDS_TEACHERS and k not in done]:
        run(key)
    replay = [k for k in plan if k[0] in NEEDS_TEACHERS and k not in done]
    if replay:
        if args.no_teacher_server:
            for key in replay:
                run(key)
        else:
            from meshrl.models.provision import resolve_model
            from meshrl.teachers.serve import LocalTeacherServer

            with LocalTeacherServer(resolve_model("smollm2-135m-instruct"), "smollm2-135m-instruct",
                                    port=TEACHER_PORT):
                for key in replay:
                    run(key)
    runs = record(plan, done, recorded, args)
    for r in runs:
        accs = " -> ".join(f"{100 * v:.1f}%" for _, v in sorted(r["eval_accuracy"].items(), key=lambda kv: int(kv[0])))
        print(f"{r['task']:>10} seed {r['seed']} {r['arm']:>8}: step {r['mean_step_s']:.1f}s "
              f"(x{r.get('step_time_vs_baseline', 1.0):.2f} baseline), accuracy {accs}, loss terms {r['mean_loss']}")
    print(f"wrote {RESULTS / 'ablation.json'} and {RESULTS / 'ablation.png'}")


def run_provenance() -> dict:
    """When, at which commit and under what load an arm ran: runs kept by --resume from the JSON may
    come from earlier sessions, so each carries its own."""
    from benchmarks.common import provenance

    return {k: v for k, v in provenance().items() if k != "machine"}


SETTINGS = ("steps", "eval_every", "eval_size", "code_eval_size")


def recorded_runs(args: argparse.Namespace) -> dict[tuple, dict]:
    """The runs already in benchmarks/results/ablation.json, when it was written with the same
    steps, evals and eval sizes (run directories are not committed; the JSON is)."""
    path = RESULTS / "ablation.json"
    if not path.exists():
        return {}
    previous = json.loads(path.read_text())
    if any(previous.get(name) != getattr(args, name) for name in SETTINGS):
        print(f"{path} was written with other settings; its runs are not kept", flush=True)
        return {}
    return {(r["arm"], r["task"], r["seed"]): r for r in previous["runs"]}


def record(plan: list[tuple], done: dict, recorded: dict, args: argparse.Namespace) -> list[dict]:
    """Write the JSON and the PNG: the arms of ``plan`` done so far (``done``; the others are listed
    as `missing`) over the runs ``recorded`` earlier with the same settings, which are kept (each
    run carries its own commit, date and load); returns the runs written."""
    from benchmarks.common import write_result

    merged = {**recorded, **done}
    keys = sorted(merged, key=lambda k: (list(TASK_OVERRIDES).index(k[1]), k[2], ARMS.index(k[0])))
    runs = [merged[key] for key in keys]
    for r in runs:
        base = [b for b in runs if b["arm"] == "baseline" and b["task"] == r["task"] and b["seed"] == r["seed"]]
        if base:
            r["step_time_vs_baseline"] = r["mean_step_s"] / base[0]["mean_step_s"]
    tasks = [t for t in TASK_OVERRIDES if any(k[1] == t for k in keys)]
    summary = {**{name: getattr(args, name) for name in SETTINGS}, "tasks": tasks,
               "seeds": {t: sorted({k[2] for k in keys if k[1] == t}) for t in tasks},
               "missing": [run_name(*key) for key in plan if key not in merged], "runs": runs}
    write_result("ablation", summary)
    plot(summary, RESULTS / "ablation.png")
    return runs

if __name__ == "__main__":
    main()
