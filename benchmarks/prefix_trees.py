"""The learner's pass with shared prefixes as trees (`learner.shared_prefix_tokens` 16, the default)
against every sequence whole (0), side by side on one learner.

    python benchmarks/prefix_trees.py                 # SmolLM2-135M, 6 interleaved repetitions
    python benchmarks/prefix_trees.py --reps 3 --model tiny

The step of benchmarks/term_cost.py (the default arithmetic job with all three channels: 40
policy-gradient datums, 8 samples a prompt; 16 SDPO sites; 8 DPO pairs, each on a prompt of its
own) with the learner's defaults (bf16 autocast, micro-batches of 16). Per repetition, in
alternating order, with each setting: the policy gradient alone (the baseline's learner pass), the
shared pass of all three terms (the full step's), and the frozen reference's forward of the DPO
pairs (what `replay.reference.source: precomputed` computes once per pair). Also counts the
positions the decoder runs (model inputs, padding included). Writes
benchmarks/results/prefix_trees.json: the medians and the ratios trees / whole.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SETTINGS = {"whole": 0, "trees": 16}


def main() -> None:
    from benchmarks.common import learner_benchmark, provenance, write_result
    from benchmarks.term_cost import step_parts, timed

    args, trainer, tokenizer = learner_benchmark(__doc__)
    parts = step_parts(tokenizer)
    all_parts = list(parts.values())
    pg, dpo = parts["policy_gradient"], parts["replay_dpo"]
    positions: dict[str, int] = {}
    decoder = trainer.model.get_decoder()
    counting: list[int] = []
    decoder.register_forward_pre_hook(lambda _m, _a, kw: counting.append(kw["input_ids"].numel()), with_kwargs=True)

    def run(setting: str, what: str) -> tuple[float, float]:
        trainer.cfg.shared_prefix_tokens = SETTINGS[setting]
        counting.clear()
        if what == "policy_gradient":
            seconds = timed(lambda: trainer.forward_backward(pg.datums, pg.loss_fn, pg.loss_fn_config))
        elif what == "all_terms":
            seconds = timed(lambda: trainer.forward_backward_parts(all_parts))
        else:
            seconds = timed(lambda: trainer.forward(dpo.datums, reference=True))
        trainer.optimizer.zero_grad(set_to_none=True)
        positions[f"{setting}/{what}"] = sum(counting)
        return seconds

    whats = ["policy_gradient", "all_terms", "dpo_reference"]
    for setting in SETTINGS:  # warm-up: allocations and the reference model's first load
        for what in whats:
            run(setting, what)
    trainer._frozen_copy.model.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: counting.append(kw["input_ids"].numel()), with_kwargs=True)  # loaded by the warm-up
    runs: dict[str, list[tuple[float, float]]] = {f"{s}/{w}": [] for s in SETTINGS for w in whats}
    loads = [provenance()["load_average_1m"]]
    for rep in range(args.reps):
        for setting in (list(SETTINGS) if rep % 2 == 0 else list(SETTINGS)[::-1]):
            for what in whats:
                runs[f"{setting}/{what}"].append(run(setting, what))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in runs.items()), flush=True)
    loads.append(provenance()["load_average_1m"])
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    ratios = {w: med[f"trees/{w}"] / med[f"whole/{w}"] for w in whats}
    result = {
        "model": args.model, "reps": args.reps,
        "learner": {"micro_batch_size": trainer.cfg.micro_batch_size, "autocast_bf16": trainer.cfg.autocast_bf16,
                    "torch_threads": trainer.cfg.torch_threads},
        "datums": {n: len(p.datums) for n, p in parts.items()},
        "tokens": {n: sum(d.length for d in p.datums) for n, p in parts.items()},
        "decoder_positions": positions, "medians_s": med, "medians_cpu_s": cpu, "trees_vs_whole": ratios,
        "runs_wall_cpu_s": runs, "load_average_1m_start_end": loads,
        "note": "medians of interleaved repetitions on one learner; decoder_positions: the model inputs the "
                "decoder ran, padding included",
    }
    for w in whats:
        print(f"{w:>16}: whole {med[f'whole/{w}']:.2f} s ({positions[f'whole/{w}']} positions), trees "
              f"{med[f'trees/{w}']:.2f} s ({positions[f'trees/{w}']} positions): x{ratios[w]:.2f}")
    write_result("prefix_trees", result)


if __name__ == "__main__":
    main()
