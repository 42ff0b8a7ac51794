"""Scoring many continuations of shared contexts without a grad, each shared prefix forwarded once
(SDPO's hinted teacher: the sites of one prompt's samples share the prompt, and a multi-turn
episode's sites its opening turns).

`prefix_groups` (meshrl.training.prefix_trees) sorts the sequences and groups neighbours whose
common prefix is long enough to be worth sharing. `topk_at_positions` runs the groups' prefixes
through the decoder once, together, keeps their keys and values, and runs every member's remaining
tokens on top of its group's (right-padded micro-batches that mix the groups); the vocabulary
projection runs only at the positions asked for. A sequence with no partner is forwarded whole,
batched with the others like it.

Unlike the training pass's trees (meshrl.training.prefix_trees), a rest attends to its prefix's
cached keys and values without a mask over a whole tree's row: for long multi-turn contexts that
measured 1.7x faster than trees (benchmarks/sdpo_teacher_cost.py). The training pass keeps the
trees: one forward and one backward per micro-batch, in step with the other ranks under FSDP2.
"""

from __future__ import annotations

import torch

from meshrl.logprobs import topk_logprobs
from meshrl.training.prefix_trees import prefix_groups, right_padded


def _prefix_caches(decoder, prefixes: list[list[int]], pad_id: int, max_rows: int, device: torch.device):
    """Per layer, the keys and values [G, heads, P, dim] of the right-padded ``prefixes`` (P the
    longest), and their attention mask [G, P]: one forward per ``max_rows`` of them."""
    ids, mask = right_padded(prefixes, max(len(p) for p in prefixes), pad_id)
    ids, mask = ids.to(device), mask.to(device)
    layers: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for at in range(0, len(prefixes), max_rows):
        cache = decoder(input_ids=ids[at : at + max_rows], attention_mask=mask[at : at + max_rows],
                        use_cache=True).past_key_values
        for n, layer in enumerate(cache.layers):
            if n == len(layers):
                layers.append(([], []))
            layers[n][0].append(layer.keys)
            layers[n][1].append(layer.values)
    return [(torch.cat(k), torch.cat(v)) for k, v in layers], mask


def _hidden_states(model, rows: list[list[int]], skip: list[int], cached, pad_id: int, device: torch.device):
    """The decoder's last hidden states [B, S, H] of ``rows[b][skip[b]:]``, right-padded. With
    ``cached`` = (per-layer keys and values, their mask, each row's index into them), row b runs
    on top of its cached prefix, the ``skip[b]`` tokens before."""
    from transformers import DynamicCache

    ids, mask = right_padded([r[s:] for r, s in zip(rows, skip)], max(len(r) - s for r, s in zip(rows, skip)), pad_id)
    positions = torch.tensor(skip)[:, None] + torch.arange(ids.shape[1])[None, :]
    cache, mask = None, mask.to(device)
    if cached is not None:
        kv, prefix_mask, index = cached
        cache = DynamicCache(ddp_cache_data=[(k[index], v[index]) for k, v in kv], config=model.config)
        mask = torch.cat([prefix_mask[index], mask], dim=1)
    out = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask, position_ids=positions.to(device),
                              past_key_values=cache, use_cache=cache is not None)
    return out.last_hidden_state


@torch.no_grad()
def topk_at_positions(model, sequences: list[list[int]], starts: list[int], lengths: list[int], k: int, *,
                      pad_id: int, max_rows: int, min_prefix: int,
                      device: torch.device) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """Per sequence, at the positions of the HF causal LM ``model`` that predict
    ``seq[start : start + length]``: the top-``k`` next-token (indices int32, log-probs float32;
    ``k = 0``: None and the full vocabulary) at temperature 1, and the log-probability of the
    sequence's own token there (float32 [length]), on the CPU. The shared prefixes of at least
    ``min_prefix`` tokens (`prefix_groups`; 0: none shared) run first, all together, then every
    sequence's rest on top of its group's prefix, at most ``max_rows`` sequences a forward
    (similar lengths together); the vocabulary projection runs at the scored positions only.
    Runs in the caller's autocast."""
    if any(s < 1 or length < 1 or s + length > len(seq) for seq, s, length in zip(sequences, starts, lengths)):
        raise ValueError("topk_at_positions: every scored span needs a token before it and must lie in its sequence")
    first = [s - 1 for s in starts]
    groups = prefix_groups(sequences, first, min_prefix)
    shared = [g for g in groups if g.prefix]
    head = model.get_output_embeddings()
    out: list = [None] * len(sequences)
    batches: list[tuple[list[int], list[int], object]] = []  # (sequences, their skipped tokens, cached)
    if shared:
        kv, prefix_mask = _prefix_caches(model.get_decoder(), [sequences[g.members[0]][: g.prefix] for g in shared],
                                         pad_id, max_rows, device)
        rows = sorted(((i, n) for n, g in enumerate(shared) for i in g.members),
                      key=lambda row: len(sequences[row[0]]) - shared[row[1]].prefix)
        for at in range(0, len(rows), max_rows):
            chunk = rows[at : at + max_rows]
            index = torch.tensor([n for _, n in chunk], device=device)
            batches.append(([i for i, _ in chunk], [shared[n].prefix for _, n in chunk], (kv, prefix_mask, index)))
    alone = [i for g in groups if not g.prefix for i in g.members]
    batches += [(alone[at : at + max_rows], [0] * len(alone[at : at + max_rows]), None)
                for at in range(0, len(alone), max_rows)]
    for members, skip, cached in batches:
        hidden = _hidden_states(model, [sequences[i] for i in members], skip, cached, pad_id, device)
        row = torch.cat([torch.full((lengths[i],), b) for b, i in enumerate(members)])
        column = torch.cat([torch.arange(first[i] - s, first[i] - s + lengths[i]) for i, s in zip(members, skip)])
        logp = torch.log_softmax(head(hidden[row.to(device), column.to(device)]).float(), dim=-1)
        indices, values = topk_logprobs(logp, k)  # a log-softmax of log-probabilities is themselves
        targets = torch.tensor([t for i in members for t in sequences[i][starts[i] : starts[i] + lengths[i]]],
                               device=device)
        own = logp.gather(-1, targets[:, None]).squeeze(-1).cpu()
        values = values.cpu()
        indices = None if indices is None else indices.cpu()
        at = 0
        for i in members:
            part = slice(at, at + lengths[i])
            out[i] = (None if indices is None else indices[part], values[part], own[part])
            at += lengths[i]
    return out
