"""Each loss term's learner cost per optimizer step, with a pass per term against one shared pass.

    python benchmarks/term_cost.py                 # SmolLM2-135M, 6 interleaved repetitions
    python benchmarks/term_cost.py --reps 3 --model tiny

A step of the default arithmetic job with all three channels (configs/ablation-full.yaml: 8 prompts
x 8 samples, responses of up to 32 tokens, the learner's own defaults: bf16 autocast, micro-batches
of 16): 40 policy-gradient datums (five groups with signal; three uniform groups are left out),
16 SDPO error sites (12 on failed samples of those groups, i.e. sequences the policy gradient
trains too, 4 on uniform groups) with a teacher top-32, and 8 DPO pairs of an earlier step's
traces (with the frozen reference's forward). Prompts are the model's chat template around an
arithmetic question; response tokens are seeded random ids of seeded lengths (the cost depends on
the lengths, not the ids).

Per repetition, in alternating order: the step as it was (`forward_backward` per term: policy
gradient, its normaliser, SDPO, DPO) and the shared pass (`forward_backward_parts`), plus the
shared pass of the policy gradient with each extra term alone (the term's marginal cost), and with
the DPO pairs carrying precomputed reference log-probabilities (`replay.reference.source:
precomputed`: the learner runs no reference forward; the values are the learner's own, computed
once before the repetitions, so the loss is the same). Gradients
are cleared between calls; the optimizer step (the same in both) is not included. Writes
benchmarks/results/term_cost.json: per term its datums, tokens, the seconds of its own pass and
its share of the separate passes; the shared pass's seconds, the rows it forwarded, and the
ratio, as medians over the repetitions.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TOP_K = 32


def step_parts(tokenizer, seed: int = 0):
    """The step's parts: policy gradient (ppo at temperature 1, token-mean), SDPO (alpha 0.1) and
    DPO (beta 0.1), as the terms build them."""
    from meshrl.renderers import renderer_for_tokenizer
    from meshrl.types import Datum, LossPart

    g = torch.Generator().manual_seed(seed)
    renderer = renderer_for_tokenizer(tokenizer)
    vocab = len(tokenizer)

    def ints(n):
        return torch.randint(100, vocab - 100, (n,), generator=g).tolist()

    def prompt(i):
        a, b = 17 + 13 * i, 5 + 7 * i
        return renderer.build_generation_prompt([{"role": "user", "content": f"What is {a} * {b} + {a - b}? "
                                                  "Reply with the number only."}])

    trajectories = [(prompt(i // 8), ints(int(torch.randint(8, 33, (1,), generator=g)))) for i in range(64)]
    tokens_total = sum(len(r) for _, r in trajectories)
    pg = []
    for i, (p, r) in enumerate(trajectories[:40]):
        pg.append(Datum.from_sequence(p + r, per_sequence={"advantages": 1.0 if i % 3 else -0.8},
                                      mask=[0.0] * len(p) + [1.0] * len(r),
                                      logprobs=[0.0] * len(p) + (-torch.rand(len(r), generator=g) * 3).tolist()))
    failed = [trajectories[i] for i in range(40) if i % 3 == 0][:12] + trajectories[40:44]
    sites = sum(len(r) for _, r in failed)
    sdpo = []
    for p, r in failed:
        n, start = len(p) + len(r), len(p)
        idx, lp, mask = torch.zeros(n, TOP_K, dtype=torch.long), torch.zeros(n, TOP_K), torch.zeros(n)
        idx[start:] = torch.randint(0, vocab, (len(r), TOP_K), generator=g)
        lp[start:] = torch.log_softmax(torch.randn(len(r), TOP_K, generator=g) * 3, -1)
        mask[start:] = 0.1 / sites
        sampler = torch.zeros(n)
        sampler[start:] = -torch.rand(len(r), generator=g) * 3
        sdpo.append(Datum.from_sequence(p + r, mask=mask, logprobs=sampler, teacher_topk_indices=idx,
                                        teacher_topk_logprobs=lp))
    dpo = [Datum.from_sequence(prompt(20 + i) + answer, per_sequence={"weight": 0.1 / 8},
                               mask=[0] * len(prompt(20 + i)) + [1] * len(answer))
           for i in range(8) for answer in (ints(6), ints(int(torch.randint(8, 33, (1,), generator=g))))]
    return {
        "policy_gradient": LossPart(pg, "ppo", {"eps_low": 0.2, "eps_high": 0.2}, 1.0, scale=1.0 / tokens_total),
        "sdpo": LossPart(sdpo, "sdpo_jsd", {"beta": 0.5, "temperature": 1.0, "is_weight_cap": 0.0,
                                            "token_clip": 10.0}, 1.0),
        "replay_dpo": LossPart(dpo, "dpo", {"beta": 0.1}, 1.0),
    }


def with_references(trainer, part):
    """``part`` (DPO) with each datum carrying its reference sequence logprob, as a pair formed
    with `replay.reference.source: precomputed` does (here the learner's own frozen reference)."""
    import dataclasses

    from meshrl.losses.preference import REFERENCE_INPUT
    from meshrl.types import Datum

    reference = trainer.forward(part.datums, reference=True)
    datums = [Datum(d.model_input, {**d.loss_fn_inputs, REFERENCE_INPUT: (lp * (d.loss_fn_inputs["mask"] != 0)).sum()})
              for d, lp in zip(part.datums, reference)]
    return dataclasses.replace(part, datums=datums)


def timed(fn) -> tuple[float, float]:
    """Wall-clock and this process's CPU seconds of ``fn()`` (the CPU seconds move less with the
    other work on a shared machine)."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def padded_tokens(batches: list[list[int]]) -> int:
    """Positions the decoder runs over: per micro-batch, its rows x the longest."""
    return sum(len(rows) * max(rows) for rows in batches)


def main() -> None:
    from benchmarks.common import learner_benchmark, provenance, write_result
    from meshrl.training.batching import split_micro_batches
    from meshrl.training.shared_pass import pack_shared

    args, trainer, tokenizer = learner_benchmark(__doc__)
    parts = step_parts(tokenizer)
    names = list(parts)
    pg = parts["policy_gradient"]

    def clear():
        trainer.optimizer.zero_grad(set_to_none=True)

    def separate() -> dict[str, tuple[float, float]]:
        out = {}
        for name in names:
            p = parts[name]
            out[name] = timed(lambda: trainer.forward_backward(p.datums, p.loss_fn, p.loss_fn_config,
                                                               temperature=p.temperature))
            if name == "policy_gradient":
                trainer.scale_grads(p.scale)
        clear()
        return out

    def shared(chosen) -> tuple[float, float]:
        seconds = timed(lambda: trainer.forward_backward_parts([parts[n] for n in chosen]))
        clear()
        return seconds

    parts["replay_dpo_precomputed"] = with_references(trainer, parts["replay_dpo"])
    combos = {"all": names, "policy_gradient+sdpo": ["policy_gradient", "sdpo"],
              "policy_gradient+replay_dpo": ["policy_gradient", "replay_dpo"],
              "policy_gradient+replay_dpo_precomputed": ["policy_gradient", "replay_dpo_precomputed"]}
    separate()  # warm-up: allocations and the reference model's first load
    shared(names)
    runs: dict[str, list[tuple[float, float]]] = {**{f"separate/{n}": [] for n in names}, **{f"shared/{c}": [] for c in combos}}
    loads = [provenance()["load_average_1m"]]
    for rep in range(args.reps):
        order = ["separate", *combos] if rep % 2 == 0 else [*combos, "separate"]
        for what in order:
            if what == "separate":
                for n, s in separate().items():
                    runs[f"separate/{n}"].append(s)
            else:
                runs[f"shared/{what}"].append(shared(combos[what]))
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1][0]:.2f} ({v[-1][1]:.2f} cpu)" for k, v in runs.items()),
              flush=True)
    loads.append(provenance()["load_average_1m"])
    cpu_med = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    med = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    separate_total = sum(med[f"separate/{n}"] for n in names)
    separate_cpu = sum(cpu_med[f"separate/{n}"] for n in names)
    size = trainer.cfg.micro_batch_size
    shared_batches = pack_shared([parts[n].datums for n in names], [1, 1, 2], size)
    rows = sum(len(b.rows) for b in shared_batches)
    own = {n: padded_tokens([[d.length for d in b] for b in split_micro_batches(
        parts[n].datums, size, 2 if n == "replay_dpo" else 1)]) for n in names}
    together = padded_tokens([[len(r) for r in b.rows] for b in shared_batches])
    terms = []
    for n in names:
        p = parts[n]
        marginal = med["shared/all"] if n == "policy_gradient" else med[f"shared/policy_gradient+{n}"]
        terms.append({
            "term": n, "loss": p.loss_fn, "datums": len(p.datums), "tokens": sum(d.length for d in p.datums),
            "signal_tokens": int(sum(float((d.loss_fn_inputs["mask"] != 0).sum()) for d in p.datums)),
            "padded_tokens": own[n], "separate_s": med[f"separate/{n}"], "separate_cpu_s": cpu_med[f"separate/{n}"],
            "separate_share": med[f"separate/{n}"] / separate_total,
            "shared_marginal_s": None if n == "policy_gradient" else marginal - med["separate/policy_gradient"],
        })
    terms[names.index("replay_dpo")]["shared_marginal_precomputed_s"] = (
        med["shared/policy_gradient+replay_dpo_precomputed"] - med["separate/policy_gradient"])
    result = {
        "model": args.model, "reps": args.reps, "learner": {"micro_batch_size": trainer.cfg.micro_batch_size,
                                                            "autocast_bf16": trainer.cfg.autocast_bf16,
                                                            "torch_threads": trainer.cfg.torch_threads},
        "terms": terms, "separate_total_s": separate_total, "shared_total_s": med["shared/all"],
        "shared_vs_separate": med["shared/all"] / separate_total,
        "separate_total_cpu_s": separate_cpu, "shared_total_cpu_s": cpu_med["shared/all"],
        "shared_vs_separate_cpu": cpu_med["shared/all"] / separate_cpu,
        "datums": sum(len(p.datums) for p in parts.values()), "shared_rows": rows,
        "separate_padded_tokens": sum(own.values()), "shared_padded_tokens": together,
        "medians_s": med, "medians_cpu_s": cpu_med, "runs_wall_cpu_s": runs, "load_average_1m_start_end": loads,
        "note": "medians of interleaved repetitions on a shared machine; shared_marginal_s = the shared pass of "
                "the policy gradient with that term minus the policy gradient's own pass",
    }
    for t in terms:
        extra = "" if t["shared_marginal_s"] is None else f", marginal in the shared pass {t['shared_marginal_s']:.2f} s"
        if "shared_marginal_precomputed_s" in t:
            extra += f" ({t['shared_marginal_precomputed_s']:.2f} s with precomputed references)"
        print(f"{t['term']:>16}: {t['datums']} datums, {t['tokens']} tokens, own pass {t['separate_s']:.2f} s "
              f"({100 * t['separate_share']:.0f} %){extra}")
    print(f"separate passes {separate_total:.2f} s ({separate_cpu:.2f} cpu), shared pass {med['shared/all']:.2f} s "
          f"({cpu_med['shared/all']:.2f} cpu): x{result['shared_vs_separate']:.2f} wall, "
          f"x{result['shared_vs_separate_cpu']:.2f} cpu; {result['datums']} datums in {rows} rows; padded tokens "
          f"{sum(own.values())} -> {together}")
    write_result("term_cost", result)


if __name__ == "__main__":
    main()
