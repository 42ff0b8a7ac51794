"""A replay pair's reference log-probabilities computed once, off the learner
(meshrl.training.reference, meshrl.actors.reference): the sum is the one DPO takes, equals the
learner's frozen reference (exactly in float32, within bf16's rounding in bf16), and DPO on the
precomputed values equals DPO on the learner's own, without the learner loading its frozen copy."""

import math

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.replay.pairs import PreferenceItem, dpo_datums
from meshrl.training.data_parallel import ValidLogits
from meshrl.training.policy import PolicyTrainer
from meshrl.training.reference import answer_logprob_sums

V = 49152


class TableModel(torch.nn.Module):
    """Logits at a position depend only on the token there: row ``token`` of a fixed table."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = table

    def forward(self, ids, attention, valid):
        return self.table[ids[valid]]


def test_answer_sums_by_hand():
    # vocabulary of 3; after token 0 the next-token logits are [0, ln 2, ln 3] (p = 1/6, 2/6, 3/6),
    # after 1 they are uniform, after 2 they are [ln 3, 0, 0] (p = 3/5, 1/5, 1/5)
    table = torch.tensor([[0.0, math.log(2), math.log(3)], [0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0]])
    model = TableModel(table)
    sequences = [[1, 0, 2, 0], [2, 2, 1]]  # answers start at 2 and 1: tokens (2, 0) and (2, 1)
    sums = answer_logprob_sums(model, sequences, [2, 1], pad_id=0, device=torch.device("cpu"), batch_size=1)
    assert sums == pytest.approx([math.log(3 / 6) + math.log(3 / 5), math.log(1 / 5) + math.log(1 / 5)], abs=1e-6)
    batched = answer_logprob_sums(model, sequences, [2, 1], pad_id=0, device=torch.device("cpu"))
    assert batched == pytest.approx(sums, abs=1e-6)  # right padding changes nothing
    # at temperature 2 the logits are halved: after 0, p(2) = sqrt3 / (1 + sqrt2 + sqrt3)
    hot = answer_logprob_sums(model, [[1, 0, 2]], [2], 0, torch.device("cpu"), temperature=2.0)
    assert hot == pytest.approx([math.log(math.sqrt(3) / (1 + math.sqrt(2) + math.sqrt(3)))], abs=1e-6)
    with pytest.raises(ValueError, match="answer start 3 outside a sequence of 3 tokens"):
        answer_logprob_sums(model, [[1, 0, 2]], [3], 0, torch.device("cpu"))


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _tokens(seed, n):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _items():
    return [PreferenceItem(f"p{s}", _tokens(s, 6 + s), _tokens(s + 50, 3 + s), _tokens(s + 90, 5 - s % 2))
            for s in range(3)]


def _trainer(model_path):
    cfg = LearnerConfig(lr=1e-2, torch_threads=1, micro_batch_size=4, autocast_bf16=False,
                        release_heap_each_micro_batch=False)
    return PolicyTrainer(model_path, cfg)


def _reference_sums(model_path, dtype, items):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    sequences = [i.prompt + a for i in items for a in (i.chosen, i.rejected)]
    starts = [len(i.prompt) for i in items for _ in range(2)]
    return answer_logprob_sums(ValidLogits(model), sequences, starts, 0, torch.device("cpu"))


def test_precomputed_references_equal_the_learners_and_dpo_on_them_loads_no_frozen_copy(model_path):
    items = _items()
    learner_made = dpo_datums(items, 1 / 3)
    trainer = _trainer(model_path)
    frozen = [float((lp * d.loss_fn_inputs["mask"]).sum()) for lp, d in
              zip(trainer.forward(learner_made, reference=True), learner_made)]
    in_float32 = _reference_sums(model_path, torch.float32, items)
    assert in_float32 == pytest.approx(frozen, abs=1e-4)
    in_bf16 = _reference_sums(model_path, torch.bfloat16, items)
    # bf16 weights (the reference actor's default): on this model the answers' sums (32 to 54 nats,
    # 3 to 5 tokens) moved by at most 0.0025 nats; the bound is 0.01 per answer
    assert in_bf16 == pytest.approx(frozen, abs=0.01)
    assert in_bf16 != pytest.approx(frozen, abs=1e-6)  # the weights really were bf16

    for item, pair in zip(items, zip(in_float32[0::2], in_float32[1::2])):
        item.reference = list(pair)
    precomputed = dpo_datums(items, 1 / 3)
    fresh = _trainer(model_path)
    out = fresh.forward_backward(precomputed, "dpo", {"beta": 0.5})
    assert fresh._frozen_copy is None  # the learner never loaded its float32 reference
    grads = [p.grad.clone() for p in fresh.model.parameters()]
    fresh.optimizer.zero_grad(set_to_none=True)
    reference = fresh.forward_backward(learner_made, "dpo", {"beta": 0.5})
    assert fresh._frozen_copy is not None  # the fallback: the datums carried no reference
    assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert out["loss"] == pytest.approx(math.log(2), rel=1e-4)  # policy == reference at the start
    for k in ("reward_margin", "chosen_reward", "rejected_reward"):
        assert out[k] == pytest.approx(reference[k], abs=1e-5)
    for a, p in zip(grads, fresh.model.parameters()):
        # atol: the learner's frozen forward lays the pairs' shared prompts as trees, the reference
        # sums above ran whole sequences; they agree to float32 rounding (about 1e-6 nats)
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_a_step_never_mixes_precomputed_and_learner_references():
    items = _items()
    items[0].reference = [-1.0, -2.0]
    with pytest.raises(ValueError, match="some pairs carry precomputed reference logprobs and others do not"):
        dpo_datums(items, 1.0)
