"""Packed micro-batches (`learner.packed_row_tokens`): sequences laid end to end with position ids
restarting at each one give every loss the per-datum values of padded micro-batches, attention
does not cross a sequence boundary, and the shared pass's prefix rows still work when packed."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.prefix_trees import pack_rows
from meshrl.training.policy import PolicyTrainer
from meshrl.types import Datum, LossPart

V = 49152


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_pack_rows_places_each_sequence_once_with_positions_from_zero():
    lengths, width = [5, 2, 7, 3], 7
    packed = pack_rows(lengths, width, row_tokens=10)
    assert packed.source.shape == (2, 9)  # two rows, longest first into the emptiest: 7 + 2 and 5 + 3
    assert packed.source[1, 8] == -1 and packed.position_ids[1, 8] == 0  # the second row's tail
    seen = packed.source[packed.source >= 0].tolist()
    assert sorted(seen) == sorted(b * width + t for b, n in enumerate(lengths) for t in range(n))
    for b, n in enumerate(lengths):
        flat = packed.target[b * width : b * width + n]
        assert packed.position_ids.reshape(-1)[flat].tolist() == list(range(n))
        assert (flat[1:] - flat[:-1]).tolist() == [1] * (n - 1)  # contiguous, in order
        assert (packed.target[b * width + n : (b + 1) * width] == -1).all()
    ids = torch.arange(len(lengths) * width).reshape(len(lengths), width)
    assert packed.input_ids(ids, pad_id=-5)[packed.source < 0].tolist() == [-5] * int((packed.source < 0).sum())
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    mask[2, 3:6], mask[0, 1] = True, True
    flat = torch.tensor([0 * width + 1, 2 * width + 3, 2 * width + 4, 2 * width + 5])
    assert packed.index(mask).tolist() == packed.index(flat).tolist() == packed.target[flat].tolist()
    with pytest.raises(ValueError, match="padding position"):
        packed.index(torch.tensor([1 * width + 2]))
    alone = pack_rows([3, 9], 9, row_tokens=4)  # rows as wide as the longest sequence
    assert alone.source.shape == (2, 9)
    assert pack_rows([6, 6, 5], 6, row_tokens=12).source.shape == (2, 11)  # 6 + 5 and 6
    assert pack_rows([7, 7, 7], 7, row_tokens=12).source.shape == (3, 7)  # the third fits in neither row: a new one


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _trainer(model_path, packed_row_tokens=0, lora=False, micro_batch_size=4):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, micro_batch_size=micro_batch_size, autocast_bf16=False,
                        release_heap_each_micro_batch=False, packed_row_tokens=packed_row_tokens,
                        **({"lora": {"enabled": True, "rank": 4}} if lora else {}))
    return PolicyTrainer(model_path, cfg)


def _datums():
    """Policy-gradient datums of varied lengths (3 to 40 tokens), two of them prefixes of others
    (the shared pass reads those off the longer rows)."""
    g = torch.Generator().manual_seed(3)
    seqs = [_tokens(20 + i, n) for i, n in enumerate([3, 40, 11, 17, 6, 29, 8])]
    seqs += [seqs[1][:25], seqs[5][:12]]
    out = []
    for i, s in enumerate(seqs):
        k = min(2, len(s) - 1)
        out.append(Datum.from_sequence(s, per_sequence={"advantages": 0.3 * (i - 4) + 0.05},
                                       mask=[0.0] * k + [1.0] * (len(s) - k),
                                       logprobs=[0.0] * k + (-torch.rand(len(s) - k, generator=g) * 4).tolist()))
    return out


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("row_tokens", [16, 64, 4096])
def test_packed_gives_the_logprobs_and_gradients_of_padded(model_path, lora, row_tokens):
    """Full fine-tuning and LoRA, rows of 16 tokens (most sequences alone or two to a row), 64 and
    one row per micro-batch: per-datum logprobs within 2e-5 absolute (float32) and the ppo
    gradient within 1e-5 relative, per parameter and overall."""
    datums = _datums()
    padded, packed = _trainer(model_path, 0, lora), _trainer(model_path, row_tokens, lora)
    for a, b in zip(padded.forward(datums), packed.forward(datums)):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    out_a = padded.forward_backward(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.28}, outputs=True, temperature=0.8)
    out_b = packed.forward_backward(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.28}, outputs=True, temperature=0.8)
    assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-5)
    for a, b in zip(out_a["logprobs"], out_b["logprobs"]):
        assert b == pytest.approx(a, abs=2e-5)
    ga, gb = _grads(padded), _grads(packed)
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert float((ga[name] - gb[name]).norm()) <= 1e-5 * float(ga[name].norm()) + 1e-12, name


def test_packed_shared_pass_with_reference_and_pairs(model_path):
    """A shared pass of ppo and DPO (its frozen reference forward packed too, pairs kept together)
    gives the gradients of the padded shared pass."""
    datums = _datums()
    pairs = [Datum.from_sequence(datums[i + 1].model_input.to_ints()[:3] + _tokens(90 + i, 4 + i),
                                 per_sequence={"weight": 0.5}, mask=[0] * 3 + [1] * (4 + i)) for i in range(4)]
    parts = [LossPart(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.2}, 1.0, scale=0.1),
             LossPart(pairs, "dpo", {"beta": 0.1}, 1.0)]
    padded, packed = _trainer(model_path, 0, micro_batch_size=3), _trainer(model_path, 32, micro_batch_size=3)
    got_a, got_b = padded.forward_backward_parts(parts), packed.forward_backward_parts(parts)
    for a, b in zip(got_a, got_b):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["tokens"] == a["tokens"]
    ga, gb = _grads(padded), _grads(packed)
    for name in ga:
        assert float((ga[name] - gb[name]).norm()) <= 1e-5 * float(ga[name].norm()) + 1e-12, name


def test_attention_does_not_cross_a_packed_boundary(model_path):
    """Two sequences in one packed row: changing every token of the first leaves the second's
    logprobs exactly as they were, and the second's equal its logprobs when forwarded alone."""
    trainer = _trainer(model_path, 64)
    a, b, other = _tokens(1, 12), _tokens(2, 9), _tokens(3, 12)
    packed = pack_rows([11, 8], 11, row_tokens=64)  # their model inputs
    assert packed.source.shape[0] == 1  # both in one row
    first = trainer.forward([Datum.from_sequence(s, mask=[1.0] * len(s)) for s in (a, b)])
    second = trainer.forward([Datum.from_sequence(s, mask=[1.0] * len(s)) for s in (other, b)])
    alone = trainer.forward([Datum.from_sequence(b, mask=[1.0] * len(b))])
    assert not torch.allclose(first[0], second[0])
    torch.testing.assert_close(second[1], first[1], rtol=0, atol=0)
    torch.testing.assert_close(first[1], alone[0], rtol=0, atol=2e-5)


def _packed_share(rank: int, world: int, mode: str, address: str, results) -> None:
    """Rank ``rank`` of ``world`` (data-parallel ``mode``) trains its token-balanced share of
    `_datums()` with ppo, packed into rows of 32 tokens when ``world`` > 1 (padded on one
    process), and takes an optimizer step: its loss, logprobs and the step's gradient norm."""
    from meshrl.meshes.client import split_by_tokens
    from meshrl.training.data_parallel import DataParallelSpec

    cfg = LearnerConfig(lr=1e-2, autocast_bf16=False, torch_threads=1, micro_batch_size=2, data_parallel=mode,
                        packed_row_tokens=32 if world > 1 else 0)
    trainer = PolicyTrainer(resolve_model("tiny"), cfg,
                            parallel=DataParallelSpec(rank, world, mode, address, 120.0) if world > 1 else None)
    datums = _datums()
    share = split_by_tokens(datums, world)[rank]
    out = trainer.forward_backward([datums[i] for i in share], "ppo", {"eps_low": 0.2, "eps_high": 0.2}, outputs=True)
    step = trainer.optim_step(cfg.adam_params())
    results.put(((mode, world, rank), {"loss": out["loss"], "grad_norm": step["grad_norm"],
                                       "logprobs": dict(zip(share, out["logprobs"]))}))
    trainer.dp.close()


@pytest.mark.slow
def test_packed_micro_batches_under_fsdp2_and_ddp_equal_one_padded_process():
    """Two ranks training packed micro-batches (FSDP2, then DDP) give the loss, per-datum logprobs
    and gradient norm of one process training the same datums padded."""
    from meshrl.testing.ranks import free_address, run_ranks

    ranks = []
    for mode in ("fsdp2", "ddp"):
        address = free_address()
        ranks += [(r, 2, mode, address) for r in range(2)]
    got = run_ranks(_packed_share, ranks, (0, 1, "fsdp2", ""), "a data-parallel rank")
    single = got["fsdp2", 1, 0]
    for mode in ("fsdp2", "ddp"):
        ranks = [got[mode, 2, r] for r in (0, 1)]
        assert sum(r["loss"] for r in ranks) == pytest.approx(single["loss"], rel=1e-5)
        assert [r["grad_norm"] for r in ranks] == pytest.approx([single["grad_norm"]] * 2, rel=1e-5)
        assert sorted(i for r in ranks for i in r["logprobs"]) == sorted(single["logprobs"])
        for r in ranks:
            for i, lp in r["logprobs"].items():
                assert lp == pytest.approx(single["logprobs"][i], abs=2e-5)


def test_packed_topk_and_custom_loss_equal_padded(model_path):
    """The other learner calls read the same packed forward: top-k logprobs at the mask's positions
    (in the micro-batches, as under FSDP2) and a custom loss's gradient equal padded ones."""
    from meshrl.testing.custom_losses import importance_sampling_custom

    datums = _datums()
    padded, packed = _trainer(model_path, 0), _trainer(model_path, 64)
    whole = padded._topk_in_micro_batches(datums, 5, False, 0)
    for a, b in zip(whole, packed._topk_in_micro_batches(datums, 5, False, 0)):
        torch.testing.assert_close(b[1], a[1], rtol=0, atol=2e-5)
        torch.testing.assert_close(b[2], a[2], rtol=0, atol=2e-5)
        assert torch.equal(a[0], b[0])
    out_a = padded.forward_backward_custom(datums, importance_sampling_custom)
    out_b = packed.forward_backward_custom(datums, importance_sampling_custom)
    assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-5)
    ga, gb = _grads(padded), _grads(packed)
    for name in ga:
        assert float((ga[name] - gb[name]).norm()) <= 1e-5 * float(ga[name].norm()) + 1e-12, name
