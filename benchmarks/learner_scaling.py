"""Learner throughput with 1 and 2 data-parallel processes, side by side in one run.

    python benchmarks/learner_scaling.py [--model smollm2-135m-instruct] [--steps 4] [--seqs 32] [--len 160]

Each arm is a real learner mesh (Monarch processes, the real model, bf16 autocast as in the default
job) that trains the same synthetic batches through the MeshClient: forward_backward (ppo loss),
scale_grads, optim_step. Arms: 1 process with 2 torch threads; 2 processes x 1 thread with FSDP2;
2 processes x 1 thread with DDP. The machine's cores are the budget every arm gets, so on a 2-core
host the figure says what the data-parallel machinery costs or saves, not what 2 GPUs would give.
The first step (warm-up) is not timed. Writes benchmarks/results/learner_scaling.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import write_result
from learner_mesh import learner_mesh

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _batch(seed: int, seqs: int, length: int, vocab: int):
    import torch

    from meshrl.types import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(seqs):
        n = length - int(torch.randint(0, length // 2, (1,), generator=g))  # uneven lengths, as rollouts are
        toks = torch.randint(0, vocab, (n,), generator=g).tolist()
        prompt = n // 3
        out.append(Datum.from_sequence(toks, mask=[0] * prompt + [1] * (n - prompt), logprobs=[-2.0] * n,
                                       advantages=[0.0] * prompt + [0.5 - (i % 2)] * (n - prompt)))
    return out


def run_arm(name: str, procs: int, mode: str, threads: int, args, cfg) -> dict:
    learner_cfg = cfg.learner.model_copy(update={"data_parallel": mode, "torch_threads": threads})
    with learner_mesh(cfg, learner_cfg, f"bench-{name}", procs) as client:
        times, tokens = [], 0.0
        for step in range(args.steps + 1):
            batch = _batch(step, args.seqs, args.len, args.vocab)
            began = time.perf_counter()
            out = client.forward_backward(batch, "ppo")
            client.scale_grads(1.0 / max(out["tokens"], 1.0))
            client.optim_step(learner_cfg.adam_params())
            if step:  # the first step warms up allocators and kernels
                times.append(time.perf_counter() - began)
                tokens += sum(d.length for d in batch)
        return {"arm": name, "procs": procs, "data_parallel": mode if procs > 1 else "single",
                "torch_threads": threads, "step_s_median": statistics.median(times),
                "tokens_per_s": tokens / sum(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--len", type=int, default=160)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.local import prepare_environment

    cfg = load_config(RunConfig, None, [f"model.name_or_path={args.model}"])
    prepare_environment(cfg.meshes)
    cores = os.cpu_count() or 1
    arms = [run_arm("1 process", 1, "fsdp2", cores, args, cfg),
            run_arm("2 processes, FSDP2", 2, "fsdp2", max(1, cores // 2), args, cfg),
            run_arm("2 processes, DDP", 2, "ddp", max(1, cores // 2), args, cfg)]
    base = arms[0]["tokens_per_s"]
    for arm in arms:
        arm["ratio_to_1_process"] = arm["tokens_per_s"] / base
        print(f"{arm['arm']:22s} {arm['tokens_per_s']:8.0f} tokens/s  step {arm['step_s_median']:6.2f} s  "
              f"x{arm['ratio_to_1_process']:.2f}")
    write_result("learner_scaling", {"model": args.model, "steps_timed": args.steps, "seqs_per_step": args.seqs,
                                     "max_len": args.len, "arms": arms})


if __name__ == "__main__":
    main()
