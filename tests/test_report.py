"""`meshrl report`: the dashboard and summary of a synthetic run (numbers checked by hand), the
overlay of two runs, the one-line errors, and the TensorBoard and W&B mirrors of `MetricsLogger`."""

import json
import time

import pytest

from meshrl.cli import main
from meshrl.metrics.curves import plot_curves
from meshrl.metrics.records import MetricsLogger, read_metrics
from meshrl.report import write_comparison, write_report
from meshrl.report.panels import PANELS

FAULT_STEP = 4


def synthetic_records() -> list[dict]:
    """Six train steps, evals at steps 0 and 6, a generator replaced during step 4; staleness 0
    only for steps 1-3, half 0 / half 1 for steps 4-6; no clip fraction and no SDPO or replay."""
    records = [{"kind": "eval", "step": 0, "eval/accuracy": 0.25, "version": 0}]
    for step in range(1, 7):
        records.append({
            "kind": "train", "step": step, "version": step,
            "reward/mean": step / 10, "accuracy": step / 10,
            "loss/grpo": 0.1 * step, "loss/total": 0.1 * step,
            "train/kl_sampler_learner_k1": 0.001, "train/kl_sampler_learner_k3": 0.002,
            "train/entropy": 2.0 - 0.1 * step,
            "gen/tokens_per_s": 100.0 * step,  # mean 350
            "train/tokens": 1000.0, "train/seconds": 2.0 if step <= 4 else 4.0,  # 500 x4, 250 x2: mean 417
            "timing/step_s": 10.0, "timing/generate_s": 6.0, "timing/train_s": 3.0, "timing/sync_s": 1.0,
            "sync/pull_s": 0.5, "sync/pull_gbps": 2.0, "sync/bytes": 1_000_000_000,
            "elapsed_s": 60.0 * step,
            **({"staleness/0": 8.0} if step <= 3 else {"staleness/0": 4.0, "staleness/1": 4.0}),  # 36 / 12 of 48
        })
        if step == FAULT_STEP:
            records.append({"kind": "fault", "step": FAULT_STEP, "mesh": "generator", "cause": "process killed",
                            "action": "replaced and re-synced", "recovery_s": 3.5, "detected_at": 1.7e9})
    records.append({"kind": "eval", "step": 6, "eval/accuracy": 0.75, "version": 6})
    return records


def write_run(path, records=None):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records or synthetic_records()))
    return path


def test_single_run_report(tmp_path):
    run = write_run(tmp_path / "demo")
    png, md, panels = write_report(run)
    assert png == run / "report.png" and png.stat().st_size > 10_000
    assert [p.title for p in panels] == [p.title for p in PANELS]
    titles = {p.title for p in panels}
    assert {"Reward and held-out accuracy", "Loss terms", "Sampler vs learner mismatch KL", "Policy entropy",
            "Clip fraction", "Throughput", "Step time and its parts", "Weight sync", "Staleness (async)"} <= titles
    for p in panels:
        texts = [t.get_text() for t in p.ax.texts]
        fault_lines = [ln for ln in p.ax.get_lines() if list(ln.get_xdata()) == [FAULT_STEP, FAULT_STEP]]
        assert fault_lines and any("generator 3.5s" in t for t in texts), p.title  # the fault, on every panel
        if p.title == "Clip fraction":  # not in the synthetic records
            assert p.artists == 0 and "not logged in this run" in texts
        else:
            assert p.artists > 0, p.title
            data = [ln for ln in p.ax.get_lines() if ln not in fault_lines]
            assert data or p.ax.collections, p.title  # lines, or the stacked staleness areas
    assert len(next(p for p in panels if p.title == "Loss terms").ax.get_lines()) == 1 + 2  # grpo, total, fault

    text = md.read_text()
    for expected in [
        "| steps | 6 (steps 1-6) |",
        "| wall time | 6.0 min (360 s) |",
        "| mean step time | 10.00 s (generate 6.00 s, train 3.00 s, weight sync 1.00 s) |",
        "| held-out accuracy | 25.0% (step 0) → 75.0% (step 6) |",
        "| train reward (mean) | 0.100 (step 1) → 0.600 (step 6) |",
        "| generation tokens/s (mean over steps) | 350 |",
        "| training tokens/s (mean over steps) | 417 |",
        "| weight sync (mean) | pull 0.500 s, 2.00 GB/s, 1.000 GB per version |",
        "| faults | 1: step 4 generator (3.5 s) |",
        "| staleness (share of samples) | 0: 75.0%, 1: 25.0% of 48 samples |",
        "- step 4: `generator` failed (process killed); replaced and re-synced; recovered in 3.5 s "
        "(about 3.0 min into the run)",
    ]:
        assert expected in text


def test_overlay_of_two_runs(tmp_path):
    a = write_run(tmp_path / "run-a")
    slower = [{**r, "timing/step_s": 20.0} if r["kind"] == "train" else r for r in synthetic_records()]
    b = write_run(tmp_path / "run-b", [r for r in slower if r["kind"] != "fault"])
    out = tmp_path / "cmp"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    png, md = out / "report-compare.png", out / "report-compare.md"
    assert png.stat().st_size > 10_000
    text = md.read_text()
    assert "| quantity | run-a | run-b |" in text
    assert "| mean step time | 10.00 s (generate 6.00 s, train 3.00 s, weight sync 1.00 s) | 20.00 s " in text
    assert "| faults | 1: step 4 generator (3.5 s) | none |" in text
    _, _, panels = write_comparison([a, b], tmp_path / "again")
    legend = [t.get_text() for t in panels[0].ax.figure.legends[0].get_texts()]
    assert legend == ["run-a", "run-b"]


def test_cli_single_run_writes_into_the_run(tmp_path, capsys):
    run = write_run(tmp_path / "demo")
    assert main(["report", str(run)]) == 0
    assert (run / "report.png").is_file() and (run / "report.md").is_file()
    assert str(run / "report.md") in capsys.readouterr().out


@pytest.mark.parametrize("case, expected", [
    ("no-dir", "no-dir: no such run directory"),
    ("no-file", "no-file/metrics.jsonl: no such file"),
    ("empty", "empty/metrics.jsonl is empty"),
    ("malformed", "malformed/metrics.jsonl:2: malformed line"),
    ("foreign", "foreign/metrics.jsonl: no train, eval or fault record"),
])
def test_bad_input_is_one_line_naming_the_file(tmp_path, capsys, case, expected):
    run = tmp_path / case
    if case != "no-dir":
        run.mkdir()
    lines = {"empty": "\n", "malformed": '{"kind": "train", "step": 1}\n{"kind": "tr\n',
             "foreign": '{"step": 0, "optim/lr": 0.001}\n'}
    if case in lines:
        (run / "metrics.jsonl").write_text(lines[case])
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("meshrl: ") and expected in err
    assert not (run / "report.png").exists()


def test_curves_png_still_written(tmp_path):
    out = plot_curves(synthetic_records(), tmp_path / "curves.png", title="demo")
    assert out.stat().st_size > 5_000


def test_tensorboard_mirror(tmp_path):
    pytest.importorskip("tensorboard", reason="output.tensorboard needs the optional `tensorboard` package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    for r in synthetic_records()[:4]:
        logger.log(r)
    logger.close()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert "eval/accuracy" in acc.Tags()["scalars"]


def _wandb_history(run_file) -> list[dict]:
    """The history rows in a W&B transaction log (`run-*.wandb`): a 7-byte header, then records
    in 32 KiB blocks, each with a 7-byte header (crc32, little-endian length, type: 1 whole,
    2/3/4 first/middle/last fragment) and a serialized `wandb_internal_pb2.Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"not a W&B transaction log: {run_file}"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a record header is padding
            pos += 32768 - pos % 32768
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def test_wandb_mirror(tmp_path, monkeypatch):
    """`output.wandb_project`: every record's numbers reach W&B at its step (offline mode: no
    account or network; the run's files go under the run directory)."""
    pytest.importorskip("wandb", reason="output.wandb_project needs the optional `wandb` package")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = MetricsLogger(tmp_path, wandb_project="meshrl-test", run_name="synthetic", config={"seed": 3})
    for r in synthetic_records()[:4]:
        logger.log(r)
    logger.close()
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 4
    run_files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1
    # wandb's service process writes the transaction log on its own: on a loaded machine the history
    # records may land a moment after `finish` returned
    deadline = time.monotonic() + 30
    while not (rows := _wandb_history(run_files[0])) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [(row["_step"], round(row["reward/mean"], 6)) for row in rows if "reward/mean" in row] == \
        [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert any(row.get("eval/accuracy") == 0.25 and row["_step"] == 0 for row in rows)
    assert not any("kind" in row for row in rows)  # text fields stay in metrics.jsonl
