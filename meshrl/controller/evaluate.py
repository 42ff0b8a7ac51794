"""Held-out evaluation: one function (`evaluate_tasks`) for the training loop's periodic evaluation
(`GRPOLoop.evaluate`) and for `meshrl eval`, which scores a checkpoint, a run directory's latest
checkpoint or an exported HF model without training.

Both roll out the task set's held-out problems with the run's rollout strategy (the same prompts,
rendered by the model's renderer; the same grading, by the rewarder or the code task's sandbox) and
the same request (`eval_request`: greedy, one sample per task). `meshrl eval --k K` samples N >= K
completions per task at the run's sampling temperature and reports pass@K with the unbiased
estimator of the HumanEval paper (`pass_at_k`).

`meshrl eval` brings the meshes up like a training run (`MeshSession`: learner, generators, the
strategy's scoring mesh), loads the checkpoint into the learner and publishes its weights to the
generators, as a resumed run does. Before anything is spawned it checks that the model fits the
task and the checkpoint fits the model (`EvalError`, one line)."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrl.engines import SampleRequest

log = logging.getLogger("meshrl")


class EvalError(ValueError):
    """What `meshrl eval` was given cannot be evaluated; the message is one line."""


# ---- the estimator and the shared evaluation ------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), computed
    as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def eval_request(sampling, stop_tokens, samples: int = 1, seed: int | None = None) -> SampleRequest:
    """The request of a held-out evaluation: greedy for one sample per task (what training
    evaluates), else ``sampling``'s (`generator.sampling`) temperature and top-p, seeded."""
    greedy = samples == 1
    return SampleRequest(n=1, max_tokens=sampling.max_new_tokens, temperature=0.0 if greedy else sampling.temperature,
                         top_p=1.0 if greedy else sampling.top_p, stop_token_ids=tuple(stop_tokens),
                         seed=None if greedy else seed)


def evaluate_tasks(strategy, tasks: list, request: SampleRequest, tag: str, samples: int = 1,
                   ks: tuple[int, ...] = (), batch: int | None = None, progress=None) -> tuple[dict, list[list]]:
    """Roll out ``samples`` trajectories per task with ``strategy`` (a rollout strategy:
    meshrl.controller.rollout) and grade them. Tasks go out ``batch`` at a time (None: all at
    once), ``progress`` (a tqdm bar) advancing by each batch's tasks. Returns the metrics
    (`eval/accuracy`: the share of correct samples; `eval/reward_mean`; `eval/n`: samples graded;
    `eval/tasks`; `eval/pass@k` for each k in ``ks``) and the trajectories grouped per task (a task
    whose prompt does not fit the context is skipped, as in training)."""
    batch = batch or max(len(tasks), 1)
    groups: list[list] = []
    for start in range(0, len(tasks), batch):
        part = tasks[start:start + batch]
        req = request if request.seed is None else dataclasses.replace(request, seed=request.seed + start * samples)
        trajectories, _ = strategy.collect(part, samples, req, tag if batch >= len(tasks) else f"{tag}.{start}")
        by_group: dict[int, list] = {}
        for t in trajectories:
            by_group.setdefault(t.group, []).append(t)
        groups += [by_group[g] for g in sorted(by_group)]
        if progress is not None:
            progress.update(len(part))
    return eval_metrics(groups, ks), groups


def eval_metrics(groups: list[list], ks: tuple[int, ...] = ()) -> dict:
    """The evaluation metrics of graded trajectories grouped per task (see `evaluate_tasks`)."""
    flat = [t for g in groups for t in g]
    n = max(len(flat), 1)
    metrics: dict[str, Any] = {"eval/accuracy": sum(bool(t.info.get("correct")) for t in flat) / n,
                               "eval/reward_mean": sum(t.reward for t in flat) / n, "eval/n": len(flat)}
    if ks:
        metrics["eval/tasks"] = len(groups)
    for k in ks:
        scored = [pass_at_k(len(g), sum(bool(t.info.get("correct")) for t in g), k) for g in groups if len(g) >= k]
        metrics[f"eval/pass@{k}"] = sum(scored) / len(scored) if scored else 0.0
    return metrics


# ---- what `meshrl eval` was given -----------------------------------------------------------------
@dataclass(frozen=True)
class EvalTarget:
    """A path given to `meshrl eval`, resolved: the learner checkpoint to load (None for an HF
    model directory), the HF model directory to serve instead of `model.name_or_path`, and the
    config it came with (None: none found beside it)."""

    kind: str  # "run", "checkpoint", "learner" or "model"
    path: Path
    config: Path | None = None
    learner_dir: Path | None = None
    model_dir: Path | None = None
    step: int | None = None

    def describe(self) -> str:
        if self.kind == "model":
            return f"{self.path} (HF model)"
        return f"{self.path} ({'latest checkpoint, ' if self.kind == 'run' else ''}step {self.step})"


def _beside(path: Path) -> Path | None:
    return path if path.is_file() else None


def resolve_target(path: str | Path) -> EvalTarget:
    """What ``path`` is: a run directory (its latest complete checkpoint), a checkpoint
    (`checkpoints/step-N`, or its `learner/` directory) or an HF model directory (e.g. a run's
    `final_model`). Raises `EvalError`."""
    from meshrl.controller.checkpoints import COMPLETE, CONTROLLER, LEARNER_DIR, CheckpointManager
    from meshrl.training.checkpoint import META, STATE

    p = Path(path)
    if not p.exists():
        raise EvalError(f"{path}: no such file or directory")
    if not p.is_dir():
        raise EvalError(f"{path}: not a directory (expected a run directory, a checkpoint or an HF model directory)")
    if (p / META).is_file() and (p / STATE).is_dir():  # a learner checkpoint: run/checkpoints/step-N/learner
        step = None
        if (p.parent / CONTROLLER).is_file():
            step = json.loads((p.parent / CONTROLLER).read_text()).get("step")
        return EvalTarget("learner", p, _beside(p.parents[2] / "config.yaml") if len(p.parents) > 2 else None,
                          learner_dir=p, step=step)
    if (p / CONTROLLER).is_file() or (p / LEARNER_DIR).is_dir():  # run/checkpoints/step-N
        if not (p / COMPLETE).is_file() or not (p / CONTROLLER).is_file():
            raise EvalError(f"{path}: an incomplete checkpoint (no {COMPLETE} marker: its write did not finish)")
        step = json.loads((p / CONTROLLER).read_text()).get("step")
        return EvalTarget("checkpoint", p, _beside(p.parents[1] / "config.yaml") if len(p.parents) > 1 else None,
                          learner_dir=p / LEARNER_DIR, step=step)
    if (p / "config.json").is_file():
        if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
            raise EvalError(f"{path}: an HF config.json but no weights (*.safetensors, *.bin) beside it")
        return EvalTarget("model", p, _beside(p.parent / "config.yaml"), model_dir=p)
    if (p / "config.yaml").is_file() or (p / "checkpoints").is_dir():
        latest = CheckpointManager(p / "checkpoints").latest()
        if latest is None:
            raise EvalError(f"{path}: a run directory without a complete checkpoint in {p / 'checkpoints'}")
        return EvalTarget("run", p, _beside(p / "config.yaml"), learner_dir=latest.learner_dir, step=latest.step)
    raise EvalError(f"{path}: not a run directory, a checkpoint or an HF model directory (no config.yaml, "
                    "checkpoints/, controller.json, learner.json or config.json in it)")


def load_eval_config(target: EvalTarget, config: str | Path | None, overrides: list[str], default: Path | None):
    """The config to evaluate with: ``config`` (`-c`), else the one the target came with, else
    ``default``; ``overrides`` on top; an HF model directory becomes `model.name_or_path`. The
    parts of a run that take no part in an evaluation (DiLoCo, fault injection) are turned off.
    Raises ConfigError."""
    from meshrl.config.base import load_config, read_yaml
    from meshrl.config.sft import config_class

    path = config or target.config or default
    cls = config_class(read_yaml(path)) if path is not None else config_class({})
    cfg = load_config(cls, path, overrides)
    if target.model_dir is not None:
        cfg.model.name_or_path = str(target.model_dir)
    cfg.diloco.enabled = False
    cfg.faults.inject = []
    return cfg


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_fit(cfg, target: EvalTarget) -> None:
    """The model (`model.name_or_path`) has a tokenizer with a chat template the renderers know,
    whose tokens its embeddings cover; a checkpoint holds tensors of that model (LoRA or not as
    `learner.lora.enabled` says). Raises `EvalError` before anything is spawned."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from meshrl.models.provision import resolve_model
    from meshrl.renderers import renderer_for_tokenizer

    name = cfg.model.name_or_path
    try:
        model_dir = resolve_model(name)
    except (ValueError, FileNotFoundError) as e:
        raise EvalError(f"model.name_or_path = {name!r}: {e}") from None
    try:
        config = AutoConfig.from_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise EvalError(f"{model_dir}: not a loadable HF model ({' '.join(str(e).split())[:200]})") from None
    try:
        renderer = renderer_for_tokenizer(tokenizer)
    except ValueError as e:
        raise EvalError(f"{model_dir}: its tokenizer cannot render the task's prompts: {e}") from None
    vocab = getattr(text_config(config), "vocab_size", None)
    if vocab is not None:
        if len(tokenizer) > vocab:
            raise EvalError(f"{model_dir}: its tokenizer has {len(tokenizer)} tokens but the model's embeddings "
                            f"only {vocab}: the tokenizer is not this model's")
        used = [*renderer.get_stop_sequences(), *renderer.generation_header()]
        if max(used) >= vocab:
            raise EvalError(f"{model_dir}: the {renderer.name} renderer's token {max(used)} is outside the model's "
                            f"vocabulary of {vocab}")
    if target.learner_dir is None:
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problem = checkpoint_mismatch(target.learner_dir, expected, cfg.learner.lora.enabled, name)
    if problem:
        raise EvalError(f"{target.learner_dir}: {problem}")


def checkpoint_mismatch(learner_dir: Path, expected: dict[str, tuple], lora: bool, model: str = "") -> str | None:
    """Why the learner checkpoint in ``learner_dir`` does not fit the model ``model`` whose HF
    state dict has the shapes ``expected`` (trained with LoRA or not as ``lora`` says); None when
    it fits."""
    import torch.distributed.checkpoint as dcp

    from meshrl.training.checkpoint import META, STATE

    meta = json.loads((learner_dir / META).read_text())
    if bool(meta.get("lora")) != lora:
        kinds = {True: "a LoRA adapter", False: "full weights"}
        return (f"the checkpoint holds {kinds[bool(meta.get('lora'))]} but learner.lora.enabled = {lora} "
                f"(evaluate it with the config of the run that wrote it)")
    try:
        stored = dcp.FileSystemReader(str(learner_dir / STATE)).read_metadata().state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint: say so in one line
        return f"unreadable checkpoint ({' '.join(str(e).split())[:200]})"
    prefix = "model.model."  # the learner's ValidLogits wrapper around the HF model
    shapes = {k[len(prefix):]: tuple(getattr(v, "size", ())) for k, v in stored.items() if k.startswith(prefix)}
    other = f"a checkpoint of another model than model.name_or_path = {model!r}"
    if not lora:
        for key, shape in shapes.items():
            if key not in expected:
                return f"{other}: it holds {key}, which this model has not"
            if shape != expected[key]:
                return f"{other}: {key} is {list(shape)} in it, {list(expected[key])} in this model"
        missing = sorted(set(expected) - set(shapes))
        return f"{other}: this model's {missing[0]} is not in it" if missing else None
    for key, shape in shapes.items():  # base_model.model.<module>.lora_A.<adapter>.weight
        name = key.removeprefix("base_model.model.")
        for part, dim in ((".lora_A.", 1), (".lora_B.", 0)):
            if part not in name or len(shape) != 2:
                continue
            base = expected.get(name.split(part)[0] + ".weight")
            if base is None:
                return f"{other}: it adapts {name.split(part)[0]}, which this model has not"
            if shape[dim] != base[dim]:  # A: (rank, in), B: (out, rank); the weight: (out, in)
                return (f"{other}: the adapter of {name.split(part)[0]} is {list(shape)}, which does not fit its "
                        f"weight {list(base)} in this model")
    return None


# ---- `meshrl eval` --------------------------------------------------------------------------------
def run_eval(cfg, target: EvalTarget, size: int | None = None, k: int = 1, samples: int | None = None,
             batch: int = 64, session=None) -> dict:
    """Evaluate ``target`` under ``cfg`` (see `load_eval_config`; call `check_fit` first) on
    ``size`` held-out tasks (None: `trainer.eval.size`): greedy for one sample per task, else
    ``samples`` (default ``k``) per task at the sampling temperature with pass@1 and pass@k.
    Spawns the meshes (or new actors in the processes of ``session``, a `MeshSession`). Returns
    the result record (`meshrl eval --out` writes it)."""
    from tqdm import tqdm

    from meshrl.actors.rewarder import load_reward_fn
    from meshrl.controller.rollout import Counters, strategy_for
    from meshrl.envs.task_sets import make_task
    from meshrl.meshes.session import host_run
    from meshrl.terms import check_config

    samples = samples or k
    if k < 1 or samples < k:
        raise EvalError(f"--k {k} --samples {samples}: pass@k needs 1 <= k <= samples")
    check_config(cfg, trains=False)  # its plugins are imported (a reward function or loss of theirs)
    try:
        if cfg.rewarder.reward_fn:
            load_reward_fn(cfg.rewarder.reward_fn)
        task = make_task(cfg.task, cfg.trainer.seed)
    except ValueError as e:  # a reward function that cannot be imported, a task set with no tasks
        raise EvalError(str(e)) from None
    tasks = task.heldout(size or cfg.trainer.eval.size)
    if not tasks:
        raise EvalError(f"task.kind = {cfg.task.kind}: no held-out tasks")
    started = time.perf_counter()
    session, release = host_run(cfg, session)
    try:
        strategy_cls = strategy_for(task)
        session.spawn_policy()
        strategy_cls.spawn(session, cfg)
        session.wait_ready()
        client = session.client
        client.publish(0)
        if target.learner_dir is not None:  # as a resumed run: load into the learner, publish, every reader pulls
            try:
                client.on_learners("load_checkpoint", str(target.learner_dir), supervised=False)
            except Exception as e:  # noqa: BLE001 - the learner's own check, in one line
                from meshrl.meshes.group import first_line

                raise EvalError(f"{target.learner_dir}: {first_line(e)}") from None
            client.publish(1)
            client.sync_readers(1)
        ready_s = time.perf_counter() - started
        strategy = strategy_cls(client, session.renderer, cfg.model.max_model_len, Counters())
        request = eval_request(cfg.generator.sampling, session.renderer.get_stop_sequences(), samples,
                               cfg.generator.seed)
        ks = tuple(sorted({1, k}))
        with tqdm(total=len(tasks), desc="eval", unit="task", disable=not cfg.trainer.progress,
                  dynamic_ncols=True) as bar:
            t0 = time.perf_counter()
            metrics, groups = evaluate_tasks(strategy, tasks, request, "eval", samples, ks, batch, bar)
            metrics["timing/eval_s"] = time.perf_counter() - t0
    finally:
        release()
    return {
        "path": str(target.path), "kind": target.kind, "step": target.step,
        "checkpoint": str(target.learner_dir) if target.learner_dir else None,
        "model": cfg.model.name_or_path, "task": cfg.task.kind, "size": len(tasks),
        "k": k, "samples": samples, "greedy": request.greedy, "temperature": request.temperature,
        **metrics, "timing/ready_s": ready_s, "wall_s": time.perf_counter() - started,
        "tasks": [{"id": _task_id(g[0].problem), "samples": len(g),
                   "correct": sum(bool(t.info.get("correct")) for t in g),
                   "reward_mean": sum(t.reward for t in g) / len(g)} for g in groups],
    }


def _task_id(problem) -> str:
    for attr in ("id", "task_id"):
        value = getattr(problem, attr, None)
        if value is not None:
            return str(value)
    return str(problem)


def summary_line(result: dict, target: EvalTarget) -> str:
    """One line: what was evaluated, on how many tasks, with what result."""
    what = {"arithmetic": "problems", "env": "episodes", "agent": "episodes"}.get(result["task"], "tasks")
    line = f"{target.describe()}: held-out {result['task']}, {result['size']} {what}"
    if result["greedy"] and result["task"] in ("env", "agent"):  # an episode's own reward: its mean return too
        return line + (f", greedy: success rate {result['eval/accuracy']:.1%}, "
                       f"mean return {result['eval/reward_mean']:.3f}")
    if result["greedy"]:
        return line + f", greedy: accuracy {result['eval/accuracy']:.1%}"
    line += f", {result['samples']} samples each at temperature {result['temperature']:g}: "
    return line + ", ".join(f"pass@{k} {result[f'eval/pass@{k}']:.1%}" for k in sorted({1, result["k"]}))


def eval_main(path: str, config: str | None = None, overrides: list[str] | None = None, *, size: int | None = None,
              k: int = 1, samples: int | None = None, batch: int = 64, out: str | None = None,
              default_config: Path | None = None, session=None) -> int:
    """`meshrl eval PATH`: the exit code (2 with one line on stderr for a bad path, config or
    model); prints the summary line, writes the result JSON to ``out``."""
    from meshrl.config.base import ConfigError
    from meshrl.meshes.group import MeshSpawnError
    from meshrl.meshes.hosts import HostLost
    from meshrl.meshes.supervisor import MeshLost, RestartBudgetExceeded

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        target = resolve_target(path)
        cfg = load_eval_config(target, config, list(overrides or []), default_config)
        check_fit(cfg, target)
        result = run_eval(cfg, target, size, k, samples, batch, session)
    except (EvalError, ConfigError) as e:
        print(f"meshrl: eval: {e}", file=sys.stderr)
        return 2
    except (RestartBudgetExceeded, HostLost, MeshSpawnError, MeshLost) as e:
        print(f"meshrl: eval: {e}", file=sys.stderr)
        return 1
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(summary_line(result, target) + (f" ({out})" if out else ""))
    return 0
