"""Losses against hand-computed values and float64 brute-force references (explicit Python loops)."""

import math

import pytest
import torch

from meshrl.losses import (
    Aggregation,
    GlobalCounts,
    aggregation_weights,
    cispo,
    cross_entropy,
    dpo,
    dro,
    generalized_jsd,
    generalized_jsd_topk,
    gspo,
    importance_sampling,
    ppo,
    sequence_logprobs,
)

LN = math.log


# ----------------------------------------------------------------------------- brute-force references


def _softmax_list(row, temperature=1.0):
    zs = [z / temperature for z in row]
    top = max(zs)
    exps = [math.exp(z - top) for z in zs]
    total = sum(exps)
    return [e / total for e in exps]


def _kl_list(p, q):
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def _jsd_list(s, t, beta):
    if beta == 0:
        return _kl_list(t, s)
    if beta == 1:
        return _kl_list(s, t)
    m = [(1 - beta) * si + beta * ti for si, ti in zip(s, t)]
    return beta * _kl_list(t, m) + (1 - beta) * _kl_list(s, m)


def _ragged_batch(seed=0, batch=3, length=5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    target = -torch.rand(batch, length, generator=g, dtype=dtype) * 2 - 0.1
    sampling = target.detach() + (torch.rand(batch, length, generator=g, dtype=dtype) - 0.5)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for b, n in enumerate([length, 2, length - 1][:batch]):
        mask[b, length - n:] = True  # left part = prompt, ragged response lengths
    adv = torch.tensor([1.5, -0.7, 0.3][:batch], dtype=dtype)
    return target.requires_grad_(), sampling, adv, mask


# ----------------------------------------------------------------------------- cross entropy


def test_cross_entropy_matches_bruteforce_with_weights_and_padding():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 6, (2, 4), generator=g)
    weights = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    out = cross_entropy(logits, targets, weights, chunk_size=3)
    expected, nll_terms = 0.0, []
    for b in range(2):
        for t in range(4):
            row = logits[b, t].tolist()
            nll = -math.log(_softmax_list(row)[targets[b, t]])
            expected += weights[b, t].item() * nll
            nll_terms.append(nll)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.metrics["weight_sum"] == 5.0
    assert out.metrics["nll_mean"] == pytest.approx(expected / 5.0)
    assert out.metrics["num_tokens"] == 4.0
    out.loss.backward()
    # d/dz of -w log softmax(z)[y] = w (softmax(z) - onehot(y))
    for b, t in [(0, 2), (1, 2), (1, 0)]:
        p = torch.tensor(_softmax_list(logits[b, t].tolist()), dtype=torch.float64)
        onehot = torch.nn.functional.one_hot(targets[b, t], 6).double()
        torch.testing.assert_close(logits.grad[b, t], weights[b, t] * (p - onehot), rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- importance sampling


def test_importance_sampling_hand_values_and_padding_garbage():
    # token 0: p=0.5, q=0.25 -> rho=2; token 1: p=q -> rho=1; token 2 is padding holding -inf/nan.
    target = torch.tensor([[LN(0.5), LN(0.2), float("-inf")]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[LN(0.25), LN(0.2), float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    out = importance_sampling(target, sampling, torch.tensor([1.5]), mask)
    assert out.loss.item() == pytest.approx(-(2 * 1.5 + 1 * 1.5))
    out.loss.backward()
    # dL/dlogp = -rho A on valid tokens, exactly 0 on padding (no nan)
    torch.testing.assert_close(target.grad, torch.tensor([[-3.0, -1.5, 0.0]], dtype=torch.float64))
    assert out.metrics["num_tokens"] == 2
    assert out.metrics["ratio_mean"] == pytest.approx(1.5)
    assert out.metrics["ratio_max"] == pytest.approx(2.0)
    # k1 = mean(log q - log p) = (log 0.5 + 0)/2 ... sign: log(0.25/0.5) = -log 2
    assert out.metrics["kl_sampler_learner_k1"] == pytest.approx(-LN(2) / 2)
    assert out.metrics["kl_sampler_learner_k3"] == pytest.approx((2 - 1 - LN(2)) / 2)


def test_importance_sampling_equals_reinforce_gradient_on_policy():
    target, _, adv, mask = _ragged_batch(seed=3)
    sampling = target.detach().clone()
    is_out = importance_sampling(target, sampling, adv, mask)
    (grad_is,) = torch.autograd.grad(is_out.loss, target)
    reinforce = -(adv[:, None] * target * mask).sum()
    (grad_rf,) = torch.autograd.grad(reinforce, target)
    torch.testing.assert_close(grad_is, grad_rf, rtol=0, atol=1e-12)
    assert is_out.loss.item() == pytest.approx(-(adv[:, None] * mask).sum().item())


def test_token_advantages_equal_broadcast_sequence_advantages():
    target, sampling, adv, mask = _ragged_batch(seed=4)
    a = ppo(target, sampling, adv, mask).loss
    b = ppo(target, sampling, adv[:, None].expand(-1, target.shape[1]).clone(), mask).loss
    assert a.item() == pytest.approx(b.item(), rel=1e-14)


# ----------------------------------------------------------------------------- PPO


BRUTE_FORCE_TOKEN_LOSS = {  # per-token loss l(rho, A, log p) from the definitions
    "importance_sampling": (lambda lp, s, a, m: importance_sampling(lp, s, a, m),
                            lambda rho, a, logp: -rho * a),
    "ppo": (lambda lp, s, a, m: ppo(lp, s, a, m, eps_low=0.2, eps_high=0.28),
            lambda rho, a, logp: -min(rho * a, min(max(rho, 0.8), 1.28) * a)),
    "cispo": (lambda lp, s, a, m: cispo(lp, s, a, m, clip_low=0.9, clip_high=1.1),
              lambda rho, a, logp: -min(max(rho, 0.9), 1.1) * a * logp),
}


@pytest.mark.parametrize("name", sorted(BRUTE_FORCE_TOKEN_LOSS))
def test_rl_losses_match_bruteforce_on_ragged_batch(name):
    loss_fn, per_token = BRUTE_FORCE_TOKEN_LOSS[name]
    target, sampling, adv, mask = _ragged_batch(seed=5)
    out = loss_fn(target, sampling, adv, mask)
    expected, n_clipped_cispo = 0.0, 0
    for b in range(3):
        for t in range(5):
            if mask[b, t]:
                logp = target[b, t].item()
                rho = math.exp(logp - sampling[b, t].item())
                expected += per_token(rho, adv[b].item(), logp)
                n_clipped_cispo += not 0.9 <= rho <= 1.1
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.metrics["num_tokens"] == 11
    if name == "ppo":
        assert 0 < out.metrics["clip_fraction"] < 1  # clipping is exercised
    if name == "cispo":
        assert 0 < n_clipped_cispo < 11  # both regimes are exercised
        assert out.metrics["clip_fraction"] == pytest.approx(n_clipped_cispo / 11)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_ppo_gradient_signs_on_both_sides_of_each_clip_boundary(advantage):
    eps_low, eps_high = 0.2, 0.28
    ratios = [1 - eps_low - 0.05, 1 - eps_low + 0.05, 1 + eps_high - 0.05, 1 + eps_high + 0.05]
    sampling = torch.full((1, 4), LN(0.3), dtype=torch.float64)
    target = (sampling + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_()
    out = ppo(target, sampling, torch.tensor([advantage], dtype=torch.float64), eps_low=eps_low, eps_high=eps_high)
    out.loss.backward()
    if advantage > 0:  # increasing p is rewarded until rho exceeds 1 + eps_high, then no gradient
        expected = [-advantage * r for r in ratios[:3]] + [0.0]
    else:  # decreasing p is rewarded until rho drops below 1 - eps_low, then no gradient
        expected = [0.0] + [-advantage * r for r in ratios[1:]]
    torch.testing.assert_close(target.grad, torch.tensor([expected], dtype=torch.float64))
    assert out.metrics["clip_fraction"] == pytest.approx(0.25)
    assert out.metrics["clip_fraction_high"] == pytest.approx(0.25 if advantage > 0 else 0.0)
    assert out.metrics["clip_fraction_low"] == pytest.approx(0.0 if advantage > 0 else 0.25)


@pytest.mark.parametrize("loss_fn", [importance_sampling, ppo, cispo])
def test_padding_with_nan_advantages_and_inf_logprobs_is_inert(loss_fn):
    target = torch.tensor([[LN(0.5), float("-inf")]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[LN(0.5), float("nan")]], dtype=torch.float64)
    adv = torch.tensor([[2.0, float("nan")]], dtype=torch.float64)
    out = loss_fn(target, sampling, adv, torch.tensor([[1, 0]]))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(target.grad).all()
    assert target.grad[0, 1] == 0
    assert all(math.isfinite(v) for v in out.metrics.values())


def test_ppo_clip_fraction_counts_only_valid_tokens():
    sampling = torch.zeros(1, 4, dtype=torch.float64)
    target = torch.log(torch.tensor([[2.0, 2.0, 1.0, 3.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0]])  # the padded token would be clipped but must not count
    out = ppo(target, sampling, torch.tensor([1.0], dtype=torch.float64), mask)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert out.loss.item() == pytest.approx(-(1.2 + 1.2 + 1.0))


@pytest.mark.parametrize("loss_fn", [importance_sampling, ppo, cispo])
def test_metrics_average_over_the_trained_tokens_not_the_prompt(loss_fn):
    # A Tinker datum: every position has weight 1, the prompt carries sampler logprob 0 and
    # advantage 0, the reply the sampler's real logprobs. Learner and sampler agree on the reply
    # (p = q = 0.5, 0.25); on the prompt the learner says p = 0.1, 0.2 against "q = 1".
    target = torch.tensor([[LN(0.1), LN(0.2), LN(0.5), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[0.0, 0.0, LN(0.5), LN(0.25)]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 0.0, 1.0, -1.0]], dtype=torch.float64)
    out = loss_fn(target, sampling, adv, torch.ones(1, 4))
    # over the reply: rho = 1, so k1 = k3 = 0 and nothing is clipped; over all four positions
    # k3 would be ((0.1 - 1 - ln 0.1) + (0.2 - 1 - ln 0.2)) / 4 = (1.4026 + 0.8094) / 4 = 0.553
    assert out.metrics["kl_sampler_learner_k1"] == 0.0
    assert out.metrics["kl_sampler_learner_k3"] == 0.0
    assert out.metrics["ratio_mean"] == 1.0 and out.metrics["ratio_max"] == 1.0
    assert out.metrics.get("clip_fraction", 0.0) == 0.0
    assert out.metrics["num_tokens"] == 4  # the loss still reads (and sums over) every position
    assert out.signal.tolist() == [[False, False, True, True]]


def test_clip_fraction_is_a_fraction_of_the_trained_tokens():
    # rho = 2 on both reply tokens (A = 1: clipped above 1.2); two prompt positions with A = 0
    sampling = torch.tensor([[0.0, 0.0, LN(0.25), LN(0.25)]], dtype=torch.float64)
    target = torch.tensor([[LN(0.5), LN(0.5), LN(0.5), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    out = ppo(target, sampling, torch.tensor([[0.0, 0.0, 1.0, 1.0]], dtype=torch.float64), torch.ones(1, 4))
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 2)  # token 2 of the 2 trained, not 1 of 4
    assert out.metrics["ratio_mean"] == pytest.approx((2 + 1) / 2)
    assert out.loss.item() == pytest.approx(-(1.2 + 1.0))


# ----------------------------------------------------------------------------- CISPO


def test_cispo_value_and_gradient_keep_clipped_tokens_alive():
    sampling = torch.tensor([[LN(0.1), LN(0.4), LN(0.5)]], dtype=torch.float64)
    target = torch.tensor([[LN(0.6), LN(0.2), LN(0.5)]], dtype=torch.float64, requires_grad=True)
    # rho = 6 (clipped to 4), 0.5, 1
    out = cispo(target, sampling, torch.tensor([[2.0, -1.0, 3.0]], dtype=torch.float64))
    expected = -(4 * 2.0 * LN(0.6) + 0.5 * -1.0 * LN(0.2) + 1.0 * 3.0 * LN(0.5))
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(target.grad, torch.tensor([[-8.0, 0.5, -3.0]], dtype=torch.float64))
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 3)


def test_cispo_lower_clip():
    sampling = torch.tensor([[LN(0.5)]], dtype=torch.float64)
    target = torch.tensor([[LN(0.1)]], dtype=torch.float64, requires_grad=True)  # rho = 0.2
    out = cispo(target, sampling, torch.tensor([1.0], dtype=torch.float64), clip_low=0.5, clip_high=2.0)
    assert out.loss.item() == pytest.approx(-0.5 * LN(0.1))
    assert out.metrics["clip_fraction_low"] == 1.0


# ----------------------------------------------------------------------------- DRO, GSPO, StableReinforce


def test_dro_hand_values_and_gradient():
    # p = 0.5, 0.25; q = 0.25, 0.25 (log rho = ln 2, 0); A = 1, -2; beta = 0.5; token 2 is padding
    target = torch.tensor([[LN(0.5), LN(0.25), float("-inf")]], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([[LN(0.25), LN(0.25), float("nan")]], dtype=torch.float64)
    out = dro(target, sampling, torch.tensor([[1.0, -2.0, float("nan")]], dtype=torch.float64),
              torch.tensor([[1, 1, 0]]), beta=0.5)
    # L = -[(1 ln 0.5 - 0.25 (ln 2)^2) + (-2 ln 0.25 - 0)] = -(-0.693147 - 0.120113 + 2.772589) = -1.959329
    assert out.loss.item() == pytest.approx(-(LN(0.5) - 0.25 * LN(2) ** 2 - 2 * LN(0.25)), rel=1e-12)
    assert out.loss.item() == pytest.approx(-1.959329, abs=1e-6)
    out.loss.backward()
    # dL/dlog p = -(A - beta log rho): -(1 - 0.5 ln 2) = -0.653426 and -(-2 - 0) = 2; padding 0
    torch.testing.assert_close(target.grad, torch.tensor([[-(1 - 0.5 * LN(2)), 2.0, 0.0]], dtype=torch.float64))
    assert out.metrics["kl_sampler_learner_k1"] == pytest.approx(-LN(2) / 2)


def test_dro_penalty_trains_tokens_without_advantage_and_counts_them():
    # a prompt token with A = 0 and sampler logprob 0: the penalty still pulls log p (= ln 0.5) to 0
    target = torch.tensor([LN(0.5), LN(0.5)], dtype=torch.float64, requires_grad=True)
    sampling = torch.tensor([0.0, LN(0.5)], dtype=torch.float64)
    adv = torch.tensor([0.0, 1.0], dtype=torch.float64)
    penalised = dro(target, sampling, adv, beta=0.1)
    assert penalised.loss.item() == pytest.approx(-(0 - 0.05 * LN(0.5) ** 2 + LN(0.5)))
    assert penalised.signal.tolist() == [True, True]
    (grad,) = torch.autograd.grad(penalised.loss, target)
    assert grad.tolist() == pytest.approx([0.1 * LN(0.5), -1.0])  # -(0 - 0.1 ln 0.5), -(1 - 0)
    assert dro(target, sampling, adv, beta=0.0).signal.tolist() == [False, True]


def _gspo_batch():
    # two sequences of three tokens; log rho per token and the tokens forming each sequence ratio
    log_rho = torch.log(torch.tensor([[2.0, 1.1, 1.0], [1.5, 1.5, 3.0]], dtype=torch.float64))
    sampling = torch.log(torch.tensor([[0.2, 0.3, 0.4], [0.1, 0.2, 0.25]], dtype=torch.float64))
    target = (sampling + log_rho).requires_grad_()
    ratio_mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    adv = torch.tensor([[0.0, 1.0, -1.0], [2.0, -1.0, 0.5]], dtype=torch.float64)
    return target, sampling, adv, ratio_mask


def test_gspo_sequence_ratio_hand_values_and_gradient():
    target, sampling, adv, ratio_mask = _gspo_batch()
    out = gspo(target, sampling, adv, ratio_mask=ratio_mask)  # clip to [0.8, 1.2]
    # s0 = exp((ln 1.1 + ln 1)/2) = sqrt(1.1) = 1.048809: inside the bounds, so sequence 0 adds
    #   -(s0 * 1 + s0 * -1) = 0; s1 = exp((ln 1.5 + ln 1.5)/2) = 1.5 (token 2's ln 3 is not in M):
    #   token 0 (A = 2 > 0, s > 1.2) -> 1.2 * 2 = 2.4, token 1 (A = -1) -> min(-1.5, -1.2) = -1.5,
    #   token 2 (A = 0.5 > 0, s > 1.2) -> 1.2 * 0.5 = 0.6; L = -(0 + 2.4 - 1.5 + 0.6) = -1.5
    assert out.loss.item() == pytest.approx(-1.5, rel=1e-12)
    out.loss.backward()
    # each token's gradient is -s A_t through its own log p (s itself has none); clipped tokens get 0
    s0 = math.sqrt(1.1)
    torch.testing.assert_close(target.grad, torch.tensor([[0.0, -s0, s0], [0.0, 1.5, 0.0]], dtype=torch.float64))
    # 5 signal tokens (A != 0); clipped above: sequence 1's tokens 0 and 2
    assert out.metrics["clip_fraction_high"] == pytest.approx(2 / 5)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 5) and out.metrics["clip_fraction_low"] == 0.0
    assert out.metrics["ratio_mean"] == pytest.approx((2 * s0 + 3 * 1.5) / 5)
    # k1 over the signal tokens' own log ratios: -(ln 1.1 + 0 + ln 1.5 + ln 1.5 + ln 3) / 5
    assert out.metrics["kl_sampler_learner_k1"] == pytest.approx(-(LN(1.1) + 2 * LN(1.5) + LN(3)) / 5)


def test_gspo_of_one_token_sequences_is_ppo_and_the_mask_is_the_default_ratio_mask():
    target, sampling, adv, mask = _ragged_batch(seed=6)
    singles = (target.reshape(-1, 1), sampling.reshape(-1, 1), adv[:, None].expand(-1, 5).reshape(-1, 1),
               mask.reshape(-1, 1))
    assert gspo(*singles).loss.item() == pytest.approx(ppo(*singles).loss.item(), rel=1e-12)
    assert gspo(target, sampling, adv, mask).loss.item() == pytest.approx(
        gspo(target, sampling, adv, mask, ratio_mask=mask.long()).loss.item(), rel=1e-12)


class _Pass:
    """A ForwardPass over given learner logprobs (what the learner hands a registered loss)."""

    def __init__(self, learner_logprobs, **inputs):
        self._logprobs, self.inputs = learner_logprobs, inputs

    def logprobs(self):
        return self._logprobs


def test_stable_reinforce_is_reinforce_with_a_truncated_importance_weight():
    from meshrl.losses import get_loss

    # prompt position (mask 0), then p = 0.75, 0.25 against the sampler's q = 0.25, 0.5: rho = 3, 0.5
    target = torch.tensor([[LN(0.1), LN(0.75), LN(0.25)]], dtype=torch.float64, requires_grad=True)
    fp = _Pass(target, logprobs=torch.tensor([[0.0, LN(0.25), LN(0.5)]], dtype=torch.float64),
               advantages=torch.tensor([[0.0, 1.0, -2.0]], dtype=torch.float64), mask=torch.tensor([[0, 1, 1]]))
    out = get_loss("stable_reinforce").fn(fp, truncation=2.0)
    # weights sg(min(rho, 2)) = 2, 0.5: L = -(2 * 1 * ln 0.75 + 0.5 * -2 * ln 0.25) = -0.810930
    assert out.loss.item() == pytest.approx(-(2 * LN(0.75) - LN(0.25)), rel=1e-12)
    assert out.loss.item() == pytest.approx(-0.810930, abs=1e-6)
    out.loss.backward()
    torch.testing.assert_close(target.grad, torch.tensor([[0.0, -2.0, 1.0]], dtype=torch.float64))
    assert out.metrics["clip_fraction_high"] == pytest.approx(1 / 2)  # rho = 3 was truncated


def test_registered_gspo_reads_sequence_ratio_mask_else_the_mask():
    from meshrl.losses import get_loss

    target, sampling, adv, ratio_mask = _gspo_batch()
    inputs = {"logprobs": sampling, "advantages": adv, "mask": torch.ones(2, 3)}
    spec = get_loss("gspo")
    with_mask = spec.fn(_Pass(target, sequence_ratio_mask=ratio_mask.float(), **inputs), **spec.config())
    assert with_mask.loss.item() == pytest.approx(-1.5, rel=1e-12)  # the hand-computed case above
    without = spec.fn(_Pass(target, **inputs), **spec.config())
    assert without.loss.item() == pytest.approx(gspo(target, sampling, adv).loss.item(), rel=1e-12)
    assert without.loss.item() != pytest.approx(-1.5)
    assert get_loss("dro").config({"beta": 0.2}) == {"beta": 0.2}
    assert spec.config() == {"eps_low": 0.2, "eps_high": 0.2}


# ----------------------------------------------------------------------------- generalized JSD


def _jsd_bruteforce(student, teacher, labels, beta, temperature=1.0, top_k=None):
    total, count = 0.0, 0
    for idx in torch.nonzero(labels != -100).tolist():
        s_row, t_row = student[tuple(idx)].tolist(), teacher[tuple(idx)].tolist()
        if top_k is not None:
            support = sorted(range(len(t_row)), key=lambda v: -t_row[v])[:top_k]
            s_row, t_row = [s_row[v] for v in support], [t_row[v] for v in support]
        s, t = _softmax_list(s_row, temperature), _softmax_list(t_row, temperature)
        total += _jsd_list(s, t, beta)
        count += 1
    return total / count


@pytest.fixture
def distill_batch():
    g = torch.Generator().manual_seed(7)
    student = torch.randn(2, 4, 7, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = (torch.randn(2, 4, 7, generator=g, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.tensor([[-100, 3, 1, -100], [2, -100, -100, 5]])
    return student, teacher, labels


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_explicit_formulas(distill_batch, beta, temperature):
    student, teacher, labels = distill_batch
    out = generalized_jsd(student, teacher, labels, beta=beta, temperature=temperature)
    expected = _jsd_bruteforce(student.detach(), teacher.detach(), labels, beta, temperature)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10)
    assert out.metrics["num_tokens"] == 4


def test_generalized_jsd_end_points_are_the_pure_kls(distill_batch):
    student, teacher, labels = distill_batch
    s = torch.log_softmax(student.detach(), -1)
    t = torch.log_softmax(teacher.detach(), -1)
    valid = labels != -100
    forward_kl = (t.exp() * (t - s)).sum(-1)[valid].mean()
    reverse_kl = (s.exp() * (s - t)).sum(-1)[valid].mean()
    assert generalized_jsd(student, teacher, labels, beta=0.0).loss.item() == pytest.approx(forward_kl.item())
    assert generalized_jsd(student, teacher, labels, beta=1.0).loss.item() == pytest.approx(reverse_kl.item())
    assert forward_kl.item() != pytest.approx(reverse_kl.item())  # the two ends really differ here


def test_generalized_jsd_symmetric_at_half_and_zero_on_identical(distill_batch):
    student, teacher, labels = distill_batch
    ab = generalized_jsd(student, teacher, labels, beta=0.5).loss.item()
    ba = generalized_jsd(teacher, student, labels, beta=0.5).loss.item()
    assert ab == pytest.approx(ba, rel=1e-12)
    assert 0 < ab <= math.log(2)  # JSD is bounded by ln 2
    same = generalized_jsd(student, student.detach().clone(), labels, beta=0.5).loss.item()
    assert same == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_top_k_path(distill_batch, beta):
    student, teacher, labels = distill_batch
    out = generalized_jsd(student, teacher, labels, beta=beta, temperature=1.5, top_k=3)
    expected = _jsd_bruteforce(student.detach(), teacher.detach(), labels, beta, 1.5, top_k=3)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10)
    full = generalized_jsd(student, teacher, labels, beta=beta, temperature=1.5)
    all_k = generalized_jsd(student, teacher, labels, beta=beta, temperature=1.5, top_k=7)
    assert all_k.loss.item() == pytest.approx(full.loss.item(), rel=1e-10)
    assert all_k.metrics["teacher_topk_mass"] == pytest.approx(1.0)
    assert 0 < out.metrics["teacher_topk_mass"] < 1


def test_generalized_jsd_topk_from_teacher_logprobs_only(distill_batch):
    """The SDPO teacher ships [N, k] indices and logprobs for the N error-site tokens only."""
    student, teacher, labels = distill_batch
    valid = labels != -100
    teacher_logp = torch.log_softmax(teacher.detach()[valid], -1)  # [N, V]
    values, indices = teacher_logp.topk(4, dim=-1)
    out = generalized_jsd_topk(student[valid], indices, values, beta=0.5, temperature=2.0)
    expected = _jsd_bruteforce(student.detach(), teacher.detach(), labels, 0.5, 2.0, top_k=4)
    assert out.loss.item() == pytest.approx(expected, rel=1e-10)
    # the masked form on the full [B, T] grid gives the same number
    idx_full = torch.zeros(2, 4, 4, dtype=torch.long)
    val_full = torch.zeros(2, 4, 4, dtype=torch.float64)
    idx_full[valid], val_full[valid] = indices, values
    masked = generalized_jsd_topk(student, idx_full, val_full, mask=valid, beta=0.5, temperature=2.0)
    assert masked.loss.item() == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("top_k", [None, 3])
def test_no_gradient_reaches_the_teacher(distill_batch, top_k):
    student, teacher, labels = distill_batch
    generalized_jsd(student, teacher, labels, beta=0.5, top_k=top_k).loss.backward()
    assert teacher.grad is None
    assert student.grad is not None and student.grad.abs().sum() > 0
    # masked positions get no gradient
    assert student.grad[0, 0].abs().sum() == 0 and student.grad[1, 2].abs().sum() == 0


def test_generalized_jsd_gradient_moves_student_towards_teacher(distill_batch):
    student, teacher, labels = distill_batch
    student = student.detach().clone().requires_grad_()
    before = generalized_jsd(student, teacher, labels, beta=0.5)
    before.loss.backward()
    with torch.no_grad():
        stepped = student - 0.1 * student.grad
    after = generalized_jsd(stepped, teacher, labels, beta=0.5)
    assert after.loss.item() < before.loss.item()


def test_generalized_jsd_sum_reduction_and_token_weights(distill_batch):
    student, teacher, labels = distill_batch
    mean = generalized_jsd(student, teacher, labels, beta=0.3).loss.item()
    total = generalized_jsd(student, teacher, labels, beta=0.3, reduction="sum").loss.item()
    assert total == pytest.approx(4 * mean)
    weights = torch.full((2, 4), 0.5, dtype=torch.float64)
    halved = generalized_jsd(student, teacher, labels, beta=0.3, reduction="sum", token_weights=weights)
    assert halved.loss.item() == pytest.approx(total / 2)


# ----------------------------------------------------------------------------- DPO


def test_dpo_closed_form_and_gradient_direction():
    pc = torch.tensor([-1.0, -3.0], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-2.0, -1.0], dtype=torch.float64, requires_grad=True)
    rc = torch.tensor([-1.5, -2.0], dtype=torch.float64)
    rr = torch.tensor([-1.5, -1.5], dtype=torch.float64)
    out = dpo(pc, pr, rc, rr, beta=0.1)
    margins = [0.1 * ((-1.0 + 1.5) - (-2.0 + 1.5)), 0.1 * ((-3.0 + 2.0) - (-1.0 + 1.5))]  # 0.1, -0.15
    expected = sum(math.log1p(math.exp(-m)) for m in margins)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    out.loss.backward()
    sig = [1 / (1 + math.exp(m)) for m in margins]  # sigmoid(-margin)
    torch.testing.assert_close(pc.grad, torch.tensor([-0.1 * s for s in sig], dtype=torch.float64))
    torch.testing.assert_close(pr.grad, torch.tensor([0.1 * s for s in sig], dtype=torch.float64))
    assert (pc.grad < 0).all() and (pr.grad > 0).all()  # descent raises chosen, lowers rejected
    assert out.metrics["reward_accuracy"] == 0.5
    assert out.metrics["reward_margin"] == pytest.approx(sum(margins) / 2)
    assert out.metrics["chosen_reward"] == pytest.approx((0.05 - 0.1) / 2)


def test_dpo_from_token_logprobs():
    token_lp = torch.tensor([[-0.5, -1.0, -9.0], [-0.25, -0.25, -0.25]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(sequence_logprobs(token_lp, mask), torch.tensor([-1.5, -0.75], dtype=torch.float64))


def test_dpo_loss_reads_precomputed_references_and_asks_the_learner_only_without_them():
    from meshrl.losses import get_loss
    from meshrl.losses.preference import REFERENCE_INPUT

    class _NoReference(_Pass):
        def reference_logprobs(self):
            raise AssertionError("the learner's reference was asked for")

    class _LearnerReference(_Pass):
        def __init__(self, learner_logprobs, reference, **inputs):
            super().__init__(learner_logprobs, **inputs)
            self.reference = reference

        def reference_logprobs(self):
            return self.reference

    # one pair: chosen = row 0 (answer tokens at positions 1, 2), rejected = row 1 (position 2)
    policy = torch.tensor([[LN(0.9), LN(0.5), LN(0.5)], [LN(0.3), LN(0.7), LN(0.25)]], dtype=torch.float64,
                          requires_grad=True)
    mask, weight = torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.tensor([0.5, 0.5], dtype=torch.float64)
    # reference sequence logprobs: chosen ln 0.5, rejected ln 0.5; policy: chosen ln 0.25, rejected ln 0.25
    # margin = beta [(ln .25 - ln .5) - (ln .25 - ln .5)] = 0: L = 0.5 ln 2
    fp = _NoReference(policy, mask=mask, weight=weight,
                      **{REFERENCE_INPUT: torch.tensor([LN(0.5), LN(0.5)], dtype=torch.float64)})
    out = get_loss("dpo").fn(fp, beta=0.5)
    assert out.loss.item() == pytest.approx(0.5 * LN(2), rel=1e-12)
    # references ln 0.125 and ln 0.25 instead: margin = 0.5 [(ln .25 - ln .125) - (ln .25 - ln .25)] = 0.5 ln 2
    fp = _NoReference(policy, mask=mask, weight=weight,
                      **{REFERENCE_INPUT: torch.tensor([LN(0.125), LN(0.25)], dtype=torch.float64)})
    out = get_loss("dpo").fn(fp, beta=0.5)
    assert out.loss.item() == pytest.approx(0.5 * LN(1 + 2 ** -0.5), rel=1e-12)
    assert out.metrics["reward_margin"] == pytest.approx(0.5 * LN(2), rel=1e-12)
    # without the input the learner's reference is used, to the same result on the same numbers
    learner_reference = torch.tensor([[0.0, LN(0.25), LN(0.5)], [0.0, 9.0, LN(0.25)]], dtype=torch.float64)
    out_learner = get_loss("dpo").fn(_LearnerReference(policy, learner_reference, mask=mask, weight=weight), beta=0.5)
    assert out_learner.loss.item() == pytest.approx(0.5 * LN(1 + 2 ** -0.5), rel=1e-12)


# ----------------------------------------------------------------------------- aggregation / micro-batches


def _policy_batch(seed=11):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(4, 6, 9, generator=g, requires_grad=True)
    tokens = torch.randint(0, 9, (4, 6), generator=g)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    for b, n in enumerate([6, 2, 4, 1]):
        mask[b, 6 - n:] = True
    sampling = (torch.log_softmax(theta.detach(), -1).gather(-1, tokens[..., None]).squeeze(-1)
                + 0.3 * torch.randn(4, 6, generator=g))
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5])
    return theta, tokens, mask, sampling, adv


def _target_logprobs(theta, tokens):
    return torch.log_softmax(theta, -1).gather(-1, tokens[..., None]).squeeze(-1)


LOSS_FNS = {
    "ppo": lambda lp, s, a, w: ppo(lp, s, a, w, eps_high=0.28).loss,
    "importance_sampling": lambda lp, s, a, w: importance_sampling(lp, s, a, w).loss,
    "cispo": lambda lp, s, a, w: cispo(lp, s, a, w).loss,
}


@pytest.mark.parametrize("loss_name", sorted(LOSS_FNS))
@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "fixed_length"])
def test_two_micro_batches_equal_one_batch(loss_name, mode):
    fn = LOSS_FNS[loss_name]
    theta, tokens, mask, sampling, adv = _policy_batch()
    counts = GlobalCounts.from_masks([mask])
    w = aggregation_weights(mask, mode, counts, max_tokens=6)
    full = fn(_target_logprobs(theta, tokens), sampling, adv, w)
    (grad_full,) = torch.autograd.grad(full, theta)

    parts = [slice(0, 2), slice(2, 4)]
    counts_mb = GlobalCounts.from_masks([mask[p] for p in parts])
    assert counts_mb == counts
    total, grad_acc = 0.0, torch.zeros_like(theta)
    for p in parts:
        w_mb = aggregation_weights(mask[p], mode, counts_mb, max_tokens=6)
        loss = fn(_target_logprobs(theta, tokens)[p], sampling[p], adv[p], w_mb)
        (g,) = torch.autograd.grad(loss, theta)
        total, grad_acc = total + loss.item(), grad_acc + g
    assert total == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(grad_acc, grad_full, rtol=0, atol=1e-6)

    # sanity: normalising each micro-batch by its own count would NOT match for token_mean
    if mode == "token_mean":
        local = sum(fn(_target_logprobs(theta, tokens)[p], sampling[p], adv[p],
                       aggregation_weights(mask[p], mode, GlobalCounts.from_masks([mask[p]]))).item()
                    for p in parts)
        assert abs(local - full.item()) > 1e-3


def test_micro_batches_for_cross_entropy_and_jsd():
    theta, tokens, mask, _, _ = _policy_batch(seed=12)
    teacher = torch.randn(4, 6, 9, generator=torch.Generator().manual_seed(5))
    counts = GlobalCounts.from_masks([mask])
    parts = [slice(0, 3), slice(3, 4)]

    def ce(rows):
        return cross_entropy(theta[rows], tokens[rows], aggregation_weights(mask[rows], "token_mean", counts)).loss

    def jsd(rows):
        labels = torch.where(mask[rows], tokens[rows], torch.full_like(tokens[rows], -100))
        return generalized_jsd(theta[rows], teacher[rows], labels, beta=0.5, reduction="sum",
                               token_weights=aggregation_weights(mask[rows], "token_mean", counts)).loss

    for fn in (ce, jsd):
        full = fn(slice(0, 4))
        (grad_full,) = torch.autograd.grad(full, theta)
        losses = [fn(p) for p in parts]
        grad_acc = sum(torch.autograd.grad(loss, theta)[0] for loss in losses)
        assert sum(loss.item() for loss in losses) == pytest.approx(full.item(), abs=1e-6)
        torch.testing.assert_close(grad_acc, grad_full, rtol=0, atol=1e-6)
    # token-mean JSD with the global weights equals the batchmean JSD of the whole batch
    labels = torch.where(mask, tokens, torch.full_like(tokens, -100))
    assert jsd(slice(0, 4)).item() == pytest.approx(generalized_jsd(theta, teacher, labels).loss.item(), rel=1e-6)


def test_aggregation_modes_hand_values():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 99.0, 99.0, 99.0], [99.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    counts = GlobalCounts.from_masks([mask])
    assert counts == GlobalCounts(num_tokens=4.0, num_sequences=2)  # the empty row is not a sequence

    def aggregate(mode, **kw):
        return (per_token * aggregation_weights(mask, mode, **kw)).sum().item()

    assert aggregate("sum") == pytest.approx(10.0)
    assert aggregate(Aggregation.TOKEN_MEAN, counts=counts) == pytest.approx(10.0 / 4)
    assert aggregate("sequence_mean", counts=counts) == pytest.approx((2.0 + 4.0) / 2)
    assert aggregate("fixed_length", counts=counts, max_tokens=4) == pytest.approx(10.0 / 8)
    with pytest.raises(ValueError, match="global counts"):
        aggregation_weights(mask, "token_mean")


def test_token_mean_weights_make_ppo_a_token_mean():
    theta, tokens, mask, sampling, adv = _policy_batch(seed=13)
    lp = _target_logprobs(theta, tokens).double()
    counts = GlobalCounts.from_masks([mask])
    weights = aggregation_weights(mask, "token_mean", counts, dtype=torch.float64)
    weighted = ppo(lp, sampling.double(), adv.double(), weights)
    summed = ppo(lp, sampling.double(), adv.double(), mask)
    assert weighted.loss.item() == pytest.approx(summed.loss.item() / counts.num_tokens, rel=1e-12)
    assert weighted.metrics["clip_fraction"] == summed.metrics["clip_fraction"]


def test_generalized_jsd_token_clip_caps_each_token_by_hand():
    # token 0: student and teacher agree (JSD 0); token 1: they swap a 30-logit gap, so the forward
    # KL is 30 nats (to 1e-12): capped at 10 it adds 10, and no gradient
    student = torch.tensor([[0.0, 0.0], [0.0, 30.0]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[0.0, 0.0], [30.0, 0.0]], dtype=torch.float64)
    labels = torch.zeros(2, dtype=torch.long)
    free = generalized_jsd(student, teacher, labels, beta=0.0)
    assert free.loss.item() == pytest.approx(15.0, abs=1e-9) and "token_clip_frac" not in free.metrics
    clipped = generalized_jsd(student, teacher, labels, beta=0.0, token_clip=10.0)
    assert clipped.loss.item() == pytest.approx(5.0, abs=1e-9)
    assert clipped.metrics["token_clip_frac"] == pytest.approx(0.5)
    assert clipped.metrics["jsd_mean"] == pytest.approx(15.0, abs=1e-9)  # the metric reports the unclipped mean
    clipped.loss.backward()
    assert student.grad.abs().sum().item() == 0.0  # token 0 is at its optimum, token 1 is capped
    with pytest.raises(ValueError, match="token_clip"):
        generalized_jsd(student, teacher, labels, token_clip=-1.0)
