"""Generation tokens/s of the Generator's two engines, vLLM against HF `generate`, on one workload.

Same model, prompts and sampling shapes, in one process, the engines taking turns round by round.

    python benchmarks/generation.py [--model smollm2-135m-instruct] [--rounds 4] [--quick]

Both engines are built by `meshrl.engines.make_engine` (the Generator actor's own path) from
configs/default.yaml's generator section with only `backend` changed, and both may use every core
this process may use (torch's thread count is the process's, shared by the in-process vLLM engine
and HF). A round is the default job's generation: `trainer.prompts_per_step` prompts of the
default task x `trainer.group_size` samples, up to `generator.sampling.max_new_tokens` tokens,
temperature and top-p from the config, seeded; each round takes the next prompts of the training
stream and a new seed, and both engines get the same round. One warm-up round per engine, then
`--rounds` timed rounds in which the engines alternate, so load from other work on a shared
machine falls on both alike.

`SampleRequest` has no minimum length (no `ignore_eos`), so a completion ends at the model's stop
token as in training: tokens/s counts the tokens each engine actually returned (the two engines'
samplers differ, so their counts differ a little), and the result records the mean length and
the share of completions that ran to the length limit.

Writes benchmarks/results/generation.json: rows per backend (tokens, seconds, tokens/s) and
`ratio_vllm_vs_hf` (vLLM tokens/s over HF tokens/s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BACKENDS = ("vllm", "hf")
SEED = 1234


def _round(engine, prompts: list[list[int]], request) -> dict:
    """One timed generate call: seconds, tokens returned, completions and how many hit the limit."""
    started = time.perf_counter()
    groups = engine.generate(prompts, request)
    seconds = time.perf_counter() - started
    completions = [c for g in groups for c in g]
    return {"seconds": seconds, "tokens": sum(len(c.tokens) for c in completions), "completions": len(completions),
            "at_limit": sum(1 for c in completions if c.finish_reason == "length")}


def _row(backend: str, rounds: list[dict], build_s: float) -> dict:
    tokens = sum(r["tokens"] for r in rounds)
    seconds = sum(r["seconds"] for r in rounds)
    completions = sum(r["completions"] for r in rounds)
    return {"backend": backend, "tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "round_s": [r["seconds"] for r in rounds], "median_round_s": statistics.median(r["seconds"] for r in rounds),
            "mean_completion_tokens": tokens / completions,
            "share_at_length_limit": sum(r["at_limit"] for r in rounds) / completions, "build_s": build_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model.name_or_path")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per engine (after a warm-up round)")
    parser.add_argument("--quick", action="store_true", help="2 timed rounds (for `make bench`)")
    args = parser.parse_args()
    rounds = 2 if args.quick else args.rounds

    from meshrl.cli import default_config_path
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.local import prepare_environment

    cfg = load_config(RunConfig, default_config_path(), [f"model.name_or_path={args.model}"])
    prepare_environment(cfg.meshes)
    from transformers import AutoTokenizer

    from meshrl.engines import SampleRequest, make_engine
    from meshrl.engines.base import cpu_share
    from meshrl.envs.task_sets import make_task
    from meshrl.models.provision import resolve_model
    from meshrl.renderers import renderer_for_tokenizer

    path = resolve_model(cfg.model.name_or_path)
    renderer = renderer_for_tokenizer(AutoTokenizer.from_pretrained(path))
    task, per_round, s = make_task(cfg.task, cfg.trainer.seed), cfg.trainer.prompts_per_step, cfg.generator.sampling

    def round_inputs(i: int) -> tuple[list[list[int]], SampleRequest]:
        prompts = [renderer.build_generation_prompt(list(p.messages)) for p in task.train_batch(i * per_round, per_round)]
        return prompts, SampleRequest(n=cfg.trainer.group_size, max_tokens=s.max_new_tokens, temperature=s.temperature,
                                      top_p=s.top_p, stop_token_ids=tuple(renderer.get_stop_sequences()),
                                      seed=SEED + 1000 * i)

    engines, build_s = {}, {}
    try:
        for backend in BACKENDS:
            started = time.perf_counter()
            gen_cfg = cfg.generator.model_copy(update={"backend": backend, "torch_threads": cpu_share(1)})
            engines[backend] = make_engine(path, gen_cfg, cfg.model.dtype, cfg.model.max_model_len, cfg.generator.seed)
            build_s[backend] = time.perf_counter() - started
            _round(engines[backend], *round_inputs(0))  # warm-up
            print(f"{backend}: built in {build_s[backend]:.1f}s, warmed up", flush=True)
        timed: dict[str, list[dict]] = {b: [] for b in BACKENDS}
        load = []
        for i in range(1, rounds + 1):
            inputs = round_inputs(i)
            for backend in BACKENDS:
                timed[backend].append(_round(engines[backend], *inputs))
            load.append(os.getloadavg()[0])
    finally:
        for engine in engines.values():
            engine.close()

    rows = [_row(b, timed[b], build_s[b]) for b in BACKENDS]
    for r in rows:
        print(f"{r['backend']:5s} {r['tokens_per_s']:8.1f} tokens/s  ({r['tokens']} tokens in {r['seconds']:.2f}s, "
              f"{r['mean_completion_tokens']:.1f} per completion, {r['share_at_length_limit']:.0%} at the limit)")
    ratio = rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"]
    print(f"vLLM / HF: {ratio:.2f}x")
    prompts, request = round_inputs(0)
    write_result("generation", {
        "kind": "generation", "model": cfg.model.name_or_path, "dtype": cfg.model.dtype, "prompts": len(prompts),
        "samples_per_prompt": request.n, "max_new_tokens": request.max_tokens, "temperature": request.temperature,
        "rounds": rounds, "rows": rows, "ratio_vllm_vs_hf": ratio, "loadavg_1min_per_round": load})


if __name__ == "__main__":
    main()
