"""`train_unembed`: on a model whose unembedding is its own matrix (the tiny model untied), an
adapter made with it has a LoRA on `lm_head` that gets gradients, is updated, merges into the
published `lm_head.weight` (the embedding untouched) and round-trips through a save (its LoRA
matrices only); an adapter made without it has none. A tied model refuses it in the learner (the
API then trains the other modules: tests/test_api.py)."""

from __future__ import annotations

import pytest
import torch

from meshrl.config.learner import LearnerConfig
from meshrl.models.provision import resolve_model
from meshrl.training.lora import adapter_state_dict, load_base_state, merge_adapter, unembedding_is_tied
from meshrl.training.policy import PolicyTrainer
from meshrl.types import AdamParams, Datum

HEAD = "lm_head"


@pytest.fixture(scope="module")
def untied_path(tmp_path_factory):
    """The tiny model with an unembedding of its own (its embedding plus noise)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = resolve_model("tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    head = model.get_input_embeddings().weight.detach().clone()
    head += 0.01 * torch.randn(head.shape, generator=torch.Generator().manual_seed(0))
    model.lm_head.weight = torch.nn.Parameter(head)
    out = tmp_path_factory.mktemp("untied")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def trainer(untied_path):
    cfg = LearnerConfig(torch_threads=1, autocast_bf16=False, lora={"enabled": True, "rank": 2})
    trainer = PolicyTrainer(untied_path, cfg)
    trainer.tenants.add("with_head", rank=4, seed=1, train_unembed=True)
    trainer.tenants.add("without", rank=4, seed=2)
    return trainer


def _data() -> list[Datum]:
    g = torch.Generator().manual_seed(3)
    return [Datum.from_sequence(torch.randint(3, 400, (9,), generator=g).tolist(), weights=[0.0] * 4 + [1.0] * 5)
            for _ in range(2)]


def _head_lora(trainer, name) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in adapter_state_dict(trainer.model, adapter=name).items() if k.startswith(HEAD)}


def test_the_untied_model_is_told_apart_from_the_tied_one(untied_path):
    assert not unembedding_is_tied(untied_path) and unembedding_is_tied(resolve_model("tiny"))


def test_an_adapter_with_train_unembed_trains_a_lora_on_the_unembedding(trainer, untied_path, tmp_path):
    assert set(_head_lora(trainer, "with_head")) == {"lm_head.lora_A", "lm_head.lora_B", "lm_head.lora_scaling"}
    assert _head_lora(trainer, "without") == {}
    trainer.tenants.use("with_head")
    before = _head_lora(trainer, "with_head")
    trainer.forward_backward(_data(), "cross_entropy")
    head_b = next(m.lora_B["with_head"].weight for n, m in trainer.model.named_modules() if n.endswith(HEAD)
                  and hasattr(m, "lora_B"))
    assert head_b.grad is not None and float(head_b.grad.abs().sum()) > 0  # B starts at 0; its gradient does not
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    after = _head_lora(trainer, "with_head")
    assert not torch.equal(after["lm_head.lora_B"], before["lm_head.lora_B"])

    merged = trainer.inference_state_dict(dtype=torch.float32)  # what the generators load
    base = load_base_state(untied_path, dtype=torch.float32)
    assert not torch.equal(merged["lm_head.weight"], base["lm_head.weight"])
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    from_adapter = merge_adapter(base, adapter_state_dict(trainer.model, adapter="with_head"))
    torch.testing.assert_close(from_adapter["lm_head.weight"], merged["lm_head.weight"])

    saved = trainer.tenants.capture("with_head").weights
    assert all("lora_" in k for k in saved)  # never the base unembedding
    trainer.tenants.save("with_head", tmp_path / "with_head")
    trainer.tenants.load("copy", tmp_path / "with_head", with_optimizer=True)
    for key, value in _head_lora(trainer, "copy").items():
        torch.testing.assert_close(value, after[key], rtol=0, atol=0)


def test_an_adapter_without_it_leaves_the_unembedding_alone(trainer):
    trainer.tenants.use("without")
    trainer.forward_backward(_data(), "cross_entropy")
    trainer.optim_step(AdamParams(learning_rate=1e-2))
    assert _head_lora(trainer, "without") == {}
    merged = trainer.inference_state_dict(dtype=torch.float32)
    head = trainer.model.get_base_model().get_output_embeddings()
    assert torch.equal(merged["lm_head.weight"], head.weight.detach())


def test_a_tied_model_refuses_it_in_the_learner():
    cfg = LearnerConfig(torch_threads=1, autocast_bf16=False, lora={"enabled": True, "rank": 2})
    tied = PolicyTrainer(resolve_model("tiny"), cfg)
    with pytest.raises(ValueError, match="train_unembed=True needs an untied unembedding; this model ties it"):
        tied.tenants.add("head", rank=2, train_unembed=True)
    with pytest.raises(ValueError, match="train_attn, train_mlp and train_unembed are all false"):
        tied.tenants.add("none", rank=2, train_attn=False, train_mlp=False)
