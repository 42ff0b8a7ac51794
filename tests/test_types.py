"""Tinker-shaped data types: alignment, validation."""

import pytest
import torch

from meshrl.training.batching import pad_datums, split_micro_batches
from meshrl.types import AdamParams, Datum, EncodedTextChunk, ModelInput, SamplingParams


def test_model_input_chunks():
    mi = ModelInput((EncodedTextChunk((1, 2, 3)), EncodedTextChunk((4, 5))))
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5 and len(mi.chunks) == 2
    assert ModelInput(()).length == 0
    assert mi.to_tensor().dtype == torch.long


def test_datum_from_sequence_shifts_once():
    tokens = [10, 11, 12, 13, 14]
    weights = [0, 0, 1, 1, 1]  # tokens 12..14 are assistant tokens
    d = Datum.from_sequence(tokens, weights=weights, logprobs=[0.0, 0.0, -0.1, -0.2, -0.3])
    assert d.model_input.to_ints() == [10, 11, 12, 13]
    assert d.loss_fn_inputs["target_tokens"].tolist() == [11, 12, 13, 14]
    # position i predicts token i+1: position 1 predicts token 12 (an assistant token, weight 1)
    assert d.loss_fn_inputs["weights"].tolist() == [0, 1, 1, 1]
    assert d.loss_fn_inputs["weights"].dtype == torch.int64  # integer input stays integer
    torch.testing.assert_close(d.loss_fn_inputs["logprobs"], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    assert d.loss_fn_inputs["logprobs"].dtype == torch.float32


def test_datum_validates_lengths():
    with pytest.raises(ValueError, match="expected first dim 3"):
        Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": torch.tensor([1, 2])})
    with pytest.raises(ValueError, match="expected 3"):
        Datum.from_sequence([1, 2, 3], weights=[1, 1])
    with pytest.raises(ValueError, match="at least 2"):
        Datum.from_sequence([1])


def test_stacking_ragged_datums():
    a = Datum.from_sequence([1, 2, 3], weights=[0.0, 1.0, 1.0])
    b = Datum.from_sequence([4, 5], weights=[0.0, 1.0])
    mb = pad_datums([a, b], pad_id=0)
    assert mb.input_ids.tolist() == [[1, 2], [4, 0]]
    assert mb.attention_mask.tolist() == [[1, 1], [1, 0]]
    assert mb.inputs["weights"].tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_per_sequence_and_multi_dim_inputs_pad():
    a = Datum.from_sequence([1, 2, 3], per_sequence={"advantages": 0.5}, topk=torch.ones(3, 2))
    b = Datum.from_sequence([4, 5], per_sequence={"advantages": -1.0}, topk=torch.full((2, 2), 2.0))
    assert a.loss_fn_inputs["advantages"].dim() == 0
    mb = pad_datums([a, b], pad_id=0)
    assert mb.inputs["advantages"].tolist() == [0.5, -1.0]
    assert mb.inputs["topk"].tolist() == [[[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [0.0, 0.0]]]
    c = Datum.from_sequence([4, 5], advantages=[0.0, 1.0], topk=torch.ones(2, 2))
    with pytest.raises(ValueError, match="per-sequence in some datums"):
        pad_datums([a, c], pad_id=0)


def test_micro_batches_keep_items_together_sorted_by_length():
    d = [Datum.from_sequence(list(range(n))) for n in (6, 2, 5, 3, 4, 7)]
    # items of two (e.g. DPO chosen + rejected): (6,2) (5,3) (4,7) sorted by their longest member
    batches = split_micro_batches(d, size=4, per_item=2)
    assert [[x.length + 1 for x in b] for b in batches] == [[5, 3, 6, 2], [4, 7]]
    assert [[x.length + 1 for x in b] for b in split_micro_batches(d, size=4)] == [[2, 3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="items of 2"):
        split_micro_batches(d[:5], size=4, per_item=2)


def test_micro_batches_stay_within_a_padded_token_budget():
    d = [Datum.from_sequence(list(range(n + 1))) for n in (6, 2, 5, 3, 4, 1)]  # lengths 6, 2, 5, 3, 4, 1
    lengths = lambda batches: [[x.length for x in b] for b in batches]  # noqa: E731
    # padded tokens = datums x the longest: [1, 2] 4, [3, 4] 8, [5] and [6] alone (a pair would be 10, 12)
    assert lengths(split_micro_batches(d, size=4, max_tokens=8)) == [[1, 2], [3, 4], [5], [6]]
    assert lengths(split_micro_batches(d, size=4, max_tokens=3)) == [[1], [2], [3], [4], [5], [6]]  # longer: alone
    assert lengths(split_micro_batches(d, size=2, max_tokens=100)) == [[1, 2], [3, 4], [5, 6]]  # the count caps too
    assert lengths(split_micro_batches(d, size=4, max_tokens=0)) == [[1, 2, 3, 4], [5, 6]]  # 0: no budget
    # pairs stay together: (4,1) (5,3) (6,2) by their longest; 4 datums x 5 = 20 fit, 6 x 6 = 36 do not
    assert lengths(split_micro_batches(d, size=4, per_item=2, max_tokens=20)) == [[4, 1, 5, 3], [6, 2]]


def test_param_validation():
    assert AdamParams().beta2 == 0.95
    with pytest.raises(ValueError, match="beta1"):
        AdamParams(beta1=1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match="mix"):
        SamplingParams(stop=["a", 2])
    assert SamplingParams(stop=[2, 3]).stop == (2, 3)
