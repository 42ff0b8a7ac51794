"""Print the trajectory of a tinker-cookbook run from its metrics.jsonl, and check that it improved.

    python scripts/cookbook/summarize.py rl LOG_DIR   # reward per step; last 5 steps' mean > first 5's
    python scripts/cookbook/summarize.py sl LOG_DIR   # train NLL per step and epoch, held-out NLL

Exit status 0 when the run improved (RL: the mean reward of the last 5 steps is above that of the
first 5; SL: the last epoch's mean train NLL is below the first's, and the last held-out NLL below
the first), 2 when it did not, 1 when the log has no such metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _rows(log_dir: Path, key: str) -> list[dict]:
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"no {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if key in r]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def rl(log_dir: Path) -> int:
    rows = _rows(log_dir, "env/all/reward/total")
    if not rows:
        print("no env/all/reward/total in metrics.jsonl")
        return 1
    print(f"{'step':>4} {'reward':>8} {'correct':>8} {'format':>7} {'tokens':>7} {'step_s':>7}")
    for r in rows:
        print(f"{r['step']:>4} {r['env/all/reward/total']:>8.4f} {r.get('env/all/correct', float('nan')):>8.4f} "
              f"{r.get('env/all/format', float('nan')):>7.3f} {r.get('env/all/ac_tokens_per_turn', float('nan')):>7.2f} "
              f"{r.get('time/total', float('nan')):>7.1f}")
    k = min(5, len(rows) // 2) or 1
    first = _mean([r["env/all/reward/total"] for r in rows[:k]])
    last = _mean([r["env/all/reward/total"] for r in rows[-k:]])
    first_c = _mean([r.get("env/all/correct", 0.0) for r in rows[:k]])
    last_c = _mean([r.get("env/all/correct", 0.0) for r in rows[-k:]])
    ok = last > first
    print(f"mean reward, first {k} steps: {first:.4f}; last {k} steps: {last:.4f} "
          f"(correct {first_c:.3f} -> {last_c:.3f}): {'ROSE' if ok else 'DID NOT RISE'}")
    return 0 if ok else 2


def sl(log_dir: Path) -> int:
    rows = _rows(log_dir, "train_mean_nll")
    if not rows:
        print("no train_mean_nll in metrics.jsonl")
        return 1
    tests = [r for r in _rows(log_dir, "test/nll")]
    test_by_step = {r["step"]: r["test/nll"] for r in tests}
    print(f"{'step':>4} {'epoch':>5} {'lr':>9} {'train_nll':>9} {'test_nll':>8}")
    for r in rows:
        t = test_by_step.get(r["step"])
        print(f"{r['step']:>4} {r.get('epoch', 0):>5} {r.get('learning_rate', float('nan')):>9.2e} "
              f"{r['train_mean_nll']:>9.4f} {'' if t is None else f'{t:8.4f}'}")
    epochs: dict[int, list[float]] = {}
    for r in rows:
        epochs.setdefault(r.get("epoch", 0), []).append(r["train_mean_nll"])
    means = {e: _mean(v) for e, v in sorted(epochs.items())}
    print("mean train NLL per epoch: " + ", ".join(f"epoch {e}: {m:.4f}" for e, m in means.items()))
    ok = True
    if len(means) > 1:
        ok &= list(means.values())[-1] < list(means.values())[0]
    else:
        k = max(1, len(rows) // 3)
        ok &= _mean([r["train_mean_nll"] for r in rows[-k:]]) < _mean([r["train_mean_nll"] for r in rows[:k]])
    if len(tests) > 1:
        print(f"held-out NLL: {tests[0]['test/nll']:.4f} (step {tests[0]['step']}) -> "
              f"{tests[-1]['test/nll']:.4f} (step {tests[-1]['step']})")
        ok &= tests[-1]["test/nll"] < tests[0]["test/nll"]
    print("NLL " + ("FELL" if ok else "DID NOT FALL"))
    return 0 if ok else 2


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("rl", "sl"):
        sys.exit(__doc__)
    sys.exit({"rl": rl, "sl": sl}[sys.argv[1]](Path(sys.argv[2])))
