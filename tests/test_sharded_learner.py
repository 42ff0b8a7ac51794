"""Weights of a sharded learner, with real Monarch learner meshes (tiny model, float32, gloo):

* 2 and 4 FSDP2 ranks publish their own shards; a reader assembles them (whole, and bucket by
  bucket) bit for bit into the 1-process learner's weights, and after a step into the weights the
  N-rank checkpoint holds; the 4-rank HF export (streamed a layer at a time) holds them too;
* a learner rank killed in the middle of a publish leaves no torn version: the index keeps the last
  complete one, and a restarted learner completes the next;
* FSDP2 with LoRA (the frozen base sharded) equals DDP with LoRA: loss, gradient norm, adapters,
  the merged weights it publishes, its published adapter and its export.
"""

import os

os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")

import time  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.test_data_parallel import _datums, _load_params  # noqa: E402

pytestmark = [pytest.mark.monarch, pytest.mark.slow]


@pytest.fixture(scope="module")
def setup():
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.meshes.local import prepare_environment
    from meshrl.models.provision import resolve_model

    cfg = load_config(RunConfig, None, ["model.name_or_path=tiny", "learner.autocast_bf16=false",
                                        "learner.micro_batch_size=2", "learner.torch_threads=1",
                                        "learner.lr=1e-3", "learner.grad_clip=0.5"])
    prepare_environment(cfg.meshes)
    return cfg, resolve_model("tiny")


class Arm:
    """One learner mesh of ``procs`` processes publishing to ``store``."""

    def __init__(self, setup, procs: int, mode: str, store: str, **learner):
        from meshrl.actors.learner import Learner
        from meshrl.config.launch import LaunchConfig
        from meshrl.config.meshes import MeshesConfig
        from meshrl.meshes.group import MeshGroup
        from meshrl.meshes.hosts import Hosts
        from meshrl.meshes.rendezvous import Rendezvous

        cfg, path = setup
        self.cfg, self.path, self.store = cfg, path, store
        if "lora" in learner:
            learner["lora"] = cfg.learner.lora.model_copy(update=learner["lora"])
        self.learner_cfg = cfg.learner.model_copy(update={"data_parallel": mode, **learner})
        self.group = MeshGroup(MeshesConfig(learner={"procs": procs}), Hosts.local(LaunchConfig()))
        self.group.spawn("learner", Learner, str(path), cfg.model, self.learner_cfg, cfg.weight_sync, store,
                         Rendezvous())
        self.client = None

    def ready(self) -> "Arm":
        from meshrl.meshes.client import MeshClient
        from meshrl.meshes.supervisor import Supervisor

        self.group.wait_ready(timeout_s=300)
        self.client = MeshClient(self.group, Supervisor(self.group, self.cfg.faults),
                                 {"learner": 120.0, "sync": 120.0}, self.cfg.meshes.chunks_per_replica)
        return self

    def step(self, seed: int) -> dict:
        out = self.client.forward_backward(_datums(seed), "ppo")
        self.client.scale_grads(1.0 / out["tokens"])
        return {**out, **self.client.optim_step(self.cfg.learner.adam_params())}

    def params(self, directory) -> dict[str, torch.Tensor]:
        """The policy's float32 parameters, through a checkpoint read back by one process."""
        self.client.on_learners("save_checkpoint", str(directory))
        return _load_params(directory, self.path, self.learner_cfg)

    def stop(self) -> None:
        self.group.stop()


def pull(store: str, version: int, bucket_mib: int = 0, **sync) -> dict[str, torch.Tensor]:
    """Version ``version`` of ``store`` as a reader in this process assembles it."""
    from meshrl.config.weight_sync import WeightSyncConfig
    from meshrl.transport.weight_store import WeightPuller

    puller = WeightPuller(store, WeightSyncConfig(pull_bucket_mib=bucket_mib, **sync))
    if not bucket_mib:
        return {k: v.clone() for k, v in puller.pull(version, exact=True).tensors.items()}
    got = {}
    result = puller.pull_into(lambda items: got.update((k, v.clone()) for k, v in items), version, exact=True)
    assert result.stats.buckets > 1
    return got


def assert_equal(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys(), label
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{label}: {len(differ)} tensors differ, e.g. {differ[0]}"


def bf16(params: dict) -> dict:
    out = {k: v.to(torch.bfloat16) for k, v in params.items()}
    if "lm_head.weight" not in out:  # tied: published under both names
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def test_fsdp2_ranks_publish_shards_that_readers_assemble_bitwise(setup, tmp_path):
    from transformers import AutoModelForCausalLM

    arms = {1: Arm(setup, 1, "fsdp2", "shards-1"), 2: Arm(setup, 2, "fsdp2", "shards-2"),
            4: Arm(setup, 4, "fsdp2", "shards-4")}
    try:
        for arm in arms.values():
            arm.ready().client.publish(1)
        whole = pull("shards-1", 1)
        initial = AutoModelForCausalLM.from_pretrained(arms[1].path, dtype=torch.float32).state_dict()
        assert_equal(whole, bf16(initial), "1 process vs the model files")
        for procs in (2, 4):
            assert_equal(pull(f"shards-{procs}", 1), whole, f"{procs} FSDP2 ranks vs 1 process")
            assert_equal(pull(f"shards-{procs}", 1, bucket_mib=1), whole, f"{procs} ranks, 1 MiB buckets")
        assert_equal(pull("shards-4", 1, transport="rdma"), whole, "4 ranks over RDMA")

        sizes = {}
        for procs, arm in arms.items():  # after a step: what each learner holds, bit for bit
            arm.step(1)
            sizes[procs] = arm.client.publish(2)
            assert sizes[procs]["bytes"] == sizes[1]["bytes"]  # the whole version, tied weights once
            assert sizes[procs]["part_bytes"] <= sizes[1]["bytes"] / procs + 2**16  # rank 0's part
            params = arm.params(tmp_path / f"ckpt-{procs}")
            assert_equal(pull(f"shards-{procs}", 2, bucket_mib=1), bf16(params), f"{procs} ranks after a step")
        exported = arms[4].client.on_learners("export", str(tmp_path / "export-4"))
        files = sorted(os.listdir(exported))
        assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 3
        reloaded = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
        held = arms[4].params(tmp_path / "ckpt-4b")
        assert_equal({k: v for k, v in reloaded.items() if k != "lm_head.weight"},
                     {k: v for k, v in held.items() if k != "lm_head.weight"}, "4-rank export vs its checkpoint")
    finally:
        for arm in arms.values():
            arm.stop()


def test_a_learner_rank_killed_mid_publish_leaves_no_torn_version(setup):
    import monarch.actor
    from meshrl.meshes.ranks import actor_at
    from meshrl.transport.weight_index import weight_index
    from meshrl.transport.weight_store import WeightSyncError

    faults = []
    default_hook, monarch.actor.unhandled_fault_hook = monarch.actor.unhandled_fault_hook, faults.append
    arm = Arm(setup, 2, "fsdp2", "killed").ready()
    restarted = None
    try:
        arm.client.publish(1)
        v1 = pull("killed", 1)
        actor_at(arm.group["learner"], 1).inject_fault.call_one("publish", "delay", 120.0).get(timeout=30)
        arm.group["learner"].publish.call(2)  # rank 0 publishes its part, rank 1 waits in the fault
        index = weight_index().get(timeout=30)
        deadline = time.monotonic() + 60
        while index.describe.call_one("killed").get(timeout=30)["pending"] != {2: [0]}:
            assert time.monotonic() < deadline, "rank 0's part of v2 never arrived"
            time.sleep(0.1)
        arm.group.kill("learner", 1)
        time.sleep(1.0)
        state = index.describe.call_one("killed").get(timeout=30)
        assert state["latest"] == 1 and state["versions"] == [1]
        with pytest.raises(WeightSyncError, match="v2 not published within 0.5s"):
            pull_exact_timeout("killed", 2, 0.5)
        arm.stop()

        restarted = Arm(setup, 2, "fsdp2", "killed").ready()  # a new learner (from its files) publishes v2
        restarted.client.publish(2)
        assert_equal(pull("killed", 2), v1, "v2 of the restarted learner")
        assert index.describe.call_one("killed").get(timeout=30)["pending"] == {}
    finally:
        for a in (arm, restarted):
            if a is not None:
                a.stop()
        monarch.actor.unhandled_fault_hook = default_hook


def pull_exact_timeout(store: str, version: int, timeout_s: float):
    from meshrl.transport.weight_store import WeightPuller

    return WeightPuller(store).pull(version, timeout_s=timeout_s, exact=True)


LORA = {"enabled": True, "rank": 4, "alpha": 8.0}


def test_fsdp2_with_lora_equals_ddp_with_lora(setup, tmp_path):
    from meshrl.training.lora import load_base_state, merge_adapter

    cfg, path = setup
    arms = {"fsdp2": Arm(setup, 2, "fsdp2", "lora-fsdp2", lora=LORA),
            "fsdp2-adapter": Arm(setup, 2, "fsdp2", "lora-fsdp2-adapter", lora={**LORA, "sync": "adapter"}),
            "ddp": Arm(setup, 2, "ddp", "lora-ddp", lora=LORA)}
    try:
        results = {name: arm.ready().step(1) for name, arm in arms.items()}
        for name in ("fsdp2", "fsdp2-adapter"):
            assert results[name]["loss"] == pytest.approx(results["ddp"]["loss"], rel=1e-5, abs=1e-7)
            assert results[name]["grad_norm"] == pytest.approx(results["ddp"]["grad_norm"], rel=1e-5)
        info = arms["fsdp2"].client.on_learners("info")
        assert info["data_parallel"] == "fsdp2" and 0 < info["trainable_params"] < 200_000

        adapters = {name: arm.params(tmp_path / name) for name, arm in arms.items()}  # LoRA checkpoints
        for name in ("fsdp2", "fsdp2-adapter"):
            worst = max((adapters[name][k] - adapters["ddp"][k]).abs().max().item() for k in adapters["ddp"])
            assert worst <= 1e-5, f"{name}: LoRA parameters differ from DDP's by {worst:.2e}"
        assert max(adapters["ddp"][k].abs().max().item() for k in adapters["ddp"] if "lora_B" in k) > 1e-4  # B left 0

        for arm in arms.values():
            arm.client.publish(1)
        ddp = pull("lora-ddp", 1)
        fsdp2 = pull("lora-fsdp2", 1, bucket_mib=1)
        assert ddp.keys() == fsdp2.keys() and not any("lora" in k for k in ddp)
        for k in ddp:  # bf16: one rounding step apart at most
            torch.testing.assert_close(fsdp2[k].float(), ddp[k].float(), rtol=2 ** -7, atol=1e-6)
        adapter = pull("lora-fsdp2-adapter", 1)
        assert adapter and all("lora" in k for k in adapter)
        merged = merge_adapter(load_base_state(path, torch.float32), adapter)
        for k in ddp:
            torch.testing.assert_close(merged[k].to(torch.bfloat16).float(), ddp[k].float(), rtol=2 ** -7, atol=1e-6)

        exports = {name: arms[name].client.on_learners("export", str(tmp_path / f"export-{name}"))
                   for name in ("fsdp2", "ddp")}
        from transformers import AutoModelForCausalLM

        states = {name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
                  for name, d in exports.items()}
        assert states["fsdp2"].keys() == states["ddp"].keys()
        for k, v in states["ddp"].items():
            torch.testing.assert_close(states["fsdp2"][k], v, rtol=0, atol=1e-5)
    finally:
        for arm in arms.values():
            arm.stop()
