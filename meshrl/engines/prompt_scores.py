"""A prompt's scores from its next-token distributions: the pure part of `PromptScoring`.

``logprobs`` is a [len(prompt) - 1, V] matrix whose row i is log p(. | prompt[:i + 1]) at
temperature 1, i.e. the distribution over prompt token i + 1. From it:
    own logprobs  logprobs[i, prompt[i + 1]]
    top-k         the k largest entries of row i, largest first
    targets       logprobs[i, t] for each asked id t of row i (0.0 where the cell holds -1)
    draws         k ids drawn with replacement from softmax(logprobs[i] / T) (T = 0: the argmax,
                  k times), each with its logprob logprobs[i, id] (temperature 1)
softmax(logprobs / T) = softmax(logits / T), since a row of logprobs is the logits less a constant.
"""

from __future__ import annotations

import torch

from meshrl.engines.base import PromptScores, PromptScoring


def prompt_scores(logprobs: torch.Tensor, prompt: list[int], scoring: PromptScoring) -> PromptScores:
    """What ``scoring`` asks of ``prompt``, from its [len(prompt) - 1, V] next-token logprobs."""
    rows = len(prompt) - 1
    if logprobs.shape[0] != rows:
        raise ValueError(f"{logprobs.shape[0]} rows of logprobs for a prompt of {len(prompt)} tokens")
    logprobs = logprobs.float()
    out = PromptScores()
    if scoring.logprobs:
        out.logprobs = logprobs.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1).tolist()
    if scoring.topk:
        values, ids = logprobs.topk(min(scoring.topk, logprobs.shape[1]), dim=1)
        out.topk = (ids.tolist(), values.tolist())
    if scoring.targets is not None:
        out.targets = target_logprobs(logprobs, scoring.targets)
    if scoring.alt_k:
        draws = draw_alternatives(logprobs, scoring.alt_k, scoring.alt_temperature, scoring.alt_seed)
        out.alt = (draws.tolist(), logprobs.gather(1, draws).tolist())
    return out


def target_logprobs(logprobs: torch.Tensor, targets: tuple[tuple[int, ...], ...]) -> list[list[float]]:
    """``logprobs[i, t]`` for each id t of row i of ``targets``; 0.0 where t is -1."""
    if len(targets) != logprobs.shape[0]:
        raise ValueError(f"targets have {len(targets)} rows, expected {logprobs.shape[0]}")
    ids = torch.tensor(targets, dtype=torch.long).reshape(logprobs.shape[0], -1)
    asked = ids >= 0
    return torch.where(asked, logprobs.gather(1, ids.clamp_min(0)), 0.0).tolist()


def draw_alternatives(logprobs: torch.Tensor, k: int, temperature: float, seed: int | None) -> torch.Tensor:
    """[rows, k] token ids drawn with replacement from each row's distribution at ``temperature``."""
    if temperature == 0:
        return logprobs.argmax(dim=1, keepdim=True).expand(-1, k).contiguous()
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    probs = torch.softmax(logprobs / temperature, dim=1)
    return torch.multinomial(probs, k, replacement=True, generator=generator)
