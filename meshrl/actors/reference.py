"""ReferenceActor: the frozen initial policy, forward only, in `model.dtype` (bf16 by default); it
scores each replay pair's chosen and rejected answers once, when the pair is formed, so that the
learner neither runs a reference forward in its step nor holds a float32 copy of the initial
weights (channel 3, `replay.reference.source: precomputed`). It never loads new weights: a
replacement loads the same initial weights again."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from monarch.actor import endpoint

from meshrl.actors.base import MeshrlActor
from meshrl.training.data_parallel import ValidLogits
from meshrl.training.gpu_budget import claim_device
from meshrl.training.reference import answer_logprob_sums


class ReferenceActor(MeshrlActor):
    """Endpoint ``score_pairs``: per (prompt, chosen, rejected), both answers' sequence
    log-probabilities under the initial weights."""

    def __init__(self, model_path: str, dtype: str = "bfloat16", torch_threads: int = 2, batch_size: int = 8):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(torch_threads)
        self.device = claim_device()
        model = AutoModelForCausalLM.from_pretrained(Path(model_path), dtype=getattr(torch, dtype)).to(self.device)
        model.eval()
        model.requires_grad_(False)
        self.model = ValidLogits(model)
        tokenizer = AutoTokenizer.from_pretrained(Path(model_path))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.dtype, self.batch_size = dtype, batch_size
        self.scored = 0

    def describe(self) -> dict:
        return {"dtype": self.dtype, "scored_pairs": self.scored}

    @endpoint
    def score_pairs(self, pairs: list[tuple[list[int], list[int], list[int]]], temperature: float = 1.0) -> dict:
        """``pairs`` = [(prompt, chosen, rejected)] token ids; ``references`` = [[chosen, rejected]]
        sequence log-probabilities, one per pair, and the call's ``seconds``."""
        self.fault_point("score_pairs")
        started = time.perf_counter()
        sequences = [prompt + answer for prompt, chosen, rejected in pairs for answer in (chosen, rejected)]
        starts = [len(prompt) for prompt, _, _ in pairs for _ in range(2)]
        sums = answer_logprob_sums(self.model, sequences, starts, self.pad_id, self.device, temperature,
                                   self.batch_size)
        self.scored += len(pairs)
        return {"references": [sums[i:i + 2] for i in range(0, len(sums), 2)],
                "seconds": time.perf_counter() - started}
