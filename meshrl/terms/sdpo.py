"""The SDPO term (channel 2): per unit of rollouts, find the error sites of the sampled
trajectories, have the SDPOTeacherActor (the current policy, no grad) score each site's response
tokens under the hinted context, and turn the teacher's top-k into `sdpo_jsd` Datums.

The sites are scored where the trajectories are produced, while the teacher holds the weights
that sampled them (at most `sdpo.max_sites_per_step` a step); the optimizer step's loss gains
``alpha * JSD`` on exactly the error-site tokens (token-mean weights, meshrl.terms.base).
"""

from __future__ import annotations

import torch

from meshrl.config.meshes import SDPO_TEACHER
from meshrl.meshes.dispatch import split_evenly
from meshrl.meshes.ranks import actor_at
from meshrl.sdpo.sites import ErrorSite, select_error_sites
from meshrl.terms.base import DatumTerm, TermContext
from meshrl.types import Datum


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


class SDPOTerm(DatumTerm):
    """Spawns the teacher mesh (a weight reader like the generators) and makes each unit's data."""

    name, prefix, loss = "sdpo_jsd", "sdpo", "sdpo_jsd"
    reads_weights = True

    def __init__(self, ctx: TermContext, weight: float | None = None, params=None):
        super().__init__(ctx, ctx.cfg.sdpo.alpha if weight is None else weight, params)
        self.cfg = ctx.cfg.sdpo
        self.renderer = ctx.renderer
        self.counts: dict[str, int] = {}
        self.client.add_reader(SDPO_TEACHER)
        self.hint_source = None
        if self.cfg.hint_generator.enabled:
            from meshrl.sdpo.hints import llm_hint_source

            self.hint_source = llm_hint_source(self.cfg.hint_generator, self.renderer, self.cfg.call_timeout_s)

    @classmethod
    def spawn(cls, session, cfg) -> None:
        from meshrl.actors.sdpo_teacher import SDPOTeacherActor

        session.spawn(SDPO_TEACHER, SDPOTeacherActor, str(session.model_path), cfg.model, cfg.weight_sync,
                      cfg.learner.torch_threads, procs=cfg.sdpo.mesh.procs, colocate_with=cfg.sdpo.mesh.colocate_with,
                      timeout_s=cfg.sdpo.call_timeout_s)

    def loss_config(self) -> dict:
        return {"beta": self.cfg.jsd_beta, "temperature": self.cfg.temperature, "is_weight_cap": self.cfg.is_weight_cap}

    def make_datums(self, unit, state) -> list[Datum]:
        """At most the step's remaining error sites of the unit's samples, scored; the channel's
        counters (cumulative over the run) go into the unit's metrics."""
        done = state.extra.get("sdpo_sites", 0)
        datums, counts = self.score(unit.sampled, self.cfg.max_sites_per_step - done)
        unit.metrics.update(counts)
        state.extra["sdpo_sites"] = done + len(datums)
        return datums

    def score(self, trajectories: list, limit: int) -> tuple[list[Datum], dict]:
        """`sdpo_jsd` Datums for at most ``limit`` error sites of ``trajectories`` and the channel's counters
        (cumulative over the run). The teacher holds the weights that sampled them."""
        c = self.cfg
        sites, counts = select_error_sites(self.renderer, trajectories, c.hints, limit, self.hint_source)
        if self.hint_source is not None:
            counts.update({f"llm_hint_{k}": v for k, v in self.hint_source.counts.items()})
            self.hint_source.counts.clear()
        for k, v in counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        metrics = {f"sdpo/{k}": float(v) for k, v in self.counts.items()}
        if not sites:
            return [], metrics
        parts = split_evenly(sites, self.client.procs(SDPO_TEACHER))

        def issue(teachers):
            return [actor_at(teachers, r).score_sites.call_one(
                [(s.teacher_tokens, s.teacher_start, s.length) for s in part], c.top_k) for r, part in enumerate(parts)]

        scored = self.client.call(SDPO_TEACHER, "sdpo", issue, f"{SDPO_TEACHER}.score_sites", c.call_timeout_s)
        topk = [t for reply in scored for t in reply["topk"]]
        return [site_datum(s, idx, lp) for s, (idx, lp) in zip(sites, topk)], metrics

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state.get("counts", {}))
