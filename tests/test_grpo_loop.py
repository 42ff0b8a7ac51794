"""GRPOLoop against fake Monarch endpoints: ordering across replicas, counting of bad input,
advantage normalisation, DAPO dynamic sampling, KL reward shaping, the staleness bound of the
asynchronous producer, streaming minibatches, version bookkeeping, and deadlines."""

import time

import pytest
import torch

from meshrl.meshes.dispatch import split_evenly
from meshrl.meshes.client import StepError
from meshrl.meshes.supervisor import CallTimeout, wait_all
from meshrl.terms import LossTerm, register_term
from meshrl.testing.fake_meshes import FakeLearner, Future, UniformForEvenOperand, make_loop


def test_split_evenly_keeps_order_and_balance():
    assert split_evenly(list(range(7)), 3) == [[0, 1], [2, 3], [4, 5, 6]]
    assert split_evenly([1], 4) == [[1]]


def test_rollout_spreads_prompts_and_counts_bad_input():
    loop, gens, _ = make_loop(**{"trainer.prompts_per_step": 5, "trainer.group_size": 3, "model.max_model_len": 40,
                                 "generator.sampling.max_new_tokens": 34})  # the 6-token prompts just fit
    metrics, trajectories = loop.step()
    assert sum(sum(g.seen) for g in gens) >= 5 and all(g.seen for g in gens)  # hedged chunks count twice
    assert metrics["gen/prompts/replica0"] + metrics["gen/prompts/replica1"] == 5
    assert 0.5 <= metrics["gen/replica_max_share"] < 1
    # the generators' own engine time: the busiest replica's chunks (10 ms a prompt in the fake)
    busiest = max(metrics["gen/prompts/replica0"], metrics["gen/prompts/replica1"])
    assert metrics["timing/generator_engine_s"] == pytest.approx(0.01 * busiest)
    assert len(trajectories) == 15
    assert [t.group for t in trajectories] == [g for g in range(5) for _ in range(3)]
    empties = [t for t in trajectories if not t.tokens]
    assert loop.counters.empty_generations == len(empties) > 0
    errors = [t for t in trajectories if "error" in t.info]
    assert errors and all(t.reward == 0.0 for t in errors)
    assert loop.counters.reward_errors == len(errors)
    assert metrics["gen/tokens"] == sum(len(t.tokens) for t in trajectories)

    loop.close()
    # max_new_tokens 35: every 6-token prompt is one too long; nothing to train, the step completes
    loop, _, _ = make_loop(**{"trainer.prompts_per_step": 5, "trainer.group_size": 3, "model.max_model_len": 40,
                              "generator.sampling.max_new_tokens": 35})
    metrics, trajectories = loop.step()
    assert trajectories == [] and loop.counters.prompts_too_long == 5 and metrics["version"] == 1
    loop.close()


def _group_advantages(trajectories):
    by_group = {}
    for t in trajectories:
        by_group.setdefault(t.group, []).append(t.reward)
    return [t.reward - sum(by_group[t.group]) / len(by_group[t.group]) for t in trajectories]


def _calls(learner, kind):
    return [c for c in learner.calls if c[0] == kind]


def _normalisers(learner):
    """The policy-gradient normaliser of each optimizer step: the scale of the streamed pieces'
    gradients (a `scale` call) and of the held last piece's part in the shared pass (the first part)."""
    out, current = [], None
    for c in learner.calls:
        if c[0] in ("scale", "parts"):
            scale = c[1] if c[0] == "scale" else c[1][0][1]
            assert current is None or current == scale  # one normaliser per optimizer step
            current = scale
        elif c[0] == "opt":
            out.append(current)
            current = None
    return out


def test_train_normalises_by_all_sampled_tokens_and_skips_zero_advantage():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4})
    metrics, trajectories = loop.step()
    kind, datums, loss_fn, loss_config = learner.calls[1]
    assert kind == "fb" and loss_fn == "ppo" and loss_config == {"eps_low": 0.2, "eps_high": 0.2}
    total = sum(len(t.tokens) for t in trajectories)
    expected = [a for t, a in zip(trajectories, _group_advantages(trajectories)) if t.tokens and a != 0]
    # one advantage per sequence, shaped once
    assert all(d.loss_fn_inputs["advantages"].dim() == 0 for d in datums)
    assert sorted(float(d.loss_fn_inputs["advantages"]) for d in datums) == pytest.approx(sorted(expected))
    for d in datums:  # weight 1 on the two sampled tokens, 0 on the prompt
        weights = d.loss_fn_inputs["mask"]
        assert weights[weights != 0].tolist() == [1.0, 1.0]
    # the step-wide normaliser, 1 / every sampled token of the step, scales the accumulated gradients
    # the step-wide normaliser, 1 / every sampled token of the step, scales the one piece's loss
    assert [c[0] for c in learner.calls] == ["parts", "fb", "opt"]
    assert _normalisers(learner) == [pytest.approx(1 / total)]
    assert metrics["batch/tokens_total"] == total
    loop.close()


def test_streaming_minibatches_send_the_same_update_as_one_batch():
    one, _, learner_one = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4})
    streamed, _, learner_streamed = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4,
                                                 "trainer.num_minibatches": 2})
    for loop in (one, streamed):
        loop.step()
        loop.close()

    def sent(learner):
        datums = [d for c in _calls(learner, "fb") for d in c[1]]
        return sorted((d.model_input.to_ints(), float(d.loss_fn_inputs["advantages"]),
                       d.loss_fn_inputs["mask"].tolist()) for d in datums)

    assert len(_calls(learner_streamed, "fb")) == 2 and len(_calls(learner_one, "fb")) == 1
    assert sent(learner_streamed) == sent(learner_one)  # the same samples (seeds follow the round)
    assert _normalisers(learner_streamed) == _normalisers(learner_one)  # one normaliser per update
    # the first piece streamed (its gradients scaled once all are in), the last one in the shared pass
    assert [c[0] for c in learner_streamed.calls] == ["fb", "scale", "parts", "fb", "opt"]
    assert len(_calls(learner_streamed, "opt")) == len(_calls(learner_one, "opt")) == 1


def test_substeps_make_one_optimizer_update_per_part():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 4, "trainer.group_size": 4, "trainer.num_substeps": 2})
    loop.step()
    loop.close()
    kinds = [c[0] for c in learner.calls]
    assert kinds == ["parts", "fb", "opt", "parts", "fb", "opt"]
    tokens = [sum(int((d.loss_fn_inputs["mask"] != 0).sum()) for d in c[1]) for c in _calls(learner, "fb")]
    # each part has its own normaliser: its own sampled tokens (zero-advantage ones included)
    assert all(s <= 1 / t for s, t in zip(_normalisers(learner), tokens))


@pytest.mark.parametrize("k", [1, 2])
def test_async_never_trains_a_sample_more_than_k_versions_old(k):
    loop, gens, _ = make_loop(learner=FakeLearner(train_s=0.1), **{
        "trainer.prompts_per_step": 2, "trainer.group_size": 2, "trainer.steps": 6, "trainer.max_steps_off_policy": k})
    for g in gens:
        g.delay = 0.05
    staleness = []
    for step in range(1, 7):
        metrics, trajectories = loop.step()
        staleness += [step - 1 - t.version for t in trajectories]
        assert metrics["count/stale_dropped"] == 0
    loop.close()
    assert max(staleness) <= k  # asserted from the stamps
    assert max(staleness) >= 1  # generation really ran ahead of training
    assert loop.cursor <= 2 * 6  # never produced past the run's last step


def test_dynamic_sampling_refills_the_batch_with_informative_groups():
    loop, _, learner = make_loop(rewarder=UniformForEvenOperand, **{
        "trainer.prompts_per_step": 4, "trainer.group_size": 4, "trainer.advantage.drop_uniform_groups": "true",
        "trainer.advantage.max_extra_rounds": 5})
    metrics, trained = loop.step()
    loop.close()
    groups = {t.group for t in trained}
    assert len(groups) == 4 and metrics["batch/groups"] == 4  # prompts_per_step informative groups
    assert all(len({t.reward for t in trained if t.group == g}) > 1 for g in groups)
    assert metrics["batch/sampling_rounds"] > 1 and metrics["batch/missing_groups"] == 0
    rounds = metrics["batch/sampling_rounds"]
    assert metrics["batch/dropped_uniform_groups"] + metrics.get("batch/surplus_groups", 0) + 4 == 4 * rounds
    # the dropped groups' tokens are not in the normaliser
    total = sum(len(t.tokens) for t in trained)
    assert _normalisers(learner)[0] == pytest.approx(1 / total)


def test_dynamic_sampling_out_of_rounds_trains_on_what_it_has():
    loop, _, _ = make_loop(rewarder=UniformForEvenOperand, **{
        "trainer.prompts_per_step": 8, "trainer.group_size": 4, "trainer.advantage.drop_uniform_groups": "true",
        "trainer.advantage.max_extra_rounds": 0})
    metrics, trained = loop.step()
    loop.close()
    assert metrics["batch/sampling_rounds"] == 1 and 0 < metrics["batch/groups"] < 8
    assert metrics["batch/missing_groups"] == 8 - metrics["batch/groups"]


def test_kl_shaping_makes_per_token_advantages_against_the_reference():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 3, "trainer.group_size": 4,
                                    "trainer.advantage.kl_coef": 0.5})
    metrics, trajectories = loop.step()
    loop.close()
    assert [c[0] for c in learner.calls] == ["forward", "parts", "fb", "opt"] and learner.calls[0][2] is True
    datums = learner.calls[2][1]
    trainable = [t for t in trajectories if t.tokens]
    assert len(datums) == len(trainable)  # zero-advantage sequences train too: shaping gives them signal
    # d_t = sampler (-0.5, -1.5) - reference (-1): +0.5, -0.5; mean 0 -> A_t = A - 0.5 d_t
    for d, a in zip(datums, [a for t, a in zip(trajectories, _group_advantages(trajectories)) if t.tokens]):
        sampled_positions = d.loss_fn_inputs["mask"] != 0
        assert d.loss_fn_inputs["advantages"][sampled_positions].tolist() == pytest.approx([a - 0.25, a + 0.25])
    assert metrics["kl/sampler_reference_k1"] == pytest.approx(0.0)


def test_std_normalisation_divides_each_group_by_its_std():
    loop, _, learner = make_loop(**{"trainer.prompts_per_step": 3, "trainer.group_size": 4,
                                    "trainer.advantage.std_normalize": "true"})
    _, trajectories = loop.step()
    loop.close()
    expected = []
    for t, a in zip(trajectories, _group_advantages(trajectories)):
        group = torch.tensor([u.reward for u in trajectories if u.group == t.group], dtype=torch.float64)
        if t.tokens and a != 0:
            expected.append(a / (float(group.std()) + 1e-6))
    got = sorted(float(d.loss_fn_inputs["advantages"]) for d in _calls(learner, "fb")[0][1])
    assert got == pytest.approx(sorted(expected), rel=1e-5) and len(got) > 0


def test_overlong_shaping_penalises_rewards_before_advantages():
    # every sampled reply is 2 tokens; with max_new_tokens 3 and a 2-token window, a 2-token reply
    # sits 1 token into the window: penalty (3 - 2 - 2) / 2 = -0.5
    common = {"trainer.prompts_per_step": 2, "trainer.group_size": 4, "generator.sampling.max_new_tokens": 3}
    loop, _, _ = make_loop(**common, **{"trainer.advantage.overlong_cache_tokens": 2})
    plain, _, _ = make_loop(**common)
    metrics, shaped = loop.step()
    _, unshaped = plain.step()
    loop.close()
    plain.close()
    for s, u in zip(shaped, unshaped):
        penalty = -0.5 if u.tokens else 0.0
        assert s.reward == pytest.approx(u.reward + penalty) and s.info["overlong_penalty"] == penalty
    assert metrics["count/overlong_penalised"] == sum(1 for u in unshaped if u.tokens)


def test_sync_advances_version_on_every_generator():
    loop, gens, _ = make_loop()
    assert loop.step()[0]["version"] == 1
    assert loop.step()[0]["version"] == 2
    loop.close()
    assert [g.version for g in gens] == [2, 2]


def test_sync_refuses_a_generator_left_on_an_old_version():
    loop, gens, _ = make_loop()
    gens[1].update_weights = lambda v: {"version": v - 1, "pull_s": 0, "transfer_s": 0, "bytes": 0, "load_s": 0}
    with pytest.raises(StepError, match=r"hold versions \[0, 1\] after a pull of 1"):
        loop.step()
    loop.close()


class ArrivesAtDeadline(Future):
    def get(self, timeout=None):
        time.sleep(timeout)
        return self.value


@pytest.mark.parametrize("watch", [None, lambda: None])
def test_wait_all_takes_replies_that_arrived_while_an_earlier_one_used_the_deadline(watch):
    assert wait_all([ArrivesAtDeadline(1), Future(2)], 0.2, "generator.generate", watch=watch) == [1, 2]


def test_wait_all_deadline_names_the_call():
    with pytest.raises(CallTimeout, match="generator.generate timed out after 2s"):
        wait_all([Future(1), Future(hang=True)], 2, "generator.generate")


def test_a_step_whose_learner_failed_midway_is_trained_again_from_the_start():
    """The learner dies after the first of a step's two pieces was trained: the step is run again
    after the recovery (here: the loop's state restored) with nothing of the failed attempt left in
    the terms, so its normaliser and datums are those of a clean step."""
    from meshrl.meshes.supervisor import LearnerLost, ProcessDied

    config = {"trainer.prompts_per_step": 4, "trainer.group_size": 4, "trainer.num_minibatches": 2}
    clean, _, clean_learner = make_loop(**config)
    clean.step()
    clean.close()

    class DiesOnce(FakeLearner):
        def forward_backward(self, datums, loss_fn, loss_config, padding=False, temperature=1.0):
            if len(_calls(self, "fb")) == 1 and not getattr(self, "died", False):
                self.died = True
                raise ProcessDied("learner.forward_backward: process 123 of mesh 'learner' is gone")
            return super().forward_backward(datums, loss_fn, loss_config, padding, temperature)

    loop, _, learner = make_loop(learner=DiesOnce(), **config)
    state = loop.state_dict()
    with pytest.raises(LearnerLost):
        loop.step()
    learner.calls.clear()
    loop.load_state_dict(state)
    loop.step()
    loop.close()
    assert _normalisers(learner) == _normalisers(clean_learner)
    assert [len(c[1]) for c in _calls(learner, "fb")] == [len(c[1]) for c in _calls(clean_learner, "fb")]


@register_term("counts_steps")
class _CountsSteps(LossTerm):
    """A term whose state is the number of steps it has seen (trains nothing)."""

    loss, trains = "ppo", False

    def __init__(self, ctx, weight=1.0, params=None):
        super().__init__(ctx, weight, params)
        self.steps = 0

    def start_step(self, step):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def test_a_run_started_over_from_step_0_starts_its_terms_over_too():
    """A learner lost before the first checkpoint starts the run over from step 0: the terms go back
    to their state at the start as well (the replay term's inbox kept its dedupe horizon and
    dropped the rerun steps' teacher results as stale or duplicate), while the counters carry on."""
    loop, _, _ = make_loop(**{"trainer.prompts_per_step": 2, "trainer.group_size": 2,
                              "trainer.terms": "[{name: counts_steps}]"})
    term = loop.terms[-1]
    loop.step()
    loop.step()
    assert term.steps == 2 and loop.version == 2
    prompts = loop.counters.prompts_too_long, loop.counters.empty_generations
    loop.load_state_dict(loop.start_over_state())
    assert term.steps == 0 and loop.version == 0 and loop.step_index == 0
    assert (loop.counters.prompts_too_long, loop.counters.empty_generations) == prompts
    loop.step()
    loop.close()
    assert term.steps == 1 and loop.version == 1
