"""`make gpu-check`: on a host with CUDA, run meshrl's GPU paths one after the other and write
benchmarks/results/gpu_check.json naming the device; a part this host cannot run is recorded as
`skipped: <why>`. On a host without CUDA it says that nothing was run, writes nothing and exits 0.

    python scripts/gpu_check.py                          # every part, the result in benchmarks/results/
    python scripts/gpu_check.py --quick                  # what one GPU can run, in at most 8 minutes
    python scripts/gpu_check.py --parts colocated,fsdp2_nccl --out /tmp/gpu_check.json

Parts (each a subprocess with a deadline; run directories under --work-dir):
  auto_placement    `meshrl train` of the default job with the HF generator and no placement setting
                    (`gpus_per_proc: auto`): the GPUs it chose, checked process by process
  train_cuda        `meshrl train` with the HF generator, learner on GPU 0 and generator on GPU 1 (with
                    one GPU both on GPU 0, separate processes with a memory share each); every mesh
                    process must run on the GPUs its placement plans (nvidia-smi's compute processes
                    against the run's mesh pids)
  placement         learner on GPU 0 and one HF generator replica on each other GPU (2+ GPUs)
  train_cuda_arena  train_cuda with the weight store's arenas in GPU memory; records the transport
  weight_pull_ipc   benchmarks/weight_transports.py with CUDA arenas, the local copy (CUDA IPC),
                    against a same-run device-to-device memcpy, SmolLM2-135M and a synthetic 1 GB
                    state dict; bitwise identical
  weight_pull_rdma  the same over RDMA (GPUDirect with ibverbs, else Monarch's TCP fallback)
  colocated         the HF generator in the learner's process on its GPU: zero bytes moved per sync
  hf_generation     benchmarks/generation.py: the HF engine's static path (CUDA graphs) against its
                    eager one, tokens/s on the GPU
  vs_trl_hf         benchmarks/vs_trl.py --backend hf --quick (needs TRL: `make bench-deps`); in the
                    quick battery without its learning run
  fsdp2_nccl        a 2-process FSDP2 learner, one GPU each (NCCL) (2+ GPUs)
  vllm_cuda         the vLLM generator on a GPU (needs vLLM's CUDA build)
  vllm_colocated    the co-located vLLM generator (dummy load, weights from the learner, sleep mode)

`--quick` runs the parts one GPU can run that the 8 minutes hold (QUICK_PARTS, in that order),
each under what is left of QUICK_BUDGET_S; a part that no longer fits is recorded as skipped.

Exit status: 0 when every part that ran passed (or nothing ran), 1 when a part failed.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
TRAIN_STEPS = 4
TRAIN = ["generator.backend=hf", f"trainer.steps={TRAIN_STEPS}", "trainer.eval.every=0", "trainer.eval.at_start=false",
         "trainer.checkpoint.every=0", "trainer.checkpoint.export_final=false", "trainer.progress=false"]
READY = re.compile(r"meshes ready in [\d.]+s: (\{.*\})")
RUN = "run"
"""A training part's run directory, inside its work directory."""
QUICK_PARTS = ("auto_placement", "train_cuda", "colocated", "weight_pull_ipc", "hf_generation", "vs_trl_hf")
"""The quick battery's parts, in the order they run."""
QUICK_BUDGET_S = 480.0
"""The quick battery's whole deadline."""
MIN_PART_S = 45.0
"""A part is not started with less than this left of the quick battery's deadline."""
SYNTHETIC_PARAMS = "5e8"
"""The synthetic weight-pull case: 0.5B bf16 parameters, 1 GB."""


@dataclass(frozen=True)
class Device:
    """What the battery needs to know about the host (`probe()` finds it; tests pass their own)."""

    gpus: tuple[str, ...] = ()
    """Names of the GPUs torch sees, by index (empty: no CUDA)."""
    gpu_ids: tuple[str, ...] = ()
    """What placement's GPU index i means in CUDA_VISIBLE_DEVICES (`host_gpu_ids()`)."""
    torch_cuda: str | None = None
    """torch's CUDA version."""
    no_vllm_cuda: str | None = "not probed"
    """Why vLLM's CUDA build cannot be used here; None when it imports."""
    no_trl: str | None = "not probed"
    """Why TRL cannot be used here; None when it imports."""

    @property
    def name(self) -> str:
        return ", ".join(f"{self.gpus.count(n)} x {n}" for n in dict.fromkeys(self.gpus)) or "no CUDA device"


@dataclass
class Part:
    """One check: a command and what its output must show, or why it cannot run here."""

    name: str
    what: str
    command: list[str] = field(default_factory=list)
    skip: str | None = None
    timeout_s: float = 900.0
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[Path, str], tuple[dict, str | None]] | None = None
    """(the part's work directory, its output) -> (facts, what is wrong or None)"""
    placement: dict[str, list[tuple[str, ...]]] | None = None
    """Per mesh, by rank, the CUDA_VISIBLE_DEVICES entries its processes should use (checked
    against nvidia-smi while the part runs)."""


def _probe_output(code: str, timeout_s: float) -> tuple[str | None, str]:
    """Run ``code`` in a fresh interpreter: (its stdout, None) or (None, why it failed)."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"did not finish within {timeout_s:.0f} s"
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit {done.returncode}"
    return done.stdout.strip(), ""


def probe() -> Device:
    """This host: the GPUs torch sees, then (with CUDA only) whether vLLM's CUDA build and TRL import.
    Each probe runs in a fresh interpreter, so this process never initialises CUDA."""
    out, why = _probe_output("import json, torch\nn = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
                             "print(json.dumps([[torch.cuda.get_device_name(i) for i in range(n)], torch.version.cuda]))",
                             120)
    if out is None:
        print(f"CUDA probe failed: {why}", file=sys.stderr)
        return Device()
    names, torch_cuda = json.loads(out.splitlines()[-1])
    if not names:
        return Device(torch_cuda=torch_cuda)
    from meshrl.meshes.placement import host_gpu_ids

    platform, why = _probe_output("from vllm.platforms import current_platform; print(current_platform.device_type)", 600)
    if platform is None:
        no_vllm = f"vLLM does not import: {why}"
    elif platform.splitlines()[-1] != "cuda":
        no_vllm = f"the installed vLLM is its {platform.splitlines()[-1]} build, not the CUDA one"
    else:
        no_vllm = None
    trl, why = _probe_output("import trl; print(trl.__version__)", 300)
    return Device(tuple(names), host_gpu_ids(), torch_cuda, no_vllm,
                  None if trl is not None else f"TRL does not import ({why}); `make bench-deps` installs it")


# ----------------------------------------------------------------------------- the plan


def _train_part(name: str, what: str, overrides: list[str], device: Device, work: Path, check=None,
                timeout_s: float = 900.0, env: dict[str, str] | None = None) -> Part:
    """`meshrl train` of the default job with ``overrides``; its placement is planned here (a bad
    key or a placement this host cannot hold fails the plan, before anything runs)."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.placement import plan_run

    overrides = [*TRAIN, *overrides, f"output.dir={work / name}", f"output.name={RUN}"]
    placement = plan_run(load_config(RunConfig, str(ROOT / "configs" / "default.yaml"), overrides), device.gpu_ids)
    planned: dict[str, list[tuple[str, ...]]] = {}
    for row in placement.rows:
        planned.setdefault(row.mesh, []).append(tuple(device.gpu_ids[d] for d in row.devices))
    return Part(name, what, [sys.executable, "-m", "meshrl.cli", "train", *overrides, "--overwrite"],
                timeout_s=timeout_s, env=env or {}, check=check or check_train, placement=planned)


def gpu_on(mesh: str) -> list[str]:
    """The override giving each process of ``mesh`` one GPU of its own."""
    return [f"meshes.{mesh}.gpus_per_proc=1"]




def separate_gpus(n: int) -> list[str]:
    """Learner and generator in processes of their own, on GPUs 0 and 1 or both on a single GPU."""
    from meshrl.meshes.auto_gpus import shared_gpu_overrides

    return gpu_on("learner") + gpu_on("generator") + ["meshes.generator.procs=1"] if n >= 2 else shared_gpu_overrides()


def plan(device: Device, work: Path, quick: bool = False) -> list[Part]:
    """Every part, in order, for ``device``: what each runs, or why it cannot run here; ``quick``:
    the quick battery's parts only (QUICK_PARTS)."""
    n = len(device.gpus)
    two = None if n >= 2 else f"needs at least 2 GPUs, this host has {n}"
    vllm = device.no_vllm_cuda
    parts = [
        _train_part("auto_placement", "the default job with no placement setting: the GPUs `auto` chose", [],
                    device, work),
        _train_part("train_cuda", "learner and HF generator on CUDA in separate processes, each on its planned GPU",
                    separate_gpus(n), device, work),
        _train_part("placement", f"learner on GPU 0, one HF generator replica on each of the other {n - 1} GPU(s)",
                    gpu_on("learner") + gpu_on("generator") + [f"meshes.generator.procs={n - 1}"], device, work)
        if not two else Part("placement", "one generator replica per GPU", skip=f"{two} (train_cuda checks the learner's)"),
        _train_part("train_cuda_arena", "train_cuda with weight_sync.arena_device=cuda (the transport it took)",
                    gpu_on("learner") + (gpu_on("generator") if n >= 2 else []) + ["weight_sync.arena_device=cuda"],
                    device, work, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ]
    for transport, name in (("shm", "weight_pull_ipc"), ("rdma", "weight_pull_rdma")):
        parts.append(Part(name, f"weight pull from CUDA arenas ({transport}) against a same-run device memcpy",
                          [sys.executable, str(ROOT / "benchmarks" / "weight_transports.py"), "--arena-device", "cuda",
                           "--cases", "smollm2,synthetic", "--synthetic-params", SYNTHETIC_PARAMS,
                           "--transports", transport, "--repeats", "4",
                           "--out", str(work / name / "weight_transports.json")],
                          env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, check=check_weight_pull))
    parts.append(_train_part("colocated", "the HF generator in the learner's process on its GPU (zero-copy sync)",
                             gpu_on("learner") + ["meshes.generator.colocate_with=learner"], device, work,
                             check=check_colocated))
    parts.append(Part("hf_generation", "the HF engine's static path against its eager one on the GPU",
                      [sys.executable, str(ROOT / "benchmarks" / "generation.py"), "--engines", "hf-eager,hf-static",
                       "--quick", "--out", str(work / "hf_generation" / "generation.json")],
                      timeout_s=600.0, check=check_generation))
    trl_flags = ["--backend", "hf", "--quick"] + (["--no-learning"] if quick else [])
    parts.append(Part("vs_trl_hf", f"benchmarks/vs_trl.py {' '.join(trl_flags)}", skip=device.no_trl)
                 if device.no_trl else
                 Part("vs_trl_hf", f"benchmarks/vs_trl.py {' '.join(trl_flags)}",
                      [sys.executable, str(ROOT / "benchmarks" / "vs_trl.py"), *trl_flags,
                       "--runs-dir", str(work / "vs_trl_hf" / "runs"), "--out", str(work / "vs_trl_hf" / "vs_trl.json")],
                      timeout_s=3600.0, check=check_vs_trl))
    parts.append(_train_part("fsdp2_nccl", "a 2-process FSDP2 learner, one GPU each (NCCL)",
                             ["meshes.learner.procs=2", "learner.data_parallel=fsdp2", *gpu_on("learner"),
                              *(gpu_on("generator") if n >= 3 else [])], device, work)
                 if not two else Part("fsdp2_nccl", "a 2-process FSDP2 learner over NCCL", skip=two))
    vllm_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    parts += [
        _train_part("vllm_cuda", "the vLLM generator on a GPU", ["generator.backend=vllm", *gpu_on("generator"),
                                                                  *(gpu_on("learner") if n >= 2 else [])],
                    device, work, env=vllm_env)
        if not vllm else Part("vllm_cuda", "the vLLM generator on a GPU", skip=vllm),
        _train_part("vllm_colocated", "the co-located vLLM generator (weights from the learner, sleep mode)",
                    ["generator.backend=vllm", "meshes.generator.colocate_with=learner", *gpu_on("learner")],
                    device, work, check=check_colocated, env=vllm_env)
        if not vllm else Part("vllm_colocated", "the co-located vLLM generator", skip=vllm),
    ]
    if quick:
        by_name = {p.name: p for p in parts}
        return [by_name[name] for name in QUICK_PARTS]
    return parts


# ----------------------------------------------------------------------------- what each part must show


def check_train(work: Path, output: str) -> tuple[dict, str | None]:
    """Every step ran with a finite loss; the step time, sync transport and bytes."""
    from meshrl.metrics.records import read_metrics

    metrics = work / RUN / "metrics.jsonl"
    if not metrics.exists():
        return {}, f"no {metrics}"
    train = [r for r in read_metrics(metrics) if r.get("kind") == "train"]
    facts = {"steps": len(train),
             "step_s_median": statistics.median(r["timing/step_s"] for r in train[1:] or train) if train else None,
             "sync_transport": sorted({k.split("/")[-1] for r in train for k in r if k.startswith("sync/transport/")}),
             "sync_bytes": train[-1].get("sync/bytes") if train else None,
             "loss_total": [r.get("loss/total") for r in train]}
    if len(train) != TRAIN_STEPS:
        return facts, f"ran {len(train)} of {TRAIN_STEPS} steps"
    bad = [r["step"] for r in train if not math.isfinite(r.get("loss/total", math.nan))]
    return facts, f"loss/total is not finite at step(s) {bad}" if bad else None


def check_colocated(work: Path, output: str) -> tuple[dict, str | None]:
    facts, problem = check_train(work, output)
    if problem is None and (facts["sync_bytes"] != 0 or facts["sync_transport"] != ["shared"]):
        problem = f"expected 0 bytes over the shared transport, got {facts['sync_bytes']} over {facts['sync_transport']}"
    return facts, problem


def check_weight_pull(work: Path, output: str) -> tuple[dict, str | None]:
    result = json.loads((work / "weight_transports.json").read_text())
    facts, wrong = {}, []
    for case in result["cases"]:
        row = {"nbytes": case["nbytes"], "memcpy_gbps": case["memcpy_gbps"], "arena_device": case["arena_device"]}
        for transport, t in case["transports"].items():
            row[transport] = {k: t[k] for k in ("pull_s", "pull_gbps", "pull_vs_memcpy", "cold_pull_s", "bitwise_identical")}
            if not t["bitwise_identical"]:
                wrong.append(f"{case['name']}: {transport}")
        facts[case["name"]] = row
    return facts, f"pulled weights differ from the published ones ({', '.join(wrong)})" if wrong else None


def check_generation(work: Path, output: str) -> tuple[dict, str | None]:
    result = json.loads((work / "generation.json").read_text())
    facts = {"device": result["device"], "tokens_per_s": {r["backend"]: r["tokens_per_s"] for r in result["rows"]},
             "ratio_static_vs_eager": result.get("ratio_static_vs_eager")}
    return facts, None


def check_vs_trl(work: Path, output: str) -> tuple[dict, str | None]:
    result = json.loads((work / "vs_trl.json").read_text())
    facts = {"device": result["device"], "ratios": result.get("ratios", {}),
             "step_s_median": {arm: s["step_s_median"] for arm, s in result["arms"].items()}}
    return facts, None


# ----------------------------------------------------------------------------- running


def _nvidia_smi(*query: str) -> list[list[str]]:
    """nvidia-smi's CSV rows for ``query`` (none when it is missing or hangs)."""
    try:
        out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


class GpuWatch:
    """The GPUs (as uuids) each process has a CUDA context on, sampled from nvidia-smi every 2 s."""

    def __init__(self) -> None:
        self.by_pid: dict[int, set[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(2.0):
            for row in _nvidia_smi("--query-compute-apps=pid,gpu_uuid"):
                if len(row) == 2 and row[0].isdigit():
                    self.by_pid.setdefault(int(row[0]), set()).add(row[1])

    def stop(self) -> dict[int, set[str]]:
        self._stop.set()
        self._thread.join()
        return self.by_pid


def compare_placement(planned: dict[str, list[tuple[str, ...]]], pids: dict[str, list[int]],
                      seen: dict[int, set[str]], uuids: dict[str, str]) -> tuple[dict, str | None]:
    """Each mesh's processes against their planned GPUs (CUDA_VISIBLE_DEVICES entries; ``uuids``
    maps nvidia-smi indices to uuids). None when nvidia-smi showed no process at all (a container
    may hide other processes' pids): then it is recorded as unverified, not as a failure."""
    rows, wrong = {}, []
    for mesh, per_rank in planned.items():
        for rank, (want, pid) in enumerate(zip(per_rank, pids.get(mesh, []))):
            want_uuids, got = sorted(uuids.get(e, e) for e in want), sorted(seen.get(pid, set()))
            rows[f"{mesh}[{rank}]"] = {"pid": pid, "planned": want_uuids, "observed": got}
            if want_uuids != got:
                wrong.append(f"{mesh}[{rank}] planned {list(want) or 'cpu'}, ran on {got or 'cpu'}")
    if not seen:
        return {"placement": rows, "placement_verified": False}, None
    return {"placement": rows, "placement_verified": not wrong}, "; ".join(wrong) or None


def run_part(part: Part, work: Path, timeout_s: float | None = None) -> dict:
    """Run ``part`` (its own process group, killed at the deadline); its record for the JSON."""
    record = {"what": part.what, "command": " ".join(part.command)}
    if part.skip:
        return {**record, "status": f"skipped: {part.skip}"}
    pwork = work / part.name
    pwork.mkdir(parents=True, exist_ok=True)
    log = pwork / "output.log"
    deadline = timeout_s or part.timeout_s
    watch = GpuWatch() if part.placement else None
    started = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(part.command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", **part.env})
        try:
            code = proc.wait(deadline)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's process group: Monarch's children too
            proc.wait()
            code = None
    seen = watch.stop() if watch else {}
    output = log.read_text(errors="replace")
    record.update(seconds=round(time.perf_counter() - started, 1), log=str(log))
    if code is None:
        return {**record, "status": f"failed: no result within {deadline:.0f} s", "output_tail": output[-3000:]}
    if code:
        return {**record, "status": f"failed: exit {code}", "output_tail": output[-3000:]}
    try:
        facts, problem = part.check(pwork, output) if part.check else ({}, None)
    except (OSError, KeyError, ValueError) as e:
        facts, problem = {}, f"its result could not be read: {type(e).__name__}: {e}"
    if part.placement and problem is None:
        ready = READY.search(output)
        if ready is None:
            problem = "no 'meshes ready' line with the mesh pids in its output"
        else:
            uuids = dict(_nvidia_smi("--query-gpu=index,uuid"))
            more, problem = compare_placement(part.placement, ast.literal_eval(ready.group(1)), seen, uuids)
            facts.update(more)
    record["facts"] = facts
    if problem:
        return {**record, "status": f"failed: {problem}", "output_tail": output[-3000:]}
    return {**record, "status": "passed"}


def report(device: Device, records: dict[str, dict]) -> dict:
    """The JSON's payload: the device, each part's record, and how many passed, failed, were skipped."""
    counts = {k: sum(r["status"].split(":")[0] == k for r in records.values()) for k in ("passed", "failed", "skipped")}
    return {"device": device.name, "gpus": list(device.gpus), "torch_cuda": device.torch_cuda, "summary": counts,
            "parts": records}


def main(argv: list[str] | None = None, device: Device | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", help="comma-separated names of the parts to run (default: all)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the result JSON (default: {OUT.relative_to(ROOT)})")
    parser.add_argument("--work-dir", type=Path, help="run directories and logs (default: a new temporary directory)")
    parser.add_argument("--timeout-s", type=float, help="deadline of each part (default: its own, 15-60 min)")
    parser.add_argument("--quick", action="store_true",
                        help=f"the parts one GPU can run ({', '.join(QUICK_PARTS)}) within {QUICK_BUDGET_S / 60:.0f} minutes")
    args = parser.parse_args(argv)
    device = device or probe()
    if not device.gpus:
        print("gpu-check: no CUDA device on this host (torch sees none): nothing was run and nothing written.")
        return 0
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="meshrl-gpu-check-"))
    parts = plan(device, work, quick=args.quick)
    if args.parts:
        wanted = args.parts.split(",")
        unknown = sorted(set(wanted) - {p.name for p in parts})
        if unknown:
            parser.error(f"--parts: unknown {', '.join(unknown)} (parts: {', '.join(p.name for p in parts)})")
        parts = [p for p in parts if p.name in wanted]
    print(f"gpu-check on {device.name}; work directory {work}", flush=True)
    records = {}
    started = time.perf_counter()
    for part in parts:
        timeout_s = args.timeout_s
        if args.quick:
            left = QUICK_BUDGET_S - (time.perf_counter() - started)
            if left < MIN_PART_S and not part.skip:
                part = Part(part.name, part.what, part.command,
                            skip=f"the quick battery's {QUICK_BUDGET_S / 60:.0f} minutes ran out ({left:.0f} s left)")
            timeout_s = min(timeout_s or part.timeout_s, left)
        print(f"  {part.name}: {part.what} ...", flush=True)
        records[part.name] = run_part(part, work, timeout_s)
        print(f"  {part.name}: {records[part.name]['status']}", flush=True)
    from benchmarks.common import write_result

    result = {**report(device, records), "mode": "quick" if args.quick else "full"}
    write_result("gpu_check", result, args.out)
    print(f"gpu-check: {result['summary']['passed']} passed, {result['summary']['failed']} failed, "
          f"{result['summary']['skipped']} skipped")
    return 1 if result["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
