"""Tinker-shaped data types: alignment, validation."""

import pytest
import torch

from meshrl.types import AdamParams, Datum, ModelInput, SamplingParams, stack_loss_inputs, stack_model_inputs


def test_model_input_chunks():
    mi = ModelInput.from_ints([1, 2, 3]).append_ints([4, 5])
    assert mi.to_ints() == [1, 2, 3, 4, 5] and mi.length == 5 and len(mi.chunks) == 2
    assert ModelInput.empty().length == 0
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
    assert stack_model_inputs([a, b], pad_token=0).tolist() == [[1, 2], [4, 0]]
    assert stack_loss_inputs([a, b], "weights").tolist() == [[1.0, 1.0], [1.0, 0.0]]


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
