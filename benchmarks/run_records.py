"""What keeping a run's trajectories costs: the seconds a step spends turning its trajectories into
`trajectories.jsonl` records and appending them (flushed to disk), the bytes per trajectory, and
the seconds to read the file back as `meshrl sft --trajectories` Datums.

    python benchmarks/run_records.py                       # 64 trajectories a step, 20 steps
    python benchmarks/run_records.py --per-step 256 --tokens 4096

Synthetic trajectories shaped like the code task's: a prompt of `--prompt` tokens and `--tokens`
tokens after it in `--turns` policy turns (each turn's context a short message list, its error
and hint in `turn_errors`), with an environment record of the size the code env writes (turns with
code and feedback, the message history). No model and no meshes: only the record code runs.
Writes benchmarks/results/run_records.json.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def trajectory(i: int, args: argparse.Namespace, rng: random.Random):
    from meshrl.training.trajectories import Trajectory

    n, turns = args.tokens, args.turns
    per_turn = n // turns
    mask = [1 if (k % per_turn) < per_turn * 3 // 4 else 0 for k in range(n)]  # a quarter: env feedback
    context = [{"role": "user", "content": "Write a function that ... " * 20}]
    info = {"correct": i % 4 == 0, "termination": "max_turns",
            "turns": [(context, "def f(x):\n    return x\n" * 5, t * per_turn, (t + 1) * per_turn)
                      for t in range(turns)],
            "turn_errors": [{"error_kind": "test_failure", "hint": "check the edge case " * 5,
                             "hint_template_key": "test_failure", "error_text": "AssertionError " * 10,
                             "tests_passed": 1, "tests_total": 3}] * turns}
    return Trajectory(id=f"train0-{i // 8}-{i % 8}", group=i // 8, problem=None,
                      prompt_tokens=[rng.randrange(50000) for _ in range(args.prompt)],
                      tokens=[rng.randrange(50000) for _ in range(n)],
                      logprobs=[-rng.random() * 3 if m else 0.0 for m in mask], mask=mask, version=3, reward=0.25,
                      info=info)


def episode(t) -> dict:
    turns = [{"code": "def f(x):\n    return x\n" * 5, "feedback": "AssertionError " * 20, "error_kind": "test_failure",
              "tests_passed": 1} for _ in t.info["turns"]]
    return {"episode_id": t.id, "task_id": "t1", "num_turns": len(turns), "turns": turns,
            "messages": [{"role": "user", "content": "Write a function that ... " * 20}] * (2 * len(turns)),
            "rewards": [0.0] * len(turns), "reward": 0.0, "termination": "max_turns", "success": False}


def main() -> None:
    from benchmarks.common import write_result
    from meshrl.config.base import load_config
    from meshrl.config.sft import SFTRunConfig
    from meshrl.controller.sft_data import load_data
    from meshrl.training.records import append_records, trajectory_record, truncate_records

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-step", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(0)
    step = [trajectory(i, args, rng) for i in range(args.per_step)]
    episodes = [episode(t) for t in step]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trajectories.jsonl"
        write_s = []
        for s in range(1, args.steps + 1):
            t0 = time.perf_counter()
            append_records(path, [trajectory_record(t, s, True, e) for t, e in zip(step, episodes)])
            write_s.append(time.perf_counter() - t0)
        size = path.stat().st_size
        cfg = load_config(SFTRunConfig, None, [f"sft.trajectories={path}", "sft.min_reward=0",
                                               f"model.max_model_len={args.prompt + args.tokens}"])
        t0 = time.perf_counter()
        data = load_data(cfg)
        read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        truncate_records(path, args.steps // 2)
        truncate_s = time.perf_counter() - t0
    result = {"per_step": args.per_step, "steps": args.steps, "prompt_tokens": args.prompt, "tokens": args.tokens,
              "turns": args.turns, "write_step_s_median": statistics.median(write_s), "write_step_s_max": max(write_s),
              "bytes_per_trajectory": size / (args.per_step * args.steps), "file_mib": size / 2**20,
              "read_back_s": read_s, "read_back_datums": len(data.train), "truncate_half_s": truncate_s}
    print(f"{args.per_step} trajectories/step of {args.prompt}+{args.tokens} tokens: "
          f"write {result['write_step_s_median'] * 1e3:.1f} ms/step "
          f"(max {result['write_step_s_max'] * 1e3:.1f}), {result['bytes_per_trajectory'] / 1024:.1f} KiB/trajectory, "
          f"file {result['file_mib']:.1f} MiB; read back as {len(data.train)} datums in {read_s:.2f} s; "
          f"truncate to half in {truncate_s:.2f} s")
    write_result("run_records", result)


if __name__ == "__main__":
    main()
