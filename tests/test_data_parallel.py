"""A data-parallel learner: N processes train one policy and equal one process.

Unit tests cover the controller's token-balanced split; the integration test runs real Monarch
learner meshes (1 process, 2 processes with FSDP2, 2 with DDP; gloo on CPU) on the tiny model in
float32 and checks that one training step through the MeshClient leaves the same parameters
(within 1e-5), that checkpoints written by N processes resume with another N, and that the shards
the FSDP2 ranks publish assemble into the whole policy. A second test trains PolicyTrainers in
plain processes (1, and 2 under DDP) and checks that an optimizer step with no gradient on any
rank moves nothing and counts no AdamW step, as in one process.
"""

import torch
import pytest

from meshrl.meshes.client import split_by_tokens
from meshrl.types import Datum


# balanced by tokens over 2 ranks these become 4 and 5 datums: 2 and 3 micro-batches of 2, so the
# lighter rank runs a padding pass under FSDP2
LENGTHS = (40, 30, 5, 6, 7, 5, 6, 8, 5)


def _datums(seed: int, lengths=LENGTHS) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        toks = torch.randint(0, 49152, (n,), generator=g).tolist()
        half = n // 2
        out.append(Datum.from_sequence(toks, mask=[0] * half + [1] * (n - half), logprobs=[-3.0] * n,
                                       advantages=[0.0] * half + [0.1 * (i - 3)] * (n - half)))
    return out


def test_split_by_tokens_balances_tokens_and_keeps_items_whole():
    datums = _datums(0, (7, 19, 5, 12, 9, 16, 6))
    shares = split_by_tokens(datums, 2)
    assert sorted(i for s in shares for i in s) == list(range(len(datums)))
    loads = [sum(datums[i].length for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(d.length for d in datums)
    assert all(s == sorted(s) for s in shares)
    pairs = split_by_tokens(datums[:6], 2, per_item=2)  # DPO-style pairs stay on one rank
    for share in pairs:
        assert len(share) % 2 == 0 and all(share[k] + 1 == share[k + 1] for k in range(0, len(share), 2))
    assert split_by_tokens(datums[:1], 3) == [[0], [], []]


def _load_params(ckpt_dir, path, cfg) -> dict[str, torch.Tensor]:
    """The parameters a checkpoint holds, read back by a single-process trainer (N -> 1 resume)."""
    from meshrl.training.checkpoint import load_learner
    from meshrl.training.policy import PolicyTrainer

    trainer = PolicyTrainer(path, cfg)
    load_learner(trainer, ckpt_dir)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_close(a: dict, b: dict, label: str) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= 1e-5, f"{label}: parameters differ by up to {worst:.2e}"


@pytest.mark.slow
@pytest.mark.monarch
def test_two_learner_processes_equal_one(tmp_path):
    from meshrl.meshes.local import prepare_environment

    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig

    cfg = load_config(RunConfig, None, ["model.name_or_path=tiny", "learner.autocast_bf16=false",
                                        "learner.micro_batch_size=2", "learner.torch_threads=1",
                                        "learner.lr=1e-3", "learner.grad_clip=0.5"])
    prepare_environment(cfg.meshes)
    from meshrl.actors.learner import Learner
    from meshrl.transport.weight_store import WeightPuller
    from meshrl.config.meshes import MeshesConfig
    from meshrl.meshes.client import MeshClient
    from meshrl.meshes.supervisor import Supervisor
    from meshrl.meshes.group import MeshGroup
    from meshrl.config.launch import LaunchConfig
    from meshrl.meshes.hosts import Hosts
    from meshrl.meshes.rendezvous import Rendezvous
    from meshrl.models.provision import resolve_model

    path = resolve_model("tiny")
    arms = {"single": (1, "fsdp2"), "fsdp2": (2, "fsdp2"), "ddp": (2, "ddp")}
    groups, clients = {}, {}
    try:
        for name, (procs, mode) in arms.items():
            group = MeshGroup(MeshesConfig(learner={"procs": procs}), Hosts.local(LaunchConfig()))
            learner_cfg = cfg.learner.model_copy(update={"data_parallel": mode})
            address = Rendezvous()
            group.spawn("learner", Learner, str(path), cfg.model, learner_cfg, cfg.weight_sync, f"dp-{name}", address)
            groups[name] = group
        for name, group in groups.items():
            group.wait_ready(timeout_s=300)
            clients[name] = MeshClient(group, Supervisor(group, cfg.faults), {"learner": 120.0, "sync": 120.0},
                                       cfg.meshes.chunks_per_replica)

        def step(client, seed):
            datums = _datums(seed)
            out = client.forward_backward(datums, "ppo")
            client.scale_grads(1.0 / out["tokens"])
            return {**out, **client.optim_step(cfg.learner.adam_params())}

        results = {name: step(c, 1) for name, c in clients.items()}
        assert [len(s) for s in split_by_tokens(_datums(1), 2)] == [4, 5]
        for name in ("fsdp2", "ddp"):
            assert results[name]["tokens"] == results["single"]["tokens"]
            assert results[name]["loss"] == pytest.approx(results["single"]["loss"], rel=1e-5, abs=1e-7)
            # Adam hides a gradient's scale: the global norm shows that ranks' gradients are summed
            assert results[name]["grad_norm"] == pytest.approx(results["single"]["grad_norm"], rel=1e-5)

        params = {}
        for name, client in clients.items():
            client.on_learners("save_checkpoint", str(tmp_path / name))
            params[name] = _load_params(tmp_path / name, path, cfg.learner)
        initial = {k: v.detach() for k, v in
                   __import__("transformers").AutoModelForCausalLM.from_pretrained(path).state_dict().items()}
        moved = max((params["single"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-4  # the step changed the weights far beyond the tolerance
        _assert_close(params["fsdp2"], params["single"], "FSDP2 x2 vs 1 process after one step")
        _assert_close(params["ddp"], params["single"], "DDP x2 vs 1 process after one step")

        # a 1-process checkpoint resumes on 2 processes (and the optimiser state comes along)
        clients["fsdp2"].on_learners("load_checkpoint", str(tmp_path / "single"))
        for name in ("single", "fsdp2"):
            step(clients[name], 2)
            clients[name].on_learners("save_checkpoint", str(tmp_path / f"{name}-2"))
        _assert_close(_load_params(tmp_path / "fsdp2-2", path, cfg.learner),
                      _load_params(tmp_path / "single-2", path, cfg.learner), "1 -> 2 processes resume")

        # every FSDP2 rank publishes its shards; a reader assembles the whole policy
        logprobs = {name: clients[name].forward(_datums(3)) for name in ("single", "fsdp2")}
        for a, b in zip(logprobs["single"], logprobs["fsdp2"]):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4
        clients["fsdp2"].publish(1)
        pulled = WeightPuller("dp-fsdp2", cfg.weight_sync).pull(1).tensors
        expected = {k: v.to(torch.bfloat16) for k, v in _load_params(tmp_path / "fsdp2-2", path, cfg.learner).items()}
        assert pulled.keys() == expected.keys()
        assert all(torch.equal(pulled[k], expected[k]) for k in expected)

        # a custom loss (a sum over datums) gives the same loss and gradient on 1 and 2 processes
        from meshrl.testing.custom_losses import importance_sampling_custom

        custom = {}
        for name in ("single", "fsdp2"):
            out = clients[name].forward_backward_custom(_datums(4), importance_sampling_custom)
            custom[name] = {**out, **clients[name].optim_step(cfg.learner.adam_params())}
        assert custom["fsdp2"]["loss"] == pytest.approx(custom["single"]["loss"], rel=1e-5, abs=1e-7)
        assert custom["fsdp2"]["grad_norm"] == pytest.approx(custom["single"]["grad_norm"], rel=1e-5)

        # several losses in one shared pass: ppo beside a DPO pair that only one rank trains (the
        # other runs as many passes for FSDP2's collectives) equal one process
        from meshrl.types import LossPart

        pair = [Datum.from_sequence(t, per_sequence={"weight": 0.5}, mask=[0] * 3 + [1] * (len(t) - 3))
                for t in ([5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12])]
        parts = [LossPart(_datums(5), "ppo", {}, 0.8, 0.01), LossPart(pair, "dpo", {"beta": 0.1})]
        clients["single"].on_learners("save_checkpoint", str(tmp_path / "before-parts"))
        for name in ("fsdp2", "ddp"):  # the same weights and optimizer state on every arm (DDP took one step only)
            clients[name].on_learners("load_checkpoint", str(tmp_path / "before-parts"))
        both = {}
        for name in clients:
            outs = clients[name].forward_backward_parts(parts)
            both[name] = (outs, clients[name].optim_step(cfg.learner.adam_params()))
        for name in ("fsdp2", "ddp"):
            for got, want in zip(both[name][0], both["single"][0]):
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
                assert got["tokens"] == want["tokens"]
            assert both[name][1]["grad_norm"] == pytest.approx(both["single"][1]["grad_norm"], rel=1e-5)
    finally:
        for group in groups.values():
            group.stop()


def _train_then_step_without_data(rank: int, world: int, address: str, results) -> None:
    """A step on `_datums(1)` (rank 0 trains them, rank 1 a padding datum, as the controller sends),
    then an optimizer step with no gradient anywhere (a step where every group had advantage 0):
    how far each parameter moved in that second step and the optimizer's step counts."""
    from meshrl.config.learner import LearnerConfig
    from meshrl.models.provision import resolve_model
    from meshrl.training.data_parallel import DataParallelSpec
    from meshrl.training.policy import PolicyTrainer

    cfg = LearnerConfig(lr=1e-2, autocast_bf16=False, torch_threads=1, micro_batch_size=4, data_parallel="ddp")
    trainer = PolicyTrainer(resolve_model("tiny"), cfg, parallel=DataParallelSpec(rank, world, "ddp", address, 120.0))
    datums = _datums(1)
    out = trainer.forward_backward(datums if rank == 0 else datums[:1], "ppo", padding=rank > 0)
    trainer.scale_grads(1.0 / sum(float((d.loss_fn_inputs["mask"] != 0).sum()) for d in datums))
    trainer.optim_step(cfg.adam_params())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.optim_step(cfg.adam_params())
    moved = max((p.detach() - b).abs().max().item() for p, b in zip(trainer.model.parameters(), before))
    counts = sorted({int(s["step"]) for s in trainer.optimizer.state.values()})
    results.put(((world, rank), {"moved": moved, "adam_steps": counts, "tokens": out["tokens"]}))
    trainer.dp.close()


@pytest.mark.slow
def test_a_step_without_gradients_moves_nothing_on_one_process_or_two_ddp_ranks():
    """N ranks equal one across a step where nothing trained: AdamW must not apply its stale
    momentum (nor count a step) under DDP when no rank has a gradient."""
    from meshrl.testing.ranks import free_address, run_ranks

    address = free_address()
    got = run_ranks(_train_then_step_without_data, [(r, 2, address) for r in range(2)], (0, 1, ""), "a DDP rank")
    single, ddp = got[1, 0], {rank: got[2, rank] for rank in (0, 1)}
    assert single["moved"] == 0.0 and single["adam_steps"] == [1]
    assert ddp[0]["tokens"] == single["tokens"] > 0
    for rank in (0, 1):
        assert ddp[rank]["moved"] == 0.0, f"DDP rank {rank} moved by {ddp[rank]['moved']:.2e} on a step without data"
        assert ddp[rank]["adam_steps"] == [1]
