"""Integration: real Monarch processes, the tiny model (the HF engine in the Generator actor).

One Runtime (learner, generator, rewarder meshes, in the test session's shared processes) is shared
by the tests of this module.
"""

import dataclasses

import pytest

from meshrl.types import Datum

from meshrl.config.base import load_config
from meshrl.config.run import RunConfig
from tests.conftest import TINY_RUN

pytestmark = pytest.mark.monarch

TOLERANCE_MEAN = 0.02  # bf16 generator weights vs fp32-master learner under bf16 autocast
TOLERANCE_MAX = 0.15


def tiny_config(output_dir):
    # later overrides win: a grader that raises on odd-length replies, no gradient clipping
    # (visible weight changes)
    return load_config(RunConfig, None, TINY_RUN + [
        f"output.dir={output_dir}", "learner.grad_clip=0", "rewarder.reward_fn=meshrl.testing.rewards:fails_on_odd_length"])


@pytest.fixture(scope="module")
def runtime(tiny_session, tmp_path_factory):
    from meshrl.controller.runtime import Runtime

    rt = Runtime(tiny_config(tmp_path_factory.mktemp("runtime")), session=tiny_session)
    yield rt
    rt.close()


def _max_mean_diff(a, b):
    diffs = [abs(x - y) for sa, sb in zip(a, b) for x, y in zip(sa, sb)]
    return max(diffs), sum(diffs) / len(diffs)


def _score(runtime, sequences):
    gen = runtime.meshes["generator"].slice(procs=0).score.call_one(sequences).get(timeout=120)
    learn = runtime.meshes["learner"].forward.call_one([Datum.from_sequence(s) for s in sequences]).get(timeout=120)
    assert [len(s) for s in gen] == [len(s) - 1 for s in sequences]
    return gen, learn


def test_three_steps_advance_version_and_weights_stay_in_sync(runtime):
    loop = runtime.loop
    versions = []
    trajectories = []
    for _ in range(3):
        metrics, trajectories = loop.step()
        versions.append(metrics["version"])
        assert metrics["batch/datums"] > 0, "the toy reward must give a learning signal"
        assert metrics["sync/bytes"] > 0 and metrics["sync/pull_s"] > 0
        assert metrics["sync/pulled_bytes"] == metrics["sync/bytes"] * runtime.meshes.procs_of("generator")
        assert metrics["sync/transport/shm"] == runtime.meshes.procs_of("generator")  # same host: shared memory
        # every sample of a step was drawn by the weights of the previous version
        assert {t.version for t in trajectories} == {metrics["version"] - 1}
    assert versions == [1, 2, 3]
    infos = runtime.meshes["generator"].info.call().get(timeout=60)
    assert [i["version"] for i in infos.values()] == [3]

    sequences = [t.prompt_tokens + t.tokens for t in trajectories[:6]]
    gen, learn = _score(runtime, sequences)
    worst, mean = _max_mean_diff(gen, learn)
    assert mean < TOLERANCE_MEAN and worst < TOLERANCE_MAX, (worst, mean)

    # one more learner update without a sync: the generator still has the old weights
    fb = runtime.meshes["learner"].forward_backward.call_one(
        _datums(loop, trajectories), "ppo", {"eps_low": 0.2, "eps_high": 0.2}).get(timeout=120)
    assert fb["tokens"] > 0
    runtime.meshes["learner"].optim_step.call_one(runtime.cfg.learner.adam_params()).get(timeout=120)
    gen_old, learn_new = _score(runtime, sequences)
    worst_stale, mean_stale = _max_mean_diff(gen_old, learn_new)
    assert mean_stale > 3 * TOLERANCE_MEAN, (worst_stale, mean_stale)

    sync, _ = loop.step()  # trains once more, publishes and brings the generator along
    assert sync["version"] == 4
    gen_new, learn_new2 = _score(runtime, sequences)
    worst, mean = _max_mean_diff(gen_new, learn_new2)
    assert mean < TOLERANCE_MEAN and worst < TOLERANCE_MAX, (worst, mean)


def _datums(loop, trajectories):
    from meshrl.training.trajectories import group_advantages, rl_datums

    datums, _ = rl_datums(trajectories, group_advantages(trajectories, False), "token_mean")
    return datums


def test_bad_inputs_are_counted_and_the_step_completes(runtime):
    loop = runtime.loop
    real_batch = loop.task.train_batch
    long_problem = dataclasses.replace(
        real_batch(0, 1)[0], id="too-long", messages=({"role": "user", "content": "word " * 400},))

    def with_long_prompt(cursor, n):
        return [long_problem] + real_batch(cursor, n - 1)

    before = dict(loop.counters.as_metrics())
    loop.task.train_batch = with_long_prompt
    # the producer rolls the next step out as soon as the last version is published: drop what it
    # made with the old task and produce the next step again
    from meshrl.controller.pipeline import ProductionState

    loop.stop_producer()
    loop.producer.feed.release(loop.step_index + 1)
    loop.producer.state = ProductionState(loop.step_index + 1, loop.cursor, loop.cursor)
    try:
        metrics, trajectories = loop.step()
    finally:
        loop.task.train_batch = real_batch
    assert metrics["count/prompts_too_long"] == before["count/prompts_too_long"] + 1
    assert all(t.problem.id != "too-long" for t in trajectories)
    assert len(trajectories) == (loop.cfg.trainer.prompts_per_step - 1) * loop.cfg.trainer.group_size
    # the toy grader raises on odd-length responses: those score 0 and are counted
    errors = [t for t in trajectories if "error" in t.info]
    assert errors and all(t.reward == 0.0 for t in errors)
    assert metrics["count/reward_errors"] >= before["count/reward_errors"] + len(errors)
    assert metrics["version"] == loop.version


def test_custom_loss_through_the_learner_endpoint(runtime):
    """A picklable custom loss crosses the process boundary and trains like the registered one."""
    from meshrl.testing.custom_losses import importance_sampling_custom

    _, trajectories = runtime.loop.step()
    datums = _datums(runtime.loop, trajectories)
    learner = runtime.meshes["learner"]
    registered = learner.forward_backward.call_one(datums, "importance_sampling").get(timeout=120)
    custom = learner.forward_backward_custom.call_one(datums, importance_sampling_custom).get(timeout=120)
    assert custom["loss"] == pytest.approx(registered["loss"], rel=1e-3, abs=1e-6)
    assert custom["num_datums"] == len(datums) > 0
    runtime.client.optim_step(runtime.cfg.learner.adam_params())  # apply both: no gradient left behind


def test_greedy_eval_is_deterministic(runtime):
    first = runtime.loop.evaluate()
    second = runtime.loop.evaluate()
    assert first["eval/n"] == runtime.cfg.trainer.eval.size
    assert first["eval/accuracy"] == second["eval/accuracy"]
