"""Learning curves of the environment examples, trained through `meshrl train` on the packaged 135M model.

Environments of the user's own kind (docs/environments.md):
- `tutor`: `AdditionTutorEnv` (examples/addition_tutor.py), a meshrl `Environment` class hosted in the
  env mesh's processes: three attempts at an addition, a better clue after each wrong one;
- `openenv`: `RetryArithmeticEnv` (examples/openenv_arithmetic.py, openenv-core's interface only), served
  by openenv-core's own server in a process the env mesh starts; episodes over OpenEnv's WebSocket;
- `tools`: `MultiplyEnv` (examples/calculator_tools.py), 3-digit multiplication with a `calculator` tool
  the agent calls in the ChatML `<tool_call>` format (tool turns appended token-in/token-out);
- `agent`: a black-box agent program (examples/agent_program.py) with the official `openai` client and
  its own loop, trained through meshrl's OpenAI-compatible endpoint (`task.kind: agent`; GRPO only:
  an agent's episodes carry no error sites or turn contexts for the other channels).

Two arms each (the agent: `grpo`): `grpo` (the policy gradient alone) and `full` (GRPO + alpha * SDPO on the environment's
error sites + beta * trace-replay DPO, the oracle teacher answering the environment's turns: it knows
each sum and is wrong 20 % of the time). Every run evaluates the base model at step 0 on the held-out
episodes (greedy), then every `--eval-every` steps: success rate and mean return.

    python benchmarks/env_examples.py                          # every example and arm, 32 steps
    python benchmarks/env_examples.py --envs tutor --arms grpo --steps 4 --commit

Each run, as it ends, writes benchmarks/results/env_examples/<env>-<arm>.json (curve, per-step reward
and time, channel counters, machine, commit) and, with --commit, commits it; env_examples.json (what
benchmarks/tables.py renders into docs/environments.md) and env_examples.png are rebuilt from the run
files after every run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.ablation import LoadSampler, commit  # noqa: E402
from benchmarks.common import provenance, write_result  # noqa: E402

RUN_FILES = ROOT / "benchmarks" / "results" / "env_examples"
RUNS = Path("benchmarks/results/runs")
TEACHER_PORT = 8002
CONFIGS = {"tutor": "configs/env-tutor.yaml", "openenv": "configs/env-openenv.yaml", "tools": "configs/env-tools.yaml",
           "agent": "configs/agent.yaml"}
_ORACLE = "{{name: oracle-{0}, base_url: 'http://127.0.0.1:%d/v1', model: oracle, temperature: 0.7, max_tokens: 48}}" % TEACHER_PORT
CHANNELS = [
    "sdpo.alpha=0.1", "sdpo.alpha_warmup_steps=4", "sdpo.teacher=learner", "sdpo.max_sites_per_step=16",
    "replay.beta=0.03", "replay.select=failed", "replay.traces_per_step=8", "replay.teachers.agreement_k=2",
    "replay.teachers.canonicaliser=math_answer", "replay.pool.procs=1", "replay.pool.max_version_lag=4",
    "replay.teachers.teachers=[" + ", ".join(_ORACLE.format(x) for x in "abc") + "]",
]
"""The `full` arm's settings over the example's config: the ablation's full step with replay's beta 0.03."""
ARMS = {"grpo": [], "full": CHANNELS}
ONLY_ARMS = {"agent": ("grpo",)}
"""Examples that run only some arms."""


def run_name(env: str, arm: str) -> str:
    return f"env-{env}-{arm}"


def command(env: str, arm: str, args) -> list[str]:
    return [sys.executable, "-m", "meshrl.cli", "train", "-c", CONFIGS[env], f"trainer.steps={args.steps}",
            f"trainer.eval.every={args.eval_every}", f"trainer.eval.size={args.eval_size}", "trainer.eval.at_start=true",
            f"output.dir={RUNS}", f"output.name={run_name(env, arm)}", "trainer.progress=false",
            "trainer.checkpoint.export_final=false", *ARMS[arm], *args.set, "--overwrite"]


def summarise(env: str, arm: str, args) -> dict:
    from meshrl.metrics.records import read_metrics

    records = read_metrics(ROOT / RUNS / run_name(env, arm) / "metrics.jsonl")
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    if len(train) != args.steps:
        raise RuntimeError(f"{run_name(env, arm)}: {len(train)} training steps recorded, expected {args.steps}")
    evals = sorted((r for r in records if r["kind"] == "eval"), key=lambda r: r["step"])
    last = train[-1]
    return {
        "env": env, "arm": arm, "config": CONFIGS[env], "overrides": ARMS[arm], "steps": args.steps,
        "eval_size": args.eval_size,
        "evals": [{"step": r["step"], "success": r["eval/accuracy"], "mean_return": r["eval/reward_mean"]} for r in evals],
        "train": [{"step": r["step"], "reward": r["reward/mean"], "success": r.get("episodes/success"),
                   "turns": r.get("episodes/mean_turns"), "step_s": r["timing/step_s"],
                   "sdpo_jsd": r.get("loss/sdpo_jsd"), "replay_dpo": r.get("loss/replay_dpo")} for r in train],
        "mean_step_s": sum(r["timing/step_s"] for r in train) / len(train),
        "final_counters": {k: last[k] for k in sorted(last)
                           if k.startswith(("sdpo/", "replay/", "env/", "episodes/", "tools/", "agents/"))
                           and isinstance(last[k], (int, float))},
        "faults": [f"{r['mesh']} lost at step {r['step']}" for r in records if r["kind"] == "fault"],
    }


def oracle():
    from meshrl.teachers.oracle import OracleConfig, OracleTeacherServer

    return OracleTeacherServer(OracleConfig(task="arithmetic", error_rate=0.2, latency_s=0.2, seed=0), port=TEACHER_PORT)


def rebuild() -> list[Path]:
    """env_examples.json and env_examples.png from the run files."""
    runs = [json.loads(p.read_text()) for p in sorted(RUN_FILES.glob("*.json"))]
    out = write_result("env_examples", {"runs": runs})
    png = ROOT / "benchmarks" / "results" / "env_examples.png"
    plot(runs, png)
    return [out, png]


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = sorted({r["env"] for r in runs})
    fig, axes = plt.subplots(len(envs), 2, figsize=(10, 3.4 * max(len(envs), 1)), squeeze=False)
    for row, env in zip(axes, envs):
        for run in (r for r in runs if r["env"] == env):
            steps = [e["step"] for e in run["evals"]]
            style = {"grpo": "-o", "full": "-s"}.get(run["arm"], "-^")
            row[0].plot(steps, [100 * e["success"] for e in run["evals"]], style, label=run["arm"])
            row[1].plot(steps, [e["mean_return"] for e in run["evals"]], style, label=run["arm"])
        row[0].set_title(f"{env}: held-out success rate (%)")
        row[1].set_title(f"{env}: held-out mean return")
        for ax in row:
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides for every run (key=value)")
    parser.add_argument("--commit", action="store_true", help="commit each run's file as it ends")
    args = parser.parse_args()
    RUN_FILES.mkdir(parents=True, exist_ok=True)
    for env in args.envs:
        for arm in (a for a in args.arms if a in ONLY_ARMS.get(env, ARMS)):
            print(f"== {run_name(env, arm)}", flush=True)
            with LoadSampler() as load:
                if arm == "full":
                    with oracle():
                        subprocess.run(command(env, arm, args), cwd=ROOT, check=True)
                else:
                    subprocess.run(command(env, arm, args), cwd=ROOT, check=True)
            record = {**summarise(env, arm, args), "load_1m": load.samples, **provenance()}
            path = RUN_FILES / f"{run_name(env, arm)}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            shutil.rmtree(ROOT / RUNS / run_name(env, arm) / "checkpoints", ignore_errors=True)
            print(json.dumps({k: record[k] for k in ("env", "arm", "evals", "mean_step_s")}), flush=True)
            paths = [path, *rebuild()]
            if args.commit:
                commit(paths, f"Env example run {run_name(env, arm)}: success "
                              + " -> ".join(f"{100 * e['success']:.0f}%" for e in record["evals"]))


if __name__ == "__main__":
    main()
