"""scripts/gpu_check.py (`make gpu-check`) without a GPU: the parts planned for a described device
and why the others are skipped, the JSON it writes, what each part's result must show, a part
killed at its deadline, and a CPU host where nothing runs."""

import importlib.util
import json
import math
import re
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)
Device, Part = gpu_check.Device, gpu_check.Part

NO_VLLM = "the installed vLLM is its cpu build, not the CUDA one"


def h100s(n: int, vllm: str | None = NO_VLLM, trl: str | None = None) -> Device:
    return Device(("NVIDIA H100 80GB HBM3",) * n, tuple(map(str, range(n))), "12.8", vllm, trl)


def by_name(parts) -> dict:
    return {p.name: p for p in parts}


def test_a_cpu_host_runs_nothing_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)], device=Device(torch_cuda=None)) == 0
    assert "nothing was run" in capsys.readouterr().out and not out.exists()


def test_one_gpu_runs_what_fits_and_says_why_the_rest_cannot(tmp_path):
    parts = by_name(gpu_check.plan(h100s(1), tmp_path))
    assert list(parts) == ["auto_placement", "train_cuda", "placement", "train_cuda_arena", "weight_pull_ipc",
                           "weight_pull_rdma", "colocated", "hf_generation", "vs_trl_hf", "fsdp2_nccl", "vllm_cuda",
                           "vllm_colocated"]
    assert {n for n, p in parts.items() if p.skip} == {"placement", "fsdp2_nccl", "vllm_cuda", "vllm_colocated"}
    assert parts["fsdp2_nccl"].skip == "needs at least 2 GPUs, this host has 1"
    assert parts["placement"].skip.startswith("needs at least 2 GPUs")
    assert parts["vllm_cuda"].skip == parts["vllm_colocated"].skip == NO_VLLM
    # one GPU: learner and generator share it, in processes of their own with a memory share each,
    # or the generator in the learner's process (explicitly, and as `auto` chooses)
    assert parts["train_cuda"].placement == {"learner": [("0",)], "generator": [("0",)], "rewarder": [()]}
    assert "meshes.generator.gpu_memory_fraction=0.4" in parts["train_cuda"].command
    assert parts["colocated"].placement == {"learner": [("0",)], "generator": [("0",)], "rewarder": [()]}
    assert parts["auto_placement"].placement == parts["colocated"].placement
    assert not [a for a in parts["auto_placement"].command if a.startswith("meshes.")]  # no placement setting
    assert "meshes.generator.colocate_with=learner" in parts["colocated"].command
    assert parts["weight_pull_ipc"].env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert by_name(gpu_check.plan(h100s(1, trl="TRL does not import"), tmp_path))["vs_trl_hf"].skip == "TRL does not import"


def test_three_gpus_with_vllm_run_every_part_on_its_own_gpus(tmp_path):
    parts = by_name(gpu_check.plan(h100s(3, vllm=None), tmp_path))
    assert not [p.name for p in parts.values() if p.skip]
    assert parts["train_cuda"].placement["generator"] == [("1",)]
    assert parts["auto_placement"].placement["generator"] == [("1",), ("2",)]  # `auto`: a replica per GPU left
    assert parts["placement"].placement["generator"] == [("1",), ("2",)]  # a replica per GPU after the learner's
    assert parts["fsdp2_nccl"].placement == {"learner": [("0",), ("1",)], "generator": [("2",)], "rewarder": [()]}
    assert parts["vllm_cuda"].placement == {"learner": [("0",)], "generator": [("1",)], "rewarder": [()]}
    assert "generator.backend=vllm" in parts["vllm_colocated"].command


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_every_command_uses_real_keys_and_flags(tmp_path, gpus):
    """Training parts' overrides are loaded and placed by `plan` itself (a wrong key raises there);
    the benchmark scripts' flags must be ones those scripts define."""
    for part in gpu_check.plan(h100s(gpus, vllm=None), tmp_path):
        if len(part.command) > 1 and part.command[1].endswith(".py"):
            source = Path(part.command[1]).read_text()
            for flag in (a for a in part.command[2:] if a.startswith("--")):
                assert f'"{flag}"' in source, f"{part.name}: {flag} is not an option of {part.command[1]}"
        elif part.command:
            assert part.command[1:4] == ["-m", "meshrl.cli", "train"] and f"output.dir={tmp_path / part.name}" in part.command


def test_the_json_names_the_device_and_why_each_part_was_skipped(tmp_path):
    out = tmp_path / "gpu_check.json"
    argv = ["--out", str(out), "--work-dir", str(tmp_path / "work"), "--parts", "placement,fsdp2_nccl,vllm_cuda"]
    assert gpu_check.main(argv, device=h100s(1)) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "1 x NVIDIA H100 80GB HBM3" and result["torch_cuda"] == "12.8"
    assert result["summary"] == {"passed": 0, "failed": 0, "skipped": 3}
    assert result["parts"]["fsdp2_nccl"]["status"] == "skipped: needs at least 2 GPUs, this host has 1"
    assert result["parts"]["vllm_cuda"]["status"] == f"skipped: {NO_VLLM}"
    assert {"machine", "date", "commit"} <= set(result)  # benchmarks/common.py's provenance
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(out), "--parts", "nccl"], device=h100s(1))


def test_the_quick_battery_runs_what_one_gpu_can_within_its_deadline(tmp_path, monkeypatch):
    parts = gpu_check.plan(h100s(1), tmp_path, quick=True)
    assert [p.name for p in parts] == list(gpu_check.QUICK_PARTS) and not [p for p in parts if p.skip]
    assert "--no-learning" in by_name(parts)["vs_trl_hf"].command
    assert "--no-learning" not in by_name(gpu_check.plan(h100s(1), tmp_path))["vs_trl_hf"].command
    ran = []

    def run_part(part, work, timeout_s=None):  # the clock moves 200 s per part
        ran.append((part.name, timeout_s, part.skip))
        clock[0] += 200.0
        return {"status": f"skipped: {part.skip}" if part.skip else "passed"}

    clock = [0.0]
    monkeypatch.setattr(gpu_check, "run_part", run_part)
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: clock[0])
    out = tmp_path / "quick.json"
    assert gpu_check.main(["--quick", "--out", str(out), "--work-dir", str(tmp_path / "w")], device=h100s(1)) == 0
    assert [(n, t) for n, t, skip in ran if not skip] == [("auto_placement", 480.0), ("train_cuda", 280.0),
                                                          ("colocated", 80.0)]
    assert [skip for _, _, skip in ran if skip][0] == "the quick battery's 8 minutes ran out (-120 s left)"
    result = json.loads(out.read_text())
    assert result["mode"] == "quick" and result["device"] == "1 x NVIDIA H100 80GB HBM3"
    assert result["summary"] == {"passed": 3, "failed": 0, "skipped": 3}


def test_the_weight_pull_and_generation_parts_record_every_case(tmp_path):
    row = {"pull_s": 0.01, "pull_gbps": 100.0, "pull_vs_memcpy": 0.6, "cold_pull_s": 0.05, "bitwise_identical": True}
    cases = [{"name": n, "nbytes": b, "memcpy_gbps": 160.0, "arena_device": "cuda", "transports": {"shm": dict(row)}}
             for n, b in (("smollm2", 269_000_000), ("synthetic-0.50B-bf16", 1_000_000_000))]
    cases[1]["transports"]["shm"]["bitwise_identical"] = False
    (tmp_path / "weight_transports.json").write_text(json.dumps({"cases": cases}))
    facts, problem = gpu_check.check_weight_pull(tmp_path, "")
    assert facts["synthetic-0.50B-bf16"]["nbytes"] == 1_000_000_000 and facts["smollm2"]["shm"]["pull_vs_memcpy"] == 0.6
    assert problem == "pulled weights differ from the published ones (synthetic-0.50B-bf16: shm)"
    rows = [{"backend": "hf-eager", "tokens_per_s": 1000.0}, {"backend": "hf-static", "tokens_per_s": 3500.0}]
    (tmp_path / "generation.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": rows,
                                                          "ratio_static_vs_eager": 3.5}))
    facts, problem = gpu_check.check_generation(tmp_path, "")
    assert problem is None and facts == {"device": "NVIDIA H200", "ratio_static_vs_eager": 3.5,
                                         "tokens_per_s": {"hf-eager": 1000.0, "hf-static": 3500.0}}


def _metrics(run: Path, losses: list[float], transport: str = "shm", nbytes: int = 269_000_000) -> Path:
    run.mkdir(parents=True)
    rows = [{"kind": "train", "step": i + 1, "loss/total": loss, "timing/step_s": 1.0 + i, "sync/bytes": nbytes,
             f"sync/transport/{transport}": 1} for i, loss in enumerate(losses)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run.parent


def test_a_training_part_needs_every_step_with_a_finite_loss(tmp_path):
    facts, problem = gpu_check.check_train(_metrics(tmp_path / "a" / "run", [1.0, 0.9, 0.8, 0.7]), "")
    assert problem is None and facts["step_s_median"] == 3.0 and facts["sync_transport"] == ["shm"]
    assert gpu_check.check_train(_metrics(tmp_path / "b" / "run", [1.0, 0.9, 0.8]), "")[1] == "ran 3 of 4 steps"
    _, problem = gpu_check.check_train(_metrics(tmp_path / "c" / "run", [1.0, math.nan, 0.8, 0.7]), "")
    assert problem == "loss/total is not finite at step(s) [2]"
    assert gpu_check.check_train(tmp_path / "missing", "")[1].startswith("no ")


def test_the_colocated_part_needs_zero_bytes_over_the_shared_transport(tmp_path):
    assert gpu_check.check_colocated(_metrics(tmp_path / "a" / "run", [1.0] * 4, "shared", 0), "")[1] is None
    _, problem = gpu_check.check_colocated(_metrics(tmp_path / "b" / "run", [1.0] * 4, "cuda_ipc"), "")
    assert problem == "expected 0 bytes over the shared transport, got 269000000 over ['cuda_ipc']"


def test_placement_is_compared_process_by_process():
    planned = {"learner": [("0",)], "generator": [("1",)], "rewarder": [()]}
    pids = {"learner": [10], "generator": [11], "rewarder": [12]}
    uuids = {"0": "GPU-a", "1": "GPU-b"}
    facts, problem = gpu_check.compare_placement(planned, pids, {10: {"GPU-a"}, 11: {"GPU-b"}}, uuids)
    assert problem is None and facts["placement_verified"]
    assert facts["placement"]["rewarder[0]"] == {"pid": 12, "planned": [], "observed": []}
    _, problem = gpu_check.compare_placement(planned, pids, {10: {"GPU-a"}, 11: {"GPU-a"}}, uuids)
    assert problem == "generator[0] planned ['1'], ran on ['GPU-a']"
    facts, problem = gpu_check.compare_placement(planned, pids, {}, uuids)  # nvidia-smi showed no process
    assert problem is None and facts["placement_verified"] is False


def test_a_part_is_failed_by_its_exit_status_or_its_check(tmp_path):
    exits = Part("exits", "exit 3", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"])
    record = gpu_check.run_part(exits, tmp_path)
    assert record["status"] == "failed: exit 3" and "boom" in record["output_tail"]
    checked = Part("checked", "a check that objects", [sys.executable, "-c", "print(42)"],
                   check=lambda work, output: ({"printed": output.strip()}, f"printed {output.strip()}"))
    record = gpu_check.run_part(checked, tmp_path)
    assert record["status"] == "failed: printed 42" and record["facts"] == {"printed": "42"}
    ok = gpu_check.run_part(Part("ok", "passes", [sys.executable, "-c", "pass"]), tmp_path)
    assert ok["status"] == "passed"
    skipped = gpu_check.run_part(Part("no", "cannot run", skip="no reason to"), tmp_path)
    summary = gpu_check.report(h100s(1), {"exits": record, "ok": ok, "no": skipped})["summary"]
    assert summary == {"passed": 1, "failed": 1, "skipped": 1}


def test_a_part_past_its_deadline_is_killed_with_its_children(tmp_path):
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
            "print('child', child.pid, flush=True)\ntime.sleep(120)\n")
    started = time.monotonic()
    record = gpu_check.run_part(Part("hangs", "never ends", [sys.executable, "-c", code], timeout_s=3), tmp_path)
    assert record["status"] == "failed: no result within 3 s" and time.monotonic() - started < 30
    child = int(re.search(r"child (\d+)", record["output_tail"]).group(1))
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
