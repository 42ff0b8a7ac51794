"""Server-side custom losses (meshrl.losses.fx_graph): graphs the official SDK traces and encodes
(`create_custom_loss`) give, interpreted, the values and gradients of the functions they were
traced from (hand-checked); anything outside the allow-list or malformed is a one-line GraphError
naming the node and its op, and is never run; the registered loss `custom` in the tiny model's
learner trains exactly as the built-in loss the graph restates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss
from torch.fx.node import _get_qualified_name

from meshrl.api.errors import UserError
from meshrl.api.losses import custom_call
from meshrl.config.learner import LearnerConfig
from meshrl.losses.fx_graph import FUNCTIONS, GraphError, compile_graph, reduce_metrics, sum_over_datums
from meshrl.models.provision import resolve_model
from meshrl.training.policy import PolicyTrainer
from meshrl.types import Datum


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss, "custom/weight:mean": weights.sum()}


def ppo_clip(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum() / logprobs.shape[0]
    return loss, {"custom/clipped:mean": ((ratio - clipped).abs() > 1e-6).float().mean()}


def scaled_by_sequence(logprobs, scale, topk):
    """A rank-0 and a rank-2 input, slicing, functional calls and a dtype."""
    tail = torch.nn.functional.logsigmoid(logprobs[1:]).sum(dim=-1)
    spread = topk.to(torch.float64).amax(dim=-1).float()
    return -scale * (logprobs * spread).sum() + 0 * tail, {}


def graph(fn, ranks: dict[str, int]) -> tuple[str, list, list]:
    """(name, inputs, nodes) of ``fn`` as the SDK uploads it."""
    handle = trace_loss(fn, ranks, "session")
    nodes = encode_graph(handle).model_dump()["nodes"]
    return handle.name, [[i.name, i.rank] for i in handle.inputs], nodes


def compiled(fn, ranks):
    return compile_graph(*graph(fn, ranks))


def test_a_traced_weighted_nll_gives_the_functions_values_and_gradient():
    loss = compiled(weighted_nll, {"logprobs": 1, "weights": 1})
    logprobs = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    weights = torch.tensor([1.0, 0.0, 2.0])
    value, metrics = loss(logprobs, weights)
    # -(-1 * 1 + -2 * 0 + -0.5 * 2) = 2
    assert float(value.detach()) == 2.0 and {k: float(v) for k, v in metrics.items()} == {"custom/nll:sum": 2.0,
                                                                                  "custom/weight:mean": 3.0}
    (grad,) = torch.autograd.grad(value, logprobs)
    assert grad.tolist() == [-1.0, -0.0, -2.0]  # d loss / d logprobs = -weights


def test_a_traced_ppo_clip_equals_the_function_run_directly():
    loss = compiled(ppo_clip, {"logprobs": 1, "old_logprobs": 1, "advantages": 1})
    logprobs = torch.tensor([-1.0, -1.0], requires_grad=True)
    old, adv = torch.tensor([-1.0, -1.5]), torch.tensor([1.0, 1.0])
    value, metrics = loss(logprobs, old, adv)
    # ratios 1 and e^0.5 = 1.6487 (clipped to 1.2): -(1 + 1.2) / 2 = -1.1; one of two clipped
    assert float(value.detach()) == pytest.approx(-1.1, abs=1e-6) and float(metrics["custom/clipped:mean"]) == 0.5
    direct_lp = logprobs.detach().clone().requires_grad_(True)
    direct, _ = ppo_clip(direct_lp, old, adv)
    direct_grad = torch.autograd.grad(direct, direct_lp)[0]
    assert torch.equal(torch.autograd.grad(value, logprobs)[0], direct_grad)
    assert direct_grad.tolist() == [-0.5, 0.0]  # the clipped token has none


def test_rank_0_and_rank_2_inputs_dtypes_and_functional_calls():
    loss = compiled(scaled_by_sequence, {"logprobs": 1, "scale": 0, "topk": 2})
    logprobs = torch.tensor([-1.0, -3.0])
    topk = torch.tensor([[0.5, 2.0], [1.0, -1.0]])
    value, metrics = loss(logprobs, torch.tensor(0.5), topk)
    assert float(value) == pytest.approx(-0.5 * (-1.0 * 2.0 + -3.0 * 1.0)) and metrics == {}
    assert float(value) == float(scaled_by_sequence(logprobs, torch.tensor(0.5), topk)[0])


def test_losses_sum_over_datums_and_metrics_reduce_by_their_suffix():
    loss = compiled(weighted_nll, {"logprobs": 1, "weights": 1})
    total, sums = sum_over_datums(loss, [torch.tensor([-1.0, -2.0]), torch.tensor([-4.0])],
                                  [[torch.tensor([1.0, 1.0])], [torch.tensor([0.5])]])
    assert float(total) == 5.0 and sums == {"custom/nll:sum": 5.0, "custom/weight:mean": 2.5}
    assert reduce_metrics(sums, 2) == {"custom/nll:sum": 5.0, "custom/weight:mean": 1.25}


def test_every_allowed_function_is_named_as_the_sdk_names_it():
    for name, fn in FUNCTIONS.items():
        wire = _get_qualified_name(fn).replace("_operator.", "operator.").replace("builtins.", "")
        assert wire == name, (name, wire)


def _nodes(*body: dict, inputs=("logprobs",)) -> list[dict]:
    """A graph: placeholders for ``inputs``, ``body``, and an output returning the last node."""
    placeholders = [{"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n in inputs]
    last = body[-1]["name"] if body else inputs[-1]
    output = {"op": "output", "name": "output", "target": "output",
              "args": [{"tuple": [{"ref": last}, {"dict": {}}]}], "kwargs": {}}
    return placeholders + list(body) + [output]


def _call(name: str, target: str, *args, op: str = "call_function", **kwargs) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


LP = {"ref": "logprobs"}


@pytest.mark.parametrize("nodes, message", [
    (_nodes(_call("load", "torch.load", "/etc/passwd")), "node 'load' (call_function 'torch.load'): function "
                                                         "'torch.load' is not allowed"),
    (_nodes(_call("system", "os.system", "touch /tmp/meshrl-fx-pwned")), "node 'system' (call_function "
                                                                          "'os.system'): function 'os.system'"),
    (_nodes(_call("ev", "builtins.eval", "1")), "(call_function 'builtins.eval'): function 'builtins.eval' is not"),
    (_nodes(_call("imp", "__import__", "os")), "(call_function '__import__'): function '__import__' is not allowed"),
    (_nodes(_call("cls", "getattr", LP, "__class__")), "node 'cls' (call_function 'getattr'): reading attribute "
                                                       "'__class__' is not allowed"),
    (_nodes(_call("g", "getattr", LP, "grad_fn")), "reading attribute 'grad_fn' is not allowed"),
    (_nodes(_call("m", "linear", LP, op="call_module")), "node 'm' (call_module 'linear'): torch.nn modules are "
                                                         "not allowed"),
    (_nodes({"op": "get_attr", "name": "w", "target": "weight", "args": [], "kwargs": {}}),
     "node 'w' (get_attr 'weight'): a captured tensor or attribute is not allowed"),
    (_nodes(_call("r", "__reduce__", LP, op="call_method")), "(call_method '__reduce__'): tensor method "
                                                             "'__reduce__' is not allowed"),
    (_nodes(_call("b", "backward", LP, op="call_method")), "tensor method 'backward' is not allowed"),
    (_nodes(_call("i", "item", LP, op="call_method")), "tensor method 'item' is not allowed"),
    (_nodes(_call("z", "add_", LP, 1, op="call_method")), "tensor method 'add_' is not allowed"),
    (_nodes(_call("n", "new_zeros", LP, 10**9, op="call_method")), "tensor method 'new_zeros' is not allowed"),
    (_nodes(_call("o", "torch.exp", LP, out=LP)), "node 'o' (call_function 'torch.exp'): out= and inplace=True"),
    (_nodes(_call("d", "torch.exp", {"device": "cuda:0"})), "a device argument ('cuda:0') is not allowed"),
    (_nodes(_call("x", "torch.exp", {"ref": "later"})), "refers to 'later', which is not an earlier node"),
    (_nodes(_call("x", "torch.exp", {"lambda": "os.system"})), "argument {'lambda': 'os.system'} is not an "
                                                                "allowed encoded value"),
    (_nodes(_call("x", "torch.exp", 10**30)), "integer 1000000000000000000000000000000 is out of range"),
    (_nodes(_call("x", "torch.exp", LP), _call("x", "torch.log", LP)), "node 'x' (call_function 'torch.log'): a "
                                                                       "second node of that name"),
    (_nodes(_call("x", "torch.exp", LP), {"op": "eval", "name": "e", "target": "t"}),
     "node 'e' (eval 't'): unknown op"),
    ([{"op": "placeholder", "name": "p", "target": "other", "args": [], "kwargs": {}}],
     "node 'p' (placeholder 'other'): parameter 0 is declared as 'logprobs'"),
    (_nodes()[:-1], "the graph has no output node"),
    (["not a node"], "node 0 is not an object"),
])
def test_graphs_outside_the_allow_list_are_refused_in_one_line(nodes, message):
    with pytest.raises(GraphError) as err:
        compile_graph("evil", [["logprobs", 1]], nodes)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("custom loss 'evil'")
    assert not Path("/tmp/meshrl-fx-pwned").exists()


@pytest.mark.parametrize("body, message", [
    ([_call("s", "getattr", LP, "shape"), _call("l", "operator.getitem", {"ref": "s"}, 0),
      _call("big", "operator.mul", [1], {"ref": "l"})], "node 'big' (call_function 'operator.mul'): operands must "
                                                         "be tensors or numbers, got a list, a int"),
    ([_call("p", "operator.pow", 10, 1000), _call("y", "operator.mul", LP, {"ref": "p"})],
     "node 'p' (call_function 'operator.pow'): integer power 1000 is out of range"),
    ([_call("bad", "operator.add", LP, {"ref": "other"})], "node 'bad' (call_function 'operator.add'): "
                                                           "RuntimeError: The size of tensor a (3)"),
    ([_call("m", "sum", 5, op="call_method")], "node 'm' (call_method 'sum'): called on a int, not a tensor"),
    ([_call("t", "to", LP, "cpu", op="call_method")], "to() takes a dtype here"),
])
def test_a_graph_that_fails_at_run_time_names_its_node(body, message):
    loss = compile_graph("bad", [["logprobs", 1], ["other", 1]], _nodes(*body, inputs=("logprobs", "other")))
    with pytest.raises(GraphError) as err:
        loss(torch.zeros(3), torch.zeros(2))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_output_must_be_a_scalar_loss_and_named_metrics():
    nodes = _nodes(_call("v", "operator.mul", LP, 2.0))
    with pytest.raises(GraphError, match=r"scalar floating-point tensor as its loss, got a float32 tensor of shape"):
        compile_graph("vec", [["logprobs", 1]], nodes)(torch.zeros(3))
    nodes[-1]["args"] = [{"tuple": [{"ref": "v"}, {"dict": {"loss": {"ref": "v"}}}]}]
    with pytest.raises(GraphError, match="metric 'loss' must be named custom/<name>:sum or custom/<name>:mean"):
        compile_graph("vec", [["logprobs", 1]], nodes)
    with pytest.raises(GraphError, match="logprobs of rank 2 are not served"):
        compile_graph("vec", [["logprobs", 2]], nodes)


def test_the_api_checks_inputs_and_tries_the_loss_before_the_learner():
    name, inputs, nodes = graph(weighted_nll, {"logprobs": 1, "weights": 1})
    config = {"name": name, "inputs": inputs, "nodes": nodes}
    datum = Datum.from_sequence([1, 2, 3], weights=[0.0, 1.0, 1.0])
    datums, passed = custom_call(config, [datum])
    assert set(datums[0].loss_fn_inputs) == {"target_tokens", "weights", "custom/positions"} and passed == config
    with pytest.raises(UserError, match=r"data\[0\].loss_fn_inputs: custom loss 'weighted_nll' reads 'weights'"):
        custom_call(config, [Datum.from_sequence([1, 2, 3], mask=[0, 1, 1])])
    with pytest.raises(UserError, match=r"has rank 0, but custom loss 'weighted_nll' declared it with rank 1"):
        custom_call(config, [Datum.from_sequence([1, 2, 3], per_sequence={"weights": 1.0})])
    constant = {"name": "c", "inputs": [["logprobs", 1]],
                "nodes": _nodes(_call("s", "sum", LP, op="call_method"), _call("d", "detach", {"ref": "s"},
                                                                               op="call_method"))}
    with pytest.raises(UserError, match="custom loss 'c' does not depend on logprobs"):
        custom_call(constant, [datum])


@pytest.fixture(scope="module")
def model_path():
    return resolve_model("tiny")


def _grads(trainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.optimizer.param_groups[0]["params"] if p.grad is not None]


def test_the_learner_trains_a_graph_exactly_as_the_loss_it_restates(model_path):
    """`forward_backward(datums, 'custom', graph)` of a traced weighted NLL gives the same loss,
    logprobs and gradients as the built-in `cross_entropy` on the same datums (micro-batched and
    padded: rows of different lengths)."""
    cfg = LearnerConfig(torch_threads=1, autocast_bf16=False, micro_batch_size=2, lora={"enabled": True, "rank": 4})
    trainer = PolicyTrainer(model_path, cfg)
    for p in trainer.optimizer.param_groups[0]["params"]:  # B = 0 at start: give every gradient a path
        torch.nn.init.normal_(p, std=0.02)
    g = torch.Generator().manual_seed(0)
    data = [Datum.from_sequence(torch.randint(0, 400, (n,), generator=g).tolist(),
                                weights=[0.0] * 3 + [1.0 + 0.5 * i] * (n - 3)) for i, n in enumerate((7, 11, 9))]
    name, inputs, nodes = graph(weighted_nll, {"logprobs": 1, "weights": 1})
    datums, config = custom_call({"name": name, "inputs": inputs, "nodes": nodes}, data)
    custom = trainer.forward_backward(datums, "custom", config, outputs=True)
    custom_grads = _grads(trainer)
    trainer.optimizer.zero_grad(set_to_none=True)
    builtin = trainer.forward_backward(data, "cross_entropy", outputs=True)
    assert custom["loss"] == pytest.approx(builtin["loss"], rel=1e-6)
    assert custom["custom/nll:sum"] * 3 == pytest.approx(builtin["loss"], rel=1e-6)  # a mean over the datums
    assert custom["custom/weight:mean"] == pytest.approx(sum(float(d.loss_fn_inputs["weights"].sum())
                                                             for d in data) / 3)
    for a, b in zip(custom["logprobs"], trainer.forward(data), strict=True):  # every position's
        assert a == pytest.approx(b.tolist(), abs=1e-6)
    for a, b in zip(custom_grads, _grads(trainer), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
