"""Answer log-probabilities under a frozen model, forward only: what DPO's reference is of a pair.

For a sequence s and the index ``start`` where its answer begins, the answer's sequence
log-probability at temperature T is

    sum_{t = start}^{len(s) - 1} log softmax(logits_{t-1} / T)[s_t]

(logits at position t-1 predict token t), exactly the sum the `dpo` loss takes over a datum's
masked-in target tokens (meshrl.losses.preference.sequence_logprobs): the learner's datum of
``prompt + answer`` has mask 1 on the answer's tokens. The same code path as the learner's
(:class:`ValidLogits`, the chunked log-softmax of meshrl.logprobs) computes it here, so the only
difference from the learner's frozen float32 reference is the weights' dtype.
"""

from __future__ import annotations

import torch

from meshrl.logprobs import token_logprobs_and_entropy
from meshrl.training.data_parallel import ValidLogits


@torch.no_grad()
def answer_logprob_sums(model: ValidLogits, sequences: list[list[int]], starts: list[int], pad_id: int,
                        device: torch.device, temperature: float = 1.0, batch_size: int = 8,
                        chunk_size: int = 1024) -> list[float]:
    """Per sequence, the sum of its tokens' log-probabilities from ``starts[i]`` on (1 <= start <
    len), at ``temperature``; ``batch_size`` sequences per right-padded forward."""
    for seq, start in zip(sequences, starts):
        if not 1 <= start < len(seq):
            raise ValueError(f"answer start {start} outside a sequence of {len(seq)} tokens (a prompt and an answer)")
    out: list[float] = []
    for first in range(0, len(sequences), batch_size):
        rows = [torch.tensor(s, dtype=torch.long) for s in sequences[first:first + batch_size]]
        begins = starts[first:first + batch_size]
        ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_id)
        lengths = torch.tensor([len(r) for r in rows])
        positions = torch.arange(ids.shape[1])[None, :]
        attention = (positions < lengths[:, None]).long()
        # input position p predicts token p + 1: the answer's tokens start..len-1 are read at start-1..len-2
        valid = (positions >= torch.tensor(begins)[:, None] - 1) & (positions < lengths[:, None] - 1)
        logits = model(ids.to(device), attention.to(device), valid.to(device))
        targets = ids[:, 1:][valid[:, :-1]].to(device)
        logp, _ = token_logprobs_and_entropy(logits, targets, chunk_size, temperature)
        row = torch.arange(len(rows))[:, None].expand_as(valid)[valid].to(device)
        sums = torch.zeros(len(rows), dtype=logp.dtype, device=device).index_add_(0, row, logp)
        out += sums.double().cpu().tolist()
    return out
