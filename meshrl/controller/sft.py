"""`meshrl sft`: supervised fine-tuning from a JSONL file of conversations (`sft.data`), full or LoRA
(`learner.lora`), on the learner mesh a training run uses.

The conversations are checked line by line before anything is made (meshrl.training.conversations),
split into training and held-out sets (`sft.eval_fraction`, or `sft.eval_data`), and rendered by the
model's renderer into `cross_entropy` Datums, token in and token out: loss weight on the assistant
turns only. Each step takes `sft.batch_size` conversations from a seeded, resumable stream (every
epoch a permutation), runs `forward_backward` on the learner mesh, scales the summed gradients to
a token mean (`scale_grads`) and makes one `optim_step` at the step's learning rate
(`sft.lr_schedule`). The held-out NLL (a `forward` without grad) is logged every `sft.eval_every`
steps, before the first and after the last.

The run directory is a training run's: `config.yaml`, `metrics.jsonl` (records `train`, with
`train/nll`, and `eval`, with `eval/nll`; `meshrl report` draws them), atomic checkpoints
(`trainer.checkpoint`, meshrl.controller.checkpoints; `--resume RUN_DIR` continues from the latest)
and `final_model`, the policy exported as an HF model directory (LoRA merged), which `meshrl eval`
scores."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import sys
import time
from pathlib import Path

from meshrl.config.base import ConfigError, load_config
from meshrl.config.meshes import LEARNER
from meshrl.config.sft import SFTRunConfig
from meshrl.training.conversations import ConversationFileError, read_conversations, supervised_datum

log = logging.getLogger("meshrl")


class SFTError(ValueError):
    """An SFT run that cannot start as configured; the message is one line."""


def split_conversations(cfg: SFTRunConfig) -> tuple[list[list[dict]], list[list[dict]]]:
    """(training, held-out) conversations: `sft.data` and `sft.eval_data`, or `sft.eval_fraction`
    of `sft.data` held out by a shuffle seeded with `sft.seed`. Raises ConversationFileError (a bad
    line, named by file:line) or SFTError."""
    sc = cfg.sft
    if not sc.data:
        raise SFTError("sft.data: no training file given (meshrl sft DATA.jsonl)")
    train = read_conversations(sc.data)
    if sc.eval_data:
        return train, read_conversations(sc.eval_data)
    if sc.eval_fraction == 0 or len(train) < 2:
        return train, []
    order = list(range(len(train)))
    random.Random(sc.seed).shuffle(order)
    held = set(order[: min(max(1, round(len(train) * sc.eval_fraction)), len(train) - 1)])
    return [c for i, c in enumerate(train) if i not in held], [c for i, c in enumerate(train) if i in held]


def build_datums(cfg: SFTRunConfig, renderer, conversations: list[list[dict]]) -> tuple[list, int]:
    """The conversations' `cross_entropy` Datums and how many were skipped (no assistant token
    within `sft.max_length`)."""
    max_length = cfg.sft.max_length or cfg.model.max_model_len
    only_last = cfg.sft.train_on == "last_assistant"
    datums = [supervised_datum(renderer, c, max_length, only_last) for c in conversations]
    return [d for d in datums if d is not None], sum(d is None for d in datums)


def total_steps(cfg: SFTRunConfig, conversations: int) -> int:
    return cfg.sft.steps or cfg.sft.epochs * math.ceil(conversations / cfg.sft.batch_size)


def learning_rate(cfg: SFTRunConfig, step: int, total: int) -> float:
    """The learning rate of step ``step`` (1-based) of ``total``."""
    if cfg.sft.lr_schedule == "linear":
        return cfg.learner.lr * (1.0 - (step - 1) / total)
    return cfg.learner.lr


def _weight(datums: list) -> float:
    return float(sum(float(d.loss_fn_inputs["weights"].sum()) for d in datums))


def heldout_nll(client, datums: list, chunk: int) -> dict:
    """Mean NLL per weighted (assistant) token of ``datums`` under the learner's current weights."""
    nll = 0.0
    for start in range(0, len(datums), chunk):
        part = datums[start:start + chunk]
        for d, logprobs in zip(part, client.forward(part)):
            nll -= sum(lp * w for lp, w in zip(logprobs, d.loss_fn_inputs["weights"].tolist()))
    tokens = _weight(datums)
    return {"eval/nll": nll / tokens, "eval/tokens": tokens, "eval/n": len(datums)}


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


def run_sft(cfg: SFTRunConfig, run_dir: Path, resume: bool = False, session=None,
            data: tuple[list, list] | None = None) -> dict:
    """Fine-tune on `sft.data` into ``run_dir`` (continuing from its latest checkpoint when
    ``resume``), in a `MeshSession` of its own or in the processes of ``session``. ``data``: the
    (training, held-out) conversations, if already read (`split_conversations`)."""
    from tqdm import tqdm

    from meshrl.controller.checkpoints import CheckpointManager
    from meshrl.envs.task_sets import SeededStream
    from meshrl.meshes.session import host_run
    from meshrl.metrics.records import MetricsLogger

    t_start = time.perf_counter()
    sc, tc = cfg.sft, cfg.trainer
    train_convs, held_convs = data if data is not None else split_conversations(cfg)
    checkpoints = CheckpointManager(run_dir / "checkpoints", tc.checkpoint.keep)
    start = checkpoints.latest() if resume else None
    if resume and start is None and (run_dir / "metrics.jsonl").exists():
        log.warning("no complete checkpoint in %s: starting the run over", run_dir)
    metrics = MetricsLogger(run_dir, cfg.output.tensorboard, cfg.output.wandb_project, run_dir.name,
                            cfg.model_dump(mode="json"))
    metrics.truncate_after(start.step if start else 0)
    result: dict = {"steps": 0, "train": [], "evals": []}
    session, release = host_run(cfg, session)
    try:
        spawn_learner(session, cfg)
        client = session.client
        train, skipped = build_datums(cfg, session.renderer, train_convs)
        held, skipped_held = build_datums(cfg, session.renderer, held_convs)
        if skipped or skipped_held:
            log.warning("%d training and %d held-out conversations skipped: no assistant token within %d tokens "
                        "(sft.max_length)", skipped, skipped_held, sc.max_length or cfg.model.max_model_len)
        if not train:
            raise SFTError(f"{sc.data}: no conversation keeps an assistant token within sft.max_length")
        total = total_steps(cfg, len(train))
        result.update(conversations=len(train), heldout=len(held), total=total)
        log.info("sft: %d training conversations, %d held out, %d steps of %d", len(train), len(held), total,
                 sc.batch_size)
        if start is not None:
            client.on_learners("load_checkpoint", str(start.learner_dir), supervised=False)
            log.info("resumed %s from step %d", run_dir, start.step)

        def run_eval(step: int) -> None:
            if held:
                record = {"kind": "eval", "step": step, **heldout_nll(client, held, 4 * sc.batch_size)}
                metrics.log(record)
                result["evals"].append(record)
                log.info("held-out NLL at step %d: %.4f", step, record["eval/nll"])

        def save(step: int) -> None:
            tmp = checkpoints.begin(step)
            client.on_learners("save_checkpoint", str(tmp / "learner"), supervised=False)
            checkpoints.commit(tmp, step, {"sft": {"cursor": step * sc.batch_size, "conversations": len(train)}})

        stream = SeededStream(train, sc.seed)
        step = start.step if start else 0
        if step == 0:
            run_eval(0)
        bar = tqdm(total=total, initial=step, desc="sft", disable=not tc.progress, dynamic_ncols=True)
        while step < total:
            t0 = time.perf_counter()
            batch = [d for _, d in stream.batch(step * sc.batch_size, sc.batch_size)]
            tokens = _weight(batch)
            step += 1
            lr = learning_rate(cfg, step, total)
            fb = client.forward_backward(batch, "cross_entropy")
            client.scale_grads(1.0 / tokens)  # the summed loss's gradients -> the token mean's
            opt = client.optim_step(dataclasses.replace(cfg.learner.adam_params(), learning_rate=lr))
            record = {"kind": "train", "step": step, "epoch": step * sc.batch_size / len(train),
                      "train/nll": fb["loss"] / tokens, "train/loss_tokens": tokens, "train/tokens": fb["tokens"],
                      "train/seconds": fb["seconds"], "batch/datums": len(batch),
                      **{f"train/{k}": v for k, v in opt.items()},
                      "timing/train_s": time.perf_counter() - t0}
            if "entropy_mean" in fb:
                record["train/entropy"] = fb["entropy_mean"]
            record.update({"timing/step_s": time.perf_counter() - t0, "elapsed_s": time.perf_counter() - t_start})
            metrics.log(record)
            result["train"].append(record)
            result["steps"] = step
            bar.update(1)
            bar.set_postfix(nll=f"{record['train/nll']:.3f}")
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
    lines = [f"run directory: {run_dir}",
             f"steps: {result['steps']} of {result.get('total', result['steps'])} ({result.get('conversations', 0)} "
             f"training conversations, {result.get('heldout', 0)} held out), wall {result['wall_s']:.0f}s"]
    if train:
        lines.append(f"train NLL: {train[0]['train/nll']:.4f} (step {train[0]['step']}) -> "
                     f"{train[-1]['train/nll']:.4f} (step {train[-1]['step']})")
    if evals:
        lines.append("held-out NLL: " + " -> ".join(f"{e['eval/nll']:.4f} (step {e['step']})"
                                                    for e in (evals[0], evals[-1])[: len(evals)]))
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
        data = split_conversations(cfg)  # every line checked before a run directory is made
        if resume is None:
            for key in ("data", "eval_data"):  # the saved config works from any directory (--resume)
                if getattr(cfg.sft, key):
                    setattr(cfg.sft, key, str(Path(getattr(cfg.sft, key)).resolve()))
            if cfg.output.name is None:
                cfg.output.name = f"sft-{time.strftime('%Y%m%d-%H%M%S')}"
            run_dir = make_run_dir(cfg, overwrite)
    except (RunDirError, ConfigError, ConversationFileError, SFTError) as e:
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
