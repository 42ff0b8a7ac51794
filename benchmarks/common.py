"""What every benchmark records about where and when it ran, and how it writes its result.

    from common import write_result          # benchmarks/ is the script's directory on sys.path
    write_result("generation", {"rows": rows})   # -> benchmarks/results/generation.json

`provenance()` describes the machine (CPU model, cores this process may use, memory, GPU if torch
sees one), the date, the short commit and the 1-minute load average; `write_result` adds it to a
payload and writes the JSON that `benchmarks/tables.py` renders into docs/benchmarks.md. A payload's own
keys win over the provenance's (a script that tracked the load average at start and end keeps its
own `load_average_1m`).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> str:
    """The GPUs torch sees, e.g. "1 x NVIDIA H100 80GB HBM3", or "no GPU"."""
    try:
        import torch
    except ImportError:
        return "no GPU (torch not installed)"
    if not torch.cuda.is_available():
        return "no GPU"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def machine() -> str:
    """One line: architecture, CPU model, usable cores, memory, GPUs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = _memory_gib()
    parts = [platform.machine(), _cpu_model(), f"{cores} cores"]
    if memory is not None:
        parts.append(f"{memory:.0f} GiB")
    parts.append(_gpus())
    return ", ".join(parts)


def git_commit() -> str:
    """The short commit of the checkout the benchmark ran from ("" outside git)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return out.stdout.strip()


def provenance() -> dict:
    """machine, date, commit and 1-minute load average, as every result file carries them."""
    return {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
            "load_average_1m": os.getloadavg()[0]}


def device_name() -> str:
    """The first GPU (what a benchmark's engines and learners run on where there is one), or the
    CPU's core count."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"


def write_result(name: str, payload: dict, out: str | Path | None = None) -> Path:
    """Write ``{**provenance(), **payload}`` to ``out`` (default benchmarks/results/<name>.json)
    and return the path."""
    path = Path(out) if out is not None else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**provenance(), **payload}, indent=1) + "\n")
    print(f"wrote {path}")
    return path


def learner_benchmark(doc: str):
    """The command line of a learner micro-benchmark (``--reps``, ``--model``; ``doc``'s first
    line describes it) and what it measures on: (args, a `PolicyTrainer` with the learner's
    defaults, the model's tokenizer)."""
    import argparse

    from meshrl.config.learner import LearnerConfig
    from meshrl.models.provision import resolve_model
    from meshrl.training.policy import PolicyTrainer
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    path = resolve_model(args.model)
    return args, PolicyTrainer(path, LearnerConfig()), AutoTokenizer.from_pretrained(path)
