"""The real SmolLM2-135M through the real vLLM engine in a Generator actor, through one weight
update: after the sync the generator and the learner disagree on the logprobs of the same tokens
no more than they did before any training (the bf16 engine vs the fp32-master learner under bf16
autocast), while the stale generator disagrees clearly with the updated learner."""

import pytest

from meshrl.types import Datum

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from meshrl.engines import SampleRequest
from meshrl.training.trajectories import group_advantages, rl_datums

pytestmark = [pytest.mark.slow, pytest.mark.monarch]


def _mean_abs_diff(rt, sequences):
    gen = rt.meshes["generator"].slice(procs=0).score.call_one(sequences).get(timeout=300)
    learn = rt.meshes["learner"].forward.call_one([Datum.from_sequence(s) for s in sequences]).get(timeout=300)
    diffs = [abs(a - b) for ga, la in zip(gen, learn) for a, b in zip(ga, la)]
    return sum(diffs) / len(diffs)


def test_real_model_weight_update_keeps_generator_and_learner_in_sync():
    from meshrl.controller.runtime import Runtime

    cfg = load_config(RunConfig, None, ["trainer.prompts_per_step=4", "trainer.group_size=8", "learner.lr=3e-4",
                                        "learner.grad_clip=0",
                                        "rewarder.reward_fn=meshrl.testing.rewards:vowel_fraction"])
    with Runtime(cfg) as rt:
        problems = rt.task.train_batch(10_000, 3)
        prompts = [rt.renderer.build_generation_prompt(list(p.messages)) for p in problems]
        groups = rt.client.generate(prompts, SampleRequest(n=2, max_tokens=32, temperature=1.0, seed=1))
        sequences = [p + list(c.tokens) for p, g in zip(prompts, groups) for c in g if c.tokens]
        before = _mean_abs_diff(rt, sequences)  # both on the initial weights
        metrics, trajectories = rt.loop.step()  # learner update, publish, generator pull
        assert metrics["batch/datums"] > 0
        assert metrics["version"] == 1 and metrics["sync/bytes"] > 200e6  # the full bf16 model moved
        after = _mean_abs_diff(rt, sequences)
        info = rt.meshes["generator"].info.call().get(timeout=60)
        assert [i["version"] for i in info.values()] == [1]
        # one more learner update without a sync: the generator is now stale
        datums, _ = rl_datums(trajectories, group_advantages(trajectories, False), "token_mean")
        rt.client.forward_backward(datums, "ppo")
        rt.client.scale_grads(1e-2)
        rt.client.optim_step(rt.cfg.learner.adam_params())
        stale = _mean_abs_diff(rt, sequences)
    assert after <= 1.5 * before + 0.01, (before, after)
    assert stale > 2 * after, (stale, after)
