"""Recovery time of a generator on one host: SIGKILL its process while a call is in flight, then
measure detection (kill -> the call fails), replacement and re-sync (new procs, engine start,
pull of the current weights) and the same excluding the engine's own start-up (model load).

    python benchmarks/recovery.py [--model tiny] [--trials 3]

Prints the figures and writes benchmarks/results/recovery.json. Goal: detection + respawn +
resync, excluding model load, under 3 s.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from common import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description="generator recovery time")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/recovery.json")
    args = parser.parse_args()

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.controller.runtime import Runtime
    from meshrl.engines import SampleRequest

    cfg = load_config(RunConfig, None, [
        f"model.name_or_path={args.model}", "model.max_model_len=256", "generator.kv_cache_gib=1",
        "trainer.prompts_per_step=4", "trainer.group_size=4", f"faults.max_restarts={args.trials + 1}",
    ])
    trials = []
    with Runtime(cfg) as rt:
        loop = rt.loop
        loop.step()  # a real weight version (v1) for the replacement to pull
        prompts = [[1, 2, 3, 4]] * 4
        request = SampleRequest(n=4, max_tokens=64, temperature=1.0)
        for _ in range(args.trials):
            events_before = len(rt.supervisor.events)
            killed_at = {}

            def kill():
                killed_at["t"] = time.time()
                rt.meshes.kill("generator")

            threading.Timer(0.2, kill).start()
            rt.client.generate(prompts, request)  # fails, recovers, re-issues
            event = rt.supervisor.events[events_before]
            init_s = rt.meshes.infos["generator"][0]["init_s"]
            detect_s = event["detected_at"] - killed_at["t"]
            trials.append({
                "detect_s": detect_s,
                "replace_and_resync_s": event["recovery_s"],
                "engine_start_s": init_s,
                "total_excluding_model_load_s": detect_s + event["recovery_s"] - init_s,
                "total_s": detect_s + event["recovery_s"],
            })
            print({k: round(v, 2) for k, v in trials[-1].items()})
    summary = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
    result = {"model": args.model, "trials": trials, "median": summary, "goal_s": 3.0,
              "supervision_poll_s": cfg.meshes.supervision_poll_s}
    out = write_result("recovery", result, args.out)
    print(f"median: detect {summary['detect_s']:.2f}s, replace+resync {summary['replace_and_resync_s']:.2f}s "
          f"(engine start {summary['engine_start_s']:.2f}s) -> excluding model load "
          f"{summary['total_excluding_model_load_s']:.2f}s (goal < 3 s); wrote {out}")


if __name__ == "__main__":
    main()
