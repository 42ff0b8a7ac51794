"""Where +SDPO's extra step time goes, with the hinted teacher on its own mesh (`sdpo.teacher=mesh`)
and in the learner's processes (`sdpo.teacher=learner`), against the baseline (GRPO alone): the
same seed, task, model and steps, run one after the other on this machine.

    python benchmarks/sdpo_cost.py                 # 8 steps per arm on arithmetic (configs/ablation-sdpo.yaml)
    python benchmarks/sdpo_cost.py --steps 4

Per arm: mean seconds per step (the first step, which pays the engines' warm-up, is left out) and
its parts: sampling (`timing/generate_s`), the learner's optimizer steps (`timing/train_s`; with
the teacher in the learner, the teacher's forward is inside it: `timing/sdpo_teacher_s`), site
selection (`timing/sdpo_select_s`), the teacher mesh's scoring (`timing/sdpo_teacher_s`, in the
producer), the weight sync (`timing/sync_s`) and the teacher mesh's share of it
(`sync/sdpo_teacher_s`). Writes benchmarks/results/sdpo_cost.json.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RUNS = Path("benchmarks/results/runs")
ARMS = {"baseline": ["sdpo.alpha=0"], "sdpo-mesh": ["sdpo.teacher=mesh"], "sdpo-learner": ["sdpo.teacher=learner"]}
PARTS = ("timing/step_s", "timing/generate_s", "timing/train_s", "timing/sdpo_select_s", "timing/sdpo_teacher_s",
         "timing/sync_s", "sync/sdpo_teacher_s")


def run(arm: str, args: argparse.Namespace) -> dict:
    from benchmarks.common import provenance
    from meshrl.metrics.records import read_metrics

    name = f"sdpo-cost-{arm}"
    cmd = [sys.executable, "-m", "meshrl.cli", "train", "-c", "configs/ablation-sdpo.yaml", f"trainer.steps={args.steps}",
           "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.progress=false",
           "trainer.checkpoint.export_final=false", f"trainer.seed={args.seed}", f"generator.seed={args.seed}",
           f"output.dir={RUNS}", f"output.name={name}", *ARMS[arm], "--overwrite"]
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    wall = time.perf_counter() - started
    train = [r for r in read_metrics(ROOT / RUNS / name / "metrics.jsonl") if r["kind"] == "train"][1:]
    means = {k: sum(r.get(k, 0.0) for r in train) / len(train) for k in PARTS}
    means["sdpo/hints"] = train[-1].get("sdpo/hints", 0.0)  # cumulative: the run's error sites scored
    load = provenance()["load_average_1m"]
    return {"arm": arm, "wall_s": wall, "steps_measured": len(train), "load_average_1m_after": load, **means}


def main() -> None:
    from benchmarks.common import write_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [run(arm, args) for arm in ARMS]
    base = rows[0]["timing/step_s"]
    for r in rows:
        r["step_vs_baseline"] = r["timing/step_s"] / base
        r["extra_step_s"] = r["timing/step_s"] - base
        print(f"{r['arm']:>13}: {r['timing/step_s']:.2f} s/step (x{r['step_vs_baseline']:.2f}), "
              + ", ".join(f"{k.split('/')[1]} {r[k]:.2f}" for k in PARTS[1:]), flush=True)
    faster = min(rows[1:], key=lambda r: r["timing/step_s"])["arm"]
    write_result("sdpo_cost", {"steps": args.steps, "seed": args.seed, "config": "configs/ablation-sdpo.yaml",
                               "rows": rows, "faster_teacher": faster.removeprefix("sdpo-")})
    print(f"faster: {faster}; wrote benchmarks/results/sdpo_cost.json")


if __name__ == "__main__":
    main()
