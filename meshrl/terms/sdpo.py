"""The SDPO term (channel 2): per unit of rollouts, find the error sites of the sampled
trajectories (every failing turn of an episode, at most `sdpo.max_sites_per_episode` of one and
`sdpo.candidates_per_site` times the step's budget in all), have the hinted teacher (the current
policy, no grad) score each site's response tokens under the hinted context (the sites' shared
prefixes forwarded once), keep the budget's worth where the teacher and the student disagree most
(meshrl.sdpo.selection), and turn the teacher's top-k into `sdpo_jsd` Datums; the optimizer
step's loss gains ``alpha * JSD`` on exactly the error-site tokens (token-mean weights,
meshrl.terms.base), alpha warmed up from 0 (`sdpo.alpha_warmup_steps`). The budget is
`sdpo.max_sites_per_step`, or with `sdpo.cost_share` what the channel's measured cost allows.

Where the teacher runs (`sdpo.teacher`): `mesh` = the SDPOTeacherActor mesh, a weight reader like
the generators, which scores the sites where the trajectories are produced, while it holds the
weights that sampled them; `learner` = the learner's own processes, which hold the current weights
already, just before the optimizer step (no extra mesh, no extra weight pull).
"""

from __future__ import annotations

import time

import torch

from meshrl.config.meshes import SDPO_TEACHER
from meshrl.meshes.dispatch import split_evenly
from meshrl.meshes.ranks import actor_at
from meshrl.sdpo.schedule import warmup_weight
from meshrl.sdpo.selection import ScoredSite, candidates, disagreement, most_informative, next_budget
from meshrl.sdpo.sites import ErrorSite, select_error_sites
from meshrl.terms.base import DatumTerm, TermContext, add_metrics, token_mean_weights
from meshrl.types import Datum, LossPart


def site_datum(site: ErrorSite, indices: torch.Tensor | None, logprobs: torch.Tensor) -> Datum:
    """The student's sequence with the teacher's top-k ([length, k]; indices None = the full
    vocabulary) placed at the site's tokens, weight 1 on each of them (the term sets a step's
    weights: `token_mean_weights`) and the sampler's logprobs for the optional IS weight."""
    n, start, length = len(site.student_tokens), site.student_start, site.length

    def at_site(rows: torch.Tensor) -> torch.Tensor:
        full = torch.zeros((n, rows.shape[-1]), dtype=rows.dtype)
        full[start : start + length] = rows
        return full

    mask = torch.zeros(n)
    mask[start : start + length] = 1.0
    sampler = torch.zeros(n)
    sampler[start : start + length] = torch.tensor(site.sampler_logprobs, dtype=torch.float32)
    teacher = {"teacher_topk_logprobs": at_site(logprobs)}
    if indices is not None:
        teacher["teacher_topk_indices"] = at_site(indices.long())
    return Datum.from_sequence(site.student_tokens, mask=mask, logprobs=sampler, **teacher)


def teacher_datum(site: ErrorSite) -> Datum:
    """The hinted teacher's sequence, `mask` on the positions that predict the site's response
    tokens: what the learner scores when it is the teacher."""
    mask = torch.zeros(len(site.teacher_tokens))
    mask[site.teacher_start : site.teacher_start + site.length] = 1.0
    return Datum.from_sequence(site.teacher_tokens, mask=mask)


class SDPOTerm(DatumTerm):
    """Selects each unit's error sites and has them scored (see the module docstring)."""

    name, prefix, loss = "sdpo_jsd", "sdpo", "sdpo_jsd"

    def __init__(self, ctx: TermContext, weight: float | None = None, params=None):
        super().__init__(ctx, ctx.cfg.sdpo.alpha if weight is None else weight, params)
        self.alpha = self.weight
        self.cfg = ctx.cfg.sdpo
        env = ctx.cfg.task.env if ctx.cfg.task.kind == "env" else None
        self.hints = {**self.cfg.hints, **(env.hints if env is not None else {})}  # the environment's own first
        self.on_learner = self.cfg.teacher == "learner"
        self.renderer = ctx.renderer
        self.counts: dict[str, int] = {}
        self.budget = self.cfg.max_sites_per_step
        """Sites a step may train (`sdpo.cost_share` adapts it after each step)."""
        self.trained_sites = 0
        self.cost_s = 0.0  # the step's channel seconds on the learner's side
        self.step_started = 0.0
        if not self.on_learner:
            self.client.add_reader(SDPO_TEACHER)
        self.hint_source = None
        if self.cfg.hint_generator.enabled:
            from meshrl.sdpo.hints import llm_hint_source

            self.hint_source = llm_hint_source(self.cfg.hint_generator, self.renderer, self.cfg.call_timeout_s)

    @classmethod
    def reads_weights(cls, cfg) -> bool:
        return cfg.sdpo.teacher == "mesh"

    @classmethod
    def spawn(cls, session, cfg) -> None:
        if cfg.sdpo.teacher != "mesh":
            return
        from meshrl.actors.sdpo_teacher import SDPOTeacherActor

        session.spawn(SDPO_TEACHER, SDPOTeacherActor, str(session.model_path), cfg.model, cfg.weight_sync,
                      cfg.learner.torch_threads, procs=cfg.sdpo.mesh.procs, colocate_with=cfg.sdpo.mesh.colocate_with,
                      timeout_s=cfg.sdpo.call_timeout_s)

    def loss_config(self) -> dict:
        c = self.cfg
        return {"beta": c.jsd_beta, "temperature": c.temperature, "is_weight_cap": c.is_weight_cap,
                "token_clip": c.token_clip}

    def weight_at(self, step: int) -> float:
        """The term's weight at ``step``: alpha after its warm-up."""
        return warmup_weight(self.alpha, self.cfg.alpha_warmup_steps, step)

    def start_step(self, step: int) -> None:
        super().start_step(step)
        self.weight = self.weight_at(step)
        self.trained_sites, self.cost_s, self.step_started = 0, 0.0, time.perf_counter()

    def make_datums(self, unit, state) -> list:
        """At most the step's remaining candidate error sites of the unit's samples (none while
        the weight is 0), scored by the teacher mesh (`ScoredSite`s), or, with the teacher in the
        learner, left for `finish` to score; the channel's counters (cumulative over the run) go
        into the unit's metrics."""
        if self.weight_at(state.step) == 0:
            return []
        done = state.extra.get("sdpo_sites", 0)
        started = time.perf_counter()
        limit = max(candidates(self.budget, self.cfg.candidates_per_site) - done, 0)
        sites, metrics = self.select(unit.sampled, limit)
        unit.metrics.update(metrics)
        unit.metrics["timing/sdpo_select_s"] = time.perf_counter() - started
        state.extra["sdpo_sites"] = done + len(sites)
        if self.on_learner or not sites:
            return sites
        started = time.perf_counter()
        scored = self.score_on_mesh(sites)
        unit.metrics["timing/sdpo_teacher_s"] = time.perf_counter() - started
        return scored

    def finish(self, version: int, metrics: dict) -> LossPart:
        """The gathered sites scored (the teacher in the learner: now, by the current weights),
        the most informative of them that the step's budget still allows as the term's part."""
        gathered, self.gathered = self.gathered, []
        if self.trained_sites >= self.budget:
            gathered = []  # the step's budget is spent (an earlier optimizer step of it): nothing more is scored
        if self.on_learner and gathered:
            started = time.perf_counter()
            gathered = self.score_on_learner(gathered)
            seconds = time.perf_counter() - started
            self.cost_s += seconds
            metrics["timing/sdpo_teacher_s"] = metrics.get("timing/sdpo_teacher_s", 0.0) + seconds
        kept, dropped = most_informative(gathered, self.budget - self.trained_sites)
        self.trained_sites += len(kept)
        if gathered:
            add_metrics(metrics, {"sdpo/scored_sites": float(len(gathered)), "sdpo/trained_sites": float(len(kept))})
            metrics.update({"sdpo/disagreement_kept": _mean([s.disagreement for s in kept]),
                            "sdpo/disagreement_dropped": _mean([s.disagreement for s in dropped])})
        datums = [site_datum(s.site, s.indices, s.logprobs) for s in kept]
        return self.part(token_mean_weights(datums, self.weight) if datums else [])

    def trained(self, part: LossPart, result: dict, metrics: dict) -> float:
        self.cost_s += result["seconds"] * result["pass_share"]
        return super().trained(part, result, metrics)

    def end_step(self, output, metrics: dict) -> None:
        """With `sdpo.cost_share`, the next step's budget from this step's cost per site trained."""
        metrics["sdpo/site_budget"] = float(self.budget)
        metrics["sdpo/cost_s"] = self.cost_s
        if self.cfg.cost_share and self.trained_sites and self.cost_s > 0:
            self.budget = next_budget(self.cfg.cost_share, time.perf_counter() - self.step_started, self.cost_s,
                                      self.trained_sites, self.cfg.max_sites_per_step)

    def select(self, trajectories: list, limit: int) -> tuple[list[ErrorSite], dict]:
        """At most ``limit`` error sites of ``trajectories`` with their hints, and the channel's
        counters (cumulative over the run)."""
        c = self.cfg
        sites, counts = select_error_sites(self.renderer, trajectories, self.hints, limit, c.max_sites_per_episode,
                                           self.hint_source)
        if self.hint_source is not None:
            counts.update({f"llm_hint_{k}": v for k, v in self.hint_source.counts.items()})
            self.hint_source.counts.clear()
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        return sites, {f"sdpo/{k}": float(v) for k, v in self.counts.items()}

    def score_on_mesh(self, sites: list[ErrorSite]) -> list[ScoredSite]:
        """``sites`` scored by the teacher mesh (which holds the weights that sampled them)."""
        c = self.cfg
        parts = split_evenly(sites, self.client.procs(SDPO_TEACHER))

        def issue(teachers):
            return [actor_at(teachers, r).score_sites.call_one(
                [(s.teacher_tokens, s.teacher_start, s.length) for s in part], c.top_k, c.min_shared_prefix)
                for r, part in enumerate(parts)]

        scored = self.client.call(SDPO_TEACHER, "sdpo", issue, f"{SDPO_TEACHER}.score_sites", c.call_timeout_s)
        return _scored(sites, [t for reply in scored for t in reply["topk"]])

    def score_on_learner(self, sites: list[ErrorSite]) -> list[ScoredSite]:
        """``sites`` scored by the learner's current weights."""
        return _scored(sites, self.client.topk_logprobs([teacher_datum(s) for s in sites], self.cfg.top_k,
                                                        self.cfg.min_shared_prefix))

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts), "budget": self.budget}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state.get("counts", {}))
        self.budget = int(state.get("budget", self.cfg.max_sites_per_step))


def _scored(sites: list[ErrorSite], replies: list[tuple]) -> list[ScoredSite]:
    """``sites`` with the teacher's replies: (top-k indices, their log-probs, the site tokens' log-probs)."""
    if len(replies) != len(sites):
        raise ValueError(f"the SDPO teacher scored {len(replies)} sites of {len(sites)}")
    return [ScoredSite(s, idx, lp, disagreement(s.sampler_logprobs, own)) for s, (idx, lp, own) in zip(sites, replies)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
