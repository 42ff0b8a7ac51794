"""Scoring many continuations of shared contexts without a grad, each shared prefix forwarded once
(SDPO's hinted teacher: the sites of one prompt's samples share the prompt, and a multi-turn
episode's sites its opening turns).

`prefix_groups` sorts the sequences and groups neighbours whose common prefix is long enough to be
worth sharing. `score_positions` runs each group's prefix through the decoder once, keeps its
keys and values, and runs the members' remaining tokens as one right-padded batch on top of them
(micro-batched); the vocabulary projection runs only at the positions asked for. A sequence with
no partner is forwarded whole, batched with the others like it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from meshrl.logprobs import topk_logprobs


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences whose first ``prefix`` tokens are the same (0: forwarded whole, no sharing)."""

    prefix: int
    members: list[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_groups(sequences: list[list[int]], first_positions: list[int], min_prefix: int) -> list[PrefixGroup]:
    """Group ``sequences`` by shared prefixes of at least ``min_prefix`` tokens, saving the most
    tokens ((members - 1) x prefix, summed over the groups). A group's prefix ends before every
    member's ``first_positions`` (the first position whose output is wanted: that and every later
    position are computed on top of the prefix). Groups are runs of the sequences in sorted
    order (a run's common prefix is the least of its neighbours'), chosen by dynamic programming;
    the sequences left alone (all of them for a ``min_prefix`` of 0) form one group of prefix 0,
    shortest first."""
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    n = len(order) if min_prefix > 0 else 0  # 0: no sharing, every sequence alone
    best = [0] * (n + 1)  # best[j]: the most tokens saved grouping order[:j]
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (where the last run of order[:j] starts, its prefix)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], (j - 1, 0)  # order[j - 1] alone
        shared = first_positions[order[j - 1]]
        for i in range(j - 2, -1, -1):  # the run order[i:j]
            shared = min(shared, first_positions[order[i]], common_prefix(sequences[order[i]], sequences[order[i + 1]]))
            if shared < min_prefix:
                break
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], cut[j] = best[i] + (j - 1 - i) * shared, (i, shared)
    groups: list[PrefixGroup] = []
    alone: list[int] = []
    j = n
    while j > 0:
        i, shared = cut[j]
        if shared:
            groups.append(PrefixGroup(shared, order[i:j]))
        else:
            alone.extend(order[i:j])
        j = i
    groups.reverse()
    alone += order[n:]
    if alone:
        groups.append(PrefixGroup(0, sorted(alone, key=lambda i: (len(sequences[i]), i))))
    return groups


def _prefix_cache(decoder, prefix: torch.Tensor):
    """Per layer, the (keys, values) of ``prefix`` [P] (one forward of the decoder)."""
    out = decoder(input_ids=prefix[None], use_cache=True)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def _hidden_states(model, sequences: list[list[int]], start: int, kv, pad_id: int,
                   device: torch.device) -> torch.Tensor:
    """The decoder's last hidden states [B, S, H] of ``sequences[b][start:]`` (right-padded), on
    top of the cached ``kv`` of the ``start`` tokens they share (None when ``start`` is 0)."""
    from transformers import DynamicCache

    width = max(len(s) - start for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), start + width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq) - start] = torch.tensor(seq[start:])
        mask[b, : len(seq)] = 1
    cache = None
    if start:
        n = len(sequences)
        cache = DynamicCache(ddp_cache_data=[(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1)) for k, v in kv],
                             config=model.config)
    positions = torch.arange(start, start + width, device=device).expand(len(sequences), -1)
    out = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions,
                              past_key_values=cache, use_cache=cache is not None)
    return out.last_hidden_state


@torch.no_grad()
def score_positions(model, sequences: list[list[int]], starts: list[int], lengths: list[int],
                    reduce: Callable[[torch.Tensor, int], object], *, pad_id: int, max_rows: int,
                    min_prefix: int, device: torch.device) -> list:
    """For each sequence, ``reduce(logits, i)`` of the HF causal LM ``model``'s logits [length, V]
    at the positions that predict ``sequences[i][start : start + length]``, each shared prefix of
    at least ``min_prefix`` tokens forwarded once (`prefix_groups`; 0: none shared), at most
    ``max_rows`` sequences a forward. Runs in the caller's autocast."""
    if any(s < 1 or length < 1 or s + length > len(seq) for seq, s, length in zip(sequences, starts, lengths)):
        raise ValueError("score_positions: every scored span needs a token before it and must lie in its sequence")
    first = [s - 1 for s in starts]
    groups = prefix_groups(sequences, first, min_prefix)
    head = model.get_output_embeddings()
    out: list = [None] * len(sequences)
    for group in groups:
        kv = _prefix_cache(model.get_decoder(), torch.tensor(sequences[group.members[0]][: group.prefix],
                                                              device=device)) if group.prefix else None
        for at in range(0, len(group.members), max_rows):
            rows = group.members[at : at + max_rows]
            hidden = _hidden_states(model, [sequences[i] for i in rows], group.prefix, kv, pad_id, device)
            for b, i in enumerate(rows):
                begin = first[i] - group.prefix
                out[i] = reduce(head(hidden[b, begin : begin + lengths[i]]), i)
    return out


def topk_at_positions(model, sequences: list[list[int]], starts: list[int], lengths: list[int], k: int,
                      **kwargs) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """Per sequence, at the positions predicting ``seq[start:start+length]`` (`score_positions`,
    whose keyword arguments ``kwargs`` are): the top-``k`` next-token (indices int32, log-probs
    float32; ``k = 0``: None and the full vocabulary) at temperature 1, and the log-probability of
    the sequence's own token there (float32 [length]), all on the CPU."""

    def reduce(logits: torch.Tensor, i: int):
        logp = torch.log_softmax(logits.float(), dim=-1)
        indices, values = topk_logprobs(logp, k)  # a log-softmax of log-probabilities is themselves
        targets = torch.tensor(sequences[i][starts[i] : starts[i] + lengths[i]], device=logits.device)
        own = logp.gather(-1, targets[:, None]).squeeze(-1)
        return None if indices is None else indices.cpu(), values.cpu(), own.cpu()

    return score_positions(model, sequences, starts, lengths, reduce, **kwargs)
