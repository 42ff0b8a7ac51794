"""The base model's pass@1 on the easy code tier (`task.code.env.task_source=meshrl_easy`): the greedy
held-out evaluation a training run makes at step 0, on the tier's test split, and the same
evaluation on its training split (a task the greedy policy sometimes solves is one whose sampled
GRPO groups can hold both successes and failures).

    python benchmarks/code_tier.py                     # smollm2-135m-instruct, the code ablation's settings
    python benchmarks/code_tier.py --no-train          # the held-out split only
    python benchmarks/code_tier.py generator.sampling.max_new_tokens=64   # extra overrides

The run is configured like `meshrl train` with configs/default.yaml and the code ablation's task
overrides (benchmarks/ablation.py: `task.kind=code`, two turns per episode) and is evaluated with
the loop's own `evaluate()` before any training step, so the held-out figure is the `eval/accuracy`
a training run logs at step 0. Writes benchmarks/results/code_tier_easy.json: pass@1, mean reward
and turns per split, and the tasks solved per family.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from ablation import TASK_OVERRIDES
from common import write_result

TIER_OVERRIDES = ["task.code.env.task_source=meshrl_easy", "trainer.eval.size=1000", "trainer.progress=false"]
"""The easy tier (whatever the ablation's code task is), every held-out task in one evaluation."""


def evaluate(rt, tasks: list) -> tuple[dict, list[dict]]:
    """The loop's greedy evaluation on ``tasks`` (made the task set's held-out list); its metrics and
    the records of its episodes."""
    rt.task.held = list(tasks)
    records = rt.loop.strategy.episode_records
    first = len(records)
    metrics = rt.loop.evaluate()
    return metrics, records[first:]


def summary(tasks: list, metrics: dict, records: list[dict]) -> dict:
    """pass@1, tasks solved, mean reward and turns of one split's evaluation."""
    return {"tasks": len(tasks), "pass@1": metrics["eval/accuracy"], "solved": sum(r["success"] for r in records),
            "reward_mean": metrics["eval/reward_mean"],
            "mean_turns": sum(r["num_turns"] for r in records) / len(records), "eval_s": metrics["timing/eval_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description="base-model pass@1 on the easy code tier")
    parser.add_argument("overrides", nargs="*", help="extra dotted config overrides")
    parser.add_argument("--no-train", action="store_true", help="skip the training split")
    parser.add_argument("--out", default=None, help="result file (default benchmarks/results/code_tier_easy.json)")
    args = parser.parse_args()

    from meshrl.cli import default_config_path
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.controller.runtime import Runtime

    overrides = list(dict.fromkeys([*TASK_OVERRIDES["code"], *TIER_OVERRIDES, *args.overrides]))
    cfg = load_config(RunConfig, default_config_path(), overrides)
    started = time.perf_counter()
    splits, family = {}, Counter()
    with Runtime(cfg) as rt:
        held, train = rt.task.heldout(), list(rt.task.stream.items)
        for name, tasks in (("test", held), ("train", train))[: 1 if args.no_train else 2]:
            metrics, records = evaluate(rt, tasks)
            splits[name] = summary(tasks, metrics, records)
            of = {t.task_id: t.metadata["family"] for t in tasks}
            for r in records:
                family[(of[r["task_id"]], name, "solved")] += r["success"]
                family[(of[r["task_id"]], name, "tasks")] += 1
            print(f"{name}: pass@1 {splits[name]['pass@1']:.1%} ({splits[name]['solved']}/{len(tasks)} tasks)")
    families = {f: {f"{split}_{k}": family[(f, split, k)] for split in splits for k in ("solved", "tasks")}
                for f in sorted({f for f, _, _ in family})}
    write_result("code_tier_easy", {
        "model": cfg.model.name_or_path, "task_source": cfg.task.code.env.task_source,
        "max_turns": cfg.task.code.env.code.max_turns, "max_new_tokens": cfg.generator.sampling.max_new_tokens,
        "greedy": True, "command": " ".join(["python", "benchmarks/code_tier.py", *sys.argv[1:]]),
        "overrides": overrides, "heldout": splits["test"], "train": splits.get("train"), "families": families,
        "wall_s": time.perf_counter() - started,
    }, args.out)


if __name__ == "__main__":
    main()
