import os
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_session_status: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _session_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with the tests' own status, without tearing Monarch's client down (as
    `meshrl`'s console script does). The fixtures have stopped their meshes by now; procs they
    left die with this process (Monarch spawns them with a parent-death signal). A teardown can
    turn a passed run into status 1: at interpreter exit (656 passed tests, status 1), and inside
    an explicit `shutdown_context()`, where a mesh controller's message to a process already gone
    came back undeliverable and the Rust client exited with 1 ("client received undeliverable
    message: crashing"), after all 955 tests had passed."""
    if not _session_status or "monarch.actor" not in sys.modules:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_session_status[-1])


@pytest.fixture(scope="session")
def smollm_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer and chat template (from the packaged GGUF)."""
    from meshrl.models.packaged import packaged_tokenizer

    return packaged_tokenizer()


TINY_RUN = [
    "model.name_or_path=tiny",
    # tiny runs sample with the HF engine: it starts in a moment; tests about vLLM name it
    "generator.backend=hf",
    "model.max_model_len=256",
    "generator.sampling.max_new_tokens=16",
    "generator.kv_cache_gib=1",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "trainer.eval.size=8",
    "trainer.progress=false",
    "learner.lr=5e-3",
    "rewarder.reward_fn=meshrl.testing.rewards:vowel_fraction",
]


@pytest.fixture(scope="session")
def tiny_session(tmp_path_factory):
    """One MeshSession for the whole test session, for tests that only need running meshes of the
    tiny config: each run (`Runtime(cfg, session=tiny_session)`) spawns fresh actors in its
    processes, sparing a process start per mesh. Runs must keep TINY_RUN's `meshes`, `launch` and
    `model` sections."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.session import MeshSession

    session = MeshSession(load_config(RunConfig, None, TINY_RUN + [f"output.dir={tmp_path_factory.mktemp('tiny')}"]))
    yield session
    session.close()


@pytest.fixture
def tiny_run_config(tmp_path):
    """Build a RunConfig for a fast real run on the tiny model (vowel-fraction toy reward)."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    def make(*overrides):
        return load_config(RunConfig, None, TINY_RUN + [f"output.dir={tmp_path}", *overrides])

    return make


def sdk_user_error(future, timeout: float = 120) -> str:
    """The message of the `user`-category error a tinker SDK future fails with (asserted)."""
    import tinker
    from tinker import types

    with pytest.raises(tinker.RequestFailedError) as err:
        future.result(timeout=timeout)
    assert err.value.category == types.RequestErrorCategory.User, err.value
    return str(err.value)
