"""The RL loop of `examples/rl_basic.py`, written against the official `tinker` SDK and run
against `meshrl serve`: group-centred advantages on two-digit additions, a LoRA adapter trained
with `importance_sampling`. Nothing here is meshrl's: the problems, the grader and the advantages
are a few lines each, as in a tinker-cookbook recipe.

    meshrl serve -c configs/serve.yaml &                  # prints: serving at http://127.0.0.1:8000
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-local python examples/tinker_sdk_rl.py
"""

from __future__ import annotations

import argparse
import os
import random
import re

import numpy as np
import tinker
from tinker import types


def problems(step: int, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """``n`` questions "What is a + b?" with their answers (a, b in 10..99), fixed per step."""
    rng = random.Random(seed * 100_003 + step)
    return [(f"What is {a} + {b}?", a + b) for a, b in ((rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n))]


def grade(reply: str, answer: int) -> float:
    """1 if the reply's last integer is the answer."""
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def datum(prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float) -> types.Datum:
    """Prompt + reply as one sequence (inputs x[:-1], targets x[1:]); logprobs and advantages of
    the reply's tokens, 0 on the prompt's."""
    seq = prompt + tokens
    n = len(prompt) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={
        "target_tokens": np.array(seq[1:], dtype=np.int64),
        "logprobs": np.array([0.0] * n + logprobs, dtype=np.float32),
        "advantages": np.array([0.0] * n + [advantage] * len(tokens), dtype=np.float32)})


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("TINKER_BASE_URL"))
    parser.add_argument("--model", default="Qwen/Qwen3-4B-Instruct-2507", help="a name the server answers to")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    with tinker.ServiceClient(base_url=args.base_url) as service:  # leaving it finishes the session
        return train(service, args)


def train(service: tinker.ServiceClient, args: argparse.Namespace) -> list[float]:
    training = service.create_lora_training_client(base_model=args.model, rank=16, seed=0)
    tokenizer = training.get_tokenizer()
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else None
    mean_rewards = []
    for step in range(args.steps):
        sampler = training.save_weights_and_get_sampling_client(f"step-{step}")
        batch = problems(step, args.problems)
        prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                      return_dict=True)["input_ids"]) for q, _ in batch]
        futures = [sampler.sample(types.ModelInput.from_ints(p), args.group, types.SamplingParams(
            max_tokens=args.max_tokens, temperature=1.0, stop=stop, seed=step * 1000 + i)) for i, p in enumerate(prompts)]
        data, rewards = [], []
        for (_, answer), prompt, future in zip(batch, prompts, futures):
            sequences = future.result().sequences
            group = [grade(tokenizer.decode(s.tokens, skip_special_tokens=True), answer) for s in sequences]
            rewards += group
            mean = sum(group) / len(group)
            data += [datum(prompt, list(s.tokens), list(s.logprobs), r - mean)
                     for s, r in zip(sequences, group) if r != mean and s.tokens]
        if data:
            training.forward_backward(data, "importance_sampling")
            training.optim_step(types.AdamParams(learning_rate=args.lr)).result()
        mean_rewards.append(sum(rewards) / len(rewards))
        print(f"step {step}: mean reward {mean_rewards[-1]:.3f} ({len(data)} datums with signal)", flush=True)
    return mean_rewards


if __name__ == "__main__":
    main()
