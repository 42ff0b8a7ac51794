"""Controller side of channel 2 (SDPO): per step, find the error sites of the sampled trajectories,
have the SDPOTeacherActor (the current policy, no grad) score each site's response tokens under
the hinted context, and turn the teacher's top-k into `sdpo_jsd` Datums for the learner.

The sites are scored where the trajectories are produced, while the teacher holds the weights
that sampled them; the optimizer step's loss gains ``alpha * JSD`` on exactly the error-site
tokens: ``alpha / (site tokens of the step)`` is each site token's weight in the Datum, so the
learner's sum-reduced loss is alpha times the per-token mean.
"""

from __future__ import annotations

import torch

from meshrl.config.meshes import SDPO_TEACHER
from meshrl.config.sdpo import SDPOConfig
from meshrl.controller.dispatch import split_evenly
from meshrl.controller.mesh_client import MeshClient
from meshrl.meshes.ranks import actor_at
from meshrl.sdpo.sites import ErrorSite, select_error_sites
from meshrl.types import Datum


def site_datum(site: ErrorSite, indices: torch.Tensor | None, logprobs: torch.Tensor) -> Datum:
    """The student's sequence with the teacher's top-k ([length, k]; indices None = the full
    vocabulary) placed at the site's tokens, weight 1 on each of them (:meth:`SDPOChannel.weighted`
    sets the step's weights) and the sampler's logprobs for the optional IS weight."""
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


class SDPOChannel:
    """Spawns the teacher mesh (a weight reader like the generators) and builds each step's data."""

    def __init__(self, cfg: SDPOConfig, client: MeshClient, renderer):
        self.cfg, self.client, self.renderer = cfg, client, renderer
        self.counts: dict[str, int] = {}
        client.add_reader(SDPO_TEACHER)
        self.hint_source = None
        if cfg.hint_generator.enabled:
            from meshrl.sdpo.hints import llm_hint_source

            self.hint_source = llm_hint_source(cfg.hint_generator, renderer, cfg.call_timeout_s)

    @staticmethod
    def spawn(meshes, cfg, model_path: str) -> None:
        from meshrl.actors.sdpo_teacher import SDPOTeacherActor

        meshes.add_mesh(SDPO_TEACHER, cfg.sdpo.mesh.procs, cfg.sdpo.mesh.colocate_with)
        meshes.spawn(SDPO_TEACHER, SDPOTeacherActor, model_path, cfg.model, cfg.weight_sync, cfg.learner.torch_threads)

    def loss_config(self) -> dict:
        return {"beta": self.cfg.jsd_beta, "temperature": self.cfg.temperature, "is_weight_cap": self.cfg.is_weight_cap}

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

    def weighted(self, datums: list[Datum]) -> list[Datum]:
        """The datums of one optimizer step, each site token weighted alpha / (site tokens of all of
        them), so the loss is alpha times the per-token mean JSD."""
        tokens = sum(float((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums)
        for d in datums:
            d.loss_fn_inputs["mask"] = (d.loss_fn_inputs["mask"] != 0).float() * (self.cfg.alpha / tokens)
        return datums

    def state_dict(self) -> dict:
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = dict(state.get("counts", {}))
