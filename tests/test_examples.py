"""The examples run as documented, on the tiny model (short)."""

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import TINY_RUN

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.monarch
def test_custom_rewarder_and_mesh_of_your_own_on_two_hosts():
    """A rewarder class and a declared mesh of the user's, the standard loop, the process launcher
    with the generator on a host of its own."""
    example = _load("custom_rewarder")
    steps = example.main(TINY_RUN + ["trainer.steps=2", "launch.launcher=process",
                                     "launch.hosts={trainer: 1, sampler: 1}", "launch.place={generator: sampler}"])
    assert [s["version"] for s in steps] == [1, 2]
    assert [s["replies"] for s in steps] == [16, 32]  # the ReplyStats mesh saw every trained reply
    # every reward came from BrevityRewarder (its info field), with its penalty applied
    assert all(s["mean_penalty"] >= 0 for s in steps)
    assert any(s["mean_penalty"] > 0 for s in steps) or all(s["mean_words"] <= 8 for s in steps)


API_TINY = ["model.name_or_path=tiny", "model.max_model_len=256", "generator.kv_cache_gib=1", "generator.backend=hf",
            "learner.lora.enabled=true", "learner.lora.sync=adapter", "weight_sync.keep_versions=2",
            "weight_sync.max_arenas=4"]


@pytest.mark.slow  # ~25 s on 2 cores
@pytest.mark.monarch
def test_sl_basic_and_rl_basic_run_on_the_api(tmp_path):
    """The two `meshrl.api` examples, short, on the tiny model."""
    losses = _load("sl_basic").main(["--steps", "3", "--lr", "1e-2", *API_TINY, f"output.dir={tmp_path}"])
    assert len(losses) == 3 and losses[-1] < losses[0]
    rewards = _load("rl_basic").main(["--steps", "2", "--problems", "2", "--group", "2", "--max-tokens", "8",
                                      *API_TINY, f"output.dir={tmp_path}"])
    assert len(rewards) == 2 and all(0.0 <= r <= 1.0 for r in rewards)


def test_openenv_example_environment_follows_openenvs_interface():
    """The example's environment, in-process behind OpenEnvAdapter: a retry after a wrong answer."""
    from meshrl.envs.openenv_adapter import OpenEnvAdapter

    example = _load("openenv_arithmetic")
    env = OpenEnvAdapter(example.RetryArithmeticEnv())
    assert env.action_cls is example.AnswerAction and env.action_field == "message"
    question = env.reset(seed=3)
    answer = example.RetryArithmeticEnv().task.train_batch(3, 1)[0].answer
    assert question.text.startswith("What is") and question.metadata["openenv_observation"]["attempts_left"] == 2
    retry = env.step("no idea")
    assert not retry.done and retry.reward == 0.0 and "not right" in retry.text
    # an error site for SDPO: its kind and hint, sent as observation fields (the wire drops metadata)
    assert (retry.error_kind, retry.hint_template_key) == ("wrong_format", "math.wrong_format")
    assert retry.metadata["hint"].endswith(f"The correct answer is {answer}.")
    final = env.step(f"It is {answer}.")
    assert final.done and final.reward == 0.5 and env.state.step_count == 2
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("1")
    # the held-out split: problems the training stream never draws
    held = env.reset(seed=3, split="test")
    assert held.text == example.RetryArithmeticEnv().task.heldout()[3].messages[-1]["content"]
