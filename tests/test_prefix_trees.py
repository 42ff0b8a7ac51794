"""Shared prefixes as trees in the learner's pass (`learner.shared_prefix_tokens`): sequences with a
common prefix run as the prefix once plus each one's rest, under a tree attention mask. Every loss
reads the values whole sequences give, and the decoder runs each shared prefix once."""

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.prefix_trees import PrefixGroup, affordable_trees, pack_rows
from meshrl.training.policy import PolicyTrainer
from meshrl.training.shared_pass import pack_shared
from meshrl.types import Datum, LossPart

V = 49152


def test_a_tree_lays_the_prefix_once_and_each_rest_after_it():
    """Sequences 0 and 1 share 4 tokens, 2 is alone: one row holds 4 + 2 + 4 positions (the prefix,
    then each rest, positions continuing from the prefix), the other row the third sequence."""
    lengths, width = [6, 8, 5], 8
    packed = pack_rows(lengths, width, row_tokens=0, trees=[(4, [0, 1])])
    assert packed.source.shape == (2, 10)
    assert packed.source[0].tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 14, 15]  # 0's prefix, 0's rest, 1's rest
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7]
    assert packed.source[1, :5].tolist() == [16, 17, 18, 19, 20] and (packed.source[1, 5:] == -1).all()
    assert packed.target[8:16].tolist() == [0, 1, 2, 3, 6, 7, 8, 9]  # sequence 1 reads the shared prefix
    assert packed.target[0:8].tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    mask = packed.mask[0, 0]
    assert mask[7].tolist() == [True] * 4 + [False, False] + [True, True] + [False, False]  # 1's rest: prefix + itself
    assert mask[5].tolist() == [True] * 6 + [False] * 4  # 0's rest
    assert mask[2].tolist() == [True] * 3 + [False] * 7  # the prefix: causal within it
    second = packed.mask[1, 0]
    assert second[4].tolist() == [True] * 5 + [False] * 5
    assert second[7].tolist() == [False] * 7 + [True] + [False] * 2  # a tail position sees only itself
    packed_rows = pack_rows(lengths, width, row_tokens=16, trees=[(4, [0, 1])])
    assert packed_rows.source.shape == (1, 15)  # the tree and the third sequence end to end
    assert not packed_rows.mask[0, 0, 12, :10].any()  # the third sequence does not see the tree
    assert pack_rows(lengths, width, row_tokens=16).mask is None  # no tree: position ids restart instead


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _trainer(model_path, shared_prefix_tokens, packed_row_tokens=0, lora=False, micro_batch_size=6):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, micro_batch_size=micro_batch_size, autocast_bf16=False,
                        release_heap_each_micro_batch=False, shared_prefix_tokens=shared_prefix_tokens,
                        packed_row_tokens=packed_row_tokens, **({"lora": {"enabled": True, "rank": 4}} if lora else {}))
    return PolicyTrainer(model_path, cfg)


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _groups():
    """Three prompts of 20-30 tokens, four samples each (responses of 3-12 tokens, one sample a
    prefix of another's), advantages of both signs; and two DPO pairs on the prompts."""
    g = torch.Generator().manual_seed(5)
    prompts = [_tokens(40 + i, 20 + 5 * i) for i in range(3)]
    datums = []
    for p, prompt in enumerate(prompts):
        for s in range(4):
            response = _tokens(60 + 4 * p + s, 3 + (5 * s + p) % 10)
            n = len(response)
            datums.append(Datum.from_sequence(prompt + response, per_sequence={"advantages": 0.4 * s - 0.7},
                                              mask=[0.0] * len(prompt) + [1.0] * n,
                                              logprobs=[0.0] * len(prompt) + (-torch.rand(n, generator=g) * 3).tolist()))
    datums.append(Datum.from_sequence(datums[1].model_input.to_ints()[:-2] + [7, 8, 9, 10], per_sequence={
        "advantages": 0.5}, mask=[0.0] * 20 + [1.0] * (len(datums[1].model_input.to_ints()) - 18),
        logprobs=[-0.5] * (len(datums[1].model_input.to_ints()) + 2)))
    pairs = []
    for p in (0, 2):
        for side in (0, 1):
            response = _tokens(90 + 2 * p + side, 4 + side * 3)
            pairs.append(Datum.from_sequence(prompts[p] + response, per_sequence={"weight": 0.5},
                                             mask=[0] * len(prompts[p]) + [1] * len(response)))
    return datums, pairs


def _grads(trainer):
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _close(ga, gb):
    assert ga.keys() == gb.keys() and ga
    for name in ga:
        assert float((ga[name] - gb[name]).norm()) <= 1e-5 * float(ga[name].norm()) + 1e-12, name


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("packed_row_tokens", [0, 128])
def test_trees_give_the_logprobs_and_gradients_of_whole_sequences(model_path, lora, packed_row_tokens):
    """Full fine-tuning and LoRA, a tree per row and trees packed end to end: the per-datum
    logprobs within 2e-5 (float32), and the shared pass of ppo and DPO (its frozen reference
    forward in trees too) gives the losses and, within 1e-5 relative, the gradients of whole
    sequences."""
    datums, pairs = _groups()
    whole, trees = _trainer(model_path, 0, lora=lora), _trainer(model_path, 16, packed_row_tokens, lora=lora)
    for group in (datums, pairs):
        for a, b in zip(whole.forward(group), trees.forward(group)):
            torch.testing.assert_close(b, a, rtol=0, atol=2e-5)
    parts = [LossPart(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.28}, 0.9, scale=0.1),
             LossPart(pairs, "dpo", {"beta": 0.1}, 1.0)]
    got_a = whole.forward_backward_parts(parts, outputs=True)
    got_b = trees.forward_backward_parts(parts, outputs=True)
    for a, b in zip(got_a, got_b):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["tokens"] == a["tokens"]
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert y == pytest.approx(x, abs=2e-5)
    _close(_grads(whole), _grads(trees))


def test_the_decoder_runs_each_shared_prefix_once(model_path):
    """The shared pass puts a prompt's samples in one micro-batch (grouped by their tokens) and
    the decoder runs the prompt once: exactly the prompts plus the responses, against every
    sequence whole without trees."""
    datums, _ = _groups()
    datums = datums[:12]  # the three prompts' samples
    positions = {}
    for shared in (0, 16):
        trainer = _trainer(model_path, shared, micro_batch_size=4)
        seen = []
        decoder = trainer.model.get_decoder()
        hook = decoder.register_forward_pre_hook(
            lambda _m, args, kwargs: seen.append(int((kwargs["input_ids"] != trainer.pad_id).sum())), with_kwargs=True)
        trainer.forward_backward(datums, "ppo", {"eps_low": 0.2, "eps_high": 0.2})
        hook.remove()
        positions[shared] = (seen, sum(seen))
    prompts = 20 + 25 + 30
    responses = sum(d.length for d in datums) - 4 * prompts
    assert positions[16][1] == prompts + responses, positions  # model inputs: one fewer token than the sequences
    assert len(positions[16][0]) == 3 and positions[0][1] == sum(d.length for d in datums)


def test_by_tokens_the_shared_pass_puts_a_prompts_rows_together():
    """Three prompts of 20 tokens, four samples each of lengths 2, 4, 6, 8: by length, micro-batches
    of 4 mix the prompts; by tokens each holds one prompt's samples."""
    prompts = [_tokens(70 + p, 20) for p in range(3)]
    datums = [Datum.from_sequence(prompts[p] + _tokens(80 + 4 * p + s, 2 + 2 * s), mask=[0.0] * 20 + [1.0] * (2 + 2 * s))
              for p in range(3) for s in range(4)]
    prompt_of = {id(d): i // 4 for i, d in enumerate(datums)}
    by_tokens = pack_shared([datums], [1], size=4, by_tokens=True)
    assert sorted(sorted({prompt_of[id(d)] for d, _ in b.views[0]}) for b in by_tokens) == [[0], [1], [2]]
    by_length = pack_shared([datums], [1], size=4)
    assert [len({prompt_of[id(d)] for d, _ in b.views[0]}) for b in by_length] == [3, 3, 3]


def test_a_tree_is_kept_only_where_it_costs_less_than_its_members_whole():
    """With 100 attention pairs costing one token (cost(W) = W + W^2 / 100): three sequences of 25
    sharing 20 tokens make one tree (each member adds 7.75 and 8.25 against 31.25 alone); two of
    64 sharing 4 do not (the second would add 172.8 against 104.96 alone); a long group splits."""
    assert affordable_trees([PrefixGroup(20, [0, 1, 2])], [25, 25, 25], 100.0) == [(20, [0, 1, 2])]
    assert affordable_trees([PrefixGroup(4, [0, 1])], [64, 64], 100.0) == []
    # 40 shared, rests of 30: members add 81, 99 and 117 to the tree, the fifth would add 135 against
    # cost(70) = 119 in a new tree of its own
    split = affordable_trees([PrefixGroup(40, list(range(6)))], [70] * 6, 100.0)
    assert split == [(40, [0, 1, 2, 3]), (40, [4, 5])]
    assert affordable_trees([PrefixGroup(0, [0, 1])], [9, 9], 100.0) == []
