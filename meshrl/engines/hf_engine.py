"""Fallback engine on transformers `generate` for machines without vLLM.

Logprobs are taken from the processed scores (after temperature and top-p), i.e. the distribution
each token was actually sampled from, matching the vLLM engine's `processed_logprobs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from meshrl.config.generation import GeneratorConfig
from meshrl.engines.base import Completion, SampleRequest


class HFEngine:
    """Batched, left-padded `model.generate` with per-token sampler logprobs."""

    def __init__(self, model_path: Path, cfg: GeneratorConfig, dtype: str, max_model_len: int, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.max_model_len = max_model_len
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], request: SampleRequest) -> list[list[Completion]]:
        if not prompts:
            return []
        if request.seed is not None:
            torch.manual_seed(request.seed)
        expanded = [p for p in prompts for _ in range(request.n)]
        width = max(len(p) for p in expanded)
        input_ids = torch.full((len(expanded), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(expanded):
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        eos = list(request.stop_token_ids) or [self.tokenizer.eos_token_id]
        kwargs = dict(
            max_new_tokens=request.max_tokens,
            eos_token_id=eos,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if request.greedy:
            kwargs.update(do_sample=False)
        else:
            kwargs.update(do_sample=True, temperature=request.temperature, top_p=request.top_p, top_k=0)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device), **kwargs
        )
        new_tokens = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [N, steps, V] processed scores
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
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
            result[-1].append(Completion(toks, lps, reason, text))
        return result

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            ids = torch.tensor([seq], device=self.device)
            logits = self.model(input_ids=ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            out.append(lp.cpu().tolist())
        return out

    @torch.no_grad()
    def topk_logprobs(self, sequences: list[list[int]], starts: list[int], lengths: list[int],
                      k: int) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """For each sequence, the top-``k`` (indices int32, log-probs float32) of the next-token
        distribution (temperature 1) at the positions predicting ``seq[start:start+length]``;
        ``k = 0`` returns the full vocabulary's log-probs with indices None."""
        width = max(len(s) for s in sequences)
        ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, seq in enumerate(sequences):
            ids[i, : len(seq)] = torch.tensor(seq)
            attention[i, : len(seq)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attention.to(self.device)).logits
        out = []
        for i, (start, length) in enumerate(zip(starts, lengths)):
            logp = torch.log_softmax(logits[i, start - 1 : start - 1 + length].float(), dim=-1).cpu()
            if k == 0:
                out.append((None, logp))
            else:
                values, indices = logp.topk(k, dim=-1)
                out.append((indices.to(torch.int32), values))
        return out

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.model.state_dict()  # includes tied aliases such as lm_head.weight
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"weight '{name}' does not exist in the generator's model")
            params[name].copy_(tensor)

    def close(self) -> None:
        del self.model
