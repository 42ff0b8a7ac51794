"""Scoring many continuations of shared contexts without a grad (SDPO's hinted teacher: the sites of
one prompt's samples share the prompt, and a multi-turn episode's sites its opening turns).

`topk_at_positions` sorts the sequences by their tokens, so those that share a prefix are
neighbours, and runs them in micro-batches whose shared prefixes are laid as trees
(meshrl.training.prefix_trees): each prefix forwarded once, with the vocabulary projection only at
the positions asked for.
"""

from __future__ import annotations

import torch

from meshrl.logprobs import topk_logprobs
from meshrl.training.prefix_trees import attention_tokens, layout, right_padded


@torch.no_grad()
def topk_at_positions(model, sequences: list[list[int]], starts: list[int], lengths: list[int], k: int, *,
                      pad_id: int, max_rows: int, min_prefix: int,
                      device: torch.device) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """Per sequence, at the positions of the HF causal LM ``model`` that predict
    ``seq[start : start + length]``: the top-``k`` next-token (indices int32, log-probs float32;
    ``k = 0``: None and the full vocabulary) at temperature 1, and the log-probability of the
    sequence's own token there (float32 [length]), on the CPU. At most ``max_rows`` sequences a
    forward, neighbours in token order together; their shared prefixes of at least ``min_prefix``
    tokens (0: none) run once, as trees. Runs in the caller's autocast."""
    if any(s < 1 or length < 1 or s + length > len(seq) for seq, s, length in zip(sequences, starts, lengths)):
        raise ValueError("topk_at_positions: every scored span needs a token before it and must lie in its sequence")
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    out: list = [None] * len(sequences)
    for at in range(0, len(order), max_rows):
        members = order[at : at + max_rows]
        rows = [sequences[i] for i in members]
        width = max(len(r) for r in rows)
        ids, mask = right_padded(rows, width, pad_id)
        flat = torch.cat([b * width + torch.arange(starts[i] - 1, starts[i] - 1 + lengths[i])
                          for b, i in enumerate(members)])
        packed = layout(ids, [len(r) for r in rows], min_prefix, 0, attention_tokens(model.config))
        if packed is None:
            hidden = decoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        else:
            tree_mask = None if packed.mask is None else packed.mask.to(device)
            hidden = decoder(input_ids=packed.input_ids(ids, pad_id).to(device), attention_mask=tree_mask,
                             position_ids=packed.position_ids.to(device)).last_hidden_state
            flat = packed.index(flat)
        logp = torch.log_softmax(head(hidden.reshape(-1, hidden.shape[-1])[flat.to(device)]).float(), dim=-1)
        indices, values = topk_logprobs(logp, k)  # a log-softmax of log-probabilities is themselves
        targets = torch.tensor([t for i in members for t in sequences[i][starts[i] : starts[i] + lengths[i]]],
                               device=device)
        own = logp.gather(-1, targets[:, None]).squeeze(-1).cpu()
        values = values.cpu()
        indices = None if indices is None else indices.cpu()
        at_row = 0
        for i in members:
            part = slice(at_row, at_row + lengths[i])
            out[i] = (None if indices is None else indices[part], values[part], own[part])
            at_row += lengths[i]
    return out
