"""Learner configuration: optimiser, LoRA, micro-batching."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from meshrl.config.base import Section


class LoraConfig(Section):
    """Low-rank adapters (peft). Off by default: the whole model is fine-tuned."""

    enabled: bool = False
    """Train LoRA adapters instead of all weights."""

    rank: int = Field(16, ge=1)
    """Adapter rank r."""

    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator (scale = alpha / rank)."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input."""

    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    """Module names that receive adapters."""

    sync: Literal["merged", "adapter"] = "merged"
    """What crosses the wire to generators: `merged` full weights (base + B A scale) or `adapter`
    (only the A/B matrices; the generator merges them into the base weights it holds)."""


class LearnerConfig(Section):
    """The Learner actor: HF causal LM, AdamW, gradient accumulation over micro-batches."""

    lr: float = Field(1e-5, gt=0)
    """AdamW learning rate."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""

    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""

    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay."""

    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 = no clipping)."""

    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward micro-batch; gradients accumulate over micro-batches with the
    global normaliser, so the result equals one big batch."""

    micro_batch_tokens: int = Field(0, ge=0)
    """Also cap a micro-batch's padded tokens (sequences x its longest one) at this many, so long
    multi-turn episodes do not multiply the logits' memory by `micro_batch_size` (0: no cap; a
    sequence longer than the cap is a micro-batch of its own). The result is unchanged."""

    packed_row_tokens: int = Field(0, ge=0)
    """0: a micro-batch's sequences are right-padded to its longest and the decoder runs on every
    padded position. N > 0: they are packed end to end instead, into as few rows as fit at most N
    tokens each, or as many as the micro-batch's longest sequence if that is more (1: rows no
    wider than padding would make them; where no row would hold two, the micro-batch runs
    padded), with position ids restarting at each sequence and
    attention that cannot cross sequences; every loss reads the same per-datum values as padded.
    The micro-batches themselves (`micro_batch_size`, `micro_batch_tokens`) are the same either
    way. Attention runs over each whole row (a block-diagonal mask), so wide rows cost attention
    that padding did not (see docs/benchmarks.md)."""

    shared_prefix_tokens: int = Field(16, ge=0)
    """N > 0: in each micro-batch, sequences that share a prefix of at least N tokens (the samples
    of one prompt, a DPO pair's two sides, a multi-turn episode's steps) run as one tree: the
    prefix once, then each sequence's rest, attending to the prefix and to itself (a tree
    attention mask; position ids continue from the prefix). The decoder computes each shared
    prefix once, forward and backward; every loss reads the values a separate forward would give.
    A tree's attention covers every pair of its positions, so sequences join a tree only where
    that costs less than running them whole (a short prompt in front of long episodes does not).
    The shared pass then groups sequences into micro-batches by their tokens, so a prompt's
    samples share one. 0: every sequence runs whole (right-padded, or packed end to end with
    `packed_row_tokens`, which also lays trees end to end)."""

    autocast_bf16: bool = True
    """Run forward/backward under bf16 autocast (master weights stay float32)."""

    logprob_chunk_tokens: int = Field(1024, ge=16)
    """Tokens per chunk when computing log-softmax over the vocabulary (bounds peak memory)."""

    release_heap_each_step: bool = True
    """After each optimizer step, hand the heap memory the step freed back to the kernel (glibc
    `malloc_trim`), so the learner's resident memory is what it holds between steps instead of
    its largest step so far plus the arenas' fragmentation (which grows step by step on long,
    varied sequences until the host kills the process). Off: the next step reuses those pages
    without faulting them in again. No effect where the C library has no `malloc_trim`."""

    release_heap_each_micro_batch: bool = True
    """Also hand the free heap back after each micro-batch's backward, so the pages one
    micro-batch freed (logits, activations) do not stay in an arena beside the next one's: bounds
    the step's own peak rather than what the learner holds between steps, at the cost of
    faulting those pages in again (measured on code-tier batches: 0.85x the step's peak at 1.01x
    its time, benchmarks/learner_memory.py)."""

    mmap_threshold_mib: int = Field(0, ge=0, le=32)
    """Serve every heap block of this many MiB or more with a mapping of its own, handed back to
    the kernel when freed (glibc's `M_MMAP_THRESHOLD`), so big tensors never stay in malloc's
    arenas; 0: glibc's default (a threshold that rises up to 32 MiB as big blocks are freed).
    Measured at 1 MiB on code-tier batches: 0.71x the step's peak at 1.20x its time (every big
    tensor is faulted in anew). No effect where the C library has no `mallopt`."""

    torch_threads: int = Field(2, ge=1)
    """torch intra-op threads in the learner process."""

    seed: int = 0
    """Seed for the learner's RNG (dropout, LoRA init)."""

    lora: LoraConfig = LoraConfig()
    """LoRA settings."""

    call_timeout_s: float = Field(900.0, gt=0)
    """Deadline for one learner call (forward_backward, optim_step, publish), and for every
    collective between data-parallel learner processes."""

    data_parallel: Literal["fsdp2", "ddp"] = "fsdp2"
    """How `meshes.learner.procs` > 1 processes train one policy: `fsdp2` shards parameters,
    gradients and optimiser state (torch `fully_shard`; under LoRA the frozen base is sharded too
    and the adapters are trained sharded), `ddp` replicates the policy and sums gradients before
    each optimiser step. gloo on CPU, NCCL on GPU."""

    def adam_params(self):
        """The optimiser settings as Tinker-style AdamParams."""
        from meshrl.types import AdamParams

        return AdamParams(
            learning_rate=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
            weight_decay=self.weight_decay, grad_clip_norm=self.grad_clip,
        )
