"""`stable_reinforce`'s stability records (`meshrl.serve.stability`): what a sampler recorded per
sequence id, resolved against a training datum's provenance into the sampler's logprobs and the
sampled positions, and every way a datum can fail to match its records."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from meshrl.api.errors import UserError
from meshrl.serve.stability import StabilityRecords
from meshrl.serve.wire import ProvenanceSpan
from meshrl.types import Datum, ModelInput


@dataclass
class _Sampled:
    tokens: list[int]
    logprobs: list[float]


def prompt_run(sequence_id, length, offset=0):
    return ProvenanceSpan(False, sequence_id, offset, length)


def sampled_run(sequence_id, length, offset=0):
    return ProvenanceSpan(True, sequence_id, offset, length)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def records(clock):
    """Session s1 sampled prompt [5, 6, 7] twice: r:0 = [8, 9], r:1 = [10]; recorded for 10 s."""
    out = StabilityRecords(ttl_s=10.0, clock=clock)
    out.record("s1", ["r:0", "r:1"], [5, 6, 7], [_Sampled([8, 9], [-0.5, -1.5]), _Sampled([10], [-2.0])])
    return out


def cookbook_datum(targets=(6, 7, 8, 9), advantages=(0.0, 0.0, 1.0, 1.0)) -> Datum:
    """The datum the cookbook builds from r:0: input prompt + sampled[:-1], targets shifted by one,
    advantage only on the sampled tokens, and (unused here) its own copy of the logprobs."""
    return Datum(ModelInput.from_ints([5, 6, 7, 8]), {
        "target_tokens": torch.tensor(list(targets)), "advantages": torch.tensor(list(advantages)),
        "logprobs": torch.tensor([0.0, 0.0, -9.0, -9.0])})


COOKBOOK_RUNS = ([prompt_run("r:0", 3), sampled_run("r:0", 1)],
                 [prompt_run("r:0", 2, offset=1), sampled_run("r:0", 2)])


def test_a_datum_gets_the_recorded_logprobs_on_its_sampled_positions(records):
    [out] = records.resolve("s1", [cookbook_datum()], [COOKBOOK_RUNS])
    # the client's -9s are replaced by what the sampler recorded for r:0's tokens 8 and 9
    assert out.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.5]
    assert out.loss_fn_inputs["mask"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert out.loss_fn_inputs["advantages"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert out.model_input.to_ints() == [5, 6, 7, 8]


def test_two_turns_name_two_sequences(records):
    # turn 2 sampled [10] after a prompt that was turn 1's prompt and reply: [5, 6, 7, 8, 9]
    records.record("s1", ["r:2"], [5, 6, 7, 8, 9], [_Sampled([11, 12], [-0.25, -0.75])])
    datum = Datum(ModelInput.from_ints([5, 6, 7, 8, 9, 11]), {"target_tokens": torch.tensor([6, 7, 8, 9, 11, 12]),
                                                              "advantages": torch.zeros(6)})
    runs = ([prompt_run("r:0", 3), sampled_run("r:0", 2), sampled_run("r:2", 1)],
            [prompt_run("r:0", 2, offset=1), sampled_run("r:0", 2), sampled_run("r:2", 2)])
    [out] = records.resolve("s1", [datum], [runs])
    assert out.loss_fn_inputs["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.5, -0.25, -0.75]
    assert out.loss_fn_inputs["mask"].tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("runs, message", [
    (([prompt_run("r:0", 3), sampled_run("r:0", 1)], [prompt_run("r:0", 2, offset=1), sampled_run("r:0", 1)]),
     r"data\[0\].target_tokens: the provenance runs cover 3 positions, the field has 4"),
    (([prompt_run("r:0", 3), sampled_run("r:0", 1)], [prompt_run("r:0", 2, offset=1), sampled_run("r:1", 2)]),
     r"data\[0\].target_tokens run 1: sampled positions 0..1 of sequence 'r:1', which has 1 sampled tokens"),
    (([prompt_run("r:0", 3), sampled_run("r:0", 1)], [prompt_run("r:0", 2), sampled_run("r:0", 2)]),
     r"data\[0\].target_tokens\[0\] is token 6, but prompt token 0 of sequence 'r:0' is 5"),
    (([prompt_run("r:0", 3), sampled_run("r:9", 1)], [prompt_run("r:0", 2, offset=1), sampled_run("r:0", 2)]),
     r"data\[0\].model_input run 1: no recorded sequence 'r:9' in this session"),
])
def test_provenance_that_does_not_match_the_records_is_a_user_error(records, runs, message):
    with pytest.raises(UserError, match=message):
        records.resolve("s1", [cookbook_datum()], [runs])


def test_a_changed_token_is_caught():
    records = StabilityRecords()
    records.record("s1", ["r:0"], [5, 6, 7], [_Sampled([8, 9], [-0.5, -1.5])])
    with pytest.raises(UserError, match=r"target_tokens\[3\] is token 4, but sampled token 1 of sequence 'r:0' is 9"):
        records.resolve("s1", [cookbook_datum(targets=(6, 7, 8, 4))], [COOKBOOK_RUNS])


def test_records_belong_to_their_session_and_expire(records, clock):
    with pytest.raises(UserError, match="no recorded sequence 'r:0' in this session"):
        records.resolve("s2", [cookbook_datum()], [COOKBOOK_RUNS])
    with pytest.raises(UserError, match=r"data\[0\]: stable_reinforce needs the datum's provenance"):
        records.resolve("s1", [cookbook_datum()], [None])
    clock.now += 8
    records.resolve("s1", [cookbook_datum()], [COOKBOOK_RUNS])  # used at 108: usable until 118
    clock.now += 8
    records.resolve("s1", [cookbook_datum()], [COOKBOOK_RUNS])
    clock.now += 11
    with pytest.raises(UserError, match="sequence 'r:0' was recorded more than a day ago"):
        records.resolve("s1", [cookbook_datum()], [COOKBOOK_RUNS])
    records.close_session("s1")
    with pytest.raises(UserError, match="no recorded sequence 'r:0'"):
        records.resolve("s1", [cookbook_datum()], [COOKBOOK_RUNS])
