"""The `meshrl` command line: train, launch, plan, eval, sft, serve, models, teachers, rollout
shards, run reports, config reference."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from meshrl.config.base import ConfigError, describe_fields, load_config, to_yaml

DEFAULT_CONFIG = "configs/default.yaml"
SERVE_CONFIG = "configs/serve.yaml"


def default_config_path(name: str = DEFAULT_CONFIG) -> Path | None:
    """``name`` (default `configs/default.yaml`) in the working directory, else the one beside the
    source tree."""
    for candidate in (Path.cwd() / name, Path(__file__).resolve().parent.parent / name):
        if candidate.is_file():
            return candidate
    return None


def _fail(message: str) -> int:
    print(f"meshrl: {message}", file=sys.stderr)
    return 2


def _plan(args: argparse.Namespace):
    """(config path, resolved config, its placement, a header describing the host and why the GPUs
    went where they did) for the arguments of `train`, `launch` and `plan`; raises ConfigError."""
    from meshrl.config.run import RunConfig
    from meshrl.meshes.auto_gpus import resolve_gpus
    from meshrl.meshes.placement import gpus_for, plan_run, remote_host_gpus

    path = args.config or default_config_path()
    overrides = list(args.overrides)
    if getattr(args, "launcher", None):
        overrides.append(f"launch.launcher={args.launcher}")
    cfg = load_config(RunConfig, path, overrides)
    from meshrl.terms import check_config

    check_config(cfg)  # the plugins, the loss and the terms a run names exist
    if cfg.task.env is not None and cfg.task.kind == "env":
        from meshrl.envs.hosting import check_env_source

        check_env_source(cfg.task.env)  # the environment's class imports, its server answers
    if cfg.task.agent is not None and cfg.task.kind == "agent":
        from meshrl.agents.programs import check_agent_source

        check_agent_source(cfg.task.agent)  # the program's callable or command and the grader are there
    remote = remote_host_gpus(cfg.launch)
    if args.host_gpus is not None:
        ids = tuple(str(i) for i in range(args.host_gpus))
        host = f"a host with {args.host_gpus} GPUs (--host-gpus)"
    else:
        ids = gpus_for(cfg.launch)
        host = f"{cfg.launch.launcher} hosts with {remote} GPUs each" if remote is not None else \
            f"this host ({len(ids)} GPUs found)"
    choice = resolve_gpus(cfg, len(ids))
    why = "".join(f"\n  why: {line}" for line in choice.reasons)
    return path, choice.cfg, plan_run(choice.cfg, ids), f"placement on {host}{why}"


def cmd_train(args: argparse.Namespace) -> int:
    """`meshrl train` (the launcher `launch.launcher` names, local by default) and `meshrl launch
    KIND` (that launcher)."""
    if args.host_gpus is not None and not args.dry_run:
        return _fail("--host-gpus plans for other hosts: it needs --dry-run")
    if args.out is not None and not args.dry_run:
        return _fail("--out is where --dry-run writes what it would submit: it needs --dry-run")
    try:
        path, cfg, placement, header = _plan(args)
    except ConfigError as e:
        return _fail(str(e))
    from meshrl.launch.run import dry_run_text, launch_main

    if args.dry_run:
        try:
            print(dry_run_text(cfg, str(path or "built-in defaults"), header, placement.table(),
                               Path(args.out) if args.out else None), end="")
        except ConfigError as e:
            return _fail(str(e))
        return 0
    try:
        return launch_main(cfg, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as e:  # a resumed run's saved placement that does not fit this host
        return _fail(str(e))


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        _, _, placement, header = _plan(args)
    except ConfigError as e:
        return _fail(str(e))
    print(header)
    print(placement.table(), end="")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """`meshrl serve`: the Tinker-protocol HTTP server over the backend `serve.backend` builds."""
    from meshrl.config.run import RunConfig

    overrides = list(args.overrides) + ([f"serve.port={args.port}"] if args.port is not None else [])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("meshrl").setLevel(logging.INFO)
    try:
        cfg = load_config(RunConfig, args.config or default_config_path(SERVE_CONFIG), overrides)
        from meshrl.serve.app import build_app
        from meshrl.serve.runner import load_backend, run_server

        backend = load_backend(cfg)
        try:
            run_server(build_app(backend, cfg.serve), cfg.serve.host, cfg.serve.port,
                       lambda url: print(f"serving at {url} (Ctrl-C stops it)", flush=True))
        finally:
            backend.close()
    except ConfigError as e:
        return _fail(str(e))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from meshrl.models.provision import BUILDERS, list_models, prepare

    if args.action == "list":
        for status in list_models():
            state = "ready" if status.complete else f"absent ({status.reason})"
            print(f"{status.name:24s} {state:40s} {status.path}")
        return 0
    names = args.names or [n for n in BUILDERS]
    for name in names:
        try:
            path = prepare(name, force=args.force, verify=args.verify)
        except (ValueError, FileNotFoundError) as e:
            return _fail(str(e))
        print(f"{name}: {path}")
    return 0


def cmd_teachers(args: argparse.Namespace) -> int:
    """`meshrl teachers serve` (vLLM serving a cached model) or `meshrl teachers oracle` (a teacher
    that knows the answers), until Ctrl-C."""
    from meshrl.teachers.serve import LocalTeacherServer, TeacherServerError

    if args.action == "oracle":
        from pydantic import ValidationError

        from meshrl.config.base import format_validation_error
        from meshrl.teachers.oracle import OracleConfig, OracleTeacherServer

        given = {"task": args.task, "error_rate": args.error_rate, "latency_s": args.latency_s, "seed": args.seed,
                 "code_source": args.code_source, "prompt_template": args.prompt_template, "served_name": args.name}
        try:
            cfg = OracleConfig(**{key: value for key, value in given.items() if value is not None})
        except ValidationError as e:
            return _fail(format_validation_error(e, "teachers oracle"))
        server = OracleTeacherServer(cfg, port=args.port)
    else:
        from meshrl.models.provision import resolve_model

        try:
            path = resolve_model(args.model)
        except (ValueError, FileNotFoundError) as e:
            return _fail(str(e))
        server = LocalTeacherServer(path, args.name or args.model, port=args.port)
    try:
        server.start()
    except TeacherServerError as e:
        return _fail(str(e))
    print(f"teacher '{server.served_name}' serving at {server.base_url} (log: {server.log_path}); Ctrl-C stops it")
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def cmd_shards(args: argparse.Namespace) -> int:
    """`meshrl shards URL`: list the committed rollout shards of a run and verify each one."""
    import json

    from meshrl.diloco.shards import ShardReader
    from meshrl.diloco.store import CorruptObject, ObjectStore, StoreError

    try:
        options = json.loads(args.storage_options) if args.storage_options else {}
        store = ObjectStore(args.url, options, args.timeout)
        reader = ShardReader(store, args.run_id)
        shards = reader.committed()
    except (ValueError, StoreError) as e:
        return _fail(str(e))
    records = bad = 0
    print(f"{'producer':16s} {'index':>6s} {'step':>6s} {'records':>8s} {'bytes':>10s} {'versions':>10s}  status")
    for producer, index in shards:
        try:
            shard = reader.read(producer, index)
        except (CorruptObject, StoreError) as e:
            bad += 1
            print(f"{producer:16s} {index:6d} {'':>6s} {'':>8s} {'':>10s} {'':>10s}  BAD: {e}")
            continue
        m = shard.manifest
        versions = "-".join(str(v) for v in m["policy_versions"]) if m.get("policy_versions") else ""
        print(f"{producer:16s} {index:6d} {str(m.get('step', '')):>6s} {m['count']:8d} {m['bytes']:10d} "
              f"{versions:>10s}  ok")
        records += m["count"]
    print(f"{len(shards)} shards under {args.url}/{args.run_id}/shards: {len(shards) - bad} good "
          f"({records} records), {bad} bad")
    return 1 if bad else 0


def cmd_report(args: argparse.Namespace) -> int:
    """`meshrl report RUN_DIR` (its dashboard and summary, into the run directory) and `meshrl report
    RUN_A RUN_B ...` (the runs overlaid and compared, into --out)."""
    from meshrl.report import ReportError, write_comparison, write_report

    try:
        if len(args.run_dirs) == 1:
            png, md, _ = write_report(args.run_dirs[0], args.out)
        else:
            png, md, _ = write_comparison(args.run_dirs, args.out or ".")
    except ReportError as e:
        return _fail(str(e))
    print(f"dashboard: {png}\nsummary: {md}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`meshrl eval PATH`: held-out accuracy or pass@k of a run directory's latest checkpoint, a
    checkpoint or an exported HF model (meshrl.controller.evaluate)."""
    from meshrl.controller.evaluate import eval_main

    return eval_main(args.path, args.config, list(args.overrides), size=args.size, k=args.k, samples=args.samples,
                     batch=args.batch, out=args.out, default_config=default_config_path())


def cmd_sft(args: argparse.Namespace) -> int:
    """`meshrl sft DATA.jsonl`: supervised fine-tuning on a file of conversations, on a run's
    successful trajectories (`--trajectories FILE`), or offline DPO on a run's teacher pairs
    (`--pairs FILE`) (meshrl.controller.sft)."""
    from meshrl.config.sft import SFTRunConfig
    from meshrl.controller.sft import sft_main

    data, overrides = args.data, list(args.overrides)
    if data is not None and "=" in data and not Path(data).exists():  # only overrides were given
        data, overrides = None, [data, *overrides]
    if args.resume:
        if data or overrides or args.config or args.eval_file or args.overwrite or args.trajectories or args.pairs:
            return _fail("sft --resume RUN_DIR continues the run with its saved config: give no data file, "
                         "-c, --eval-file, --trajectories, --pairs, --overwrite or overrides with it")
        return sft_main(None, resume=args.resume)
    try:
        cfg = load_config(SFTRunConfig, args.config or default_config_path(), overrides)
        if data:
            cfg.sft.data = data
        if args.eval_file:
            cfg.sft.eval_data = args.eval_file
        if args.trajectories:
            cfg.sft.trajectories = args.trajectories
        if args.pairs:
            cfg.sft.pairs = args.pairs
    except ConfigError as e:
        return _fail(str(e))
    return sft_main(cfg, overwrite=args.overwrite)


def cmd_config_reference(args: argparse.Namespace) -> int:
    print(config_reference_markdown(), end="")
    return 0


def config_reference_markdown() -> str:
    """Markdown table of every config key, its default and its documentation."""
    from meshrl.config.run import RunConfig

    lines = [
        "# Configuration reference",
        "",
        "Generated by `meshrl config-reference`; every key can be set in YAML or as a dotted override",
        "(`meshrl train -c configs/default.yaml learner.lr=2e-5`).",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    for key, default, doc in describe_fields(RunConfig):
        doc = " ".join(doc.split()).replace("|", "\\|")
        lines.append(f"| `{key}` | `{default}` | {doc} |")
    from meshrl.config.sft import SFTConfig

    lines += ["", "## `meshrl sft`", "",
              "`meshrl sft` reads the same configuration with one more section, `sft` (`meshrl sft DATA.jsonl "
              "sft.batch_size=16`):", "", "| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, doc in describe_fields(SFTConfig, "sft."):
        doc = " ".join(doc.split()).replace("|", "\\|")
        lines.append(f"| `{key}` | `{default}` | {doc} |")
    return "\n".join(lines) + "\n"


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a GPU count >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshrl", description="RL post-training on Monarch actor meshes")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a training job (default: configs/default.yaml) with the launcher "
                           "launch.launcher names (default: local)")
    launch = sub.add_parser("launch", help="run a training job with a given launcher")
    launch.add_argument("launcher", choices=["local", "process", "slurm", "k8s"],
                        help="local: this machine; process: each host a local worker process; slurm: sbatch; "
                             "k8s: Kubernetes pods (sets launch.launcher)")
    for p in (train, launch):
        p.add_argument("-c", "--config", help="YAML run config (default: configs/default.yaml)")
        p.add_argument("overrides", nargs="*", help="dotted overrides such as learner.lr=2e-5")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config, the GPU placement and what "
                       "the launcher would submit, and exit")
        p.add_argument("--out", metavar="DIR", help="with --dry-run: write the batch script or manifests into DIR")
        p.add_argument("--host-gpus", type=_gpu_count, metavar="N", help="with --dry-run: plan for hosts with N GPUs "
                       "(default: this host's, or what the launch section requests per host)")
        p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (with its saved config) from its "
                       "last checkpoint")
        p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
        p.set_defaults(func=cmd_train)

    plan = sub.add_parser("plan", help="print which GPUs each mesh process gets, without spawning anything")
    plan.add_argument("-c", "--config", help="YAML run config (default: configs/default.yaml)")
    plan.add_argument("overrides", nargs="*", help="dotted overrides such as meshes.learner.procs=4")
    plan.add_argument("--host-gpus", type=_gpu_count, metavar="N", help="plan for a host with N GPUs (default: the GPUs of this host)")
    plan.set_defaults(func=cmd_plan)

    ev = sub.add_parser("eval", help="held-out accuracy (greedy) or pass@k of a run directory's latest checkpoint, "
                        "a checkpoint or an exported HF model, without training")
    ev.add_argument("path", metavar="PATH", help="a run directory (its saved config and latest checkpoint), a "
                    "checkpoint (RUN/checkpoints/step-N) or an HF model directory (e.g. RUN/final_model)")
    ev.add_argument("-c", "--config", help="YAML run config (default: the run's config.yaml beside PATH, else "
                    "configs/default.yaml)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides such as task.code.heldout_limit=20")
    ev.add_argument("--size", type=_positive, metavar="N", help="held-out problems or tasks (default: "
                    "trainer.eval.size; at most the task's held-out set)")
    ev.add_argument("--k", type=_positive, default=1, metavar="K", help="report pass@K from --samples samples per task "
                    "at generator.sampling.temperature (default 1: one greedy sample, as training evaluates)")
    ev.add_argument("--samples", type=_positive, metavar="N", help="samples per task for pass@K, at least K "
                    "(default K); pass@K is the unbiased estimate from N")
    ev.add_argument("--batch", type=_positive, default=64, metavar="N", help="tasks per generation call (default 64)")
    ev.add_argument("--out", metavar="FILE", help="write the result (metrics, per-task counts) as JSON")
    ev.set_defaults(func=cmd_eval)

    sft = sub.add_parser("sft", help="supervised fine-tuning (full or LoRA) on a JSONL file of conversations or on "
                         "a run's successful trajectories, or offline DPO on a run's teacher pairs")
    sft.add_argument("data", nargs="?", metavar="DATA.jsonl", help="one JSON object per line with a `messages` list "
                     "of {role, content} (sets sft.data)")
    sft.add_argument("-c", "--config", help="YAML run config with an optional sft section (default: "
                     "configs/default.yaml)")
    sft.add_argument("overrides", nargs="*", help="dotted overrides such as sft.batch_size=16 "
                     "learner.lora.enabled=true")
    sft.add_argument("--trajectories", metavar="FILE", help="train on the successful trajectories of a run's "
                     "trajectories.jsonl, from their recorded token ids (sets sft.trajectories; success: `correct`, "
                     "or reward >= sft.min_reward)")
    sft.add_argument("--pairs", metavar="FILE", help="offline DPO on the teacher preference pairs of a run's "
                     "pairs.jsonl against the frozen starting policy (sets sft.pairs; temperature sft.dpo_beta)")
    sft.add_argument("--eval-file", metavar="FILE", help="held-out examples in the training file's format (sets "
                     "sft.eval_data; default: sft.eval_fraction of the training file)")
    sft.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR (with its saved config) from "
                     "its last checkpoint")
    sft.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    sft.set_defaults(func=cmd_sft)

    serve = sub.add_parser("serve", help="serve the Tinker HTTP API (the `tinker` SDK with TINKER_BASE_URL) "
                           "until Ctrl-C")
    serve.add_argument("-c", "--config", help="YAML run config (default: configs/serve.yaml)")
    serve.add_argument("overrides", nargs="*", help="dotted overrides such as serve.host=0.0.0.0")
    serve.add_argument("--port", type=int, help="TCP port (sets serve.port)")
    serve.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="prepare or list cached models")
    models.add_argument("action", choices=["prepare", "list"])
    models.add_argument("names", nargs="*", help="model names (default: all)")
    models.add_argument("--force", action="store_true", help="rebuild even if cached")
    models.add_argument("--verify", action="store_true", help="re-hash cached files")
    models.set_defaults(func=cmd_models)

    teachers = sub.add_parser("teachers", help="local OpenAI-compatible teachers for trace replay: serve (vLLM "
                              "serving a cached model) or oracle (knows the answers, wrong at --error-rate)")
    teachers.add_argument("action", choices=["serve", "oracle"])
    teachers.add_argument("--model", default="smollm2-135m-instruct", help="serve: cached model name or HF directory")
    teachers.add_argument("--name", help="served model name (default: --model; oracle: 'oracle')")
    teachers.add_argument("--port", type=int, default=8001)
    teachers.add_argument("--task", help="oracle: arithmetic (default) or code")
    teachers.add_argument("--error-rate", type=float, help="oracle: probability of a wrong reply (default 0.2)")
    teachers.add_argument("--latency-s", type=float, help="oracle: mean delay of a reply (default 0)")
    teachers.add_argument("--seed", type=int, help="oracle: seed of its random draws (default 0)")
    teachers.add_argument("--code-source", help="oracle: code tasks it knows, an env.task_source (default meshrl)")
    teachers.add_argument("--prompt-template", help="oracle: task.arithmetic.prompt_template of the run "
                          "(default 'What is {a} {op} {b}?')")
    teachers.set_defaults(func=cmd_teachers)

    shards = sub.add_parser("shards", help="list the rollout shards of a run in an object store and verify them "
                            "(exit 1 if any is bad)")
    shards.add_argument("url", help="the store root (diloco.store_url), e.g. file:///shared/dir or s3://bucket/prefix")
    shards.add_argument("--run-id", default="diloco", help="the run under the store root (diloco.run_id)")
    shards.add_argument("--storage-options", metavar="JSON", help="fsspec options as JSON (diloco.storage_options)")
    shards.add_argument("--timeout", type=float, default=120.0, help="seconds per store operation")
    shards.set_defaults(func=cmd_shards)

    report = sub.add_parser("report", help="a run's metrics as a dashboard (report.png) and a summary (report.md); "
                            "with several runs, one overlay and a comparison table (report-compare.png/.md)")
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by `meshrl train`")
    report.add_argument("--out", metavar="DIR", help="where to write (default: the run directory for one run, the "
                        "current directory for several)")
    report.set_defaults(func=cmd_report)

    ref = sub.add_parser("config-reference", help="print every config key with its meaning (Markdown)")
    ref.set_defaults(func=cmd_config_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow flags (`train --overwrite learner.lr=1e-5`): argparse leaves those over
    if extra and (args.command not in ("train", "launch", "plan", "serve", "eval", "sft")
                  or any(e.startswith("-") for e in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    return args.func(args)


def console_main() -> None:
    """The `meshrl` console script."""
    code = main()
    if "monarch" in sys.modules:
        # Meshes are stopped and files closed by now. Leave without interpreter finalisation:
        # tearing down Monarch's and the engines' native threads at exit can abort the process
        # ("FATAL: exception not rethrown") after a run that succeeded.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
