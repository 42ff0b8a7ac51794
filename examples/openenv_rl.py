"""Reinforcement learning on an environment served over HTTP by OpenEnv: `RetryArithmeticEnv`
(examples/openenv_arithmetic.py, written against openenv-core's interface only) runs in
openenv-core's own server (`create_app`, in a process of its own), meshrl's `OpenEnvClient` plays
episodes on it through OpenEnv's WebSocket client, and `meshrl.api` trains a LoRA adapter on them
with the `importance_sampling` loss and group-centred advantages.

An episode is "What is a + b?" with a second attempt after a wrong answer: reward 1 for a correct
first answer, 0.5 for a correct second one. Token-in/token-out: each turn samples the policy's
reply after the tokens so far, and the environment's feedback joins the sequence through the
renderer's bridge (history is never re-rendered), so every episode is one training sequence whose
sampled tokens carry the episode's advantage.

    python examples/openenv_rl.py                     # the packaged SmolLM2-135M-Instruct
    python examples/openenv_rl.py model.name_or_path=tiny --steps 2 --problems 2 --group 2
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from pathlib import Path

import torch

from meshrl.advantages import group_centered_advantages
from meshrl.api import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.envs.openenv_adapter import OpenEnvClient, spawn_openenv_server
from meshrl.renderers import renderer_for_tokenizer

EXAMPLES = Path(__file__).resolve().parent
SERVE_CONFIG = EXAMPLES.parent / "configs" / "serve.yaml"


class Episode:
    """One episode's training sequence: the prompt, each sampled reply and each feedback turn."""

    def __init__(self, prompt: list[int]):
        self.tokens, self.logprobs = list(prompt), [0.0] * len(prompt)
        self.sampled = [0] * len(prompt)  # 1 on the policy's tokens
        self.reward, self.turns, self.done = 0.0, 0, False

    def add(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.sampled += [1 if logprobs is not None else 0] * len(tokens)


def play(envs: list[OpenEnvClient], seeds: list[int], sampler, renderer, params: SamplingParams,
         max_len: int) -> list[Episode]:
    """One episode per (client, seed), turn by turn: every live episode's next reply is sampled,
    sent to its server session, and the feedback appended until the episode ends (or its sequence
    would pass ``max_len``)."""
    episodes = []
    for env, seed in zip(envs, seeds):
        episodes.append(Episode(renderer.build_generation_prompt([env.reset(seed=seed).message])))
    live = list(zip(envs, episodes))
    while live:
        futures = [sampler.sample(ModelInput.from_ints(ep.tokens), 1, replace(params, seed=params.seed + 1000 * i))
                   for i, (_, ep) in enumerate(live)]
        for (env, ep), future in zip(live, futures):
            reply = future.result().sequences[0]
            ep.add(list(reply.tokens), list(reply.logprobs))
            obs = env.step(renderer.parse_response(reply.tokens)[0]["content"])
            ep.turns += 1
            ep.reward += obs.reward or 0.0
            ep.done = obs.done
            if not obs.done:
                ep.add(renderer.bridge(ep.tokens, [obs.message]))
        live = [(env, ep) for env, ep in live if not ep.done and len(ep.tokens) + params.max_tokens <= max_len]
        params = replace(params, seed=params.seed + 7919)
    return episodes


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--env", default="openenv_arithmetic:RetryArithmeticEnv",
                        help="the OpenEnv environment the server hosts (package.module:callable; examples/ is on its path)")
    parser.add_argument("-c", "--config", default=str(SERVE_CONFIG), help="run config (default: configs/serve.yaml)")
    parser.add_argument("overrides", nargs="*", help="run config overrides (model, meshes, ...)")
    args = parser.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    n = args.problems * args.group
    # the server imports examples/openenv_arithmetic.py as the module `openenv_arithmetic`
    path = os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH", "")) if p)
    server = spawn_openenv_server(args.env, max_sessions=n, env={**os.environ, "PYTHONPATH": path})
    envs: list[OpenEnvClient] = []
    stats = []
    try:
        envs = [OpenEnvClient(server.url) for _ in range(n)]  # one server session each
        with ServiceClient(cfg) as service:
            training = service.create_lora_training_client(base_model=cfg.model.name_or_path, rank=16, seed=0,
                                                              train_unembed=False)
            renderer = renderer_for_tokenizer(training.get_tokenizer())
            for step in range(args.steps):
                sampler = training.save_weights_and_get_sampling_client(f"step-{step}")
                params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=step,
                                        stop=tuple(renderer.get_stop_sequences()))
                seeds = [step * args.problems + i // args.group for i in range(n)]
                episodes = play(envs, seeds, sampler, renderer, params, cfg.model.max_model_len)
                data = []
                for g in range(args.problems):
                    group = episodes[g * args.group:(g + 1) * args.group]
                    advantages = group_centered_advantages(torch.tensor([ep.reward for ep in group])).tolist()
                    data += [Datum.from_sequence(ep.tokens, logprobs=ep.logprobs,
                                                 advantages=[advantage * s for s in ep.sampled])
                             for ep, advantage in zip(group, advantages) if advantage != 0.0]
                if data:
                    training.forward_backward(data, "importance_sampling")
                    training.optim_step(AdamParams(learning_rate=args.lr)).result()
                stats.append({"reward": sum(ep.reward for ep in episodes) / n, "turns": sum(ep.turns for ep in episodes) / n,
                              "episodes": len(episodes), "datums": len(data)})
                print(f"step {step}: mean reward {stats[-1]['reward']:.3f}, {stats[-1]['turns']:.2f} turns per episode "
                      f"({len(data)} episodes with signal)", flush=True)
    finally:
        for env in envs:
            env.close()
        server.close()
    return stats


if __name__ == "__main__":
    main()
