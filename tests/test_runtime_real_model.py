"""The real SmolLM2-135M through the real vLLM engine in a Generator actor: one GRPO step with a
weight update, then the generator and the learner agree on the logprobs of the same tokens."""

import pytest

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig

pytestmark = [pytest.mark.slow, pytest.mark.monarch]


def test_real_model_weight_update_keeps_generator_and_learner_in_sync():
    from meshrl.controller.runtime import Runtime

    cfg = load_config(RunConfig, None, ["trainer.prompts_per_step=4", "trainer.group_size=8", "learner.lr=1e-4",
                                        "rewarder.reward_fn=meshrl.testing.rewards:vowel_fraction"])
    with Runtime(cfg) as rt:
        metrics, trajectories = rt.loop.step()
        assert metrics["version"] == 1 and metrics["batch/datums"] > 0
        assert metrics["sync/bytes"] > 200e6  # the full bf16 model moved over the weight store
        sequences = [t.prompt_tokens + t.tokens for t in trajectories[:4]]
        gen = rt.meshes["generator"].slice(procs=0).score.call_one(sequences).get(timeout=300)
        learn = rt.meshes["learner"].score.call_one(sequences).get(timeout=300)
        diffs = [abs(a - b) for ga, la in zip(gen, learn) for a, b in zip(ga, la)]
        assert sum(diffs) / len(diffs) < 0.02 and max(diffs) < 0.25, (max(diffs), sum(diffs) / len(diffs))
        info = rt.meshes["generator"].info.call().get(timeout=60)
        assert [i["version"] for i in info.values()] == [1]
