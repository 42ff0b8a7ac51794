"""Stability records for `stable_reinforce`: what the samplers recorded for each sequence sampled
with `record_stability_info`, and training datums' provenance resolved against it.

The SDK sets `record_stability_info` on every request of a sampling client made with
`record_stability_info=True`. For such a request the server records, under each sequence id it
hands back, the prompt, the sampled tokens and the sampler's logprob of each. Records belong to
the session that sampled them and expire a day after sampling or after the last training request
that used them (Tinker's terms); finishing the session drops them.

A `stable_reinforce` datum names the recorded sequence behind each of its tokens through its
provenance (`Datum.with_provenance`: prompt and sampled runs tiling `model_input` and
`target_tokens`). `resolve` checks every named token against the record (the same token at that
position of that sequence) and gives the datum the sampler's recorded logprob at each sampled
target position (`logprobs`) and a `mask` of those positions, which is what the loss reads. An
unknown, expired or other session's sequence, a token that differs, runs that do not tile the
field, or a datum without provenance is a user error naming the datum and the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshrl.api.errors import UserError
from meshrl.serve.wire import Provenance, ProvenanceSpan
from meshrl.types import Datum

RECORD_TTL_S = 24 * 3600.0
"""How long a record stays usable after its sampling, or after the last training request that
used it (Tinker: one day)."""

_PRUNE_EVERY_S = 60.0


@dataclass
class _Record:
    session_id: str
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    expires: float


class StabilityRecords:
    """The records of every session, by sequence id (thread-safe: samples are recorded on the
    event loop, datums resolved on the training models' workers)."""

    def __init__(self, ttl_s: float = RECORD_TTL_S, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = ttl_s
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._next_prune = clock() + _PRUNE_EVERY_S

    def record(self, session_id: str, sequence_ids: Sequence[str], prompt: Sequence[int], sequences) -> None:
        """Record the samples of one request (``sequences``: the backend's, each with ``tokens``
        and ``logprobs``) under their sequence ids."""
        now = self._clock()
        prompt = tuple(prompt)
        with self._lock:
            for sequence_id, seq in zip(sequence_ids, sequences, strict=True):
                self._records[sequence_id] = _Record(session_id, prompt, tuple(seq.tokens), tuple(seq.logprobs),
                                                     now + self._ttl_s)
            if now >= self._next_prune:
                self._next_prune = now + _PRUNE_EVERY_S
                for sequence_id in [s for s, r in self._records.items() if r.expires <= now]:
                    del self._records[sequence_id]

    def close_session(self, session_id: str) -> None:
        """Drop a finished session's records."""
        with self._lock:
            for sequence_id in [s for s, r in self._records.items() if r.session_id == session_id]:
                del self._records[sequence_id]

    def resolve(self, session_id: str, datums: list[Datum], provenance: list[Provenance | None]) -> list[Datum]:
        """``datums`` (of a training request of ``session_id``) with `logprobs` and `mask` from the
        records their provenance names; UserError for anything that does not match."""
        now = self._clock()
        out = []
        with self._lock:
            for i, (datum, spans) in enumerate(zip(datums, provenance, strict=True)):
                if spans is None:
                    raise UserError(f"data[{i}]: stable_reinforce needs the datum's provenance (Datum.with_provenance "
                                    "naming the sequence_id behind each token; sample with record_stability_info=True)")
                targets = datum.loss_fn_inputs.get("target_tokens")
                if targets is None or targets.dim() != 1:
                    raise UserError(f"data[{i}].loss_fn_inputs: stable_reinforce needs 1-D target_tokens")
                model_spans, target_spans = spans
                self._positions(f"data[{i}].model_input", model_spans, datum.model_input.to_ints(), session_id, now)
                logprobs = torch.zeros(datum.length)
                mask = torch.zeros(datum.length)
                for position, record, run, index in self._positions(f"data[{i}].target_tokens", target_spans,
                                                                    targets.tolist(), session_id, now):
                    if run.sampled:
                        logprobs[position] = record.logprobs[index]
                        mask[position] = 1.0
                out.append(Datum(datum.model_input, {**datum.loss_fn_inputs, "logprobs": logprobs, "mask": mask}))
        return out

    def _positions(self, where: str, runs: list[ProvenanceSpan], values: list[int], session_id: str,
                   now: float) -> list[tuple[int, _Record, ProvenanceSpan, int]]:
        """(position, record, run, index in the record) for each position of a field the runs
        tile, after checking that the field's token there is the recorded one."""
        covered = sum(run.length for run in runs)
        if covered != len(values):
            raise UserError(f"{where}: the provenance runs cover {covered} positions, the field has {len(values)}")
        out, position = [], 0
        for j, run in enumerate(runs):
            record = self._record(f"{where} run {j}", run.sequence_id, session_id, now)
            kind = "sampled" if run.sampled else "prompt"
            source = record.tokens if run.sampled else record.prompt
            if run.offset < 0 or run.length < 0 or run.offset + run.length > len(source):
                raise UserError(f"{where} run {j}: {kind} positions {run.offset}..{run.offset + run.length - 1} of "
                                f"sequence {run.sequence_id!r}, which has {len(source)} {kind} tokens")
            for k in range(run.length):
                if values[position + k] != source[run.offset + k]:
                    raise UserError(f"{where}[{position + k}] is token {values[position + k]}, but {kind} token "
                                    f"{run.offset + k} of sequence {run.sequence_id!r} is {source[run.offset + k]}")
                out.append((position + k, record, run, run.offset + k))
            position += run.length
        return out

    def _record(self, where: str, sequence_id: str, session_id: str, now: float) -> _Record:
        record = self._records.get(sequence_id)
        if record is None or record.session_id != session_id:
            raise UserError(f"{where}: no recorded sequence {sequence_id!r} in this session (sample with "
                            "record_stability_info=True, and train in the session that sampled)")
        if record.expires <= now:
            raise UserError(f"{where}: sequence {sequence_id!r} was recorded more than a day ago (or last "
                            "trained on then)")
        record.expires = now + self._ttl_s
        return record
