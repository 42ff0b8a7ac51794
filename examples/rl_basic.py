"""Reinforcement learning with `meshrl.api` (Tinker's client API, in process): GRPO-style
group-centred advantages on the arithmetic task ("What is a + b?", the last integer of the reply
graded), a LoRA adapter trained with the `importance_sampling` loss; the mean reward rises.

Each step saves the adapter's weights for sampling, samples `group` replies per problem, grades
them, centres the rewards within each group and trains on every reply token with its group's
advantage: the token-level loop tinker-cookbook's RL recipes run.

    python examples/rl_basic.py                       # the packaged SmolLM2-135M-Instruct
    python examples/rl_basic.py model.name_or_path=tiny --steps 2 --problems 2 --group 2
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from meshrl.advantages import group_centered_advantages
from meshrl.api import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.envs.arithmetic import ArithmeticTask
from meshrl.renderers import renderer_for_tokenizer

SERVE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"


def rl_datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> Datum:
    """Prompt + reply as one training sequence; sampler logprobs and the advantage on the reply."""
    n = len(prompt)
    return Datum.from_sequence(prompt + tokens, logprobs=[0.0] * n + logprobs,
                               advantages=[0.0] * n + [advantage] * len(tokens))


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("-c", "--config", default=str(SERVE_CONFIG), help="run config (default: configs/serve.yaml)")
    parser.add_argument("overrides", nargs="*", help="run config overrides (model, meshes, ...)")
    args = parser.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    task = ArithmeticTask(cfg.task.arithmetic, cfg.trainer.seed)
    rewards_by_step = []
    with ServiceClient(cfg) as service:
        training = service.create_lora_training_client(base_model=cfg.model.name_or_path, rank=16, seed=0,
                                                          train_unembed=False)
        renderer = renderer_for_tokenizer(training.get_tokenizer())
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=tuple(renderer.get_stop_sequences()))
        for step in range(args.steps):
            sampler = training.save_weights_and_get_sampling_client(f"step-{step}")
            problems = task.train_batch(step * args.problems, args.problems)
            prompts = [renderer.build_generation_prompt(p.messages) for p in problems]
            futures = [sampler.sample(ModelInput.from_ints(prompt), args.group, replace(params, seed=step * 1000 + i))
                       for i, prompt in enumerate(prompts)]
            data, rewards = [], []
            for problem, prompt, future in zip(problems, prompts, futures):
                sequences = future.result().sequences
                group = [task.grade(problem, renderer.parse_response(s.tokens)[0]["content"])[0] for s in sequences]
                rewards += group
                for s, advantage in zip(sequences, group_centered_advantages(torch.tensor(group)).tolist()):
                    if advantage != 0.0 and s.tokens:
                        data.append(rl_datum(prompt, s.tokens, s.logprobs, advantage))
            if data:
                training.forward_backward(data, "importance_sampling")
                training.optim_step(AdamParams(learning_rate=args.lr)).result()
            rewards_by_step.append(sum(rewards) / len(rewards))
            print(f"step {step}: mean reward {rewards_by_step[-1]:.3f} ({len(data)} datums with signal)", flush=True)
    return rewards_by_step


if __name__ == "__main__":
    main()
