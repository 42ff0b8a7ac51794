"""Do the channels help? The ablation arms (baseline, +SDPO, +replay, full) with the same seeds,
steps and held-out evals, on arithmetic and on the easy code tier, plus the contrast arms (replay
with student-copy teachers; SDPO at other alphas; replay at other betas and teacher error rates).

    python benchmarks/ablation.py                        # the plan below, resuming what is done
    python benchmarks/ablation.py --arms baseline sdpo --tasks arithmetic --seeds 0
    python benchmarks/ablation.py --report-only          # rebuild ablation.json/.png from the run files

The plan: arms baseline, sdpo, replay, full on arithmetic (32 steps, evals of 200 problems every
4 steps) and on the easy code tier (`task.code.env.task_source=meshrl_easy`, 16 steps, evals of
50 tasks every 4), seeds 0 1 2; then on arithmetic seed 0 the contrast arms `replay-student`
(three copies of the student behind a local vLLM server, the teachers the earlier ablation used)
and `sdpo-a0.05`, `sdpo-a0.3` (the alpha sweep; `sdpo` itself is alpha 0.1), `replay-b0.03`,
`replay-b0.3`, `replay-b1.0` (the replay term's weight; `replay` itself is beta 0.1) and
`replay-b0.03-d0.03`, `replay-b0.03-d0.3` (beta 0.03 with DPO's own beta at 0.03 and 0.3, not 0.1),
`full-b0.03` (the full step with the best of those betas), `replay-e0`, `replay-e0.4` (the
oracle teacher wrong never or 40 % of the time; `replay`'s is wrong 20 %, `--oracle-error-rate`),
and `sdpo-h-noanswer`, `sdpo-h-worked` (other hint templates: `HINTS`).

A seed sets `trainer.seed` (the data order) and `generator.seed` (sampling). The replay arms'
teachers are the oracle teacher server (meshrl.teachers.oracle: it knows each task's answer and
errs at a configured rate, standing in for a model stronger than the student), started by this
script on the configs' port for those arms and stopped after them.

Each run, as it ends, writes benchmarks/results/ablation/<run>.json (its settings, eval curve
with the training seconds spent before each eval, losses, counters, commit, date and the load
sampled during the run) and, with --commit, commits that file, so a stop loses no finished run;
the run's checkpoints are then deleted (its directory under benchmarks/results/runs keeps the
config, metrics and curves).
A run whose file exists with the same settings is not run again. ablation.json (the summary that
benchmarks/tables.py renders) and ablation.png are rebuilt from the run files after every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
ROUNDS = {"": "the first round (the channels as they were: a learner pass per term)",
          "per-second": "the round of the shared learner pass (every term's datums in one forward/backward)",
          "budget": "the round of SDPO's budget (the hinted teacher's shared prefixes forwarded once, twice the "
                    "sites scored and the most informative trained, a budget that follows the channel's cost)",
          "trees": "the round of the learner's shared prefixes (a prompt's samples, a DPO pair's two sides: the "
                   "prefix forwarded and trained once, as a tree)",
          "pairs": "the round of fewer replay pairs (4 failed traces a step to the teachers and at most 4 pairs "
                   "trained, not 8: half the DPO rows on the learner and half the reference's scoring)"}
"""A round of the ablation -> what it measured. Each round keeps its run files in
benchmarks/results/ablation[-<round>]/ and its summary in ablation[-<round>].json/.png, so a later
round never overwrites the runs an earlier one made (the earlier round is the "before")."""
SDPO_BEFORE_BUDGET = ["sdpo.candidates_per_site=1", "sdpo.cost_share=0", "sdpo.min_shared_prefix=0"]
"""SDPO as it ran before the budget round: every site it found trained, each forwarded whole."""
SDPO_BUDGET = ["sdpo.candidates_per_site=2", "sdpo.cost_share=0.1"]
"""SDPO in the budget round: twice the sites scored, the most informative trained, a tenth of the step's cost."""
FOUR_PAIRS = ["replay.traces_per_step=4", "replay.max_pairs_per_step=4"]
"""Replay in the pairs round: half the traces replayed and pairs trained a step."""
WHOLE = ["learner.shared_prefix_tokens=0"]
"""The learner as it ran before the trees round: every sequence forwarded and trained whole."""
PINNED = {"": {"baseline": WHOLE, "replay": ["replay.beta=0.1", *WHOLE], "sdpo": [*SDPO_BEFORE_BUDGET, *WHOLE],
               "full": ["replay.beta=0.1", *SDPO_BEFORE_BUDGET, *WHOLE], "replay-student": WHOLE},
          "per-second": {"baseline": WHOLE, "replay": WHOLE, "sdpo": [*SDPO_BEFORE_BUDGET, *WHOLE],
                         "full": [*SDPO_BEFORE_BUDGET, *WHOLE]},
          "budget": {"baseline": WHOLE, "sdpo": [*SDPO_BUDGET, *WHOLE], "full": [*SDPO_BUDGET, *WHOLE]},
          "trees": {}, "pairs": {"replay": FOUR_PAIRS, "full": FOUR_PAIRS}}
"""round -> config -> the round's settings that differ from the config's (replay's weight is 0.03
there now, the better setting the first round found; the shared prefixes of SDPO's teacher came
after the per-second round; the budget round's SDPO selection did not become the configs'; the
learner's prefix trees came after the budget round; the pairs round's 4 pairs a step did not become
the configs'), so that every round's arms run as they did (an arm's own overrides come after these)."""
RUNS = Path("benchmarks/results/runs")
TEACHER_PORT = 8001  # the port the ablation configs' teachers point at

MAIN_ARMS = ("baseline", "sdpo", "replay", "full")
HINTS = {
    "noanswer": {"math.wrong_answer": "Hint: {extracted} is not right.",
                 "math.wrong_format": "Hint: finish with the final result as a plain number."},
    "worked": {"math.wrong_answer": "Hint: {a} {op} {b} = {answer}, so {extracted} is wrong. Reply with {answer}.",
               "math.wrong_format": "Hint: {a} {op} {b} = {answer}. End your reply with the number {answer}."},
}
"""The hint-template sweep on arithmetic (the `sdpo` arm's templates, meshrl.config.sdpo.DEFAULT_HINTS,
say the answer is wrong and what the correct one is): `noanswer` withholds the correct answer,
`worked` states the computation and asks for the answer outright."""
ARMS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("baseline", []),
    "sdpo": ("sdpo", []),
    "replay": ("replay", []),
    "full": ("full", []),
    "replay-student": ("replay-student", []),
    "sdpo-a0.05": ("sdpo", ["sdpo.alpha=0.05"]),
    "sdpo-a0.3": ("sdpo", ["sdpo.alpha=0.3"]),
    "replay-b0.03": ("replay", ["replay.beta=0.03"]),
    "replay-b0.3": ("replay", ["replay.beta=0.3"]),
    "replay-b1.0": ("replay", ["replay.beta=1.0"]),
    "full-b0.03": ("full", ["replay.beta=0.03"]),
    "replay-e0": ("replay", []),
    "replay-e0.4": ("replay", []),
    "replay-b0.03-d0.03": ("replay", ["replay.beta=0.03", "replay.dpo_beta=0.03"]),
    "replay-b0.03-d0.3": ("replay", ["replay.beta=0.03", "replay.dpo_beta=0.3"]),
    "sdpo-h-noanswer": ("sdpo", [f"sdpo.hints={json.dumps(HINTS['noanswer'])}"]),
    "sdpo-h-worked": ("sdpo", [f"sdpo.hints={json.dumps(HINTS['worked'])}"]),
}
"""arm -> (configs/ablation-<name>.yaml, extra overrides)."""
TEACHERS = {"replay": "oracle", "full": "oracle", "replay-student": "student"}
"""config -> the teachers its arms need."""


ORACLE_ARMS = {"replay-e0": {"error_rate": 0.0}, "replay-e0.4": {"error_rate": 0.4}}
"""arm -> the oracle teacher's settings it sets over the command line's (the teacher sweep)."""


def teacher_kind(arm: str) -> str | None:
    """The teachers ``arm`` needs ("oracle", "student"), or None."""
    return TEACHERS.get(ARMS[arm][0])


def oracle_config(arm: str, task: str, args: argparse.Namespace):
    """The oracle teacher's settings for ``arm`` on ``task``."""
    from meshrl.teachers.oracle import OracleConfig

    return OracleConfig(**{**ORACLE[task], "error_rate": args.oracle_error_rate, "latency_s": args.oracle_latency_s,
                           "seed": 0, **ORACLE_ARMS.get(arm, {})})


TASK_OVERRIDES = {
    "arithmetic": [],
    # two-turn code episodes are long: a token budget per learner micro-batch bounds the learner's memory
    "code": ["task.kind=code", "task.code.env.task_source=meshrl_easy", "task.code.env.code.max_turns=2",
             "learner.micro_batch_tokens=4096"],
}
ORACLE = {"arithmetic": {"task": "arithmetic"}, "code": {"task": "code", "code_source": "meshrl_easy"}}
"""The oracle teacher's settings per task (with the error rate, latency and seed of the command line)."""


def run_name(arm: str, task: str, seed: int) -> str:
    return f"ablation-{arm}-{task}-s{seed}"


def settings(task: str, args: argparse.Namespace) -> dict:
    """What makes two runs of one arm comparable."""
    if task == "code":
        return {"steps": args.code_steps, "eval_every": args.code_eval_every, "eval_size": args.code_eval_size}
    return {"steps": args.steps, "eval_every": args.eval_every, "eval_size": args.eval_size}


def command(arm: str, task: str, seed: int, s: dict, round_: str = "") -> list[str]:
    config, extra = ARMS[arm]
    extra = [*PINNED.get(round_, {}).get(config, []), *extra]
    size = f"task.code.heldout_limit={s['eval_size']}" if task == "code" else f"trainer.eval.size={s['eval_size']}"
    overrides = [f"trainer.seed={seed}", f"generator.seed={seed}", *TASK_OVERRIDES[task], size, *extra]
    if task == "code" and teacher_kind(arm):
        overrides.append("replay.teachers.canonicaliser=code")
    return [sys.executable, "-m", "meshrl.cli", "train", "-c", f"configs/ablation-{config}.yaml",
            f"trainer.steps={s['steps']}", f"trainer.eval.every={s['eval_every']}", f"output.dir={RUNS}",
            f"output.name={run_name(arm, task, seed)}", "trainer.progress=false",
            "trainer.checkpoint.export_final=false", *overrides, "--overwrite"]


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds while a run goes on."""

    def __init__(self, every_s: float = 15.0):
        self.every_s, self.samples, self.stop = every_s, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self.stop.wait(self.every_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def summarise(arm: str, task: str, seed: int, s: dict) -> dict:
    """A finished run's figures, from its metrics.jsonl."""
    from meshrl.metrics.records import read_metrics

    records = read_metrics(ROOT / RUNS / run_name(arm, task, seed) / "metrics.jsonl")
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    if len(train) != s["steps"]:
        raise RuntimeError(f"{run_name(arm, task, seed)}: {len(train)} training steps recorded, expected {s['steps']}")
    spent, seconds = 0.0, {0: 0.0}
    for r in train:  # training seconds before each step's end (evals excluded)
        spent += r["timing/step_s"]
        seconds[r["step"]] = spent
    evals = sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])
    last = train[-1]

    def mean(key: str) -> float:
        return sum(r.get(key, 0.0) for r in train) / len(train)

    return {
        "arm": arm, "task": task, "seed": seed, **s,
        "evals": [{"step": r["step"], "accuracy": r["eval/accuracy"], "train_s": seconds[r["step"]]} for r in evals],
        "train_s": spent, "mean_step_s": spent / len(train),
        "mean_parts_s": {k.split("/", 1)[1]: mean(k) for k in ("timing/generate_s", "timing/train_s", "timing/sync_s",
                                                                  "timing/sdpo_s", "timing/sdpo_teacher_s")},
        "mean_loss": {k: mean(k) for k in ("loss/grpo", "loss/sdpo_jsd", "loss/replay_dpo", "loss/total")},
        "steps_with_nonzero": {k: sum(1 for r in train if r.get(k, 0.0) != 0.0)
                               for k in ("loss/sdpo_jsd", "loss/replay_dpo")},
        "reward_mean": mean("reward/mean"),
        "final_counters": {k: last[k] for k in sorted(last) if k.startswith(("sdpo/", "replay/"))
                           and isinstance(last[k], (int, float))},
        "faults": [f"{r['mesh']} lost at step {r['step']}, {r['action']}" for r in records if r["kind"] == "fault"],
    }


def round_name(round_: str) -> str:
    """The result name of an ablation round: ``ablation`` or ``ablation-<round>``."""
    return f"ablation-{round_}" if round_ else "ablation"


def run_file(key: tuple, round_: str) -> Path:
    return RESULTS / round_name(round_) / f"{run_name(*key)}.json"


def recorded(key: tuple, s: dict, round_: str) -> dict | None:
    """The run's file in ``round_`` if it exists with settings ``s``."""
    path = run_file(key, round_)
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    return run if all(run.get(k) == v for k, v in s.items()) else None


def commit(paths: list[Path], message: str) -> None:
    """Commit exactly ``paths`` (whatever else the index holds stays out), retrying a busy index."""
    rel = [str(p.relative_to(ROOT)) for p in paths]
    for _ in range(10):
        add = subprocess.run(["git", "add", "--", *rel], cwd=ROOT, capture_output=True, text=True)
        done = add.returncode == 0 and subprocess.run(["git", "commit", "-q", "-m", message, "--", *rel], cwd=ROOT,
                                                       capture_output=True, text=True).returncode == 0
        if done:
            return
        time.sleep(3)
    print(f"could not commit {rel}", flush=True)


@contextlib.contextmanager
def teachers(arm: str, task: str, args: argparse.Namespace, record: dict):
    """The teacher server ``arm`` needs on TEACHER_PORT (if any); the oracle's settings and
    counters go into ``record["oracle"]`` when the arm is over."""
    kind = teacher_kind(arm)
    if kind is None or args.no_teacher_server:
        yield
        return
    if kind == "oracle":
        from meshrl.teachers.oracle import OracleTeacherServer

        cfg = oracle_config(arm, task, args)
        with OracleTeacherServer(cfg, port=TEACHER_PORT) as server:
            yield
            record["oracle"] = {**cfg.model_dump(), "stats": server.stats()}
        return
    from meshrl.models.provision import resolve_model
    from meshrl.teachers.serve import LocalTeacherServer

    with LocalTeacherServer(resolve_model("smollm2-135m-instruct"), "smollm2-135m-instruct", port=TEACHER_PORT):
        yield


def render_tables() -> list[Path]:
    """The pages benchmarks/tables.py renders from the results (the ablation's summary among them),
    brought up to date, so that a committed run leaves them matching the committed JSON."""
    from benchmarks.tables import DOCS, README, main as tables_main

    if tables_main([]) != 0:
        raise RuntimeError("benchmarks/tables.py could not render the tables")
    return [DOCS, README]


def plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(arm, task, seed) in the order they run: each seed's main arms together, so the first
    paired comparisons are complete early; the contrast arms last."""
    keys = [(arm, task, seed) for task in args.tasks for seed in (args.code_seeds if task == "code" else args.seeds)
            for arm in args.arms if arm in MAIN_ARMS]
    keys += [(arm, "arithmetic", seed) for arm in args.arms if arm not in MAIN_ARMS
             for seed in args.contrast_seeds if "arithmetic" in args.tasks]
    return keys


def main() -> None:
    from benchmarks.ablation_report import write_summary
    from benchmarks.common import provenance

    parser = argparse.ArgumentParser(description="the ablation arms side by side")
    parser.add_argument("--steps", type=int, default=32, help="arithmetic steps")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=200, help="held-out arithmetic problems per eval")
    parser.add_argument("--code-steps", type=int, default=16)
    parser.add_argument("--code-eval-every", type=int, default=4)
    parser.add_argument("--code-eval-size", type=int, default=50, help="held-out code tasks per eval")
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--tasks", nargs="+", choices=tuple(TASK_OVERRIDES), default=list(TASK_OVERRIDES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--code-seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--contrast-seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--oracle-error-rate", type=float, default=0.2)
    parser.add_argument("--oracle-latency-s", type=float, default=0.2)
    parser.add_argument("--no-teacher-server", action="store_true",
                        help="a teacher is already listening on the configs' base_url")
    parser.add_argument("--rerun", action="store_true", help="run the planned arms even where a run file exists")
    parser.add_argument("--report-only", action="store_true", help="rebuild ablation.json/.png, run nothing")
    parser.add_argument("--commit", action="store_true", help="git-commit each run's file as it is written")
    parser.add_argument("--round", default="", choices=tuple(ROUNDS),
                        help="the round the runs belong to (its own run files and summary); " +
                        "; ".join(f"{k or 'the default'}: {v}" for k, v in ROUNDS.items()))
    args = parser.parse_args()
    run_files = RESULTS / round_name(args.round)

    todo = [k for k in plan(args) if args.rerun or recorded(k, settings(k[1], args), args.round) is None]
    print(f"{len(todo)} runs to go: {[run_name(*k) for k in todo]}", flush=True)
    if args.report_only:
        todo = []
    for key in todo:
        arm, task, seed = key
        s = settings(task, args)
        served: dict = {}
        with teachers(arm, task, args, served), LoadSampler() as load:
            started = time.perf_counter()
            cmd = command(arm, task, seed, s, args.round)
            print("$", " ".join(cmd), flush=True)
            code = subprocess.run(cmd, cwd=ROOT).returncode
            wall = time.perf_counter() - started
        if code != 0:  # the others still run; this one stays unrecorded, so a later invocation retries it
            print(f"{run_name(*key)} failed with exit code {code}; going on", flush=True)
            continue
        run = {**summarise(arm, task, seed, s), "wall_s": wall, "command": " ".join(cmd[2:]), **served,
               **{k: v for k, v in provenance().items() if k != "load_average_1m"},
               "load_1m": {"mean": sum(load.samples) / max(len(load.samples), 1), "max": max(load.samples, default=0.0)}}
        run_files.mkdir(parents=True, exist_ok=True)
        run_file(key, args.round).write_text(json.dumps(run, indent=1) + "\n")
        # the run file holds what the ablation needs; a run's two checkpoints (~3.3 GB with the
        # optimizer state) would fill the disk over the 30 planned runs
        shutil.rmtree(ROOT / RUNS / run_name(*key) / "checkpoints", ignore_errors=True)
        written = [*write_summary(run_files, round_name(args.round)), *render_tables()]
        if args.commit:
            commit([run_file(key, args.round), *written], f"Ablation run {run_name(*key)}: {len(run['evals'])} evals, "
                   f"last {100 * run['evals'][-1]['accuracy']:.1f}%, {run['mean_step_s']:.1f} s/step")
    if not todo:  # each run rebuilt (and with --commit committed) the summary as it ended
        written = [*write_summary(run_files, round_name(args.round)), *render_tables()]
        print("wrote", ", ".join(str(p.relative_to(ROOT)) for p in written))


if __name__ == "__main__":
    main()
