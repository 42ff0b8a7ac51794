"""Supervised fine-tuning with `meshrl.api` (Tinker's client API, in process): a LoRA adapter
learns to answer two-digit additions in one fixed format; the cross-entropy on the answer tokens
falls.

    python examples/sl_basic.py                       # the packaged SmolLM2-135M-Instruct, 12 steps
    python examples/sl_basic.py --steps 3 model.name_or_path=tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshrl.api import AdamParams, Datum, ServiceClient
from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.envs.arithmetic import ArithmeticTask
from meshrl.renderers import renderer_for_tokenizer

SERVE_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "serve.yaml"


def examples(renderer, n: int) -> list[Datum]:
    """``n`` chat examples "What is a + b?" -> "The answer is c.", weight 1 on the answer only."""
    task = ArithmeticTask(RunConfig().task.arithmetic)
    data = []
    for problem in task.train_batch(0, n):
        messages = [*problem.messages, {"role": "assistant", "content": f"The answer is {problem.answer}."}]
        tokens, weights = renderer.build_supervised_example(messages)
        data.append(Datum.from_sequence(tokens, weights=weights))
    return data


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("-c", "--config", default=str(SERVE_CONFIG), help="run config (default: configs/serve.yaml)")
    parser.add_argument("overrides", nargs="*", help="run config overrides (model, meshes, ...)")
    args = parser.parse_args(argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    losses = []
    with ServiceClient(cfg) as service:
        training = service.create_lora_training_client(base_model=cfg.model.name_or_path, rank=16, seed=0,
                                                          train_unembed=False)
        data = examples(renderer_for_tokenizer(training.get_tokenizer()), args.batch)
        answer_tokens = sum(float(d.loss_fn_inputs["weights"].sum()) for d in data)
        for step in range(args.steps):
            fwd_bwd = training.forward_backward(data, "cross_entropy")
            optim = training.optim_step(AdamParams(learning_rate=args.lr))  # queued right behind it
            loss = fwd_bwd.result().metrics["loss:sum"] / answer_tokens
            optim.result()
            losses.append(loss)
            print(f"step {step}: mean answer-token NLL {loss:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    main()
