"""The synchronous GRPO loop: prompts -> G samples each -> rewards -> group-relative advantages ->
learner step with sampler logprobs -> publish -> generators pull.

The controller only moves tokens and small records; the actors own the engines and the model.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from meshrl.config.run import RunConfig
from meshrl.controller.supervisor import Supervisor, wait_all
from meshrl.controller.rollouts import Trajectory, build_datums, group_advantages, uniform_groups
from meshrl.engines import SampleRequest

log = logging.getLogger(__name__)
SDPO_TEACHER = "sdpo_teacher"


class StepError(RuntimeError):
    """A step cannot proceed; the message names the mesh and the call."""


def split_evenly(items: list, parts: int) -> list[list]:
    """``parts`` contiguous slices whose sizes differ by at most one (empty slices dropped)."""
    n = len(items)
    bounds = [n * i // parts for i in range(parts + 1)]
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts) if bounds[i] < bounds[i + 1]]


@dataclass
class Counters:
    """Things that were skipped or went wrong, counted over the run."""

    prompts_too_long: int = 0
    empty_generations: int = 0
    reward_errors: int = 0

    def as_metrics(self) -> dict[str, int]:
        return {
            "count/prompts_too_long": self.prompts_too_long,
            "count/empty_generations": self.empty_generations,
            "count/reward_errors": self.reward_errors,
        }


class GRPOLoop:
    """Drives generator, rewarder and learner meshes through synchronous GRPO steps."""

    def __init__(self, cfg: RunConfig, task, renderer, meshes, supervisor: Supervisor, faults=None,
                 replay=None):
        self.cfg = cfg
        self.task = task
        self.renderer = renderer
        self.meshes = meshes
        self.sup = supervisor
        self.faults = faults
        self.counters = Counters()
        self.version = 0
        self.cursor = 0
        self.step_index = 0  # the step being run (1-based once running)
        self.stop_tokens = tuple(renderer.get_stop_sequences())
        self.replay = replay  # channel 3 (ReplayChannel) or None
        self.episode_records: list[dict] = []  # multi-turn episode records not yet written out
        self.sdpo_counts: dict[str, int] = {}
        self.hint_source = None  # LLM hint generator (sdpo.hint_generator), built on first use
        supervisor.on_respawn("generator", self._resync_generators)
        if cfg.sdpo.alpha > 0:
            supervisor.on_respawn(SDPO_TEACHER, lambda: self._pull_teacher_weights(self.version))

    def sync_readers(self, version: int) -> list[dict]:
        """Every weight reader (generators, SDPO teacher) pulls ``version``; generator stats returned."""
        pulls = self.pull_weights(version)
        if self.cfg.sdpo.alpha > 0:
            self._pull_teacher_weights(version)
        return pulls

    def _pull_teacher_weights(self, version: int) -> None:
        self._remote(SDPO_TEACHER, "sync", lambda m: [m.update_weights.call(version)],
                     self.cfg.sdpo.call_timeout_s, f"{SDPO_TEACHER}.update_weights")

    def _resync_generators(self) -> None:
        """A fresh generator mesh starts from the base weights: bring it to the current version."""
        self.pull_weights(self.version)

    def _remote(self, mesh: str, phase: str, issue, timeout_s: float, what: str):
        """Issue a call on mesh ``mesh`` (``issue(actor_mesh)`` returns futures), wait for all of
        them with one deadline, and recover/retry through the supervisor on failure."""

        def attempt():
            if self.faults is not None:
                self.faults.before_call(self.step_index, mesh, phase)
            futures = issue(self.meshes[mesh])
            return wait_all(futures, timeout_s, what, watch=lambda: self.meshes.dead_process(mesh))

        return self.sup.run(mesh, attempt, what)

    # ---- remote helpers --------------------------------------------------------------------
    def _generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list]:
        """Spread prompts over the generator replicas; returns completions per prompt, in order."""
        parts = split_evenly(list(range(len(prompts))), self.meshes.procs_of("generator"))

        def issue(generators):
            futures = []
            for r, idx in enumerate(parts):
                # prompt i of the batch is sampled with seed + i, whichever replica serves it
                part = request if request.seed is None else dataclasses.replace(request, seed=request.seed + idx[0])
                futures.append(generators.slice(procs=r).generate.call_one([prompts[i] for i in idx], part))
            return futures

        batches = self._remote("generator", "generate", issue, self.cfg.generator.generate_timeout_s,
                               "generator.generate")
        return [group for batch in batches for group in batch.completions]

    def _score(self, items: list[tuple[Any, str]]) -> list[tuple[float, dict]]:
        parts = split_evenly(items, self.meshes.procs_of("rewarder"))

        def issue(rewarders):
            return [rewarders.slice(procs=r).score.call_one(part) for r, part in enumerate(parts)]

        scored = self._remote("rewarder", "score", issue, self.cfg.rewarder.timeout_s, "rewarder.score")
        return [s for part in scored for s in part]

    def _learner(self, what: str, call):
        """One learner call (``call(learner_mesh)`` -> future) with the learner deadline."""
        return self._remote("learner", "train", lambda m: [call(m)], self.cfg.learner.call_timeout_s,
                            f"learner.{what}")[0]

    def pull_weights(self, version: int) -> list[dict]:
        pulls = self._remote("generator", "sync", lambda g: [g.update_weights.call(version)],
                             self.cfg.learner.call_timeout_s, "generator.update_weights")[0]
        pulls = list(pulls.values())
        stale = [p["version"] for p in pulls if p["version"] != version]
        if stale:
            raise StepError(f"generator.update_weights returned versions {stale}, expected {version}")
        return pulls

    def _prompt_tokens(self, problems: list) -> tuple[list, list[list[int]]]:
        """Rendered prompts; problems whose prompt cannot fit with a full response are skipped."""
        limit = self.cfg.model.max_model_len - self.cfg.generator.sampling.max_new_tokens
        kept, prompts = [], []
        for p in problems:
            tokens = self.renderer.build_generation_prompt(list(p.messages))
            if len(tokens) > limit:
                self.counters.prompts_too_long += 1
                log.warning("skipping problem %s: prompt of %d tokens exceeds %d (model.max_model_len - "
                            "max_new_tokens)", p.id, len(tokens), limit)
                continue
            kept.append(p)
            prompts.append(tokens)
        return kept, prompts

    def sampling_seed(self, cursor: int) -> int:
        """Seed of the batch starting at data position ``cursor``: a rerun of the same step (e.g.
        after a resume) samples exactly the same tokens given the same weights."""
        return (self.cfg.generator.seed * 1_000_003 + cursor * 7919) % (2**31 - 1)

    # ---- stages -----------------------------------------------------------------------------
    def _episodes(self, tasks: list, group_size: int, request: SampleRequest, tag: str):
        """Multi-turn episodes in the env mesh; a failed env mesh is replaced and the whole batch of
        episodes replayed (it is seeded, so the retry samples the same tokens)."""
        from meshrl.controller.multiturn import ENV, run_episodes

        trajectories, records = self.sup.run(ENV, lambda: run_episodes(self, tasks, group_size, request, tag),
                                             f"{ENV} episodes")
        self.episode_records.extend(records)
        return trajectories

    def _rollout_code(self) -> tuple[list[Trajectory], dict]:
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        cursor = self.cursor
        tasks = self.task.train_batch(cursor, tc.prompts_per_step)
        self.cursor += tc.prompts_per_step
        s = self.cfg.generator.sampling
        request = SampleRequest(n=1, max_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                stop_token_ids=self.stop_tokens, seed=self.sampling_seed(cursor))
        trajectories = self._episodes(tasks, tc.group_size, request, f"train{cursor}")
        n = max(len(trajectories), 1)
        gen_tokens = sum(t.sampled_tokens for t in trajectories)
        elapsed = time.perf_counter() - t0
        return trajectories, {
            "timing/generate_s": elapsed,
            "gen/tokens": gen_tokens,
            "gen/tokens_per_s": gen_tokens / max(elapsed, 1e-9),
            "episodes/mean_turns": sum(len(t.info["turns"]) for t in trajectories) / n,
            "episodes/success": sum(bool(t.info["correct"]) for t in trajectories) / n,
        }

    def rollout(self) -> tuple[list[Trajectory], dict]:
        """Sample G completions (or G multi-turn episodes) per problem and score them."""
        if self.cfg.task.kind == "code":
            return self._rollout_code()
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        problems = self.task.train_batch(self.cursor, tc.prompts_per_step)
        self.cursor += tc.prompts_per_step
        problems, prompts = self._prompt_tokens(problems)
        s = self.cfg.generator.sampling
        request = SampleRequest(n=tc.group_size, max_tokens=s.max_new_tokens, temperature=s.temperature,
                                top_p=s.top_p, stop_token_ids=self.stop_tokens,
                                seed=self.sampling_seed(self.cursor - tc.prompts_per_step))
        completions = self._generate(prompts, request) if prompts else []
        t1 = time.perf_counter()
        trajectories: list[Trajectory] = []
        for g, (problem, prompt, group) in enumerate(zip(problems, prompts, completions)):
            for k, c in enumerate(group):
                if not c.tokens:
                    self.counters.empty_generations += 1
                trajectories.append(Trajectory(
                    id=f"{problem.id}-s{k}", group=g, problem=problem, prompt_tokens=prompt,
                    tokens=list(c.tokens), logprobs=list(c.logprobs), mask=[1] * len(c.tokens),
                    version=c.meta.get("version", self.version), response_text=c.text,
                    finish_reason=c.finish_reason,
                ))
        scores = self._score([(t.problem, t.response_text) for t in trajectories]) if trajectories else []
        for t, (reward, info) in zip(trajectories, scores):
            t.reward, t.info = reward, info
            if "error" in info:
                self.counters.reward_errors += 1
                log.warning("reward for %s failed: %s", t.id, info["error"])
        t2 = time.perf_counter()
        gen_tokens = sum(t.sampled_tokens for t in trajectories)
        return trajectories, {
            "timing/generate_s": t1 - t0,
            "timing/reward_s": t2 - t1,
            "gen/tokens": gen_tokens,
            "gen/tokens_per_s": gen_tokens / max(t1 - t0, 1e-9),
            "gen/mean_length": gen_tokens / max(len(trajectories), 1),
            "gen/stopped_fraction": sum(t.finish_reason == "stop" for t in trajectories) / max(len(trajectories), 1),
        }

    def train(self, trajectories: list[Trajectory]) -> dict:
        """One optimizer step on the trajectories (channel 1: ppo / importance sampling / cispo)."""
        t0 = time.perf_counter()
        tc = self.cfg.trainer
        advantages = group_advantages(trajectories, tc.advantage.std_normalize)
        datums, stats = build_datums(trajectories, advantages, tc.loss.normalize)
        metrics: dict[str, Any] = {f"batch/{k}": v for k, v in stats.items()}
        grpo_loss = 0.0
        if datums:
            loss_config = self._loss_config()
            fb = self._learner("forward_backward",
                               lambda m: m.forward_backward.call_one(datums, tc.loss.name, loss_config))
            metrics.update({f"train/{k}": v for k, v in fb.items()})
            grpo_loss = fb["loss"]
        metrics["loss/grpo"] = grpo_loss
        total = grpo_loss
        if self.cfg.sdpo.alpha > 0:
            sdpo = self._sdpo(trajectories)
            metrics.update(sdpo)
            total += self.cfg.sdpo.alpha * sdpo["loss/sdpo_jsd"]
        if self.replay is not None:
            dpo = self._replay_dpo()
            metrics.update(dpo)
            total += self.cfg.replay.beta * dpo["loss/replay_dpo"]
        metrics["loss/total"] = total
        adam = self.cfg.learner.adam_params()
        opt = self._learner("optim_step", lambda m: m.optim_step.call_one(adam))
        metrics.update({f"train/{k}": v for k, v in opt.items()})
        metrics["timing/train_s"] = time.perf_counter() - t0
        return metrics

    def _sdpo(self, trajectories: list[Trajectory]) -> dict:
        """Channel 2: score the step's error sites with the hinted teacher, then add alpha * JSD."""
        from meshrl.channels.sdpo import select_error_sites
        from meshrl.training.channel_losses import SDPOItem

        c = self.cfg.sdpo
        if c.hint_generator.enabled and self.hint_source is None:
            from meshrl.controller.hinting import llm_hint_source

            self.hint_source = llm_hint_source(c.hint_generator, self.renderer, c.call_timeout_s)
        sites, counts = select_error_sites(self.renderer, trajectories, c.hints, c.max_sites_per_step,
                                           self.hint_source)
        if self.hint_source is not None:
            counts.update({f"llm_hint_{k}": v for k, v in self.hint_source.counts.items()})
            self.hint_source.counts.clear()
        for k, v in counts.items():
            self.sdpo_counts[k] = self.sdpo_counts.get(k, 0) + v
        out = {f"sdpo/{k}": float(v) for k, v in self.sdpo_counts.items()}
        out["loss/sdpo_jsd"] = 0.0
        if not sites:
            return out
        parts = split_evenly(sites, self.meshes.procs_of(SDPO_TEACHER))

        def issue(teachers):
            return [teachers.slice(procs=r).score_sites.call_one(
                [(s.teacher_tokens, s.teacher_start, s.length) for s in part], c.top_k) for r, part in enumerate(parts)]

        scored = self._remote(SDPO_TEACHER, "sdpo", issue, c.call_timeout_s, f"{SDPO_TEACHER}.score_sites")
        topk = [t for reply in scored for t in reply["topk"]]
        items = [SDPOItem(s.student_tokens, s.student_start, s.length, idx, lp, s.sampler_logprobs)
                 for s, (idx, lp) in zip(sites, topk)]
        normaliser = float(sum(s.length for s in sites))
        fb = self._learner("forward_backward_sdpo", lambda m: m.forward_backward_sdpo.call_one(
            items, c.alpha, c.jsd_beta, c.temperature, normaliser, c.is_weight_cap))
        out.update({f"sdpo/{k}": v for k, v in fb.items() if k != "jsd"})
        out["loss/sdpo_jsd"] = fb["jsd"]
        return out

    def _replay_dpo(self) -> dict:
        """Channel 3: train on the DPO pairs that have arrived (never waits for teachers)."""
        c = self.cfg.replay
        out = self.replay.drain(self.version)
        items = self.replay.take(c.max_pairs_per_step)
        out["loss/replay_dpo"] = 0.0
        if items:
            fb = self._learner("forward_backward_dpo",
                               lambda m: m.forward_backward_dpo.call_one(items, c.beta, c.dpo_beta))
            out.update({f"dpo/{k}": v for k, v in fb.items() if k != "loss"})
            out["loss/replay_dpo"] = fb["loss"]
        return out

    def sync_weights(self) -> dict:
        """Publish the learner's weights as the next version and have every generator pull them."""
        t0 = time.perf_counter()
        version = self.version + 1
        pub = self._learner("publish", lambda m: m.publish.call_one(version))
        self.version = version
        t1 = time.perf_counter()
        pulls = self.sync_readers(version)
        t2 = time.perf_counter()
        pull_s = max(p["pull_s"] for p in pulls)
        nbytes = pub["bytes"]
        return {
            "version": self.version,
            "sync/publish_s": pub["publish_s"],
            "sync/pull_s": pull_s,
            "sync/load_s": max(p["load_s"] for p in pulls),
            "sync/bytes": nbytes,
            "sync/pull_gbps": nbytes / max(pull_s, 1e-9) / 1e9,
            "timing/sync_s": t2 - t0,
            "timing/publish_s": t1 - t0,
        }

    def evaluate(self) -> dict:
        """Greedy accuracy on the held-out problems (episode success rate for code tasks)."""
        t0 = time.perf_counter()
        if self.cfg.task.kind == "code":
            request = SampleRequest(n=1, max_tokens=self.cfg.generator.sampling.max_new_tokens, temperature=0.0,
                                    stop_token_ids=self.stop_tokens)
            held = self.task.heldout(self.cfg.trainer.eval.size)
            trajectories = self._episodes(held, 1, request, f"eval{self.version}")
            n = max(len(trajectories), 1)
            return {"eval/accuracy": sum(bool(t.info["correct"]) for t in trajectories) / n,
                    "eval/reward_mean": sum(t.reward for t in trajectories) / n,
                    "eval/n": len(trajectories), "timing/eval_s": time.perf_counter() - t0}
        problems, prompts = self._prompt_tokens(self.task.heldout(self.cfg.trainer.eval.size))
        request = SampleRequest(n=1, max_tokens=self.cfg.generator.sampling.max_new_tokens, temperature=0.0,
                                stop_token_ids=self.stop_tokens)
        completions = self._generate(prompts, request)
        scores = self._score([(p, c[0].text) for p, c in zip(problems, completions)])
        correct = sum(1 for _, info in scores if info.get("correct"))
        return {
            "eval/accuracy": correct / max(len(problems), 1),
            "eval/reward_mean": sum(r for r, _ in scores) / max(len(scores), 1),
            "eval/n": len(problems),
            "timing/eval_s": time.perf_counter() - t0,
        }

    def step(self) -> tuple[dict, list[Trajectory]]:
        """One full synchronous GRPO step; returns its metrics and trajectories."""
        t0 = time.perf_counter()
        self.step_index += 1
        if self.faults is not None:
            self.faults.before_call(self.step_index, "*", "step_start")
        trajectories, metrics = self.rollout()
        rewards = [t.reward for t in trajectories]
        n = max(len(rewards), 1)
        mean = sum(rewards) / n
        metrics.update({
            "reward/mean": mean,
            "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            "accuracy": sum(bool(t.info.get("correct")) for t in trajectories) / n,
            "batch/uniform_groups": len(uniform_groups(trajectories)),
            "batch/trajectories": len(trajectories),
            "batch/groups": len({t.group for t in trajectories}),
        })
        if self.replay is not None:
            self.replay.submit(trajectories, self.version)
        metrics.update(self.train(trajectories))
        metrics.update(self.sync_weights())
        metrics.update(self.counters.as_metrics())
        metrics.update(self.sup.metrics())
        metrics["timing/step_s"] = time.perf_counter() - t0
        return metrics, trajectories

    def state_dict(self) -> dict:
        """Controller-side training state for checkpoints (JSON-able)."""
        state = {"cursor": self.cursor, "version": self.version, "step_index": self.step_index,
                 "counters": dataclasses.asdict(self.counters), "sdpo_counts": dict(self.sdpo_counts)}
        if self.replay is not None:
            state["replay"] = self.replay.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.cursor = int(state["cursor"])
        self.version = int(state["version"])
        self.step_index = int(state["step_index"])
        self.counters = Counters(**state["counters"])
        self.sdpo_counts = dict(state.get("sdpo_counts", {}))
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])

    def _loss_config(self) -> dict:
        loss = self.cfg.trainer.loss
        if loss.name == "ppo":
            return {"eps_low": loss.eps_low, "eps_high": loss.eps_high}
        if loss.name == "cispo":
            return {"clip_high": loss.cispo_clip_high}
        return {}
