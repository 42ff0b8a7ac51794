"""`meshrl sft`: supervised fine-tuning, full or LoRA (`learner.lora`), on the learner mesh a training
run uses, from a JSONL file of conversations (`sft.data`), from the successful trajectories of a
run's `trajectories.jsonl` (`sft.trajectories`), or offline DPO on the teacher preference pairs of
a run's `pairs.jsonl` (`sft.pairs`).

The file is checked line by line before anything is made (meshrl.controller.sft_data), split into
training and held-out sets (`sft.eval_fraction`, or `sft.eval_data`), and made into Datums token in
and token out: conversations rendered by the model's renderer (`cross_entropy`, weight on the
assistant turns), trajectories from their recorded token ids (`cross_entropy`, weight on the
policy's sampled tokens), pairs as chosen/rejected `dpo` Datums (the reference is the learner's
frozen starting policy, temperature `sft.dpo_beta`). Each step takes `sft.batch_size` examples from
a seeded, resumable stream (every epoch a permutation), runs `forward_backward` on the learner mesh,
scales the summed gradients to a mean (per weighted token; DPO: per pair) (`scale_grads`) and makes
one `optim_step` at the step's learning rate (`sft.lr_schedule`). The held-out NLL (DPO: the
held-out pairs' DPO loss and preference accuracy) is logged every `sft.eval_every` steps, before
the first and after the last.

The run directory is a training run's: `config.yaml`, `metrics.jsonl` (records `train`, with
`train/nll` or `train/dpo_loss`, and `eval`, with `eval/nll` or `eval/dpo_loss` and
`eval/preference_accuracy`; `meshrl report` draws them), atomic checkpoints
(`trainer.checkpoint`, meshrl.controller.checkpoints; `--resume RUN_DIR` continues from the latest)
and `final_model`, the policy exported as an HF model directory (LoRA merged), which `meshrl eval`
scores."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

from meshrl.config.base import ConfigError, load_config
from meshrl.config.meshes import LEARNER
from meshrl.config.sft import SFTRunConfig
from meshrl.controller.sft_data import SOURCES, SFTData, SFTError, check_vocabulary, load_data, units
from meshrl.training.conversations import ConversationFileError
from meshrl.training.records import RecordFileError

log = logging.getLogger("meshrl")


def total_steps(cfg: SFTRunConfig, examples: int) -> int:
    return cfg.sft.steps or cfg.sft.epochs * math.ceil(examples / cfg.sft.batch_size)


def learning_rate(cfg: SFTRunConfig, step: int, total: int) -> float:
    """The learning rate of step ``step`` (1-based) of ``total``."""
    if cfg.sft.lr_schedule == "linear":
        return cfg.learner.lr * (1.0 - (step - 1) / total)
    return cfg.learner.lr


def _weight(datums: list) -> float:
    return float(sum(float(d.loss_fn_inputs["weights"].sum()) for d in datums))


def weighted_sums(client, datums: list, key: str, chunk: int, reference: bool = False) -> list[float]:
    """Per datum, its tokens' log-probabilities times their ``key`` weights, summed, under the
    learner's current weights (``reference``: its frozen starting policy)."""
    sums = []
    for start in range(0, len(datums), chunk):
        part = datums[start:start + chunk]
        for d, logprobs in zip(part, client.forward(part, reference=reference)):
            sums.append(sum(lp * w for lp, w in zip(logprobs, d.loss_fn_inputs[key].tolist())))
    return sums


def heldout_nll(client, datums: list, chunk: int) -> dict:
    """Mean NLL per weighted (assistant or sampled) token of ``datums`` under the learner's
    current weights."""
    tokens = _weight(datums)
    return {"eval/nll": -sum(weighted_sums(client, datums, "weights", chunk)) / tokens, "eval/tokens": tokens,
            "eval/n": len(datums)}


def heldout_preference(client, datums: list, reference: list[float], beta: float, chunk: int) -> dict:
    """The DPO loss (mean over pairs) and preference accuracy of held-out `dpo` Datum pairs
    (chosen, rejected, ...) under the learner's current weights, against ``reference``, their
    sequence log-probabilities under the frozen starting policy. A pair is ranked right when its
    implicit reward margin is above 0 (at the start, policy = reference: every margin is 0)."""
    import torch

    from meshrl.losses.preference import dpo

    policy = torch.tensor(weighted_sums(client, datums, "mask", chunk), dtype=torch.float64)
    ref = torch.tensor(reference, dtype=torch.float64)
    m = dpo(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta=beta).metrics
    return {"eval/dpo_loss": m["loss_mean"], "eval/preference_accuracy": m["reward_accuracy"],
            "eval/reward_margin": m["reward_margin"], "eval/n": len(datums) // 2}


def model_vocabulary(session) -> int:
    """The size of the model's embedding table (its HF config's `vocab_size`; the tokenizer's
    length if the config has none)."""
    from transformers import AutoConfig

    from meshrl.controller.evaluate import text_config

    config = text_config(AutoConfig.from_pretrained(session.model_path))
    return getattr(config, "vocab_size", None) or len(session.tokenizer)


def spawn_learner(session, cfg: SFTRunConfig) -> None:
    """The learner mesh alone (no generator: SFT samples nothing), as `MeshSession.spawn_policy`
    spawns it, publishing nothing."""
    from meshrl.actors.generator import POLICY_STORE
    from meshrl.actors.learner import Learner
    from meshrl.meshes.rendezvous import Rendezvous

    session.spawn(LEARNER, Learner, str(session.model_path), cfg.model, cfg.learner, cfg.weight_sync, POLICY_STORE,
                  Rendezvous(), share_in_process=False, publish_to_store=False, diloco_cfg=None,
                  plugins=list(cfg.plugins))
    session.wait_ready([LEARNER])


def train_step(client, cfg: SFTRunConfig, loss: str, batch: list[list], lr: float) -> dict:
    """One optimizer step on ``batch`` (training units: a Datum, or a DPO pair's two) with the
    ``loss`` (`cross_entropy` or `dpo`); the summed loss's gradients are scaled to the mean per
    weighted token (DPO: per pair). Returns the step's `train/...` record entries."""
    datums = [d for unit in batch for d in unit]
    dpo = loss == "dpo"
    norm = float(len(batch)) if dpo else _weight(datums)
    fb = client.forward_backward(datums, loss, {"beta": cfg.sft.dpo_beta} if dpo else None)
    client.scale_grads(1.0 / norm)
    opt = client.optim_step(dataclasses.replace(cfg.learner.adam_params(), learning_rate=lr))
    if dpo:
        record = {"train/dpo_loss": fb["loss"] / norm, "train/pairs": norm,
                  **{f"train/{k}": fb[k] for k in ("reward_accuracy", "reward_margin") if k in fb}}
    else:
        record = {"train/nll": fb["loss"] / norm, "train/loss_tokens": norm}
    record.update({"train/tokens": fb["tokens"], "train/seconds": fb["seconds"], "batch/datums": len(datums),
                   **{f"train/{k}": v for k, v in opt.items()}})
    if "entropy_mean" in fb:
        record["train/entropy"] = fb["entropy_mean"]
    return record


def run_sft(cfg: SFTRunConfig, run_dir: Path, resume: bool = False, session=None, data: SFTData | None = None) -> dict:
    """Fine-tune on the run's file into ``run_dir`` (continuing from its latest checkpoint when
    ``resume``), in a `MeshSession` of its own or in the processes of ``session``. ``data``: the
    examples, if already read (`load_data`)."""
    from tqdm import tqdm

    from meshrl.controller.checkpoints import CheckpointManager
    from meshrl.envs.task_sets import SeededStream
    from meshrl.meshes.session import host_run
    from meshrl.metrics.records import MetricsLogger

    t_start = time.perf_counter()
    sc, tc = cfg.sft, cfg.trainer
    data = data if data is not None else load_data(cfg)
    dpo = data.loss == "dpo"
    checkpoints = CheckpointManager(run_dir / "checkpoints", tc.checkpoint.keep)
    start = checkpoints.latest() if resume else None
    if resume and start is None and (run_dir / "metrics.jsonl").exists():
        log.warning("no complete checkpoint in %s: starting the run over", run_dir)
    metrics = MetricsLogger(run_dir, cfg.output.tensorboard, cfg.output.wandb_project, run_dir.name,
                            cfg.model_dump(mode="json"))
    metrics.truncate_after(start.step if start else 0)
    result: dict = {"steps": 0, "train": [], "evals": [], "loss": data.loss}
    session, release = host_run(cfg, session)
    try:
        spawn_learner(session, cfg)
        client = session.client
        train, skipped = units(cfg, session.renderer, data, data.train)
        held, skipped_held = units(cfg, session.renderer, data, data.held)
        if skipped or skipped_held:
            log.warning("%d training and %d held-out conversations skipped: no assistant token within %d tokens "
                        "(sft.max_length)", skipped, skipped_held, sc.max_length or cfg.model.max_model_len)
        if not train:
            raise SFTError(f"{sc.data}: no conversation keeps an assistant token within sft.max_length")
        check_vocabulary(data, train + held, model_vocabulary(session))
        total = total_steps(cfg, len(train))
        result.update(examples=len(train), heldout=len(held), total=total)
        log.info("sft (%s): %d training examples, %d held out (%d records not used), %d steps of %d", data.source,
                 len(train), len(held), data.skipped, total, sc.batch_size)
        if start is not None:
            client.on_learners("load_checkpoint", str(start.learner_dir), supervised=False)
            log.info("resumed %s from step %d", run_dir, start.step)
        held_datums = [d for unit in held for d in unit]
        chunk = 4 * sc.batch_size
        reference = weighted_sums(client, held_datums, "mask", chunk, reference=True) if dpo and held else []

        def run_eval(step: int) -> None:
            if held:
                stats = (heldout_preference(client, held_datums, reference, sc.dpo_beta, chunk) if dpo
                         else heldout_nll(client, held_datums, chunk))
                record = {"kind": "eval", "step": step, **stats}
                metrics.log(record)
                result["evals"].append(record)
                log.info("held-out %s at step %d: %s", "DPO loss, preference accuracy" if dpo else "NLL", step,
                         f"{record['eval/dpo_loss']:.4f}, {record['eval/preference_accuracy']:.1%}" if dpo
                         else f"{record['eval/nll']:.4f}")

        def save(step: int) -> None:
            tmp = checkpoints.begin(step)
            client.on_learners("save_checkpoint", str(tmp / "learner"), supervised=False)
            checkpoints.commit(tmp, step, {"sft": {"cursor": step * sc.batch_size, "examples": len(train)}})

        stream = SeededStream(train, sc.seed)
        step = start.step if start else 0
        if step == 0:
            run_eval(0)
        bar = tqdm(total=total, initial=step, desc="sft", disable=not tc.progress, dynamic_ncols=True)
        key = "train/dpo_loss" if dpo else "train/nll"
        while step < total:
            t0 = time.perf_counter()
            batch = [unit for _, unit in stream.batch(step * sc.batch_size, sc.batch_size)]
            step += 1
            record = {"kind": "train", "step": step, "epoch": step * sc.batch_size / len(train),
                      **train_step(client, cfg, data.loss, batch, learning_rate(cfg, step, total)),
                      "timing/train_s": time.perf_counter() - t0}
            record.update({"timing/step_s": time.perf_counter() - t0, "elapsed_s": time.perf_counter() - t_start})
            metrics.log(record)
            result["train"].append(record)
            result["steps"] = step
            bar.update(1)
            bar.set_postfix(loss=f"{record[key]:.3f}")
            if sc.eval_every and step % sc.eval_every == 0 and step != total:
                run_eval(step)
            if (tc.checkpoint.every and step % tc.checkpoint.every == 0) or step == total:
                save(step)
        bar.close()
        run_eval(total)
        if tc.checkpoint.export_final:
            result["export"] = client.on_learners("export", str(run_dir / "final_model"), supervised=False)
    finally:
        metrics.close()
        release()
    result["wall_s"] = time.perf_counter() - t_start
    return result


def summary_text(result: dict, run_dir: Path) -> str:
    train, evals = result["train"], result["evals"]
    dpo = result.get("loss") == "dpo"
    lines = [f"run directory: {run_dir}",
             f"steps: {result['steps']} of {result.get('total', result['steps'])} ({result.get('examples', 0)} "
             f"training {'pairs' if dpo else 'examples'}, {result.get('heldout', 0)} held out), "
             f"wall {result['wall_s']:.0f}s"]
    key, name = ("dpo_loss", "DPO loss") if dpo else ("nll", "NLL")
    if train:
        lines.append(f"train {name}: {train[0]['train/' + key]:.4f} (step {train[0]['step']}) -> "
                     f"{train[-1]['train/' + key]:.4f} (step {train[-1]['step']})")
    if evals:
        first_last = (evals[0], evals[-1])[: len(evals)]
        lines.append(f"held-out {name}: " + " -> ".join(f"{e['eval/' + key]:.4f} (step {e['step']})"
                                                        for e in first_last))
        if dpo:
            lines.append("held-out preference accuracy: " + " -> ".join(
                f"{e['eval/preference_accuracy']:.1%} (step {e['step']})" for e in first_last))
    lines.append(f"metrics: {run_dir / 'metrics.jsonl'}; dashboard and summary: meshrl report {run_dir}")
    if result.get("export"):
        lines.append(f"final policy (HF format): {result['export']}; held-out accuracy: meshrl eval {run_dir}")
    return "\n".join(lines)


def sft_main(cfg: SFTRunConfig | None, resume: str | None = None, overwrite: bool = False, session=None) -> int:
    """Entry point of `meshrl sft`; returns the exit code (2 with one line on stderr for a bad
    config, data file or run directory; 1 for meshes that failed). ``resume``: continue the run
    in that directory with its saved config."""
    from meshrl.controller.train import RunDirError, make_run_dir
    from meshrl.meshes.group import MeshSpawnError
    from meshrl.meshes.hosts import HostLost
    from meshrl.meshes.supervisor import MeshLost, RestartBudgetExceeded
    from meshrl.terms import check_config

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("meshrl").setLevel(logging.INFO)
    try:
        if resume is not None:
            run_dir = Path(resume)
            if not (run_dir / "config.yaml").is_file():
                raise RunDirError(f"--resume {resume}: no run directory there (no config.yaml)")
            cfg = load_config(SFTRunConfig, run_dir / "config.yaml")
        check_config(cfg)  # the plugins (a loss of theirs) are imported
        data = load_data(cfg)  # every line checked before a run directory is made
        if resume is None:
            for key in (*SOURCES, "eval_data"):  # the saved config works from any directory (--resume)
                if getattr(cfg.sft, key):
                    setattr(cfg.sft, key, str(Path(getattr(cfg.sft, key)).resolve()))
            if cfg.output.name is None:
                cfg.output.name = f"sft-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir = make_run_dir(cfg, overwrite)
    except (RunDirError, ConfigError, ConversationFileError, RecordFileError, SFTError) as e:
        print(f"meshrl: sft: {e}", file=sys.stderr)
        return 2
    try:
        result = run_sft(cfg, run_dir, resume=resume is not None, session=session, data=data)
    except SFTError as e:
        print(f"meshrl: sft: {e}", file=sys.stderr)
        return 2
    except (RestartBudgetExceeded, HostLost, MeshSpawnError, MeshLost) as e:
        again = f"; continue from the last checkpoint: meshrl sft --resume {run_dir}" if isinstance(e, MeshLost) else ""
        print(f"meshrl: sft: {e}{again}", file=sys.stderr)
        return 1
    print(summary_text(result, run_dir))
    return 0
