"""Chunked logprob/entropy utilities against the naive full-materialisation version."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from meshrl.logprobs import (
    causal_shift,
    compute_token_logprobs,
    selective_log_softmax,
    token_logprobs_and_entropy,
)


def naive_logprobs_entropy(logits, targets, temperature=1.0):
    logp_all = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


class LargestFloatTensor(TorchDispatchMode):
    """Records the largest float32/float64 tensor produced by any op while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.float64):
                self.largest = max(self.largest, t.numel())
        return out


def test_hand_computed_shift():
    # V = 2; position 0 predicts token 1 with p = 3/4; position 1 predicts token 0 with p = 1/2.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, -5.0]]])
    tokens = torch.tensor([[0, 1, 0]])
    out = compute_token_logprobs(logits, tokens, return_entropy=True)
    torch.testing.assert_close(out.logprobs, torch.tensor([[math.log(0.75), math.log(0.5)]]))
    h0 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(out.entropy, torch.tensor([[h0, math.log(2.0)]]))
    shifted_logits, shifted_tokens = causal_shift(logits, tokens)
    assert shifted_logits.shape == (1, 2, 2) and shifted_tokens.tolist() == [[1, 0]]


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_naive_float64(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64) * 3
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    out = compute_token_logprobs(logits, tokens, chunk_size=chunk_size, temperature=temperature, return_entropy=True)
    ref_lp, ref_h = naive_logprobs_entropy(logits[:, :-1], tokens[:, 1:], temperature)
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref_h, rtol=1e-12, atol=1e-12)
    unshifted = selective_log_softmax(logits, tokens, chunk_size=chunk_size, temperature=temperature)
    torch.testing.assert_close(unshifted, naive_logprobs_entropy(logits, tokens, temperature)[0])


def test_bf16_logits_give_float32_outputs_equal_to_upcast_naive():
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 9, 50, generator=g) * 4).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (2, 9), generator=g)
    out = compute_token_logprobs(logits, tokens, chunk_size=4, return_entropy=True)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    ref_lp, ref_h = naive_logprobs_entropy(logits.float()[:, :-1], tokens[:, 1:])
    torch.testing.assert_close(out.logprobs, ref_lp.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_h.float(), rtol=1e-5, atol=1e-5)


def test_gradients_equal_naive_autograd():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 8, (2, 6), generator=g)
    w_lp = torch.randn(2, 5, generator=g, dtype=torch.float64)
    w_h = torch.randn(2, 5, generator=g, dtype=torch.float64)
    out = compute_token_logprobs(logits, tokens, chunk_size=4, temperature=1.3, return_entropy=True)
    (grad,) = torch.autograd.grad((out.logprobs * w_lp).sum() + (out.entropy * w_h).sum(), logits)
    ref_lp, ref_h = naive_logprobs_entropy(logits[:, :-1], tokens[:, 1:], 1.3)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp).sum() + (ref_h * w_h).sum(), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert grad[:, -1].abs().sum() == 0  # the last position predicts nothing
    # logprob-only backward (entropy unused) also matches
    out = compute_token_logprobs(logits, tokens, chunk_size=3)
    (grad,) = torch.autograd.grad(out.logprobs.sum(), logits)
    ref_lp, _ = naive_logprobs_entropy(logits[:, :-1], tokens[:, 1:])
    (ref_grad,) = torch.autograd.grad(ref_lp.sum(), logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_gradcheck_logprobs_and_entropy():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (6,), generator=g)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs_and_entropy(x, targets, chunk_size=4, temperature=0.8), (logits,)
    )


def test_no_float32_tensor_of_batch_size_is_materialised():
    batch, length, vocab, chunk = 2, 64, 512, 16
    logits = torch.randn(batch, length, vocab).to(torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, vocab, (batch, length))
    with LargestFloatTensor() as tracker:
        out = compute_token_logprobs(logits, tokens, chunk_size=chunk, return_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert tracker.largest <= chunk * vocab
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.abs().sum() > 0
    # the tracker does see the naive version's full float32 tensor
    with LargestFloatTensor() as naive_tracker:
        torch.log_softmax(logits.float(), -1)
    assert naive_tracker.largest == batch * length * vocab


def test_shape_errors_are_one_line():
    with pytest.raises(ValueError, match="disagree"):
        causal_shift(torch.zeros(1, 3, 4), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="do not match"):
        selective_log_softmax(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))
