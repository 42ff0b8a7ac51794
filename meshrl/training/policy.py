"""PolicyTrainer: the learner's model, optimiser and Tinker-style forward_backward / optim_step.

Losses are sum-reduced token losses from :mod:`meshrl.losses`; the caller normalises by scaling
advantages or weights (e.g. by 1 / total valid tokens of the step), so accumulating gradients over
micro-batches gives exactly the gradient of one big batch.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from meshrl import losses
from meshrl.config.learner import LearnerConfig
from meshrl.logprobs import token_logprobs_and_entropy
from meshrl.training.batching import pad_datums, split_micro_batches
from meshrl.types import AdamParams, Datum

RL_LOSSES: dict[str, Callable[..., losses.LossOutput]] = {
    "ppo": losses.ppo,
    "importance_sampling": losses.importance_sampling,
    "cispo": losses.cispo,
}
LOSS_NAMES = (*RL_LOSSES, "cross_entropy")


def _combine_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Token-weighted means of per-micro-batch metrics (maxima for `*_max`, sums for `loss`)."""
    total = sum(w for w, _ in parts) or 1.0
    out: dict[str, float] = {}
    for weight, metrics in parts:
        for k, v in metrics.items():
            if k == "loss":
                out[k] = out.get(k, 0.0) + v
            elif k.endswith("_max"):
                out[k] = max(out.get(k, float("-inf")), v)
            else:
                out[k] = out.get(k, 0.0) + v * weight / total
    return out


class PolicyTrainer:
    """An HF causal LM (float32 master weights, optional LoRA) with AdamW."""

    def __init__(self, model_path: Path, cfg: LearnerConfig, autocast_dtype: str = "bfloat16"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.torch_threads)
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        if cfg.lora.enabled:
            from peft import LoraConfig as PeftLoraConfig
            from peft import get_peft_model

            model = get_peft_model(
                model,
                PeftLoraConfig(
                    r=cfg.lora.rank,
                    lora_alpha=cfg.lora.alpha,
                    lora_dropout=cfg.lora.dropout,
                    target_modules=list(cfg.lora.target_modules),
                    bias="none",
                ),
            )
        self.model = model.to(self.device)
        self.model.train()
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.autocast_dtype = getattr(torch, autocast_dtype) if cfg.autocast_bf16 else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
        )
        self.pending_tokens = 0  # valid tokens whose gradients are accumulated but not yet applied
        self.steps_applied = 0  # optimizer steps taken (restored from checkpoints)
        self.reference = None  # frozen initial policy for DPO, loaded on first use

    # ---- forward -------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def valid_logits(self, mb, valid: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] at the N valid model_input positions (row-major over batch, position).
        The vocabulary projection runs only there, in the autocast dtype."""
        with self._autocast():
            hidden = self.model.get_decoder()(
                input_ids=mb.input_ids.to(self.device), attention_mask=mb.attention_mask.to(self.device)
            ).last_hidden_state
            return self.model.get_output_embeddings()(hidden[valid])

    def sequence_logprobs(self, mb, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprob (and entropy) of ``target_tokens`` at every valid model_input position, as [B, T]
        tensors (zero elsewhere); the log-softmax is chunked so no float32 [N, V] tensor is formed."""
        logits = self.valid_logits(mb, valid)
        targets = mb.inputs["target_tokens"].to(self.device)[valid]
        logp_rows, entropy_rows = token_logprobs_and_entropy(logits, targets, chunk_size=self.cfg.logprob_chunk_tokens)
        logp = torch.zeros(valid.shape, dtype=logp_rows.dtype, device=self.device).masked_scatter(valid, logp_rows)
        entropy = torch.zeros(valid.shape, dtype=logp_rows.dtype, device=self.device)
        entropy[valid] = entropy_rows.detach()
        return logp, entropy

    # ---- Tinker-style API ----------------------------------------------------------------
    def forward_backward(self, datums: list[Datum], loss_fn: str, loss_config: dict | None = None) -> dict:
        """Accumulate gradients of the sum-reduced ``loss_fn`` over all datums (micro-batched)."""
        if loss_fn not in LOSS_NAMES:
            raise ValueError(f"unknown loss_fn '{loss_fn}': expected one of {LOSS_NAMES}")
        loss_config = dict(loss_config or {})
        started = time.perf_counter()
        parts: list[tuple[float, dict[str, float]]] = []
        tokens = 0
        for group in split_micro_batches(datums, self.cfg.micro_batch_size):
            mb = pad_datums(group, self.pad_id)
            inputs = {k: v.to(self.device) for k, v in mb.inputs.items()}
            weight_key = "weights" if loss_fn == "cross_entropy" else "mask"
            if weight_key in inputs:
                valid = inputs[weight_key] > 0
            else:
                valid = mb.attention_mask.to(self.device) > 0
            logp, entropy = self.sequence_logprobs(mb, valid)
            if loss_fn == "cross_entropy":
                out = losses.LossOutput(-(logp * inputs["weights"]).sum(), {})
            else:
                out = RL_LOSSES[loss_fn](
                    logp, inputs["logprobs"], inputs["advantages"], mask=inputs.get("mask"), **loss_config
                )
            out.loss.backward()
            n_valid = int(valid.sum())
            metrics = dict(out.metrics)
            metrics["loss"] = float(out.loss.detach())
            metrics["entropy"] = float(entropy.detach()[valid].mean()) if n_valid else 0.0
            parts.append((float(n_valid), metrics))
            tokens += n_valid
        self.pending_tokens += tokens
        result = _combine_metrics(parts)
        result.update(tokens=float(tokens), seconds=time.perf_counter() - started)
        return result

    def optim_step(self, adam: AdamParams) -> dict:
        """Apply the accumulated gradients with AdamW, then clear them."""
        for group in self.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if adam.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in params if p.grad is not None])
            ) if any(p.grad is not None for p in params) else torch.tensor(0.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending_tokens = 0
        self.steps_applied += 1
        return {"grad_norm": float(norm), "lr": adam.learning_rate}

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Logprob of tokens 1..n-1 of each sequence given its prefix, in the training dtype."""
        datums = [Datum.from_sequence(seq) for seq in sequences]
        out = []
        for datum in datums:
            mb = pad_datums([datum], self.pad_id)
            valid = mb.attention_mask.to(self.device) > 0
            logp, _ = self.sequence_logprobs(mb, valid)
            out.append(logp[0].cpu().tolist())
        return out

    # ---- weights for inference -----------------------------------------------------------
    def sync_state_dict(self) -> dict[str, torch.Tensor]:
        """What the learner publishes for readers: the merged weights, or under
        `lora.sync: adapter` only the adapter matrices (readers merge them)."""
        if self.cfg.lora.enabled and self.cfg.lora.sync == "adapter":
            from meshrl.training.lora import adapter_state_dict

            return adapter_state_dict(self.model)
        return self.inference_state_dict()

    @torch.no_grad()
    def inference_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """HF-named weights as the generators load them: LoRA merged. A tied lm_head stays in (as
        an alias of the embedding: the arena stores it once), since vLLM's in-place reload only
        refreshes its head from an explicit `lm_head.weight`."""
        if self.cfg.lora.enabled:
            self.model.merge_adapter()
            try:
                base = self.model.get_base_model()
                state = {
                    k.replace(".base_layer", ""): v.to(dtype).clone()
                    for k, v in base.state_dict().items()
                    if "lora_" not in k
                }
            finally:
                self.model.unmerge_adapter()
        else:
            state = {k: v.to(dtype) for k, v in self.model.state_dict().items()}
        return state
