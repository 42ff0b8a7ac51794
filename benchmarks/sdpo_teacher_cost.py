"""The hinted teacher's scoring of a step's SDPO sites in the learner, each site forwarded whole
against the sites' shared prefixes forwarded once (`sdpo.min_shared_prefix`).

    python benchmarks/sdpo_teacher_cost.py            # SmolLM2-135M, 6 interleaved repetitions
    python benchmarks/sdpo_teacher_cost.py --reps 3 --model tiny

Two steps' sites, built as the SDPO term builds them (the student's prefix, a hint turn inserted
before the error turn's generation header, the student's response; meshrl.sdpo.sites):
- arithmetic (configs/ablation-sdpo.yaml): 16 failed samples of 3 prompts (the units come in
  prompt order, so a step's first failing samples share few prompts), responses of 8-32 tokens,
  and, as `sdpo.candidates_per_site: 2` scores them, 32 of 6 prompts;
- a multi-turn code episode step: 2 tasks of a 400-token statement, 4 episodes each, each with its
  3 failing turns as sites (responses of 60-100 tokens, tool output of 40-80 between turns).
Responses are seeded random ids of seeded lengths (the cost depends on the lengths). Per
repetition, in alternating order, `PolicyTrainer.topk_logprobs` (top-32, the learner's defaults:
bf16 autocast, micro-batches of 16) with `min_prefix` 0 and 16. Writes
benchmarks/results/sdpo_teacher_cost.json: per step its sites, the tokens the decoder ran in each
way, and the median seconds and their ratio.
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


def _sites(renderer, student_turns, hint: str):
    """ErrorSites of one episode: ``student_turns`` = (prompt tokens, [(response, observation)...]),
    every turn an error site."""
    from meshrl.sdpo.sites import ErrorSite, insert_hint

    prompt, turns = student_turns
    header = renderer.generation_header()
    out, prefix = [], list(prompt)
    for i, (response, observation) in enumerate(turns):
        teacher = insert_hint(renderer, prefix, hint)
        out.append(ErrorSite(f"e{i}", "test_failure", hint, prefix + response, len(prefix), teacher + response,
                             len(teacher), len(response), [-1.0] * len(response)))
        prefix = prefix + response + observation + header
    return out


def steps(tokenizer, seed: int = 0) -> dict[str, list]:
    from meshrl.renderers import renderer_for_tokenizer

    g = torch.Generator().manual_seed(seed)
    renderer = renderer_for_tokenizer(tokenizer)
    vocab = len(tokenizer)

    def ints(low, high):
        return torch.randint(100, vocab - 100, (int(torch.randint(low, high + 1, (1,), generator=g)),), generator=g).tolist()

    def question(i):
        a, b = 17 + 13 * i, 5 + 7 * i
        return renderer.build_generation_prompt([{"role": "user", "content": f"What is {a} * {b} + {a - b}? "
                                                  "Reply with the number only."}])

    hint = "Hint: 412 is not right. The correct answer is 398."
    arithmetic = [s for i in range(32) for s in _sites(renderer, (question(i // 6), [(ints(8, 32), [])]), hint)]
    statement = "Write a Python function that " + " ".join(f"handles case {i} of the input carefully," for i in range(40))
    code = []
    for task in range(2):
        prompt = renderer.build_generation_prompt([{"role": "user", "content": f"Task {task}. {statement}"}])
        for _ in range(4):
            turns = [(ints(60, 100), renderer.render_turn({"role": "user", "content": "Tests failed: " + "x " * 30},
                                                          is_first=False).tokens[: int(torch.randint(40, 81, (1,), generator=g))])
                     for _ in range(3)]
            code += _sites(renderer, (prompt, turns), "Hint: the second test fails on an empty list.")
    return {"arithmetic_16": arithmetic[:16], "arithmetic_32": arithmetic, "code_multi_turn": code}


def main() -> None:
    from benchmarks.common import learner_benchmark, write_result
    from benchmarks.term_cost import padded_tokens
    from meshrl.terms.sdpo import teacher_datum
    from meshrl.training.prefix_trees import prefix_groups

    args, trainer, tokenizer = learner_benchmark(__doc__)
    rows = trainer.cfg.micro_batch_size
    result = {"model": args.model, "reps": args.reps, "top_k": TOP_K, "micro_batch_size": rows, "steps": {}}
    for name, sites in steps(tokenizer).items():
        datums = [teacher_datum(s) for s in sites]
        sequences = [s.teacher_tokens for s in sites]
        tokens = {}
        for min_prefix in (0, 16):  # the decoder's positions, as topk_at_positions batches them
            groups = prefix_groups(sequences, [s.teacher_start - 1 for s in sites], min_prefix)
            shared = [g for g in groups if g.prefix]
            rests = sorted(len(sequences[i]) - g.prefix for g in shared for i in g.members)
            lone = sorted(len(sequences[i]) for g in groups if not g.prefix for i in g.members)
            tokens[min_prefix] = len(shared) * max((g.prefix for g in shared), default=0) + padded_tokens(
                [w[i : i + rows] for w in (rests, lone) for i in range(0, len(w), rows)])
        trainer.topk_logprobs(datums, TOP_K, min_prefix=16)  # warm-up
        seconds: dict[int, list[float]] = {0: [], 16: []}
        for rep in range(args.reps):
            for min_prefix in ((0, 16) if rep % 2 == 0 else (16, 0)):
                started = time.perf_counter()
                trainer.topk_logprobs(datums, TOP_K, min_prefix=min_prefix)
                seconds[min_prefix].append(time.perf_counter() - started)
        whole, shared = statistics.median(seconds[0]), statistics.median(seconds[16])
        result["steps"][name] = {"sites": len(sites), "site_tokens": sum(len(s) for s in sequences),
                                 "decoder_tokens_whole": tokens[0], "decoder_tokens_shared": tokens[16],
                                 "whole_s": whole, "shared_s": shared, "shared_vs_whole": shared / whole,
                                 "runs_s": {"whole": seconds[0], "shared": seconds[16]}}
        print(f"{name}: {len(sites)} sites, decoder tokens {tokens[0]} -> {tokens[16]}, "
              f"{whole:.3f} s -> {shared:.3f} s (x{shared / whole:.2f})", flush=True)
    write_result("sdpo_teacher_cost", result)


if __name__ == "__main__":
    main()
