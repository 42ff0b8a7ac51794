"""PolicyTrainer: the learner's model, optimiser and Tinker-style forward_backward / optim_step.

The trainer is algorithm-blind: a loss is a name in :mod:`meshrl.losses.registry`, and the trainer
only pads datums into micro-batches, hands each to the loss as a :class:`MicroBatchPass` (logits,
logprobs, reference logprobs on demand) and backpropagates the loss it returns. Losses are
sum-reduced; the caller normalises through the datums' weights, or through `scale_grads` once a
step-wide count is known (e.g. 1 / total valid tokens of the step), so accumulating gradients over
micro-batches gives exactly the gradient of one big batch.
"""

from __future__ import annotations

import contextlib
import functools
import time
from pathlib import Path
from typing import Callable

import torch

from meshrl import losses
from meshrl.config.learner import LearnerConfig
from meshrl.logprobs import token_logprobs_and_entropy, topk_logprobs
from meshrl.training.batching import MicroBatch, pad_datums, split_micro_batches
from meshrl.training.shared_pass import SharedForward, first_reader_tokens, pack_shared
from meshrl.training.data_parallel import DataParallel, DataParallelSpec, ValidLogits, local_value
from meshrl.training.gpu_budget import claim_device
from meshrl.training.memory import release_free_heap, reset_peak, resident_gib, set_mmap_threshold
from meshrl.training.prefix_scoring import topk_at_positions
from meshrl.training.prefix_trees import attention_tokens, layout
from meshrl.training.optimizers import ADAMW, make_optimizer, set_step_params
from meshrl.training.tenants import LoraTenants, TrainState
from meshrl.transport.shards import Shard, layer_group
from meshrl.types import AdamParams, Datum, DimuonParams, LossPart

CustomLoss = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict]]
"""``fn(datums, logprobs) -> (loss, metrics)``: ``logprobs[i]`` is the [length] log-probability of
datum i's target tokens (differentiable); used by :meth:`PolicyTrainer.forward_backward_custom`."""


def combine_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Weighted means of per-micro-batch metrics (maxima for `*_max`; sums for `loss` and `num_*`)."""
    total = sum(w for w, _ in parts) or 1.0
    out: dict[str, float] = {}
    for weight, metrics in parts:
        for k, v in metrics.items():
            if k == "loss" or k.startswith("num_"):
                out[k] = out.get(k, 0.0) + v
            elif k.endswith("_max"):
                out[k] = max(out.get(k, float("-inf")), v)
            else:
                out[k] = out.get(k, 0.0) + v * weight / total
    return out


class MicroBatchPass:
    """One padded micro-batch on the device; implements :class:`meshrl.losses.ForwardPass`."""

    def __init__(self, trainer: "PolicyTrainer", mb: MicroBatch, valid_key: str | None, temperature: float = 1.0,
                 shared: SharedForward | None = None, rows: list[int] | None = None, min_prefix: int | None = None,
                 valid: torch.Tensor | None = None):
        """``shared``: the micro-batch is a view of a shared forward (meshrl.training.shared_pass)
        whose row ``rows[b]`` holds datum b's sequence (or a longer one it is a prefix of).
        ``min_prefix``: the shared prefixes run once (`PolicyTrainer.valid_logits`). ``valid``:
        the positions read, instead of those ``valid_key`` (else the attention mask) gives."""
        self.trainer, self.mb, self.temperature, self.min_prefix = trainer, mb, temperature, min_prefix
        self.inputs = {k: v.to(trainer.device) for k, v in mb.inputs.items()}
        key = self.inputs.get(valid_key) if valid_key else None
        if valid is not None:
            self.valid = valid
        else:
            self.valid = (key != 0) if key is not None else mb.attention_mask.to(trainer.device) > 0
        self.shared = shared
        self.view = shared.add(rows, self.valid) if shared is not None else 0
        self._logits: torch.Tensor | None = None
        self._logprobs: torch.Tensor | None = None
        self.entropy: torch.Tensor | None = None  # [B, T], set with the logprobs

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            if self.shared is not None:
                self._logits = self.shared.logits(self.trainer.valid_logits, self.view)
            else:
                self._logits = self.trainer.valid_logits(self.mb, self.valid, min_prefix=self.min_prefix)
        return self._logits

    def _scatter(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.valid.shape, dtype=rows.dtype, device=rows.device).masked_scatter(self.valid, rows)

    def logprobs(self) -> torch.Tensor:
        if self._logprobs is None:
            targets = self.inputs["target_tokens"][self.valid]
            rows, entropy = token_logprobs_and_entropy(self.logits(), targets, self.trainer.cfg.logprob_chunk_tokens,
                                                       self.temperature)
            self._logprobs = self._scatter(rows)
            self.entropy = self._scatter(entropy.detach())
        return self._logprobs

    @torch.no_grad()
    def reference_logprobs(self) -> torch.Tensor:
        with self.trainer.reference_model() as model:
            logits = self.trainer.valid_logits(self.mb, self.valid, model=model)
        targets = self.inputs["target_tokens"][self.valid]
        rows, _ = token_logprobs_and_entropy(logits, targets, self.trainer.cfg.logprob_chunk_tokens, self.temperature)
        return self._scatter(rows)


class PolicyTrainer:
    """An HF causal LM (float32 master weights, optional LoRA) with AdamW. Under LoRA, ``tenants``
    holds several adapters on the one base model; every operation acts on the active one."""

    def __init__(self, model_path: Path, cfg: LearnerConfig, autocast_dtype: str = "bfloat16",
                 parallel: DataParallelSpec | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.torch_threads)
        if cfg.mmap_threshold_mib:
            set_mmap_threshold(cfg.mmap_threshold_mib << 20)
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.device = claim_device()
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
        self.dp = DataParallel(parallel, self.device)
        self.logits_module = self.dp.wrap(ValidLogits(self.model))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.autocast_dtype = getattr(torch, autocast_dtype) if cfg.autocast_bf16 else None
        self.state = TrainState(self.new_optimizer([p for p in self.model.parameters() if p.requires_grad]))
        """The optimiser being trained and its step count: the active LoRA adapter's under tenants."""
        self.tenants = LoraTenants(self) if cfg.lora.enabled else None
        """The LoRA adapters (``default`` and any added), or None without LoRA."""
        self._frozen_copy = None  # the initial weights (full fine-tuning), loaded on first use

    def new_optimizer(self, params: list[torch.nn.Parameter], kind: str = ADAMW) -> torch.optim.Optimizer:
        """A fresh optimizer over ``params``: AdamW with the learner's settings, or Dimuon (LoRA
        adapters: meshrl.training.optimizers)."""
        cfg = self.cfg
        return make_optimizer(kind, params, {"lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps,
                                            "weight_decay": cfg.weight_decay})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def steps_applied(self) -> int:
        """Optimizer steps taken (restored from checkpoints)."""
        return self.state.steps_applied

    @steps_applied.setter
    def steps_applied(self, value: int) -> None:
        self.state.steps_applied = value

    # ---- forward -------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def valid_logits(self, mb: MicroBatch, *valid: torch.Tensor, model=None,
                     min_prefix: int | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Logits [N, V] of ``model`` (a :class:`ValidLogits`; default: the policy) at the N valid model_input positions
        (row-major over batch, position). The vocabulary projection runs only there, in the
        autocast dtype. Several ``valid`` (masks or flat position indices): one decoder forward,
        a logits tensor for each. The sequences' shared prefixes of at least ``min_prefix`` tokens
        (default `learner.shared_prefix_tokens`) run once, as trees, and with
        `learner.packed_row_tokens` the sequences run packed end to end instead of padded
        (meshrl.training.prefix_trees); the logits are the same, in the same order."""
        module = self.logits_module if model is None else model
        packed = layout(mb.input_ids, mb.lengths, self.cfg.shared_prefix_tokens if min_prefix is None else min_prefix,
                        self.cfg.packed_row_tokens, attention_tokens(self.model.config))
        ids = mb.input_ids.to(self.device)
        with self._autocast():
            if packed is None:
                return module(ids, mb.attention_mask.to(self.device), *valid)
            mask = None if packed.mask is None else packed.mask.to(self.device)
            return module(packed.input_ids(ids, self.pad_id), mask, *(packed.index(v) for v in valid),
                          position_ids=packed.position_ids.to(self.device))

    @contextlib.contextmanager
    def reference_model(self):
        """The frozen reference policy (the initial weights): the policy with its LoRA adapters
        switched off, or (full fine-tuning) a frozen copy loaded on first use, so a run that never
        asks for it never pays for it."""
        if self.cfg.lora.enabled:
            with self.model.disable_adapter():
                yield self.logits_module
            return
        if self._frozen_copy is None:
            from transformers import AutoModelForCausalLM

            ref = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).to(self.device)
            ref.eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self._frozen_copy = ValidLogits(ref)
        yield self._frozen_copy

    def _passes(self, datums: list[Datum], valid_key: str | None, per_item: int = 1, padding: bool = False,
                temperature: float = 1.0, min_prefix: int | None = None):
        """``(group, pass, scale)`` per micro-batch (its log-probabilities at ``temperature``); the
        caller multiplies the loss by ``scale`` and
        drops the outputs of passes whose scale is 0. Those are ``padding`` datums (sent to a
        data-parallel rank only to keep it in step) and, under FSDP2, repeats of a rank's last
        micro-batch until it has run as many passes as the busiest rank (the collectives match)."""
        min_prefix = self.cfg.shared_prefix_tokens if min_prefix is None else min_prefix
        groups = split_micro_batches(datums, self.cfg.micro_batch_size, per_item, self.cfg.micro_batch_tokens,
                                     min_prefix > 0) if datums else []
        extra = self.dp.padding_passes(len(groups))
        if extra and not groups:
            raise ValueError("a data-parallel learner rank got no datums while others did: send it padding datums")
        real = 0 if padding else len(groups)
        for i, group in enumerate(groups + [groups[-1]] * extra):
            yield group, MicroBatchPass(self, pad_datums(group, self.pad_id), valid_key, temperature,
                                        min_prefix=min_prefix), float(i < real)

    # ---- Tinker-style API ----------------------------------------------------------------
    def forward_backward(self, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None = None,
                         padding: bool = False, outputs: bool = False, temperature: float = 1.0,
                         backward: bool = True) -> dict:
        """Accumulate gradients of the registered, sum-reduced ``loss_fn`` over all datums
        (micro-batched); returns its summed ``loss`` and combined metrics, and with ``outputs``
        each datum's target-token logprobs (``logprobs``: a list per datum, at every position, also
        those the loss reads nothing at, from the loss's one decoder forward). ``temperature``: the
        log-probabilities (and the entropy) are those of softmax(logits / temperature), the
        distribution the datums' tokens were sampled from (the sampler's recorded `logprobs` are of
        that distribution). Without ``backward``: the loss and its metrics only, no gradient (a
        forward-only loss). One loss of :meth:`forward_backward_parts`, which says the rest."""
        part = LossPart(datums, loss_fn, dict(loss_fn_config or {}), temperature)
        return self.forward_backward_parts([part], padding, outputs, backward)[0]

    def forward_backward_parts(self, parts: list[LossPart], padding: bool = False, outputs: bool = False,
                               backward: bool = True) -> list[dict]:
        """Accumulate the gradients of several registered, sum-reduced losses, each on its own
        datums, in one set of micro-batches (meshrl.training.shared_pass): a micro-batch's decoder
        forward runs once for every loss with datums there (each distinct token sequence once),
        each loss reads its own datums' rows at its own ``temperature`` with its own config, and
        the micro-batch's loss is the sum of each loss times its part's ``scale``; one backward.
        Per part, its summed (unscaled) ``loss`` and combined metrics: ``tokens`` counts the
        positions that carry its training signal (the loss's ``signal``, else every position it
        reads): the policy entropy is their mean, and the micro-batches' metrics are weighted by
        them; ``seconds`` is the whole call's and ``pass_share`` the part's share of it (the tokens
        of the rows it adds to the parts before it, over all rows'). ``padding`` datums add nothing
        (see :meth:`_passes`); with ``outputs`` each datum's target-token logprobs at every position
        (``logprobs``). With `learner.release_heap_each_micro_batch` the free heap goes back to the
        kernel after each micro-batch. Without ``backward`` the same losses and metrics, computed
        without grad and nothing accumulated."""
        with contextlib.nullcontext() if backward else torch.no_grad():
            return self._train_parts(parts, padding, outputs, backward)

    def _train_parts(self, parts: list[LossPart], padding: bool, outputs: bool, backward: bool) -> list[dict]:
        specs = [losses.get_loss(p.loss_fn) for p in parts]
        configs = [dict(p.loss_fn_config or {}) for p in parts]
        started = time.perf_counter()
        batches = pack_shared([p.datums for p in parts], [s.datums_per_item for s in specs], self.cfg.micro_batch_size,
                              self.cfg.micro_batch_tokens, self.cfg.shared_prefix_tokens > 0
                              ) if any(p.datums for p in parts) else []
        extra = self.dp.padding_passes(len(batches))
        if extra and not batches:
            raise ValueError("a data-parallel learner rank got no datums while others did: send it padding datums")
        real = 0 if padding else len(batches)
        metrics: list[list[tuple[float, dict[str, float]]]] = [[] for _ in parts]
        tokens = [0] * len(parts)
        added = [0] * len(parts)  # the tokens of the rows each part adds to the parts before it
        per_datum: dict[int, list[float]] = {}
        for i, batch in enumerate(batches + [batches[-1]] * extra):
            shared = SharedForward(batch.rows, self.pad_id, self.device)
            views = [(k, [d for d, _ in view], [r for _, r in view]) for k, view in enumerate(batch.views) if view]
            passes = {k: MicroBatchPass(self, pad_datums(group, self.pad_id), specs[k].valid_key,
                                        parts[k].temperature, shared, rows) for k, group, rows in views}
            unread = {k: self._unread_view(passes[k], shared, rows) for k, _, rows in views
                      } if outputs and i < real else {}
            outs = [(k, group, passes[k], specs[k].fn(passes[k], **configs[k])) for k, group, _ in views]
            total = sum(out.loss * parts[k].scale for k, _, _, out in outs)
            if backward:
                (total * float(i < real)).backward()
            if i >= real:
                continue
            added = [a + b for a, b in zip(added, first_reader_tokens(batch))]
            for k, group, fp, out in outs:
                if outputs:
                    logp = fp.logprobs().detach().float().cpu()
                    if unread[k] is not None:
                        with torch.no_grad():
                            logp += unread[k].logprobs().float().cpu()
                    per_datum.update((id(d), logp[row, : d.length].tolist()) for row, d in enumerate(group))
                signal = fp.valid if out.signal is None else out.signal
                n_signal = int(signal.sum())
                values = {**out.metrics, "loss": float(out.loss.detach())}
                if fp.entropy is not None:
                    values["entropy"] = float(fp.entropy[signal].mean()) if n_signal else 0.0
                weight = n_signal if specs[k].metric_weight == "tokens" else len(group) // specs[k].datums_per_item
                metrics[k].append((float(weight), values))
                tokens[k] += n_signal
            if self.cfg.release_heap_each_micro_batch:
                del shared, views, passes, unread, outs, total, fp, out, signal  # the micro-batch's activations
                release_free_heap()
        seconds = time.perf_counter() - started
        results = []
        for k, part in enumerate(parts):
            result = combine_metrics(metrics[k])
            result.update(tokens=float(tokens[k]), seconds=seconds, pass_share=added[k] / max(sum(added), 1))
            if outputs:
                result["logprobs"] = [per_datum[id(d)] for d in part.datums]
            results.append(result)
        return results

    def _unread_view(self, fp: MicroBatchPass, shared: SharedForward, rows: list[int]) -> MicroBatchPass | None:
        """A view of ``fp``'s rows at the positions its loss does not read (None if it reads them
        all), registered on the same shared forward: the outputs' logprobs there come from the
        loss's one decoder forward."""
        rest = (fp.mb.attention_mask.to(self.device) > 0) & ~fp.valid
        if not bool(rest.any()):
            return None
        return MicroBatchPass(self, fp.mb, None, fp.temperature, shared, rows, valid=rest)

    def forward_backward_custom(self, datums: list[Datum], fn: CustomLoss, padding: bool = False) -> dict:
        """Accumulate gradients of an arbitrary ``fn(datums, logprobs) -> (loss, metrics)`` over
        the whole batch: one pass without grad gives every datum's target logprobs, ``fn`` runs on
        them as leaf tensors, and a second, micro-batched pass backpropagates d loss / d logprobs
        through the model (the surrogate sum(grad * logprobs))."""
        started = time.perf_counter()
        leaves = [lp.requires_grad_(True) for lp in self.forward(datums, padding=padding)]
        loss, metrics = fn(datums, leaves)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        grad_of = {id(d): g if g is not None else torch.zeros_like(lp) for d, g, lp in zip(datums, grads, leaves)}
        tokens = 0
        for group, fp, scale in self._passes(datums, None, padding=padding):
            grad = torch.nn.utils.rnn.pad_sequence([grad_of[id(d)] for d in group], batch_first=True).to(self.device)
            (fp.logprobs() * grad).sum().mul(scale).backward()
            tokens += int(fp.valid.sum()) if scale else 0
        return {**{k: float(v) for k, v in metrics.items()}, "loss": float(loss.detach()), "tokens": float(tokens),
                "seconds": time.perf_counter() - started}

    @torch.no_grad()
    def forward(self, datums: list[Datum], reference: bool = False, padding: bool = False,
                temperature: float = 1.0) -> list[torch.Tensor]:
        """Log-probability of every datum's target tokens ([length] float32 each, in datum order)
        under the current weights, or under the frozen reference policy (``padding``: zeros), at
        ``temperature``."""
        out: dict[int, torch.Tensor] = {}
        for group, fp, scale in self._passes(datums, None, padding=padding, temperature=temperature):
            logp = fp.reference_logprobs() if reference else fp.logprobs()
            for row, d in enumerate(group):
                out.setdefault(id(d), logp[row, : d.length].float().cpu() * scale)
        return [out[id(d)] for d in datums]

    @torch.no_grad()
    def topk_logprobs(self, datums: list[Datum], k: int, padding: bool = False, min_prefix: int = 0) -> list[tuple]:
        """Per datum, the current policy's top-``k`` (indices int32, log-probs float32; ``k = 0``:
        indices None and the full vocabulary) at its non-zero `mask` positions, and the log-probs
        of its own target tokens there (float32), without grad: the next-token distributions that
        predict those target tokens (SDPO's hinted teacher scored in the learner's processes).
        The mask must be one run of positions. Datums whose sequences share at least
        ``min_prefix`` leading tokens before their runs have that prefix forwarded once, its keys
        and values cached (meshrl.training.prefix_scoring); under FSDP2, whose forward gathers the
        sharded weights in step with the other ranks, in the learner's micro-batches with the
        shared prefixes as trees."""
        if self.dp.mode == "fsdp2":
            return self._topk_in_micro_batches(datums, k, padding, min_prefix)
        if padding or not datums:
            return []
        sequences, starts, lengths = [], [], []
        for d in datums:
            where = (d.loss_fn_inputs["mask"] != 0).nonzero().flatten().tolist()
            if not where or where[-1] - where[0] + 1 != len(where):
                raise ValueError("topk_logprobs: each datum's mask must be one run of positions")
            inputs, targets = d.model_input.to_ints(), d.loss_fn_inputs["target_tokens"].tolist()
            if inputs[1:] != targets[:-1]:
                raise ValueError("topk_logprobs: each datum's targets must be its model input shifted by one")
            sequences.append(inputs + targets[-1:])
            starts.append(where[0] + 1)
            lengths.append(len(where))
        with self._autocast():
            return topk_at_positions(self.model, sequences, starts, lengths, k, pad_id=self.pad_id,
                                     max_rows=self.cfg.micro_batch_size, min_prefix=min_prefix, device=self.device)

    def _topk_in_micro_batches(self, datums: list[Datum], k: int, padding: bool, min_prefix: int) -> list[tuple]:
        """`topk_logprobs` in the learner's micro-batches, grouped by their tokens, the prefixes
        of at least ``min_prefix`` tokens they share laid as trees (`valid_logits`)."""
        out: dict[int, tuple] = {}
        for group, fp, scale in self._passes(datums, "mask", padding=padding, min_prefix=min_prefix):
            logp = torch.log_softmax(fp.logits().float(), dim=-1)
            indices, values = topk_logprobs(logp, k)  # a log-softmax of log-probabilities is themselves
            own = logp.gather(-1, fp.inputs["target_tokens"][fp.valid][:, None])
            rows = fp.valid.sum(-1).tolist()
            starts = [sum(rows[:i]) for i in range(len(rows))]
            for row, d in enumerate(group):
                if scale:
                    part = slice(starts[row], starts[row] + rows[row])
                    out.setdefault(id(d), (None if indices is None else indices[part].cpu(), values[part].cpu(),
                                           own[part, 0].cpu()))
        return [out[id(d)] for d in datums] if not padding else []

    @torch.no_grad()
    def scale_grads(self, factor: float) -> None:
        """Multiply the accumulated gradients of the optimised parameters (under LoRA tenants: the
        active adapter's) by ``factor`` (a step-wide normaliser known only after they were accumulated)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def optim_step(self, adam: AdamParams | DimuonParams) -> dict:
        """Apply the accumulated gradients with the optimizer (AdamW, or a LoRA adapter's Dimuon:
        ``adam`` must be that optimizer's parameters), then clear them. Reports the gradient norm,
        the learning rate, the seconds and this process's memory: `rss_gib` after the step,
        `peak_rss_gib` the peak since the previous optim_step (the step's own), and with
        `learner.release_heap_each_step` `released_gib`, the free heap handed back to the kernel
        first (meshrl.training.memory)."""
        started = time.perf_counter()
        set_step_params(self.optimizer, adam)
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.dp.sum_grads(params)
        grads = [p.grad for p in params if p.grad is not None]
        if adam.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_applied += 1
        held = resident_gib()["rss_gib"] if self.cfg.release_heap_each_step else None
        released = held is not None and release_free_heap()
        memory = resident_gib()
        reset_peak()  # the next step's peak is its own
        if released:
            memory["released_gib"] = held - memory["rss_gib"]
        return {"grad_norm": float(local_value(norm)), "lr": adam.learning_rate,
                "optim_s": time.perf_counter() - started, **memory}

    # ---- weights for inference -----------------------------------------------------------
    def sync_shards(self) -> dict[str, Shard]:
        """This rank's part of what the learner publishes for readers (meshrl.transport.shards):
        the merged bf16 weights, or under `lora.sync: adapter` only the (active) adapter's float32
        matrices (readers merge them). Under FSDP2 every rank publishes its own rows; otherwise
        rank 0 holds everything. Nothing is gathered or copied here (see :meth:`weight_shards`)."""
        if self.cfg.lora.enabled and self.cfg.lora.sync == "adapter":
            from meshrl.training.lora import adapter_state_dict

            return self.dp.local_shards(adapter_state_dict(self.model), torch.float32)
        return self.weight_shards(torch.bfloat16)

    def weight_shards(self, dtype: torch.dtype) -> dict[str, Shard]:
        """This rank's rows of the HF-named weights as generators load them (the active LoRA
        adapter merged), as ``dtype``. Each is converted (and merged) only when it is packed, so a
        publish needs no converted copy of the model. A tied lm_head stays in (as an alias of the
        embedding: the arena stores it once), since vLLM's in-place reload only refreshes its head
        from an explicit `lm_head.weight`. Under FSDP2 every rank calls this together (the LoRA
        A matrices are gathered: they are small)."""
        state, merge = self._merge_rules()
        keys = {k: v for k, v in self._tie_keys().items() if k not in merge}  # a merged weight is its own tensor
        return self.dp.local_shards(state, dtype, keys, merge)

    def export_groups(self) -> list[Callable[[], dict[str, torch.Tensor]]]:
        """The float32 weights an HF export writes (the active adapter merged), one decoder layer
        (or other top-level tensor) at a time: each call gives that group's tensors (FSDP2:
        sharded DTensors, for `DataParallel.gather_to_first`). Tied names are written once (the
        first in module order, as HF saves them). Under FSDP2 every rank calls this together."""
        state, merge = self._merge_rules()
        keys, seen, groups = self._tie_keys(), set(), {}
        for name in state:
            key = keys.get(name) if name not in merge else None
            if key is not None and key in seen:
                continue
            seen.add(key)
            groups.setdefault(layer_group(name), []).append(name)
        return [functools.partial(_merged_group, {n: state[n] for n in names}, merge) for names in groups.values()]

    def _tie_keys(self) -> dict[str, int]:
        """HF name -> one key per distinct parameter (tied names share it)."""
        model = self.model.get_base_model() if self.cfg.lora.enabled else self.model
        return {k.replace(".base_layer", ""): id(p) for k, p in model.named_parameters(remove_duplicate=False)}

    def _merge_rules(self) -> tuple[dict[str, torch.Tensor], dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
        """The base model's HF-named weights (this rank's DTensors under FSDP2) and, under LoRA, per
        adapted weight the function adding the active adapter's delta to its rows
        (W0 + (B @ A) * scale, in float32 as peft's merge computes it; B's rows are sharded like
        W0's, A is gathered whole)."""
        if not self.cfg.lora.enabled:
            return self.model.state_dict(), {}
        from peft.tuners.lora import LoraLayer

        adapter = self.model.active_adapter
        merge = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) and adapter in module.lora_A:
                a = _whole(module.lora_A[adapter].weight.detach())
                b = module.lora_B[adapter].weight.detach()
                b = b.to_local() if hasattr(b, "to_local") else b
                merge[f"{name.removeprefix('base_model.model.')}.weight"] = functools.partial(
                    _add_delta, a=a, b=b, scale=float(module.scaling[adapter]))
        state = {k.replace(".base_layer", ""): v for k, v in self.model.get_base_model().state_dict().items()
                 if "lora_" not in k}
        return state, merge

    @torch.no_grad()
    def inference_state_dict(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """HF-named whole weights as the generators load them (the active LoRA adapter merged), of
        an unsharded learner (the in-process source of a co-located generator); tied names share
        one tensor. Under FSDP2 no process holds them: see :meth:`weight_shards`."""
        if self.dp.sharded:
            raise ValueError("inference_state_dict: under FSDP2 no learner process holds the whole weights")
        if self.cfg.lora.enabled:
            from meshrl.training.lora import merged_state_dict

            return merged_state_dict(self.model, dtype)
        converted: dict[int, torch.Tensor] = {}  # tied names keep sharing one tensor
        return {k: converted.setdefault(id(v), v.to(dtype)) for k, v in self.model.state_dict().items()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@torch.no_grad()
def _add_delta(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return w + (b @ a) * scale


@torch.no_grad()
def _merged_group(state: dict[str, torch.Tensor], merge: dict) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        fn = merge.get(name)
        if fn is None:
            out[name] = t
        elif hasattr(t, "to_local"):
            from torch.distributed.tensor import DTensor

            out[name] = DTensor.from_local(fn(t.to_local()), t.device_mesh, t.placements, run_check=False,
                                           shape=t.shape, stride=t.stride())
        else:
            out[name] = fn(t)
    return out
