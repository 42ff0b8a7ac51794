"""Fallback engine on transformers `generate` for machines without vLLM.

Logprobs are taken from the processed scores (after temperature and top-p), i.e. the distribution
each token was actually sampled from, matching the vLLM engine's `processed_logprobs`. They are
gathered on the device as generation goes (`SampledLogprobs`, the last logits processor: it keeps one
step's scores, never the [samples, steps, vocab] stack), and only [samples, steps] floats leave it.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable

import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import Completion, PromptScoring, SampleRequest, Sampled
from meshrl.engines.device_sampler import sample_step
from meshrl.engines.hf_static import Decoded, row_seeds, static_generate
from meshrl.engines.prompt_scores import prompt_scores
from meshrl.training.gpu_budget import claim_device
from meshrl.training.prefix_scoring import topk_at_positions
from meshrl.training.prefix_trees import right_padded


class SampledLogprobs:
    """A logits processor placed after temperature and top-p: at each step it gathers, on the
    device, the logprob of the token sampled at the previous step from that step's processed
    scores (the token is the last column of ``input_ids`` by then), and with ``k`` that step's
    ``k`` most likely tokens; `finish` adds the last step's."""

    def __init__(self, k: int = 0):
        self.k = k
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.top: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _gather(self, tokens: torch.Tensor) -> None:
        logp = torch.log_softmax(self.previous, dim=-1)
        self.steps.append(logp.gather(-1, tokens[:, None]).squeeze(-1))
        if self.k:
            values, ids = logp.topk(self.k, dim=-1)
            self.top.append((ids, values))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self._gather(input_ids[:, -1])
        self.previous = scores
        return scores

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[samples, steps] logprobs on the device, given the final sequences."""
        if self.previous is not None:
            self._gather(sequences[:, -1])
            self.previous = None
        return torch.stack(self.steps, dim=1) if self.steps else sequences.new_zeros((len(sequences), 0),
                                                                                   dtype=torch.float32)

    def topk(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([samples, steps, k] ids, the same of logprobs), after `finish`."""
        return torch.stack([ids for ids, _ in self.top], dim=1), torch.stack([v for _, v in self.top], dim=1)


class HFEngine:
    """Batched, left-padded `model.generate` with per-token sampler logprobs. With ``module`` (a
    co-located learner's policy, LoRA adapters applied on the fly) it samples with that module's own
    parameters: no copy of the weights exists."""

    holds_weights = True  # the model it was built from, or the co-located learner's module

    def __init__(self, model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int,
                 module: torch.nn.Module | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(cfg.torch_threads)
        if module is not None:
            self.model = module
            self.device = next(module.parameters()).device
        else:
            self.device = claim_device()
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
            self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_model_len = max_model_len
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.static = cfg.hf_decode == "static" or (cfg.hf_decode == "auto" and self.device.type == "cuda")
        """Decode on the static-cache path (`hf_static`: buckets, CUDA graphs on CUDA, the seeded device
        sampler) rather than transformers' sampler on a dynamic cache."""
        self._sample = torch.compile(sample_step) if self.static and self.device.type == "cuda" else sample_step

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        if not prompts:
            return []
        expanded = [p for p in prompts for _ in range(request.n)]
        eos = list(request.stop_token_ids) or [self.tokenizer.eos_token_id]
        if self.static:
            seeds = row_seeds(len(prompts), request.n, request.seed, self.generator)
            decoded = static_generate(self.model, self.device, self.pad_id, expanded, seeds, request.max_tokens,
                                      request.temperature, request.top_p, request.topk, eos, self._sample)
        else:
            decoded = self._eager_generate(expanded, request, eos)
        new_tokens, logprobs, top_ids, top_values = decoded.tokens, decoded.logprobs, decoded.top_ids, decoded.top_values
        result: list[list[Completion]] = []
        for i in range(len(expanded)):
            toks, lps, reason = [], [], "length"
            for t, lp in zip(new_tokens[i].tolist(), logprobs[i].tolist()):
                toks.append(t)
                lps.append(lp)
                if t in eos:
                    reason = "stop"
                    break
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if i % request.n == 0:
                result.append([])
            topk = None if top_ids is None else (top_ids[i, :len(toks)].tolist(), top_values[i, :len(toks)].tolist())
            result[-1].append(Completion(toks, lps, reason, text, topk=topk))
        return result

    def _eager_generate(self, expanded: list[list[int]], request: SampleRequest, eos: list[int]) -> Decoded:
        """transformers' own sampler on a dynamic cache, left-padded to the longest row; the
        request's seed seeds the process-wide generator."""
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        if request.seed is not None:
            torch.manual_seed(request.seed)
        width = max(len(p) for p in expanded)
        input_ids = torch.full((len(expanded), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(expanded):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        # the warpers are ours (generate's own would run after any processor we pass), so that
        # the recorder sees the scores sampled from; generate then adds none (temperature 1, top-p 1)
        recorder = SampledLogprobs(request.topk)
        warpers = [] if request.greedy else \
            ([TemperatureLogitsWarper(request.temperature)] if request.temperature != 1.0 else []) + \
            ([TopPLogitsWarper(request.top_p)] if request.top_p < 1.0 else [])
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=request.max_tokens, eos_token_id=eos, pad_token_id=self.pad_id,
            do_sample=not request.greedy, temperature=1.0, top_p=1.0, top_k=0,
            logits_processor=LogitsProcessorList([*warpers, recorder]),
        )
        logprobs = recorder.finish(out).cpu()
        top_ids, top_values = recorder.topk() if request.topk and logprobs.shape[1] else (None, None)
        return Decoded(out[:, width:].cpu(), logprobs, top_ids, top_values)

    def submit(self, prompt: list[int], request: SampleRequest, scoring: PromptScoring, adapter=None) -> Future:
        """Samples one prompt before returning (the HF engine batches per call, not per step)."""
        done: Future = Future()
        try:
            if adapter is not None:
                raise ValueError("the hf engine applies no adapters: generator.lora_slots needs the vllm backend")
            completions = self.generate([prompt], request)[0]
            scores = None
            if scoring.wanted:
                with torch.no_grad():
                    _, logits = self._batched_logits([prompt])
                scores = prompt_scores(torch.log_softmax(logits[0, :-1], dim=-1).cpu(), prompt, scoring)
            done.set_result(Sampled(completions, scores))
        except Exception as exc:  # noqa: BLE001 - the caller's, through the future
            done.set_exception(exc)
        return done

    def paused(self):
        """Nothing to wait for: every call has finished before it returns."""
        return contextlib.nullcontext()

    def _batched_logits(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One right-padded forward over ``sequences``: (ids, float32 logits), both on the device."""
        ids, attention = right_padded(sequences, max(len(s) for s in sequences), self.pad_id)
        ids = ids.to(self.device)
        return ids, self.model(input_ids=ids, attention_mask=attention.to(self.device)).logits.float()

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's token logprobs (from its second token), one batched forward on the device."""
        if not sequences:
            return []
        ids, logits = self._batched_logits(sequences)
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()
        return [lp[i, : len(seq) - 1].tolist() for i, seq in enumerate(sequences)]

    def topk_logprobs(self, sequences: list[list[int]], starts: list[int], lengths: list[int],
                      k: int, min_prefix: int = 0) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        """For each sequence, the top-``k`` (indices int32, log-probs float32) of the next-token
        distribution (temperature 1) at the positions predicting ``seq[start:start+length]``, and
        the log-probs of those tokens themselves; ``k = 0`` returns the full vocabulary's log-probs
        with indices None. One batched forward, each prefix of at least ``min_prefix`` tokens
        that sequences share forwarded once (meshrl.training.prefix_scoring); the vocabulary
        projection, log-softmax and top-k run on the device, at the scored positions only."""
        return topk_at_positions(self.model, sequences, starts, lengths, k, pad_id=self.pad_id,
                                 max_rows=max(len(sequences), 1), min_prefix=min_prefix, device=self.device)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict()  # includes tied aliases such as lm_head.weight
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight '{name}' does not exist in the generator's model")
            params[name].copy_(tensor)

    def close(self) -> None:
        del self.model
