"""Tokens trained per second with padded micro-batches and with packed ones (`learner.packed_row_tokens`).

    python benchmarks/packing.py                       # SmolLM2-135M, 3 interleaved repetitions
    python benchmarks/packing.py --reps 2 --model tiny

Two batches, each trained by one `forward_backward_parts` call (gradients cleared after it, no
optimizer step), at each setting of `learner.packed_row_tokens` in ``--rows`` (0: padded, the
before; 1: packed into rows as wide as the micro-batch's longest sequence; N: rows of up to N
tokens), in a rotating order per repetition on one loaded model:

- ``arithmetic``: the three-term step of benchmarks/term_cost.py (40 policy-gradient datums, 16
  SDPO sites, 8 DPO pairs; sequences of about 60 to 90 tokens, micro-batches of 16);
- ``long_tail``: ``--long-tail`` policy-gradient datums of code-task-like lengths (a seeded
  log-normal around 300 tokens, clipped to 100..1100, a fifth of each the completion), with the
  code tier's learner settings (micro-batches of at most 16 sequences and 4096 padded tokens).

Tokens trained are the datums' model-input tokens; per arm the medians of wall-clock and process
CPU seconds over the repetitions, tokens per second of each, and the decoder positions run (padded:
rows x the longest per micro-batch; packed: packed rows x their width). Writes
benchmarks/results/packing.json (``--name``: another name).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def long_tail_part(n: int, vocab: int, seed: int = 0):
    """``n`` ppo datums of code-task-like lengths, random tokens; advantages +-0.5 on completions."""
    from meshrl.types import Datum, LossPart

    g = torch.Generator().manual_seed(seed)
    datums = []
    for i in range(n):
        length = int(min(1100, max(100, math.exp(math.log(300) + 0.6 * float(torch.randn(1, generator=g))))))
        completion = max(1, length // 5)
        prompt = length - completion
        datums.append(Datum.from_sequence(torch.randint(100, vocab - 100, (length,), generator=g).tolist(),
                                          mask=[0.0] * prompt + [1.0] * completion, logprobs=[-2.0] * length,
                                          advantages=[0.0] * prompt + [0.5 - (i % 2)] * completion))
    tokens = sum(d.length for d in datums)
    return LossPart(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.2}, 1.0, scale=1.0 / tokens)


def positions(parts, cfg, row_tokens: int) -> int:
    """Decoder positions the policy forward runs over for ``parts`` under ``cfg`` at ``row_tokens``."""
    from meshrl import losses
    from meshrl.training.prefix_trees import pack_rows
    from meshrl.training.shared_pass import pack_shared

    per_item = [losses.get_loss(p.loss_fn).datums_per_item for p in parts]
    total = 0
    for batch in pack_shared([p.datums for p in parts], per_item, cfg.micro_batch_size, cfg.micro_batch_tokens):
        lengths = [len(r) for r in batch.rows]
        packed = pack_rows(lengths, max(lengths), row_tokens).source if row_tokens else None
        # as the learner does: padded where no packed row would hold two sequences
        total += packed.numel() if packed is not None and packed.shape[0] < len(lengths) else len(lengths) * max(lengths)
    return total


def main() -> None:
    from benchmarks.common import provenance, write_result
    from benchmarks.term_cost import step_parts, timed
    from meshrl.config.learner import LearnerConfig
    from meshrl.models.provision import resolve_model
    from meshrl.training.policy import PolicyTrainer
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--name", default="packing", help="the result's name: benchmarks/results/NAME.json")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="0,1,1024,4096", help="packed_row_tokens settings (0: padded)")
    parser.add_argument("--long-tail", type=int, default=32, help="datums of the long-tailed batch")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    trainer = PolicyTrainer(path, LearnerConfig())
    base = trainer.cfg
    batches = {
        "arithmetic": (list(step_parts(tokenizer).values()), {}),
        "long_tail": ([long_tail_part(args.long_tail, len(tokenizer))], {"micro_batch_size": 16,
                                                                        "micro_batch_tokens": 4096}),
    }

    def run(name: str, row_tokens: int) -> tuple[float, float]:
        parts, settings = batches[name]
        trainer.cfg = base.model_copy(update={**settings, "packed_row_tokens": row_tokens})
        seconds = timed(lambda: trainer.forward_backward_parts(parts))
        trainer.optimizer.zero_grad(set_to_none=True)
        return seconds

    for name in batches:  # warm-up: allocations and the reference model's first load
        run(name, 0)
    runs: dict[str, dict[int, list[tuple[float, float]]]] = {n: {r: [] for r in rows} for n in batches}
    loads = [provenance()["load_average_1m"]]
    for rep in range(args.reps):
        order = rows[rep % len(rows):] + rows[: rep % len(rows)]
        for name in batches:
            for r in order:
                runs[name][r].append(run(name, r))
            print(f"rep {rep} {name}: " + ", ".join(f"rows {r}: {runs[name][r][-1][0]:.2f} s" for r in rows), flush=True)
    loads.append(provenance()["load_average_1m"])
    results = []
    for name, (parts, settings) in batches.items():
        cfg = base.model_copy(update=settings)
        tokens = sum(d.length for p in parts for d in p.datums)
        lengths = [d.length for p in parts for d in p.datums]
        arms = []
        for r in rows:
            wall = statistics.median(w for w, _ in runs[name][r])
            cpu = statistics.median(c for _, c in runs[name][r])
            arms.append({"packed_row_tokens": r, "seconds": wall, "cpu_seconds": cpu, "tokens_per_s": tokens / wall,
                         "tokens_per_cpu_s": tokens / cpu, "positions": positions(parts, cfg, r),
                         "runs_wall_cpu_s": runs[name][r]})
        padded = arms[0]
        for arm in arms:
            arm["speedup"] = padded["seconds"] / arm["seconds"]
            arm["speedup_cpu"] = padded["cpu_seconds"] / arm["cpu_seconds"]
        results.append({"batch": name, "datums": len(lengths), "tokens": tokens, "shortest": min(lengths),
                        "longest": max(lengths), "micro_batch_size": cfg.micro_batch_size,
                        "micro_batch_tokens": cfg.micro_batch_tokens, "arms": arms})
        for arm in arms:
            print(f"{name:>10} rows {arm['packed_row_tokens']:>5}: {arm['seconds']:.2f} s ({arm['cpu_seconds']:.2f} cpu), "
                  f"{arm['tokens_per_s']:.0f} tokens/s, x{arm['speedup']:.2f}; {arm['positions']} positions")
    write_result(args.name, {
        "model": args.model, "reps": args.reps, "learner": {"autocast_bf16": base.autocast_bf16,
                                                            "torch_threads": base.torch_threads},
        "batches": results, "load_average_1m_start_end": loads,
        "note": "medians of repetitions in a rotating order on one loaded model, on a shared machine; "
                "speedup = the padded arm's seconds / the arm's",
    })


if __name__ == "__main__":
    main()
