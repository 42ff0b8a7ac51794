"""Seeded short runs on the tiny model whose per-step losses are compared across code versions.

    python scripts/seeded_losses.py --out before.json            # on one version
    python scripts/seeded_losses.py --out after.json --compare before.json   # on another
    python scripts/seeded_losses.py --out after.json --compare before.json --override learner.shared_prefix_tokens=0

Arms (3 steps each, same seed, vowel-fraction toy reward so every group has signal):
  baseline  channel 1 only (ppo, token-mean)
  sdpo      channel 1 + alpha * SDPO JSD (template hints at every failed sample)
Each arm runs through `meshrl train`'s own entry point with real Monarch processes and the real
vLLM engine. `--compare` prints the largest relative difference per arm and metric and exits 1
when one exceeds `--rtol`; it reads a file this script wrote or a recorded before/after comparison
(`benchmarks/results/*_seeded_losses.json`: it compares with that file's `after`). The figures are
reproducible on one machine type only: on another CPU (a different vector unit) they agree at the
first step to about 1e-4 and then drift, so compare runs made on the same kind of CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

TINY = [
    "model.name_or_path=tiny", "model.max_model_len=256", "generator.sampling.max_new_tokens=16",
    "generator.kv_cache_gib=1", "trainer.prompts_per_step=4", "trainer.group_size=4", "trainer.progress=false",
    "learner.lr=5e-3", "rewarder.reward_fn=meshrl.testing.rewards:vowel_fraction", "trainer.steps=3",
    "trainer.eval.every=0", "trainer.eval.at_start=false", "trainer.checkpoint.every=0",
    "trainer.checkpoint.export_final=false",
]
ARMS = {"baseline": [], "sdpo": ["sdpo.alpha=0.5"]}
METRICS = ("loss/grpo", "loss/sdpo_jsd", "loss/total", "reward/mean", "train/grad_norm")


def run_arm(name: str, overrides: list[str], out_dir: Path) -> list[dict]:
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training

    cfg = load_config(RunConfig, None, TINY + [f"output.dir={out_dir}", f"output.name={name}", *overrides])
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    return [{k: r[k] for k in METRICS if k in r} for r in train]


def load_arms(path: Path) -> dict[str, list[dict]]:
    """The per-step metrics of each arm in ``path``: this script's output, or the ``after`` of a
    recorded before/after comparison."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("after"), dict):
        data = data["after"]
    if not (isinstance(data, dict) and data
            and all(isinstance(v, list) and all(isinstance(s, dict) for s in v) for v in data.values())):
        raise ValueError(f"{path}: not a seeded-losses file (arm -> list of per-step metrics, or a "
                         "recorded comparison with an 'after' of that shape)")
    return data


def compare(now: dict, before: dict, rtol: float) -> bool:
    ok = True
    for arm, steps in before.items():
        for metric in METRICS:
            worst = 0.0
            for a, b in zip(now.get(arm, []), steps):
                if metric in b:
                    x, y = a.get(metric, float("nan")), b[metric]
                    worst = max(worst, abs(x - y) / max(abs(y), 1e-12))
            flag = "ok" if worst <= rtol else "DIFFERS"
            ok &= worst <= rtol
            print(f"{arm:9s} {metric:16s} max relative difference {worst:.2e}  {flag}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="write the per-step metrics here (JSON)")
    parser.add_argument("--compare", type=Path, help="a JSON written by an earlier run to compare against")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest accepted relative difference")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted config override added to every arm (repeatable), e.g. to compare "
                             "a version with a setting off against one without the setting")
    args = parser.parse_args()
    before = load_arms(args.compare) if args.compare else None  # a bad file fails before the runs
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: run_arm(name, overrides + args.override, Path(tmp)) for name, overrides in ARMS.items()}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    if before is not None:
        return 0 if compare(result, before, args.rtol) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
