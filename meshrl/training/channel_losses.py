"""The learner side of channels 2 and 3: gradient passes that add `alpha * SDPO JSD` and
`beta * trace-replay DPO` to the gradients already accumulated for the GRPO loss, so one
`optim_step` applies the total loss = grpo + alpha * jsd + beta * dpo.

Inputs are token sequences only (token-in/token-out): SDPO items carry the student's exact tokens
and the teacher's top-k log-probabilities at the error-site positions; DPO items carry the prompt
tokens, the teacher's chosen answer (encoded once, it never existed as tokens) and the student's
own sampled tokens as the rejected answer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from meshrl import losses
from meshrl.training.batching import pad_datums
from meshrl.types import Datum


@dataclass
class SDPOItem:
    """One error site to distil: ``tokens[start:start+length]`` are the student's response tokens."""

    tokens: list[int]
    start: int
    length: int
    teacher_indices: torch.Tensor  # [length, k] int (k = V and indices = arange(V) for the full vocabulary)
    teacher_logprobs: torch.Tensor  # [length, k] float, log-softmax at temperature 1
    sampler_logprobs: list[float]


@dataclass
class DPOItem:
    """One preference pair for the same prompt (all token ids)."""

    key: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def _span_datum(tokens: list[int], start: int, length: int) -> Datum:
    """A datum whose valid positions predict exactly ``tokens[start:start+length]``."""
    mask = [0] * start + [1] * length + [0] * (len(tokens) - start - length)
    return Datum.from_sequence(tokens, mask=mask)


def _chunks(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def sdpo_forward_backward(trainer, items: list[SDPOItem], weight: float, beta: float, temperature: float,
                          normaliser: float, is_weight_cap: float = 0.0) -> dict:
    """Accumulate gradients of ``weight * sum_tokens JSD / normaliser`` over the error sites.
    Returns the unweighted mean JSD per error-site token and the top-k mass metrics."""
    total, tokens, parts = 0.0, 0, []
    for group in _chunks(items, trainer.cfg.micro_batch_size):
        mb = pad_datums([_span_datum(i.tokens, i.start, i.length) for i in group], trainer.pad_id)
        valid = mb.inputs["mask"].to(trainer.device) > 0
        logits = trainer.valid_logits(mb, valid)
        indices = torch.cat([i.teacher_indices for i in group]).to(trainer.device)
        teacher = torch.cat([i.teacher_logprobs for i in group]).to(trainer.device)
        token_weights = None
        if is_weight_cap > 0:
            with torch.no_grad():
                targets = mb.inputs["target_tokens"].to(trainer.device)[valid]
                logp = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
                old = torch.tensor([x for i in group for x in i.sampler_logprobs], device=trainer.device)
                token_weights = torch.exp(logp - old).clamp(max=is_weight_cap)
        out = losses.generalized_jsd_topk(logits, indices, teacher, beta=beta, temperature=temperature,
                                          reduction="sum", token_weights=token_weights)
        (out.loss * (weight / normaliser)).backward()
        total += float(out.loss.detach())
        tokens += int(valid.sum())
        parts.append(out.metrics)
    mass = {k: sum(p.get(k, 0.0) for p in parts) / max(len(parts), 1)
            for k in ("teacher_topk_mass", "student_topk_mass")}
    return {"jsd": total / max(normaliser, 1e-9), "tokens": float(tokens), "sites": float(len(items)), **mass}


def _sum_logprobs(trainer, sequences: list[tuple[list[int], int]], grad: bool) -> torch.Tensor:
    """Sum of log p over tokens ``seq[start:]`` of each (seq, start), as a [P] tensor."""
    datums = [_span_datum(seq, start, len(seq) - start) for seq, start in sequences]
    context = contextlib.nullcontext() if grad else torch.no_grad()
    with context:
        mb = pad_datums(datums, trainer.pad_id)
        valid = mb.inputs["mask"].to(trainer.device) > 0
        logp, _ = trainer.sequence_logprobs(mb, valid)
        return logp.sum(dim=1)


@contextlib.contextmanager
def reference_policy(trainer):
    """The frozen initial policy: LoRA adapters switched off, or (full fine-tuning) a frozen copy
    of the initial weights, loaded on first use so a run without DPO never pays for it."""
    if trainer.cfg.lora.enabled:
        with trainer.model.disable_adapter():
            yield trainer
        return
    if trainer.reference is None:
        from transformers import AutoModelForCausalLM

        ref = AutoModelForCausalLM.from_pretrained(trainer.model_path, dtype=torch.float32).to(trainer.device)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        trainer.reference = ref
    live = trainer.model
    trainer.model = trainer.reference
    try:
        yield trainer
    finally:
        trainer.model = live


def dpo_forward_backward(trainer, items: list[DPOItem], weight: float, dpo_beta: float) -> dict:
    """Accumulate gradients of ``weight * mean_pairs DPO loss`` (reference = initial policy)."""
    if not items:
        return {"loss": 0.0, "pairs": 0.0}
    parts = []
    total = 0.0
    for group in _chunks(items, max(1, trainer.cfg.micro_batch_size // 2)):
        chosen = [(i.prompt + i.chosen, len(i.prompt)) for i in group]
        rejected = [(i.prompt + i.rejected, len(i.prompt)) for i in group]
        with reference_policy(trainer) as ref:
            ref_c, ref_r = _sum_logprobs(ref, chosen, grad=False), _sum_logprobs(ref, rejected, grad=False)
        pol_c, pol_r = _sum_logprobs(trainer, chosen, grad=True), _sum_logprobs(trainer, rejected, grad=True)
        out = losses.dpo(pol_c, pol_r, ref_c, ref_r, beta=dpo_beta)
        (out.loss * (weight / len(items))).backward()
        total += float(out.loss.detach())
        parts.append((len(group), out.metrics))
    n = len(items)
    accuracy = sum(m["reward_accuracy"] * k for k, m in parts) / n
    margin = sum(m["reward_margin"] * k for k, m in parts) / n
    return {"loss": total / n, "pairs": float(n), "reward_accuracy": accuracy, "reward_margin": margin}
