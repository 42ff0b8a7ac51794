"""Generation throughput with 1 and 2 generator replicas, side by side in one run, through the
generator actors and the MeshClient's dynamic dispatch (the default job's backend, model and
sampling shapes: configs/default.yaml, 8 prompts x 8 samples x up to 32 tokens per round).

On a 2-core machine two replicas share the same two cores: each replica's engine uses its share of
them (one thread), one replica uses both. Rows:

- `1 replica`: the default layout.
- `2 replicas`: the default settings with `meshes.generator.procs=2`.
- `2 replicas, 1 chunk per replica`: the same mesh with `meshes.chunks_per_replica=1` (bigger
  batches, no balancing inside a call).
- `2 replicas, one stalled`: the same mesh with replica 1 made to sleep `--stall-s` in its next
  generate call (fault injection); hedging serves its chunk elsewhere.

Both meshes are up at once and the rows take turns round by round, so load from other work on a
shared machine falls on every row alike (the load average is recorded per round). Before the
replicas capped their threads, each used both cores: 2 replicas x 2 spinning OpenMP threads on 2
cores generated 35 tokens/s against 377 for 1 replica (this file's result at commit 410da03).

Every row samples the same seeded requests; `same_samples` says whether a row produced exactly the
tokens of the first (prompt i is sampled with seed + i whichever replica serves it).

    python benchmarks/generation_replicas.py [--model smollm2-135m-instruct] [--rounds 4]

Prints a table and writes benchmarks/results/generation_replicas.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import write_result

ROWS = [("1 replica", 1, 4), ("2 replicas", 2, 4), ("2 replicas, 1 chunk per replica", 2, 1)]
"""(row, meshes.generator.procs, meshes.chunks_per_replica)"""


def _tokens(groups) -> list[list[list[int]]]:
    return [[c.tokens for c in g] for g in groups]


def _row(name: str, seconds: list[float], groups: list, served: dict, reference: list) -> dict:
    tokens = sum(len(c.tokens) for g in groups for c in g)
    s = statistics.median(seconds)
    row = {"layout": name, "round_s": seconds, "median_round_s": s, "tokens_per_round": tokens,
           "tokens_per_s": tokens / s, "prompts_by_replica": {str(r): n for r, n in sorted(served.items())},
           "same_samples": _tokens(groups) == reference}
    print(f"{name:40s} {row['tokens_per_s']:7.1f} tokens/s  median round {s:5.2f}s  served "
          f"{row['prompts_by_replica']}  same samples: {row['same_samples']}")
    return row


def _timed(client, prompts, request, served: dict) -> tuple[float, list]:
    """One round: its seconds and completions; counts the prompts each replica served."""
    started = time.perf_counter()
    groups = client.generate(prompts, request)
    seconds = time.perf_counter() - started
    for g in groups:
        served[g[0].meta["replica"]] = served.get(g[0].meta["replica"], 0) + 1
    return seconds, groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model.name_or_path (default: configs/default.yaml's)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per row (after a warm-up round)")
    parser.add_argument("--stall-s", type=float, default=30.0, help="how long the stalled replica sleeps")
    args = parser.parse_args()

    from meshrl.cli import default_config_path
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.local import prepare_environment

    overrides = [f"model.name_or_path={args.model}"] if args.model else []
    base = load_config(RunConfig, default_config_path(), overrides)
    prepare_environment(base.meshes)
    from transformers import AutoTokenizer

    from meshrl.actors.generator import Generator
    from meshrl.config.meshes import GENERATOR
    from meshrl.meshes.client import MeshClient
    from meshrl.meshes.supervisor import Supervisor
    from meshrl.engines import SampleRequest
    from meshrl.envs.task_sets import make_task
    from meshrl.meshes.group import MeshGroup
    from meshrl.config.launch import LaunchConfig
    from meshrl.meshes.hosts import Hosts
    from meshrl.models.provision import resolve_model
    from meshrl.renderers import renderer_for_tokenizer

    path = resolve_model(base.model.name_or_path)
    renderer = renderer_for_tokenizer(AutoTokenizer.from_pretrained(path))
    prompts = [renderer.build_generation_prompt(list(p.messages))
               for p in make_task(base.task).train_batch(0, base.trainer.prompts_per_step)]
    s = base.generator.sampling
    request = SampleRequest(n=base.trainer.group_size, max_tokens=s.max_new_tokens, temperature=s.temperature,
                            top_p=s.top_p, stop_token_ids=tuple(renderer.get_stop_sequences()), seed=1234)
    groups_by_procs, clients, spawn_s = {}, [], {}
    try:
        for procs in sorted({procs for _, procs, _ in ROWS}):
            cfg = load_config(RunConfig, default_config_path(), overrides + [f"meshes.generator.procs={procs}"])
            started = time.perf_counter()
            meshes = groups_by_procs[procs] = MeshGroup(cfg.meshes, Hosts.local(LaunchConfig()))
            meshes.spawn(GENERATOR, Generator, str(path), cfg.model, cfg.generator, cfg.weight_sync)
            meshes.wait_ready()
            spawn_s[procs] = time.perf_counter() - started
        for name, procs, chunks in ROWS:
            meshes = groups_by_procs[procs]
            timeouts = {GENERATOR: base.generator.generate_timeout_s, "sync": base.learner.call_timeout_s}
            clients.append(MeshClient(meshes, Supervisor(meshes, base.faults), timeouts, chunks))
            clients[-1].generate(prompts, request)  # warm-up
        seconds = [[] for _ in ROWS]
        served = [{} for _ in ROWS]
        last = [None for _ in ROWS]
        load = []
        for _ in range(args.rounds):
            for i, client in enumerate(clients):
                took, last[i] = _timed(client, prompts, request, served[i])
                seconds[i].append(took)
            load.append(os.getloadavg()[0])
        reference = _tokens(last[0])
        rows = [{**_row(name, seconds[i], last[i], served[i], reference), "replicas": procs,
                 "chunks_per_replica": chunks, "spawn_s": spawn_s[procs]}
                for i, (name, procs, chunks) in enumerate(ROWS)]
        stalled = groups_by_procs[2][GENERATOR]
        stalled.slice(procs=1).inject_fault.call_one("generate", "delay", args.stall_s).get(timeout=60)
        stalled_served: dict[int, int] = {}
        took, groups = _timed(clients[1], prompts, request, stalled_served)
        rows.append({**_row(f"2 replicas, one stalled {args.stall_s:g}s", [took], groups, stalled_served, reference),
                     "replicas": 2, "chunks_per_replica": ROWS[1][2], "stall_s": args.stall_s})
        stalled.info.call().get(timeout=args.stall_s + 60)  # let the stalled one finish
    finally:
        for meshes in groups_by_procs.values():
            meshes.stop()
    write_result("generation_replicas", {
        "kind": "generation_replicas", "model": base.model.name_or_path, "backend": base.generator.backend,
        "prompts": len(prompts), "samples_per_prompt": request.n, "max_new_tokens": request.max_tokens,
        "rounds": args.rounds, "rows": rows, "loadavg_1min_per_round": load})


if __name__ == "__main__":
    main()
