"""Preference pairs from agreed-on teacher actions, as token ids, their `dpo` Datums and their JSON
records (a DiLoCo shard's, the run directory's `pairs.jsonl`), read back by offline DPO
(`meshrl sft --pairs`)."""

from __future__ import annotations

from dataclasses import dataclass

from meshrl.losses.preference import REFERENCE_INPUT
from meshrl.types import Datum


@dataclass
class PreferenceItem:
    """One preference pair for the same prompt (all token ids)."""

    key: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    version: int | None = None
    """The policy version that sampled the replayed trace, by which the replay term drops a pair
    grown too old before its turn (`replay.pool.max_version_lag`); None where it is not known
    (pairs read from rollout shards, checkpoints that predate it)."""
    reference: list[float] | None = None
    """[chosen, rejected]: each answer's sequence log-probability (the sum over its tokens) under
    the reference policy, computed once when the pair was formed (`replay.reference:
    precomputed`); None where it was not (the learner then computes it on every pass)."""


def dpo_datums(items: list[PreferenceItem], weight: float) -> list[Datum]:
    """Two Datums per pair, chosen then rejected, each answer's tokens masked in and the pair's
    term weighted by ``weight``; a pair's precomputed reference values go with its datums
    (`REFERENCE_INPUT`). Either every pair has them or none (ValueError), so that a micro-batch
    never mixes the two."""
    with_reference = {item.reference is not None for item in items}
    if len(with_reference) > 1:
        raise ValueError("dpo_datums: some pairs carry precomputed reference logprobs and others do not")
    datums = []
    for item in items:
        for i, answer in enumerate((item.chosen, item.rejected)):
            per_sequence = {"weight": weight}
            if item.reference is not None:
                per_sequence[REFERENCE_INPUT] = item.reference[i]
            datums.append(Datum.from_sequence(item.prompt + answer, per_sequence=per_sequence,
                                              mask=[0] * len(item.prompt) + [1] * len(answer)))
    return datums


def preference_record(item: PreferenceItem, step: int, **about) -> dict:
    """One preference pair as a JSON record of kind `preference`: its key, the token ids of the
    exact context the student saw (`prompt_tokens`), of the teachers' agreed answer (`chosen`) and
    of the student's (`rejected`), the step, and ``about`` it (a DiLoCo shard: `diloco_round`; the
    run directory's `pairs.jsonl`: teachers, agreement, cost, texts and status)."""
    return {"kind": "preference", "step": step, "key": item.key, "prompt_tokens": list(item.prompt),
            "chosen": list(item.chosen), "rejected": list(item.rejected), **about}


def item_from_record(record: dict, key_prefix: str = "") -> PreferenceItem:
    """A `preference_record` back as a PreferenceItem (its key after ``key_prefix``);
    KeyError/TypeError/ValueError on a malformed record."""
    prompt, chosen, rejected = ([int(t) for t in record[k]] for k in ("prompt_tokens", "chosen", "rejected"))
    if not chosen or not rejected:
        raise ValueError(f"pair {record.get('key')}: an empty answer")
    if any(t < 0 for t in prompt + chosen + rejected):
        raise ValueError(f"pair {record.get('key')}: a negative token id")
    return PreferenceItem(f"{key_prefix}{record['key']}", prompt, chosen, rejected)


def pair_record(item: PreferenceItem, step: int, pair, version: int, trace_cost_usd: float, trace_pairs: int,
                trains: bool, identical: bool) -> dict:
    """The `pairs.jsonl` record of a teacher pair (``pair``: a meshrl.replay.trace.ReplayPair) made
    in step ``step`` from a trace sampled by policy ``version``: the token ids, the frozen context,
    both texts, the agreeing teachers and the k-of-N vote, the trace's teacher spend shared over its
    ``trace_pairs`` pairs, and its status: `buffered` for training (``trains``), `exported` with a
    generation job's shards, or `dropped` (the agreed answer's tokens equal the student's)."""
    p = pair.preference
    status = "dropped" if identical else "buffered" if trains else "exported"
    return preference_record(
        item, step, version=version, context=list(pair.context), chosen_text=p.chosen, rejected_text=p.rejected,
        teachers=list(p.agreeing_teachers), votes=p.votes, n_teachers=p.n_teachers, n_answered=p.n_answered,
        agreement=f"{p.votes} of {p.n_teachers}", trace_cost_usd=trace_cost_usd,
        cost_usd=trace_cost_usd / max(trace_pairs, 1), status=status,
        drop_reason="identical_to_student" if identical else None)
