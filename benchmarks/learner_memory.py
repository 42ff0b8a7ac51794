"""The learner's host memory per step, with the free heap handed back at different points, side by side.

    python benchmarks/learner_memory.py [--steps 3] [--run benchmarks/results/runs/ablation-baseline-code-s2]

Each arm is a real learner mesh (a Monarch process, the real model, the code tier's learner
settings: bf16 autocast, micro-batches of at most 16 sequences and 4096 padded tokens, 2 torch
threads) that trains ``--steps`` policy-gradient steps (forward_backward with `ppo`, scale_grads,
optim_step) on batches of random tokens shaped like the last training step of a committed code-tier
run: one sequence per episode, as long as that episode's tokens, of which its completions' tokens
carry the loss (a new random draw per step, the lengths shuffled). Arms:

- `step`: the free heap goes back to the kernel after each optimizer step only
  (`learner.release_heap_each_step`);
- `micro-batch`: also after each micro-batch (`learner.release_heap_each_micro_batch`; the
  default, on this benchmark's figures);
- `mmap`: the step's release, with glibc's mmap threshold fixed at 1 MiB
  (`learner.mmap_threshold_mib`), so every block of 1 MiB or more is mapped and unmapped instead
  of kept in an arena;
- `off` (with `--arms`): no release at all.

Per step the learner reports its peak resident memory during the step (the kernel's VmHWM, started
over after each optimizer step), its resident memory after it, and the step's seconds. Writes
benchmarks/results/learner_memory.json.

    python benchmarks/learner_memory.py --replay [--steps 3] [--pairs 16]

adds (or replaces) its `replay` section, leaving the arms above as they are (without the run's
directory, on a seeded shape with the totals the file records for it): full fine-tuning with
the trace-replay term, each step one shared pass of the same policy-gradient batch and ``--pairs``
DPO pairs (`replay.max_pairs_per_step`'s default), each pair's rejected answer one of the batch's
episodes (as the student's reply is) and its chosen answer random tokens as long; the `micro-batch`
release. Arms:

- `replay-learner-reference` (before; `replay.reference.source: learner`): the learner computes
  the pairs' reference log-probabilities with its frozen float32 copy of the initial weights,
  loaded on the first step;
- `replay-precomputed` (after; the default): the pairs carry them, computed here before the step
  as the reference actor does (the initial weights in bf16, forward only:
  meshrl.training.reference; its seconds are `reference_s`, off the learner); the learner loads
  no copy and runs no reference forward.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from common import write_result
from learner_mesh import learner_mesh

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ARMS = {
    "step": {"release_heap_each_step": True, "release_heap_each_micro_batch": False},
    "micro-batch": {"release_heap_each_step": True, "release_heap_each_micro_batch": True},
    "mmap": {"release_heap_each_step": True, "release_heap_each_micro_batch": False, "mmap_threshold_mib": 1},
    "off": {"release_heap_each_step": False, "release_heap_each_micro_batch": False},
}
"""arm -> its learner settings."""


def episode_lengths(run: Path, tokenizer) -> list[tuple[int, int]]:
    """(tokens, completion tokens) of each episode of ``run``'s last training step (its last
    prompts_per_step x group_size training episodes in trajectories.jsonl), counted with the
    model's tokenizer; only their lengths are used."""
    import yaml

    config = yaml.safe_load((run / "config.yaml").read_text())
    per_step = config["trainer"]["prompts_per_step"] * config["trainer"]["group_size"]
    episodes = [json.loads(line) for line in (run / "trajectories.jsonl").open()]
    episodes = [e for e in episodes if e["kind"] == "trajectory"][-per_step:]
    out = []
    for e in episodes:
        total = len(tokenizer.apply_chat_template(e["messages"], tokenize=True, return_dict=True)["input_ids"])
        completion = sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                         for m in e["messages"] if m["role"] == "assistant")
        out.append((total, min(completion, total - 1)))
    return out


def recorded_lengths(result: dict, seed: int = 0) -> list[tuple[int, int]]:
    """Where the ``--run`` directory is not at hand (runs are not committed): a seeded shape with
    the totals ``result`` (this benchmark's JSON) records for it: as many sequences, the same total
    and longest length, completions the same share of each sequence."""
    rng = random.Random(seed)
    n, total, longest = result["sequences"], result["tokens_per_step"], result["longest"]
    draws = [rng.expovariate(1.0) for _ in range(n - 1)]
    scale = (total - longest) / sum(draws)
    lengths = [longest] + [max(2, min(longest, round(d * scale))) for d in draws]
    share = result["completion_tokens_per_step"] / total
    return [(m, max(1, min(m - 1, round(m * share)))) for m in lengths]


def batch(seed: int, lengths: list[tuple[int, int]], vocab: int):
    """Random-token datums of these lengths in a seeded order; advantages +-0.5 on the completions."""
    import torch

    from meshrl.types import Datum

    order = list(lengths)
    random.Random(seed).shuffle(order)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (n, completion) in enumerate(order):
        prompt = n - completion
        out.append(Datum.from_sequence(torch.randint(0, vocab, (n,), generator=g).tolist(),
                                       mask=[0] * prompt + [1] * completion, logprobs=[-2.0] * n,
                                       advantages=[0.0] * prompt + [0.5 - (i % 2)] * completion))
    return out


REPLAY_ARMS = ("replay-learner-reference", "replay-precomputed")
"""The replay section's arms: the pairs' references computed by the learner (before), or carried (after)."""


def replay_parts(seed: int, lengths: list[tuple[int, int]], vocab: int, pairs: int, reference=None):
    """The step's policy-gradient part and its DPO part of ``pairs`` pairs (the rejected answer of
    pair i is episode i's own completion, the chosen one random tokens as long); with
    ``reference`` (a callable giving each pair's [chosen, rejected] sums) the pairs carry them."""
    from meshrl.replay.pairs import PreferenceItem, dpo_datums
    from meshrl.types import LossPart

    episodes = batch(seed, lengths, vocab)
    g = random.Random(seed + 1000)
    items = []
    for d in episodes[:pairs]:
        tokens = d.model_input.to_ints() + [int(d.loss_fn_inputs["target_tokens"][-1])]
        prompt = len(tokens) - int((d.loss_fn_inputs["mask"] != 0).sum())
        rejected = tokens[prompt:]
        items.append(PreferenceItem(f"p{len(items)}", tokens[:prompt], [g.randrange(vocab) for _ in rejected], rejected))
    seconds = 0.0
    if reference is not None:
        began = time.perf_counter()
        for item, values in zip(items, reference(items)):
            item.reference = values
        seconds = time.perf_counter() - began
    return [LossPart(episodes, "ppo"), LossPart(dpo_datums(items, 0.1 / len(items)), "dpo")], seconds


def bf16_reference(model_name: str, threads: int):
    """What the reference actor computes, in this process: [chosen, rejected] sums per pair under
    the initial weights in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from meshrl.models.provision import resolve_model
    from meshrl.training.data_parallel import ValidLogits
    from meshrl.training.reference import answer_logprob_sums

    torch.set_num_threads(threads)
    model = ValidLogits(AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.bfloat16).eval())

    def score(items):
        sums = answer_logprob_sums(model, [i.prompt + a for i in items for a in (i.chosen, i.rejected)],
                                   [len(i.prompt) for i in items for _ in range(2)], 0, torch.device("cpu"))
        return [sums[k:k + 2] for k in range(0, len(sums), 2)]

    return score


def run_replay_arm(name: str, args, cfg, lengths, vocab: int) -> dict:
    settings = ARMS["micro-batch"]
    learner_cfg = cfg.learner.model_copy(update={"micro_batch_size": 16, "micro_batch_tokens": 4096, **settings})
    reference = bf16_reference(args.model, learner_cfg.torch_threads) if name == "replay-precomputed" else None
    steps = []
    with learner_mesh(cfg, learner_cfg, f"bench-memory-{name}") as client:
        for step in range(args.steps):
            parts, reference_s = replay_parts(step, lengths, vocab, args.pairs, reference)
            began = time.perf_counter()
            pg, dpo = client.forward_backward_parts(parts)
            client.scale_grads(1.0 / max(pg["tokens"], 1.0))  # the DPO part is normalised by its weights
            m = client.optim_step(learner_cfg.adam_params())
            steps.append({"step_s": time.perf_counter() - began, "peak_gib": m["peak_rss_gib"],
                          "rss_after_gib": m["rss_gib"], "reference_s": reference_s, "dpo_loss": dpo["loss"]})
            print(f"{name:26s} step {step + 1}: {steps[-1]['step_s']:6.1f} s  peak {m['peak_rss_gib']:5.2f} GiB  "
                  f"after {m['rss_gib']:5.2f} GiB  reference {reference_s:5.1f} s off the learner", flush=True)
    return {"arm": name, "settings": settings, "steps": steps,
            "peak_gib_max": max(s["peak_gib"] for s in steps),
            "rss_after_gib_last": steps[-1]["rss_after_gib"],
            "step_s_median": statistics.median(s["step_s"] for s in steps[1:] or steps),
            "reference_s_median": statistics.median(s["reference_s"] for s in steps)}


def replay_section(args, cfg, lengths, vocab: int) -> None:
    """Run the replay arms and write them as the `replay` section of the existing result file."""
    from common import RESULTS, provenance

    load_before = os.getloadavg()[0]
    arms = [run_replay_arm(name, args, cfg, lengths, vocab) for name in REPLAY_ARMS]
    before, after = arms
    for arm in arms:
        arm["peak_vs_before"] = arm["peak_gib_max"] / before["peak_gib_max"]
        arm["time_vs_before"] = arm["step_s_median"] / before["step_s_median"]
        print(f"{arm['arm']:26s} peak {arm['peak_gib_max']:5.2f} GiB (x{arm['peak_vs_before']:.2f})  "
              f"step {arm['step_s_median']:6.1f} s (x{arm['time_vs_before']:.2f})")
    path = RESULTS / "learner_memory.json"
    result = json.loads(path.read_text())
    result["replay"] = {**provenance(), "load_average_1m": [load_before, os.getloadavg()[0]], "pairs": args.pairs,
                        "steps": args.steps, "lengths": "the run's" if args.run.exists() else "recorded totals",
                        "sequences": len(lengths), "tokens_per_step": sum(n for n, _ in lengths),
                        "longest": max(n for n, _ in lengths), "arms": arms}
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote the replay section of {path}")


def run_arm(name: str, args, cfg, lengths, vocab: int) -> dict:
    settings = ARMS[name]
    learner_cfg = cfg.learner.model_copy(update={"micro_batch_size": 16, "micro_batch_tokens": 4096, **settings})
    steps = []
    with learner_mesh(cfg, learner_cfg, f"bench-memory-{name}") as client:
        for step in range(args.steps):
            began = time.perf_counter()
            out = client.forward_backward(batch(step, lengths, vocab), "ppo")
            client.scale_grads(1.0 / max(out["tokens"], 1.0))
            m = client.optim_step(learner_cfg.adam_params())
            steps.append({"step_s": time.perf_counter() - began, "peak_gib": m["peak_rss_gib"],
                          "rss_after_gib": m["rss_gib"], "released_gib": m.get("released_gib")})
            print(f"{name:12s} step {step + 1}: {steps[-1]['step_s']:6.1f} s  peak {m['peak_rss_gib']:5.2f} GiB  "
                  f"after {m['rss_gib']:5.2f} GiB", flush=True)
    return {"arm": name, "settings": settings, "steps": steps,
            "peak_gib_max": max(s["peak_gib"] for s in steps),
            "rss_after_gib_last": steps[-1]["rss_after_gib"],
            "step_s_median": statistics.median(s["step_s"] for s in steps[1:] or steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--run", type=Path, default=Path("benchmarks/results/runs/ablation-baseline-code-s2"),
                        help="a committed code-tier run whose last training step gives the sequence lengths")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["step", "micro-batch", "mmap"])
    parser.add_argument("--replay", action="store_true",
                        help="run the replay arms (learner reference, precomputed) into the file's `replay` section")
    parser.add_argument("--pairs", type=int, default=16, help="DPO pairs per step of the replay arms")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.local import prepare_environment
    from meshrl.models.provision import resolve_model

    cfg = load_config(RunConfig, None, [f"model.name_or_path={args.model}"])
    prepare_environment(cfg.meshes)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    if args.run.exists():
        lengths = episode_lengths(args.run, tokenizer)
    elif args.replay:
        from common import RESULTS

        lengths = recorded_lengths(json.loads((RESULTS / "learner_memory.json").read_text()))
        print(f"{args.run} is not here: {len(lengths)} sequences shaped like the totals the file records for it")
    else:
        raise SystemExit(f"{args.run}: no such run directory (the committed code-tier runs are not in the repository)")
    if args.replay:
        replay_section(args, cfg, lengths, len(tokenizer))
        return
    load_before = os.getloadavg()[0]
    arms = [run_arm(name, args, cfg, lengths, len(tokenizer)) for name in args.arms]
    base = next((a for a in arms if a["arm"] == "step"), arms[0])
    for arm in arms:
        arm["peak_vs_step"] = arm["peak_gib_max"] / base["peak_gib_max"]
        arm["time_vs_step"] = arm["step_s_median"] / base["step_s_median"]
        print(f"{arm['arm']:12s} peak {arm['peak_gib_max']:5.2f} GiB (x{arm['peak_vs_step']:.2f})  "
              f"step {arm['step_s_median']:6.1f} s (x{arm['time_vs_step']:.2f})")
    write_result("learner_memory", {
        "model": args.model, "run": str(args.run), "steps": args.steps, "sequences": len(lengths),
        "tokens_per_step": sum(n for n, _ in lengths), "completion_tokens_per_step": sum(c for _, c in lengths),
        "longest": max(n for n, _ in lengths), "arms": arms,
        "load_average_1m": [load_before, os.getloadavg()[0]]})


if __name__ == "__main__":
    main()
