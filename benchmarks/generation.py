"""Generation tokens/s of the Generator's engines, vLLM against HF `generate`, on one workload.

Same model, prompts and sampling shapes, in one process, the engines taking turns round by round.

    python benchmarks/generation.py [--model smollm2-135m-instruct] [--rounds 4] [--quick]
    python benchmarks/generation.py --engines hf-eager,hf-static --out elsewhere.json   # the HF paths

Engines: `vllm`, `hf` (its default path: static on CUDA, eager on the CPU), `hf-eager` and
`hf-static` (`generator.hf_decode`). On a host with CUDA every engine runs on the first GPU (the
process sees the host's GPUs; the result names the device).

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

Writes benchmarks/results/generation.json (`--out`): rows per engine (tokens, seconds, tokens/s),
`ratio_vllm_vs_hf` (vLLM tokens/s over HF tokens/s) when both ran and `ratio_static_vs_eager`
(the HF engine's static path over its eager one) when both of those ran.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from common import device_name, write_result

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ENGINES = {"vllm": {"backend": "vllm"}, "hf": {"backend": "hf"},
           "hf-eager": {"backend": "hf", "hf_decode": "eager"}, "hf-static": {"backend": "hf", "hf_decode": "static"}}
"""Engine name -> the generator settings it changes."""
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
    parser.add_argument("--engines", default="vllm,hf", help=f"comma-separated, of {', '.join(ENGINES)}")
    parser.add_argument("--out", type=Path, default=None, help="the result JSON (default: benchmarks/results/)")
    args = parser.parse_args()
    names = args.engines.split(",")
    unknown = sorted(set(names) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)} (engines: {', '.join(ENGINES)})")
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
        for backend in names:
            started = time.perf_counter()
            gen_cfg = cfg.generator.model_copy(update={**ENGINES[backend], "torch_threads": cpu_share(1)})
            engines[backend] = make_engine(path, gen_cfg, cfg.model.dtype, cfg.model.max_model_len, cfg.generator.seed)
            build_s[backend] = time.perf_counter() - started
            _round(engines[backend], *round_inputs(0))  # warm-up
            print(f"{backend}: built in {build_s[backend]:.1f}s, warmed up", flush=True)
        timed: dict[str, list[dict]] = {b: [] for b in names}
        load = []
        for i in range(1, rounds + 1):
            inputs = round_inputs(i)
            for backend in names:
                timed[backend].append(_round(engines[backend], *inputs))
            load.append(os.getloadavg()[0])
    finally:
        for engine in engines.values():
            engine.close()

    rows = {b: _row(b, timed[b], build_s[b]) for b in names}
    for r in rows.values():
        print(f"{r['backend']:9s} {r['tokens_per_s']:8.1f} tokens/s  ({r['tokens']} tokens in {r['seconds']:.2f}s, "
              f"{r['mean_completion_tokens']:.1f} per completion, {r['share_at_length_limit']:.0%} at the limit)")
    ratios = {key: rows[a]["tokens_per_s"] / rows[b]["tokens_per_s"]
              for key, a, b in (("ratio_vllm_vs_hf", "vllm", "hf"), ("ratio_static_vs_eager", "hf-static", "hf-eager"))
              if a in rows and b in rows}
    for key, ratio in ratios.items():
        print(f"{key}: {ratio:.2f}x")
    prompts, request = round_inputs(0)
    write_result("generation", {
        "kind": "generation", "device": device_name(), "model": cfg.model.name_or_path, "dtype": cfg.model.dtype,
        "prompts": len(prompts), "samples_per_prompt": request.n, "max_new_tokens": request.max_tokens,
        "temperature": request.temperature, "rounds": rounds, "rows": list(rows.values()), **ratios,
        "loadavg_1min_per_round": load}, args.out)


if __name__ == "__main__":
    main()
