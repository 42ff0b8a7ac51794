"""Sampling throughput of `meshrl serve` under concurrent SDK clients while two tenants train.

    python benchmarks/serve_load.py [--levels 1 4 16 64] [--samples 4] [--max-tokens 16] [--rounds 3]

Starts `meshrl serve -c configs/serve.yaml` on loopback (the packaged SmolLM2-135M-Instruct, one
vLLM generator) and two training tenants (sessions of their own) that loop forward_backward +
optim_step on LoRA adapters for the whole run. Each level N runs `--rounds` rounds, each of two
phases back to back through the same server: the engine's one-batch figure (one request of
N x `num_samples` samples, which the engine generates as one batch) and then N sampling clients of
the official SDK sending requests back to back (`num_samples` samples of up to `max_tokens` tokens
at temperature 1, every request with its own seed; `--requests-per-client` each). A round's ratio is
the clients' generated tokens per second over the one batch's; the level reports the median round
(ratio and tokens/s) and the latencies of all its requests. Alternating the phases round by round
keeps the tenants' training, which takes most of the 2 cores in bursts of seconds, from falling on
one phase only. Writes benchmarks/results/serve_load.json; goal: at 16 clients, at least 0.8x of
the one-batch figure.

    python benchmarks/serve_load.py --abusive-neighbour [--flood 100] [--flood-tokens 128] [--quiet 12]

The abusive-neighbour arm instead: two tenants on a keys file, no training tenants. The quiet one
sends `--quiet` requests of one 8-token sample from the base model, one after the other, first
alone (the baseline), then while the other floods the server with `--flood` requests of
`--flood-tokens` tokens at once from a sampler of its own saved weights (another weight version,
so every quiet request needs a version switch). Reports the quiet tenant's p50 / p99 latency in
both phases and their ratio (goal: within 2x), how many flood requests the server refused for the
flooding tenant's quota (the SDK retries them) and whether any mesh was restarted. Writes
benchmarks/results/serve_abusive_neighbour.json.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import ROOT, write_result

KEY = "tml-serve-load"
seeds = itertools.count(1)  # every request's own seed
PROMPT = "Write one sentence about the sea, then one about the mountains."


def start_server(config: str, overrides: list[str], workdir: Path) -> tuple[subprocess.Popen, str, Path]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = workdir / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "meshrl.cli", "serve", "-c", config, f"output.dir={workdir}",
                                 *overrides, "--port", str(port)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=err, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 600)
    line = proc.stdout.readline() if ready else ""
    if not line.startswith("serving at http://"):
        proc.kill()
        raise RuntimeError(f"the server did not start: {line!r}\n{log.read_text()[-3000:]}")
    return proc, f"http://127.0.0.1:{port}", log


def stop_server(proc: subprocess.Popen) -> None:
    import psutil

    family = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    finally:
        for p in family:
            if p.is_running():
                p.kill()


class Tenant(threading.Thread):
    """A training client of its own session looping forward_backward + optim_step until stopped."""

    def __init__(self, url: str, base_model: str, seed: int, prompt: list[int]):
        super().__init__(daemon=True)
        import numpy as np
        import tinker
        from tinker import types as T

        self.service = tinker.ServiceClient(base_url=url, api_key=KEY)
        self.client = self.service.create_lora_training_client(base_model=base_model, rank=8, seed=seed).result(600)
        rng = np.random.default_rng(seed)
        tokens = [prompt + rng.integers(100, 5000, 48).tolist() for _ in range(8)]
        self.data = [T.Datum(model_input=T.ModelInput.from_ints(t[:-1]),
                             loss_fn_inputs={"target_tokens": np.array(t[1:], dtype=np.int64),
                                             "weights": np.ones(len(t) - 1, dtype=np.float32)}) for t in tokens]
        self.adam = T.AdamParams(learning_rate=1e-4)
        self.steps = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.client.forward_backward(self.data, "cross_entropy")
            self.client.optim_step(self.adam).result(timeout=600)
            self.steps += 1

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=600)
        self.service.close("success").result(timeout=60)


def generated(response) -> int:
    return sum(len(s.tokens) for s in response.sequences)


def one_batch(sampler, prompt, samples: int, max_tokens: int, seed: int) -> dict:
    """One request of ``samples`` samples (one engine batch): tokens, seconds, tokens/s."""
    from tinker import types as T

    started = time.perf_counter()
    response = sampler.sample(prompt, samples, T.SamplingParams(max_tokens=max_tokens, temperature=1.0,
                                                                seed=seed)).result(timeout=1200)
    seconds, tokens = time.perf_counter() - started, generated(response)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def concurrent_level(samplers, prompt, clients: int, requests: int, samples: int, max_tokens: int) -> dict:
    """``clients`` SDK sampling clients sending ``requests`` requests each, back to back."""
    from tinker import types as T

    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests):
            params = T.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=next(seeds))
            started = time.perf_counter()
            response = samplers[c].sample(prompt, samples, params).result(timeout=1200)
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens[0] += generated(response)

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    seconds = time.perf_counter() - started
    return {"requests": clients * requests, "tokens": tokens[0], "seconds": seconds,
            "tokens_per_s": tokens[0] / seconds, "latencies": latencies}


def level(samplers, prompt, clients: int, requests: int, samples: int, max_tokens: int, rounds: int) -> dict:
    """``rounds`` alternations of the one-batch figure and the clients' figure; the median round."""
    per_round, latencies = [], []
    for _ in range(rounds):
        batch = one_batch(samplers[0], prompt, clients * samples, max_tokens, next(seeds))
        load = concurrent_level(samplers, prompt, clients, requests, samples, max_tokens)
        latencies += load.pop("latencies")
        per_round.append({**load, "one_batch_tokens_per_s": batch["tokens_per_s"],
                          "one_batch_seconds": batch["seconds"],
                          "ratio_to_one_batch": load["tokens_per_s"] / batch["tokens_per_s"]})
    median = sorted(per_round, key=lambda r: r["ratio_to_one_batch"])[len(per_round) // 2]
    latencies.sort()
    return {"clients": clients, "requests": sum(r["requests"] for r in per_round),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in per_round),
            "one_batch_tokens_per_s": statistics.median(r["one_batch_tokens_per_s"] for r in per_round),
            "ratio_to_one_batch": median["ratio_to_one_batch"], "rounds": per_round,
            "latency_p50_s": statistics.median(latencies),
            "latency_p95_s": latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
            "load_average_1m": os.getloadavg()[0]}


QUIET_KEY, FLOOD_KEY = "tml-quiet-tenant", "tml-flooding-tenant"


def quiet_latencies(sampler, prompt, requests: int) -> list[float]:
    """One 8-token sample request after the other; each one's seconds."""
    from tinker import types as T

    out = []
    for _ in range(requests):
        started = time.perf_counter()
        sampler.sample(prompt, 1, T.SamplingParams(max_tokens=8, temperature=1.0, seed=next(seeds))).result(1200)
        out.append(time.perf_counter() - started)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def abusive_neighbour(url: str, model: str, prompt, args) -> dict:
    """The quiet tenant's latencies alone, then while the other tenant floods (see the module)."""
    import tinker
    from tinker import types as T

    quiet = tinker.ServiceClient(base_url=url, api_key=QUIET_KEY)
    flooder = tinker.ServiceClient(base_url=url, api_key=FLOOD_KEY)
    try:
        mine = quiet.create_sampling_client(base_model=model).result(600)
        trainer = flooder.create_lora_training_client(base_model=model, rank=8, seed=1).result(600)
        theirs = trainer.save_weights_and_get_sampling_client().result(600)  # another weight version
        quiet_latencies(mine, prompt, 2)  # warm-up
        alone = quiet_latencies(mine, prompt, args.quiet)
        started = time.perf_counter()
        flood = [theirs.sample(prompt, 1, T.SamplingParams(max_tokens=args.flood_tokens, temperature=1.0,
                                                           seed=next(seeds))) for _ in range(args.flood)]
        time.sleep(2.0)  # the flood is in the server's queues
        loaded = quiet_latencies(mine, prompt, args.quiet)
        quiet_done = time.perf_counter() - started
        flooded_tokens, gave_up = 0, 0
        for f in flood:
            try:
                flooded_tokens += generated(f.result(timeout=3600))
            except tinker.RateLimitError:  # refused for its quota more often than the SDK retries
                gave_up += 1
        flood_s = time.perf_counter() - started
    finally:
        for client in (quiet, flooder):
            client.close("success").result(timeout=60)
    p50, p99 = statistics.median(alone), percentile(alone, 0.99)
    lp50, lp99 = statistics.median(loaded), percentile(loaded, 0.99)
    return {"quiet": args.quiet, "flood": args.flood, "flood_tokens": args.flood_tokens,
            "alone_latencies_s": alone, "flooded_latencies_s": loaded,
            "alone_p50_s": p50, "alone_p99_s": p99, "flooded_p50_s": lp50, "flooded_p99_s": lp99,
            "p50_ratio": lp50 / p50, "p99_ratio": lp99 / p99, "goal_ratio": 2.0,
            "quiet_phase_s": quiet_done, "flood_s": flood_s, "flood_generated_tokens": flooded_tokens,
            "flood_requests_given_up": gave_up}


SWITCH = re.compile(r"generators hold weight version \d+ after ([\d.]+) s \(per replica: pull ([\d./]+) s, "
                    r"load ([\d./]+) s\)")


def switches(log: str) -> dict:
    """The server's weight-version loads on the generators (logged by meshrl.api.backend): how
    many, and their mean seconds in all, pulling and loading (summed over replicas)."""
    found = [(float(total), sum(map(float, pull.split("/"))), sum(map(float, load.split("/"))))
             for total, pull, load in SWITCH.findall(log)]
    if not found:
        return {"count": 0}
    return {"count": len(found), **{f"mean_{name}_s": statistics.fmean(f[i] for f in found)
                                    for i, name in enumerate(("total", "pull", "load"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/serve.yaml")
    parser.add_argument("--override", action="append", default=[], help="a dotted config override for the server")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--samples", type=int, default=4, help="num_samples of each request")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=0,
                        help="requests each client sends per round (default: 32 requests a round, at least 2 each)")
    parser.add_argument("--rounds", type=int, default=3, help="one-batch / clients alternations per level")
    parser.add_argument("--tenants", type=int, default=2, help="training tenants running throughout")
    parser.add_argument("--abusive-neighbour", action="store_true",
                        help="run the abusive-neighbour arm instead (two tenants on a keys file; see the module)")
    parser.add_argument("--flood", type=int, default=100, help="abusive-neighbour: requests the flooding tenant sends")
    parser.add_argument("--flood-tokens", type=int, default=128, help="abusive-neighbour: max_tokens of each")
    parser.add_argument("--quiet", type=int, default=12, help="abusive-neighbour: the quiet tenant's requests a phase")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"

    import tinker
    from tinker import types as T
    from transformers import AutoTokenizer

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.models.provision import resolve_model

    cfg = load_config(RunConfig, args.config, args.override)
    model = cfg.model.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(model))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    prompt = T.ModelInput.from_ints(list(ids))
    load_at_start = os.getloadavg()[0]
    if args.abusive_neighbour:
        with tempfile.TemporaryDirectory(prefix="serve_abuse_") as tmp:
            keys = Path(tmp) / "keys.txt"
            keys.write_text(f"{QUIET_KEY} quiet\n{FLOOD_KEY} flooding\n")
            proc, url, log = start_server(args.config, [*args.override, f"serve.keys_file={keys}"], Path(tmp))
            try:
                result = abusive_neighbour(url, model, prompt, args)
                text = log.read_text()
            finally:
                stop_server(proc)
        result.update(model=model, prompt_tokens=len(ids), overrides=args.override,
                      refusals_for_quota=len(re.findall("serve.limits.max_pending_samples", text)),
                      mesh_recoveries=len(re.findall("recovering mesh", text)),
                      version_switches=switches(text),
                      load_average_1m_at_start=load_at_start, load_average_1m=os.getloadavg()[0])
        print(f"quiet tenant: alone p50 {result['alone_p50_s']:.2f} s / p99 {result['alone_p99_s']:.2f} s; while "
              f"flooded p50 {result['flooded_p50_s']:.2f} s / p99 {result['flooded_p99_s']:.2f} s "
              f"({result['p50_ratio']:.1f}x / {result['p99_ratio']:.1f}x; goal 2x)", flush=True)
        write_result("serve_abusive_neighbour", result, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="serve_load_") as tmp:
        proc, url, log = start_server(args.config, args.override, Path(tmp))
        try:
            tenants = [Tenant(url, model, seed, list(ids)) for seed in range(1, args.tenants + 1)]
            for t in tenants:
                t.start()
            service = tinker.ServiceClient(base_url=url, api_key=KEY)
            samplers = [service.create_sampling_client(base_model=model).result(600) for _ in range(max(args.levels))]
            one_batch(samplers[0], prompt, args.samples, args.max_tokens, 0)  # warm-up
            rows = []
            for clients in args.levels:
                requests = args.requests_per_client or max(2, -(-32 // clients))
                row = level(samplers, prompt, clients, requests, args.samples, args.max_tokens, args.rounds)
                rows.append(row)
                each = ", ".join(f"{r['ratio_to_one_batch']:.2f}" for r in row["rounds"])
                print(f"{clients:3d} clients: {row['tokens_per_s']:7.1f} tokens/s, one batch "
                      f"{row['one_batch_tokens_per_s']:7.1f}; median round {row['ratio_to_one_batch']:.2f}x "
                      f"(rounds {each}); latency p50 {row['latency_p50_s']:.2f} s, p95 {row['latency_p95_s']:.2f} s",
                      flush=True)
            service.close("success").result(timeout=60)
            steps = [t.steps for t in tenants]
            for t in tenants:
                t.close()
            recovered = len(re.findall("recovering mesh", log.read_text()))
        finally:
            stop_server(proc)
    at16 = next((r["ratio_to_one_batch"] for r in rows if r["clients"] == 16), None)
    write_result("serve_load", {
        "model": model, "samples_per_request": args.samples, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "temperature": 1.0, "prompt_tokens": len(ids), "tenant_train_steps": steps, "mesh_recoveries": recovered,
        "rows": rows, "ratio_at_16_clients": at16, "goal_ratio_at_16_clients": 0.8,
        "load_average_1m_at_start": load_at_start, "load_average_1m": os.getloadavg()[0],
    }, args.out)


if __name__ == "__main__":
    main()
