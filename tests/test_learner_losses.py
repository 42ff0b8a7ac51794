"""The algorithm-blind learner (tiny model, CPU, no Monarch): every loss comes from the registry,
channel losses read their own Datum fields, micro-batching never changes the gradient, the
reference policy is the frozen initial weights, and custom losses train like registered ones."""

import math

import pytest
import torch

from meshrl import losses
from meshrl.config.learner import LearnerConfig
from meshrl.losses import LossOutput, register_loss
from meshrl.models.provision import resolve_model
from meshrl.testing.custom_losses import importance_sampling_custom
from meshrl.training.policy import PolicyTrainer
from meshrl.types import AdamParams, Datum

V = 49152


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _trainer(model_path, micro_batch_size=8, micro_batch_tokens=0, **lora):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, micro_batch_size=micro_batch_size,
                        micro_batch_tokens=micro_batch_tokens, autocast_bf16=False,
                        **({"lora": {"enabled": True, **lora}} if lora else {}))
    return PolicyTrainer(model_path, cfg)


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rl_datums(n=4):
    out = []
    for i in range(n):
        toks = _tokens(i, 8 + i)
        k = len(toks) - 4
        out.append(Datum.from_sequence(toks, per_sequence={"advantages": 0.5 * (i - 1.5)},
                                       mask=[0] * k + [0.1] * 4, logprobs=[0.0] * k + [-11.0] * 4))
    return out


def _grads(trainer):
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def _assert_same_grads(a, b, atol=1e-6):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)


def test_unknown_loss_is_a_one_line_error(model_path):
    with pytest.raises(ValueError, match="unknown loss_fn 'nope': expected one of .*'ppo'"):
        _trainer(model_path).forward_backward(_rl_datums(), "nope")


def test_a_new_loss_is_one_registered_function(model_path):
    """Registering a loss makes the learner train on it; nothing else changes."""

    @register_loss("test_negative_logprob_sum")
    def negative_logprob_sum(fp, scale: float = 1.0) -> LossOutput:
        loss = -(fp.logprobs() * fp.inputs["mask"]).sum() * scale
        return LossOutput(loss, {"scaled_by": scale})

    try:
        trainer = _trainer(model_path)
        datums = _rl_datums()
        out = trainer.forward_backward(datums, "test_negative_logprob_sum", {"scale": 2.0})
        registered = _grads(trainer)
        logps = trainer.forward(datums)
        expected = -2.0 * sum(float((lp * d.loss_fn_inputs["mask"]).sum()) for lp, d in zip(logps, datums))
        assert out["loss"] == pytest.approx(expected, rel=1e-4) and out["scaled_by"] == 2.0
        trainer.forward_backward(datums, "test_negative_logprob_sum", {"scale": 1.0})
        _assert_same_grads({k: 2 * v for k, v in _grads(trainer).items()}, registered)
    finally:
        losses.LOSSES.pop("test_negative_logprob_sum")


@pytest.mark.parametrize("name", ["ppo", "importance_sampling", "cispo"])
def test_micro_batch_size_does_not_change_the_gradient(model_path, name):
    datums = _rl_datums(5)
    one = _trainer(model_path, micro_batch_size=8)
    out_one = one.forward_backward(datums, name)
    many = _trainer(model_path, micro_batch_size=2)
    out_many = many.forward_backward(datums, name)
    assert out_one["loss"] == pytest.approx(out_many["loss"], rel=1e-4, abs=1e-7)
    assert out_one["tokens"] == out_many["tokens"] == 20
    reference = _grads(one)
    _assert_same_grads(reference, _grads(many))
    capped = _trainer(model_path, micro_batch_size=8, micro_batch_tokens=2 * max(d.length for d in datums))
    assert len(list(capped._passes(datums, None))) == 3  # 5 datums, at most 2 of them a pass
    out_capped = capped.forward_backward(datums, name)
    assert out_one["loss"] == pytest.approx(out_capped["loss"], rel=1e-4, abs=1e-7)
    _assert_same_grads(reference, _grads(capped))


def test_outputs_give_every_positions_logprob_from_the_losss_one_forward(model_path):
    datums = _rl_datums(4)  # ppo reads the last 4 positions of each (its mask)
    trainer = _trainer(model_path, micro_batch_size=2)
    whole = trainer.forward(datums)
    plain = trainer.forward_backward(datums, "ppo")
    expected_grads = _grads(trainer)
    calls = []
    hook = trainer.model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    try:
        forward_only = trainer.forward_backward(datums, "ppo", outputs=True, backward=False)
        assert len(calls) == 2  # one decoder forward per micro-batch of 2, none more for the outputs
        assert all(p.grad is None for p in trainer.model.parameters())
        trained = trainer.forward_backward(datums, "ppo", outputs=True)
    finally:
        hook.remove()
    _assert_same_grads(expected_grads, _grads(trainer))  # the outputs' extra positions carry no gradient
    for out in (forward_only, trained):
        assert out["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-7)
        for lp, ref, d in zip(out["logprobs"], whole, datums):
            assert len(lp) == d.length and all(v != 0 for v in lp)  # the prompt's positions too
            torch.testing.assert_close(torch.tensor(lp), ref, rtol=0, atol=1e-5)


def test_ppo_on_a_tinker_datum_reports_the_kl_of_the_reply_only(model_path):
    """The cookbook's datum: sampler logprobs 0 on the prompt and real on the reply, advantage 0 on
    the prompt; mapped as `meshrl serve` maps it (weight 1 everywhere). When the sampler agrees with
    the learner on the reply, the sampler/learner KL is ~0, nothing is clipped, and `tokens` counts
    the reply positions only."""
    from meshrl.api.losses import core_call

    trainer = _trainer(model_path)
    plain = []
    for i in range(3):
        toks = _tokens(20 + i, 10 + 2 * i)
        plain.append(Datum.from_sequence(toks, logprobs=[0.0] * len(toks), advantages=[0.0] * len(toks)))
    learner = trainer.forward(plain)
    datums = []
    for d, lp in zip(plain, learner):
        reply = torch.arange(d.length) >= d.length - 4  # the last 4 targets are the reply
        datums.append(Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"],
                                            "logprobs": torch.where(reply, lp, torch.zeros_like(lp)),
                                            "advantages": reply.float() * 0.5}))
    mapped, config = core_call("ppo", None, datums)
    out = trainer.forward_backward(mapped, "ppo", config)
    assert abs(out["kl_sampler_learner_k3"]) < 1e-6 and abs(out["kl_sampler_learner_k1"]) < 1e-5
    assert out["clip_fraction"] == 0.0 and out["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert out["tokens"] == 12 and out["num_tokens"] == sum(d.length for d in datums)
    assert 0 < out["entropy"] < math.log(V)


def test_tinkers_dro_gspo_and_stable_reinforce_through_the_learner_equal_their_formulas(model_path):
    """Tinker datums (the prompt with sampler logprob 0 and advantage 0) mapped as the API maps
    them, trained by the learner: each loss equals its definition evaluated on the learner's own
    logprobs of the same weights."""
    from meshrl.api.errors import UserError
    from meshrl.api.losses import core_call

    trainer = _trainer(model_path)
    plain = [Datum.from_sequence(_tokens(30 + i, 9 + i), advantages=[0.0] * (9 + i)) for i in range(3)]
    learner = trainer.forward(plain)
    g = torch.Generator().manual_seed(7)
    datums, parts = [], []
    for i, (d, lp) in enumerate(zip(plain, learner)):
        reply = torch.arange(d.length) >= d.length - 4
        q = torch.where(reply, lp + 0.3 * torch.randn(d.length, generator=g), torch.zeros_like(lp))
        adv = reply.float() * (1.0 - i)  # 1, 0 (a group's equal rewards), -1
        datums.append(Datum(d.model_input, {"target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": q,
                                            "advantages": adv, "sequence_ratio_mask": reply.float(),
                                            "mask": reply.float()}))
        parts.append((lp.double(), q.double(), adv.double(), reply))

    def run(loss_fn, config=None, keep=("target_tokens", "logprobs", "advantages")):
        data = [Datum(d.model_input, {k: d.loss_fn_inputs[k] for k in keep}) for d in datums]
        mapped, cfg = core_call(loss_fn, config, data)
        out = trainer.forward_backward(mapped, loss_fn, cfg)
        trainer.optimizer.zero_grad(set_to_none=True)
        return out["loss"]

    dro = -sum(float((a * lp - 0.5 * 0.1 * (lp - q) ** 2).sum()) for lp, q, a, _ in parts)
    assert run("dro", {"beta": 0.1}) == pytest.approx(dro, rel=1e-4)

    def gspo_value(lp, q, a, reply):
        s = torch.exp((lp - q)[reply].mean())
        return float(torch.minimum(s * a, s.clamp(0.9, 1.1) * a).sum())

    gspo = -sum(gspo_value(*p) for p in parts)
    assert run("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
               ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")) == pytest.approx(gspo, rel=1e-4)

    stable = -sum(float((torch.exp(lp - q).clamp(max=2.0) * a * lp)[r].sum()) for lp, q, a, r in parts)
    assert run("stable_reinforce", None, ("target_tokens", "logprobs", "advantages", "mask")) == \
        pytest.approx(stable, rel=1e-4)

    with pytest.raises(UserError, match="stable_reinforce takes nonzero advantages only on sampled tokens"):
        core_call("stable_reinforce", None, [Datum(d.model_input, {**d.loss_fn_inputs, "mask": torch.zeros(d.length)})
                                             for d in datums])
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs\['sequence_ratio_mask'\] marks no token"):
        core_call("gspo", None, [Datum(d.model_input, {**d.loss_fn_inputs,
                                                       "sequence_ratio_mask": torch.zeros(d.length)}) for d in datums])
    with pytest.raises(UserError, match="loss_fn_config for 'dro': unknown key 'clip_low_threshold'"):
        core_call("dro", {"clip_low_threshold": 0.5}, datums)


def test_per_sequence_advantages_equal_per_token_advantages(model_path):
    datums = _rl_datums()
    per_token = [Datum(d.model_input, {**d.loss_fn_inputs,
                                       "advantages": d.loss_fn_inputs["advantages"].expand(d.length).clone()})
                 for d in datums]
    a, b = _trainer(model_path), _trainer(model_path)
    assert a.forward_backward(datums, "ppo")["loss"] == pytest.approx(b.forward_backward(per_token, "ppo")["loss"])
    _assert_same_grads(_grads(a), _grads(b))


def test_custom_loss_trains_like_the_registered_one(model_path):
    datums = _rl_datums()
    reg, custom = _trainer(model_path, micro_batch_size=3), _trainer(model_path, micro_batch_size=3)
    out_reg = reg.forward_backward(datums, "importance_sampling")
    out_custom = custom.forward_backward_custom(datums, importance_sampling_custom)
    assert out_custom["loss"] == pytest.approx(out_reg["loss"], rel=1e-4)
    assert out_custom["num_datums"] == 4
    _assert_same_grads(_grads(reg), _grads(custom))


def _sdpo_datum(seed, start, length, k, weight):
    toks = _tokens(seed, start + length + 2)
    g = torch.Generator().manual_seed(100 + seed)
    idx = torch.zeros(len(toks), k, dtype=torch.long)
    lp = torch.zeros(len(toks), k)
    idx[start : start + length] = torch.randint(0, V, (length, k), generator=g)
    lp[start : start + length] = torch.log_softmax(torch.randn(length, k, generator=g), -1)
    mask = torch.zeros(len(toks))
    mask[start : start + length] = weight
    d = Datum.from_sequence(toks, mask=mask, logprobs=torch.full((len(toks),), -10.0),
                            teacher_topk_indices=idx, teacher_topk_logprobs=lp)
    return d, toks, idx[start : start + length], lp[start : start + length]


def test_sdpo_jsd_reads_its_fields_and_equals_the_direct_formula(model_path):
    """The registered JSD on the error-site rows equals generalized_jsd_topk on the model's own
    logits at exactly those positions, weights included, for any micro-batching."""
    sites = [_sdpo_datum(s, start=3 + s, length=4, k=5, weight=0.125) for s in range(3)]
    datums = [d for d, *_ in sites]
    trainer = _trainer(model_path, micro_batch_size=2)
    out = trainer.forward_backward(datums, "sdpo_jsd", {"beta": 0.3})
    via_registry = _grads(trainer)
    direct = 0.0
    for d, toks, idx, lp in sites:
        start = d.loss_fn_inputs["mask"].nonzero()[0, 0]
        logits = trainer.model(input_ids=torch.tensor([toks[:-1]])).logits[0, start : start + 4]
        loss = losses.generalized_jsd_topk(logits, idx, lp, beta=0.3, reduction="sum",
                                           token_weights=torch.full((4,), 0.125)).loss
        loss.backward()
        direct += float(loss.detach())
    assert out["loss"] == pytest.approx(direct, rel=1e-4)
    assert out["num_tokens"] == 12
    _assert_same_grads(via_registry, _grads(trainer))


def test_sdpos_importance_cap_compares_the_learner_and_sampler_at_the_sampling_temperature(model_path):
    """Sites whose sampler logprobs are the policy's own at temperature 0.7 are on policy: with
    the learner at that temperature every importance weight min(p / q, cap) is 1, so the capped
    JSD equals the uncapped one."""
    datums = [_sdpo_datum(s, start=3 + s, length=4, k=5, weight=0.125)[0] for s in range(3)]
    trainer = _trainer(model_path, micro_batch_size=2)
    for d, own in zip(datums, trainer.forward(datums, temperature=0.7)):
        d.loss_fn_inputs["logprobs"] = own
    capped = trainer.forward_backward(datums, "sdpo_jsd", {"is_weight_cap": 2.0}, temperature=0.7)
    plain = trainer.forward_backward(datums, "sdpo_jsd", {"is_weight_cap": 0.0}, temperature=0.7)
    assert capped["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    at_one = trainer.forward_backward(datums, "sdpo_jsd", {"is_weight_cap": 2.0})  # weights p(T=1) / q(T=0.7)
    assert at_one["loss"] != pytest.approx(plain["loss"], rel=1e-3)


def _pair(seed, weight):
    prompt, chosen, rejected = _tokens(seed, 5), _tokens(seed + 50, 3), _tokens(seed + 90, 4)
    return [Datum.from_sequence(prompt + ans, per_sequence={"weight": weight},
                                mask=[0] * len(prompt) + [1] * len(ans)) for ans in (chosen, rejected)]


@pytest.mark.parametrize("lora", [False, True])
def test_dpo_reference_is_the_frozen_initial_policy(model_path, lora):
    trainer = _trainer(model_path, micro_batch_size=2, **({"rank": 4} if lora else {}))
    datums = [d for s in range(3) for d in _pair(s, weight=1 / 3)]
    first = trainer.forward_backward(datums, "dpo", {"beta": 0.5})
    # at the start policy == reference: every margin is 0, the loss is log 2 per pair
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert first["num_pairs"] == 3 and first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    reference_before = trainer.forward(datums, reference=True)
    for _ in range(3):
        trainer.optim_step(trainer.cfg.adam_params())
        out = trainer.forward_backward(datums, "dpo", {"beta": 0.5})
    opt = trainer.optim_step(trainer.cfg.adam_params())
    assert opt["optim_s"] > 0 and opt["lr"] == trainer.cfg.lr  # timed inside the learner (controller overhead)
    assert out["reward_accuracy"] == 1.0 and out["loss"] < first["loss"]  # chosen rose above rejected
    reference_after = trainer.forward(datums, reference=True)
    for a, b in zip(reference_before, reference_after):
        torch.testing.assert_close(a, b)  # the reference never moves
    assert any(not torch.allclose(a, b) for a, b in zip(trainer.forward(datums), reference_after))


def test_sdpo_full_vocabulary_equals_the_top_k_path_with_every_token(model_path):
    """`top_k: 0`: the teacher sends full-vocabulary logprobs and no indices; the loss equals the
    top-k form whose support is the whole vocabulary."""
    g = torch.Generator().manual_seed(3)
    toks = _tokens(7, 9)
    teacher = torch.zeros(len(toks), V)
    teacher[4:7] = torch.log_softmax(torch.randn(3, V, generator=g), -1)
    mask = torch.zeros(len(toks))
    mask[4:7] = 0.5
    full = Datum.from_sequence(toks, mask=mask, logprobs=torch.zeros(len(toks)), teacher_topk_logprobs=teacher)
    indices = torch.arange(V).expand(len(toks), V).clone()
    topk = Datum.from_sequence(toks, mask=mask, logprobs=torch.zeros(len(toks)), teacher_topk_logprobs=teacher,
                               teacher_topk_indices=indices)
    a, b = _trainer(model_path), _trainer(model_path)
    out_full = a.forward_backward([full], "sdpo_jsd", {"beta": 0.5, "temperature": 0.7})
    out_topk = b.forward_backward([topk], "sdpo_jsd", {"beta": 0.5, "temperature": 0.7})
    assert out_full["loss"] == pytest.approx(out_topk["loss"], rel=1e-4) and out_full["loss"] > 0
    _assert_same_grads(_grads(a), _grads(b))


def test_learner_topk_equals_the_teacher_engines_on_the_same_weights(model_path):
    """SDPO's teacher in the learner's processes (`sdpo.teacher: learner`) scores a site as the
    teacher mesh's HF engine does, and as the learner's micro-batched path (under FSDP2, its
    shared prefixes as trees) does: same top-k indices, log-probs (and the site tokens' own)
    equal to float32 rounding."""
    from meshrl.config.generation import GeneratorConfig
    from meshrl.engines.hf_engine import HFEngine
    from meshrl.sdpo.sites import ErrorSite
    from meshrl.terms.sdpo import teacher_datum

    trainer = _trainer(model_path, micro_batch_size=2)  # 3 sites: two micro-batches
    engine = HFEngine(model_path, GeneratorConfig(torch_threads=1), "float32", 256, seed=0)
    sites = [ErrorSite(f"t{i}", "wrong_answer", "hint", [], 0, _tokens(i, n), start, n - start, [])
             for i, (n, start) in enumerate([(20, 12), (9, 3), (31, 30)])]
    datums = [teacher_datum(s) for s in sites]
    learner = trainer.topk_logprobs(datums, 5)
    micro_batched = trainer._topk_in_micro_batches(datums, 5, padding=False, min_prefix=16)
    reference = engine.topk_logprobs([s.teacher_tokens for s in sites], [s.teacher_start for s in sites],
                                     [s.length for s in sites], 5)
    for site, got, other, ref in zip(sites, learner, micro_batched, reference):
        assert got[0].shape == (site.length, 5) and got[0].dtype == torch.int32
        for scored in (got, other):
            assert torch.equal(scored[0], ref[0])
            assert torch.allclose(scored[1], ref[1], atol=1e-4) and torch.allclose(scored[2], ref[2], atol=1e-4)
    full = trainer.topk_logprobs([teacher_datum(sites[1])], 0)[0]
    assert full[0] is None and torch.allclose(full[1].exp().sum(-1), torch.ones(sites[1].length), atol=1e-4)
    own = full[1].gather(-1, torch.tensor(sites[1].teacher_tokens[3:])[:, None]).squeeze(-1)
    assert torch.allclose(full[2], own, atol=1e-5)  # the site tokens' own log-probs


def test_optim_step_reports_the_learners_memory(model_path):
    """A step's metrics carry the learner's resident memory and the step's own peak (a run's JSONL
    shows the learner growing before the host kills it), and the free heap handed back before
    (unless `release_heap_each_step` is off); a big allocation held across a step shows in both,
    and the next step's peak no longer counts it once it is freed."""
    trainer = _trainer(model_path)
    trainer.forward_backward(_rl_datums(), "ppo")
    before = trainer.optim_step(AdamParams(learning_rate=1e-5))
    held = torch.ones(512 << 20, dtype=torch.uint8)  # 512 MiB, touched
    trainer.forward_backward(_rl_datums(), "ppo")
    during = trainer.optim_step(AdamParams(learning_rate=1e-5))
    assert 0 < before["rss_gib"] <= before["peak_rss_gib"]
    assert during["rss_gib"] - before["rss_gib"] > 0.4 and during["peak_rss_gib"] >= during["rss_gib"]
    assert during["released_gib"] > -0.01  # the held tensor stays: releasing frees only free pages
    del held  # after the peak's reset at the end of that step: the next step's peak starts with it
    trainer.cfg.release_heap_each_step = False
    for _ in range(2):
        trainer.forward_backward(_rl_datums(), "ppo")
        after = trainer.optim_step(AdamParams(learning_rate=1e-5))
    assert "released_gib" not in after
    assert after["peak_rss_gib"] < during["peak_rss_gib"] - 0.4  # the step's own peak, not the process's


def test_the_heap_can_go_back_after_every_micro_batch(model_path, monkeypatch):
    """`release_heap_each_micro_batch` hands the free heap back once per micro-batch, after its
    backward; off, forward_backward releases nothing (optim_step does, per step).
    `mmap_threshold_mib` is set in the learner's process when the trainer starts."""
    import meshrl.training.policy as policy

    calls, thresholds = [], []
    monkeypatch.setattr(policy, "release_free_heap", lambda: calls.append(1) or True)
    monkeypatch.setattr(policy, "set_mmap_threshold", lambda n: thresholds.append(n) or True)
    trainer = PolicyTrainer(model_path, LearnerConfig(torch_threads=1, micro_batch_size=2, autocast_bf16=False,
                                                      mmap_threshold_mib=4, release_heap_each_micro_batch=False))
    assert thresholds == [4 << 20]
    datums = _rl_datums()
    trainer.forward_backward(datums, "ppo")
    assert calls == []
    trainer.cfg.release_heap_each_micro_batch = True
    trainer.forward_backward(datums, "ppo")
    assert len(calls) == -(-len(datums) // 2)


def test_on_policy_ratios_are_one_at_the_sampling_temperature(model_path):
    """Tokens sampled at temperature 0.7 (the HF engine records the logprobs of the distribution
    it sampled from): the learner scoring them at that temperature gives ratios of 1, no PPO
    clipping and no sampler/learner KL; at temperature 1 the same samples look off policy (the
    tiny random model's distributions are nearly flat, so the gap is smaller than a real model's)."""
    from meshrl.config.generation import GeneratorConfig
    from meshrl.engines.base import SampleRequest
    from meshrl.engines.hf_engine import HFEngine

    engine = HFEngine(model_path, GeneratorConfig(torch_threads=1), "float32", 256, seed=0)
    prompts = [[1, 5, 9, 13], [2, 7, 3]]
    sampled = engine.generate(prompts, SampleRequest(n=4, max_tokens=12, temperature=0.7, seed=7))
    datums = [Datum.from_sequence(prompt + c.tokens, per_sequence={"advantages": 1.0 - 2 * (i % 2)},
                                  mask=[0] * len(prompt) + [1] * len(c.tokens),
                                  logprobs=[0.0] * len(prompt) + list(c.logprobs))
              for prompt, group in zip(prompts, sampled) for i, c in enumerate(group)]
    trainer = _trainer(model_path)
    at_sampling = trainer.forward_backward(datums, "ppo", temperature=0.7)
    assert at_sampling["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert at_sampling["ratio_max"] == pytest.approx(1.0, abs=1e-3)
    assert at_sampling["clip_fraction"] == 0.0 and abs(at_sampling["kl_sampler_learner_k1"]) < 1e-4
    for d, logprobs in zip(datums, trainer.forward(datums, temperature=0.7)):
        scored = d.loss_fn_inputs["mask"] != 0
        torch.testing.assert_close(logprobs[scored], d.loss_fn_inputs["logprobs"][scored], rtol=0, atol=1e-4)
    at_one = trainer.forward_backward(datums, "ppo")  # the model's own distribution: not what was sampled
    assert at_one["ratio_max"] > 1.1 and at_one["kl_sampler_learner_k3"] > 1e-3  # (1.24 and 4e-3 measured)
