"""Custom losses sent as data: the torch.fx graph of a per-datum loss (what the tinker SDK's
`ServiceClient.create_custom_loss` uploads as a `CustomLossGraph`), interpreted against an
allow-list of torch operations.

A graph is a list of nodes, each ``{op, name, target, args, kwargs}`` in execution order:
``placeholder`` nodes for the loss's parameters (``logprobs`` first, then the `loss_fn_inputs` it
reads), ``call_function`` (``target`` a qualified name such as ``torch.exp`` or ``operator.mul``),
``call_method`` (a tensor method on its first argument) and one ``output`` node whose argument is
``(loss, {"custom/<name>:sum" | "custom/<name>:mean": value})``. Arguments are JSON: scalars and
strings stand for themselves, lists for lists, and one-key objects for the rest (``{"ref": node}``,
``{"tuple": [...]}``, ``{"dict": {...}}``, ``{"slice": [start, stop, step]}``,
``{"ellipsis": true}``, ``{"float": "inf" | "-inf" | "nan"}``, ``{"dtype": "float32"}``).

Nothing a graph names is imported, evaluated or looked up in a module: a function must be a key of
`FUNCTIONS` and a method a name in `METHODS`, tables built here from explicit references, and an
attribute read (``getattr``) one of `ATTRIBUTES`. Captured tensors (``get_attr``), ``torch.nn``
modules (``call_module``), devices, in-place operations and functions that allocate a size the
graph chooses (``torch.zeros(n)``, ``Tensor.repeat``) are refused, and Python numbers stay within
int64 and finite, so a graph computes on tensors no larger than its inputs' products. Every refusal
is a `GraphError` in one line naming the loss, the node and its op.

The registered loss `custom` runs a graph in the learner: per datum, on its target logprobs and its
inputs, summing the losses (Tinker's per-datum custom loss, summed over datums).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pydantic import Field

from meshrl.config.base import Section
from meshrl.losses.base import LossOutput
from meshrl.losses.registry import ForwardPass, register_loss

POSITIONS = "custom/positions"
"""The loss input that marks every position of a datum (ones over its length) for the learner's
`custom` loss, so each padded row is cut back to its datum; no input name of a graph has a '/'."""

MAX_NODES = 10_000
MAX_INPUTS = 16
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INT_LIMIT = 2**63
"""Python ints a graph computes stay below this in magnitude (shape arithmetic, not big numbers)."""

_ARITHMETIC = {
    "operator.add": operator.add, "operator.sub": operator.sub, "operator.mul": operator.mul,
    "operator.truediv": operator.truediv, "operator.floordiv": operator.floordiv, "operator.mod": operator.mod,
    "operator.pow": operator.pow, "operator.matmul": operator.matmul, "operator.neg": operator.neg,
    "operator.pos": operator.pos, "operator.abs": operator.abs, "operator.invert": operator.invert,
    "operator.eq": operator.eq, "operator.ne": operator.ne, "operator.lt": operator.lt, "operator.le": operator.le,
    "operator.gt": operator.gt, "operator.ge": operator.ge, "operator.and_": operator.and_,
    "operator.or_": operator.or_, "operator.xor": operator.xor,
}
"""Python operators (what fx records for ``a * b``, ``-a``, ``a > b``): on tensors and numbers only."""

_TORCH = {f"torch.{fn.__name__}": fn for fn in (
    torch.exp, torch.exp2, torch.expm1, torch.log, torch.log1p, torch.log2, torch.log10, torch.sqrt, torch.rsqrt,
    torch.square, torch.abs, torch.neg, torch.sign, torch.reciprocal, torch.floor, torch.ceil, torch.round,
    torch.tanh, torch.sigmoid, torch.relu, torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max,
    torch.minimum, torch.maximum, torch.where, torch.lerp, torch.nan_to_num, torch.isfinite, torch.isnan,
    torch.logical_and, torch.logical_or, torch.logical_not, torch.add, torch.sub, torch.mul, torch.div, torch.pow,
    torch.sum, torch.mean, torch.prod, torch.std, torch.var, torch.min, torch.max, torch.amin, torch.amax,
    torch.argmin, torch.argmax, torch.any, torch.all, torch.count_nonzero, torch.numel, torch.logsumexp,
    torch.softmax, torch.log_softmax, torch.cumsum, torch.diff, torch.sort, torch.topk, torch.dot, torch.matmul,
    torch.gather, torch.masked_fill, torch.stack, torch.cat, torch.flatten, torch.reshape, torch.squeeze,
    torch.unsqueeze, torch.transpose, torch.zeros_like, torch.ones_like, torch.full_like,
)}
_FUNCTIONAL = {
    # torch.nn.functional as fx records it: its Python functions by their module, its C builtins by theirs
    "torch._C._nn.log_sigmoid": F.logsigmoid, "torch._C._nn.softplus": F.softplus, "torch._C._nn.gelu": F.gelu,
    **{f"torch.nn.functional.{fn.__name__}": fn for fn in (
        F.relu, F.silu, F.softmax, F.log_softmax, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss,
        F.binary_cross_entropy_with_logits, F.kl_div)},
    "torch.functional.einsum": torch.einsum,
}
_MATH = {f"math.{fn.__name__}": fn for fn in (math.log, math.log1p, math.exp, math.expm1, math.sqrt, math.tanh)}

FUNCTIONS: dict[str, Callable] = {**_ARITHMETIC, "operator.getitem": operator.getitem, "getattr": getattr,
                                  **_TORCH, **_FUNCTIONAL, **_MATH}
"""What a ``call_function`` node may call, by the qualified name the SDK sends."""

METHODS = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt", "square", "abs", "neg", "sign",
    "reciprocal", "floor", "ceil", "round", "tanh", "sigmoid", "relu", "clamp", "clip", "clamp_min", "clamp_max",
    "minimum", "maximum", "where", "lerp", "nan_to_num", "isfinite", "isnan", "logical_and", "logical_or",
    "logical_not", "add", "sub", "mul", "div", "pow", "rsub", "eq", "ne", "lt", "le", "gt", "ge", "sum", "mean",
    "prod", "std", "var", "min", "max", "amin", "amax", "argmin", "argmax", "any", "all", "count_nonzero",
    "logsumexp", "softmax", "log_softmax", "cumsum", "diff", "sort", "topk", "dot", "matmul", "gather",
    "masked_fill", "flatten", "reshape", "reshape_as", "view", "view_as", "squeeze", "unsqueeze", "transpose",
    "t", "permute", "contiguous", "detach", "float", "double", "bool", "long", "int", "type_as", "to", "size",
    "dim", "numel",
})
"""Tensor methods a ``call_method`` node may call (no in-place ``*_`` method, none that leaves torch
or allocates a size of its choosing)."""

ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T", "mT"})
"""Tensor attributes a graph may read (``getattr``)."""

DTYPES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")}

_SCALARS = (bool, int, float)


class GraphError(ValueError):
    """A custom loss graph that is malformed, or asks for something not allowed, or fails; one line."""


@dataclass(frozen=True)
class _Ref:
    name: str


@dataclass(frozen=True)
class _Step:
    node: str
    op: str
    target: str
    fn: Callable | None
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class GraphLoss:
    """A checked graph: call it as the traced function, ``loss(logprobs, *inputs) -> (loss, metrics)``."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    """(name, rank) of each parameter: ``("logprobs", 1)``, then the `loss_fn_inputs` it reads."""
    steps: tuple[_Step, ...]
    output: tuple[_Ref, dict[str, _Ref]]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The `loss_fn_inputs` keys the loss reads, in the order it takes them."""
        return tuple(name for name, _ in self.inputs[1:])

    def __call__(self, logprobs: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict[str, Any] = {}
        for _ in self._evaluate(env, logprobs, *inputs):
            pass
        loss_ref, metric_refs = self.output
        loss = env[loss_ref.name]
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            raise GraphError(f"custom loss {self.name!r} must return a scalar floating-point tensor as its loss, got "
                             f"{_describe(loss)}")
        metrics = {}
        for key, ref in metric_refs.items():
            value = env[ref.name]
            if not (isinstance(value, torch.Tensor) and value.numel() == 1):
                raise GraphError(f"custom loss {self.name!r} metric {key!r} must be a one-element tensor, got "
                                 f"{_describe(value)}")
            metrics[key] = value.reshape(())
        return loss, metrics

    def largest_tensor(self, logprobs: torch.Tensor, *inputs: torch.Tensor) -> int:
        """The most elements of any tensor the graph computes on tensors of these shapes and
        dtypes, found on the meta device: nothing is computed or allocated. GraphError for a node
        whose size depends on the values (its size cannot be known before it runs)."""
        meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (logprobs, *inputs)]
        largest = 0
        try:
            for value in self._evaluate({}, *meta):
                for tensor in _tensors(value):
                    largest = max(largest, tensor.numel())
        except GraphError as e:
            raise GraphError(f"{e} (sizing the loss from its inputs' shapes: its tensors' sizes must follow from "
                             "those shapes)") from None
        return largest

    def _evaluate(self, env: dict[str, Any], logprobs: torch.Tensor, *inputs: torch.Tensor):
        """Run the steps on these tensors into ``env``, yielding each step's value."""
        if len(inputs) != len(self.inputs) - 1:
            raise GraphError(f"custom loss {self.name!r} takes {len(self.inputs)} tensors, got {len(inputs) + 1}")
        values = iter((logprobs, *inputs))
        for step in self.steps:
            env[step.node] = next(values) if step.op == "placeholder" else _run(self.name, step, env)
            yield env[step.node]


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a step's value (a tensor, or a tuple of them such as `torch.sort`'s)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def compile_graph(name: str, inputs: list, nodes: list) -> GraphLoss:
    """Check a graph (``nodes`` as the SDK sends them; ``inputs``: (name, rank) pairs) and build
    its `GraphLoss`; GraphError naming the first thing wrong."""
    if not isinstance(name, str) or not name:
        raise GraphError("custom loss: name must be a non-empty string")
    declared = _inputs(name, inputs)
    if not isinstance(nodes, list) or not nodes:
        raise GraphError(f"custom loss {name!r}: the graph has no nodes")
    if len(nodes) > MAX_NODES:
        raise GraphError(f"custom loss {name!r}: {len(nodes)} nodes; at most {MAX_NODES}")
    steps: list[_Step] = []
    known: set[str] = set()
    output = None
    for i, node in enumerate(nodes):
        op, node_name, target, args, kwargs = _fields(name, i, node)
        where = f"custom loss {name!r}: node {node_name!r} ({op} {target!r})"
        if node_name in known:
            raise GraphError(f"{where}: a second node of that name")
        if output is not None:
            raise GraphError(f"{where}: comes after the output node")
        if op == "placeholder":
            if len(steps) >= len(declared) or steps and steps[-1].op != "placeholder":
                raise GraphError(f"{where}: the parameters come first, one per declared input "
                                 f"({', '.join(n for n, _ in declared)})")
            if target != declared[len(steps)][0]:
                raise GraphError(f"{where}: parameter {len(steps)} is declared as {declared[len(steps)][0]!r}")
            steps.append(_Step(node_name, op, target, None, (), {}))
        elif op == "output":
            output = _output(where, _decode(where, args, known), kwargs)
        elif op in ("call_function", "call_method"):
            if len(steps) < len(declared):
                raise GraphError(f"{where}: comes before the parameter {declared[len(steps)][0]!r}")
            decoded_args = _decode(where, args, known)
            decoded_kwargs = {key: _decode(where, value, known) for key, value in kwargs.items()}
            steps.append(_Step(node_name, op, target, _callable(where, op, target, decoded_args, decoded_kwargs),
                               tuple(decoded_args), decoded_kwargs))
        elif op == "get_attr":
            raise GraphError(f"{where}: a captured tensor or attribute is not allowed; a custom loss reads only "
                             "logprobs and the loss_fn_inputs it names")
        elif op == "call_module":
            raise GraphError(f"{where}: torch.nn modules are not allowed; use functions (torch, "
                             "torch.nn.functional)")
        else:
            raise GraphError(f"{where}: unknown op (expected placeholder, call_function, call_method or output)")
        known.add(node_name)
    if output is None:
        raise GraphError(f"custom loss {name!r}: the graph has no output node")
    return GraphLoss(name, declared, tuple(steps), output)


def sum_over_datums(loss: GraphLoss, logprobs: list[torch.Tensor],
                    inputs: list[list[torch.Tensor]]) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss summed over datums (``logprobs[i]`` and ``inputs[i]``: datum i's tensors, in the
    loss's parameter order) and each metric summed over them."""
    total = None
    sums: dict[str, float] = {}
    for lp, tensors in zip(logprobs, inputs, strict=True):
        value, metrics = loss(lp, *tensors)
        total = value if total is None else total + value
        for key, metric in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(metric.detach())
    if total is None:
        raise GraphError(f"custom loss {loss.name!r}: no datums")
    return total, sums


def reduce_metrics(sums: dict[str, float], datums: int) -> dict[str, float]:
    """Metrics summed over ``datums`` datums as Tinker reports them: ``:mean`` ones divided by the
    number of datums, ``:sum`` ones as they are (the SDK's reduction of a custom loss's metrics)."""
    return {key: value / datums if key.endswith(":mean") else value for key, value in sums.items()}


class GraphParams(Section):
    """A custom loss graph, as `create_custom_loss` uploaded it."""

    name: str
    """The loss's name (its function's), for messages."""
    inputs: list[tuple[str, int]] = Field(min_length=1)
    """(name, rank) of each parameter: ``logprobs`` (rank 1) first, then the `loss_fn_inputs` keys it
    reads, each with its rank (0: one value per datum, 1: [T], 2: [T, K])."""
    nodes: list[dict[str, Any]] = Field(min_length=1)
    """The graph's nodes in execution order (see the module docstring)."""


@register_loss("custom", kind="other", params=GraphParams, valid_key=POSITIONS, metric_weight="items")
def custom(forward_pass: ForwardPass, name: str, inputs: list, nodes: list) -> LossOutput:
    """A custom loss graph on every datum of the micro-batch (its positions: `POSITIONS`), summed.
    Metrics are means over the micro-batch's datums (weighted by datums across micro-batches, so
    the learner reports means over all datums; ``:sum`` metrics are those means times the count)."""
    loss = compile_graph(name, inputs, nodes)
    logprobs = forward_pass.logprobs()
    lengths = forward_pass.valid.sum(-1).tolist()
    rows = [[_row(forward_pass.inputs[key], b, n, rank) for key, rank in loss.inputs[1:]]
            for b, n in enumerate(lengths)]
    total, sums = sum_over_datums(loss, [logprobs[b, :n] for b, n in enumerate(lengths)], rows)
    return LossOutput(total, {key: value / len(lengths) for key, value in sums.items()})


def _row(padded: torch.Tensor, b: int, length: int, rank: int) -> torch.Tensor:
    """Datum ``b``'s tensor of a padded micro-batch input: its scalar (rank 0) or its first
    ``length`` positions."""
    return padded[b] if rank == 0 else padded[b, :length]


def _inputs(name: str, inputs: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise GraphError(f"custom loss {name!r}: inputs must list (name, rank) pairs, logprobs first")
    if len(inputs) > MAX_INPUTS:
        raise GraphError(f"custom loss {name!r}: {len(inputs)} inputs; at most {MAX_INPUTS}, logprobs included")
    declared = []
    for item in inputs:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)
                and INPUT_NAME.fullmatch(item[0]) and type(item[1]) is int and item[1] in (0, 1, 2)):
            raise GraphError(f"custom loss {name!r}: input {item!r} is not a (lowercase name, rank 0, 1 or 2) pair")
        declared.append((item[0], item[1]))
    names = [n for n, _ in declared]
    if names[0] != "logprobs" or len(set(names)) != len(names):
        raise GraphError(f"custom loss {name!r}: inputs must be logprobs then distinct loss_fn_inputs keys, "
                         f"got {names}")
    if declared[0][1] != 1:
        raise GraphError(f"custom loss {name!r}: logprobs of rank {declared[0][1]} are not served; the learner "
                         "gives one logprob per target token (rank 1)")
    return tuple(declared)


def _fields(name: str, i: int, node: Any) -> tuple[str, str, str, Any, Any]:
    if not isinstance(node, dict):
        raise GraphError(f"custom loss {name!r}: node {i} is not an object")
    op, node_name, target = node.get("op"), node.get("name"), node.get("target")
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    if not (isinstance(op, str) and isinstance(node_name, str) and node_name and isinstance(target, str)):
        raise GraphError(f"custom loss {name!r}: node {i} needs string op, name and target")
    if not isinstance(args, list) or not isinstance(kwargs, dict) or set(node) - {"op", "name", "target", "args",
                                                                                   "kwargs"}:
        raise GraphError(f"custom loss {name!r}: node {node_name!r} ({op} {target!r}): args must be a list, kwargs "
                         "an object, and nothing else may be given")
    return op, node_name, target, args, kwargs


def _decode(where: str, value: Any, known: set[str]) -> Any:
    """An encoded argument as a Python value, node references as `_Ref`s (to earlier nodes only)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if abs(value) >= INT_LIMIT:
            raise GraphError(f"{where}: integer {value} is out of range")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise GraphError(f"{where}: a non-finite number must be sent as {{'float': ...}}")
        return value
    if isinstance(value, list):
        return [_decode(where, item, known) for item in value]
    if not (isinstance(value, dict) and len(value) == 1):
        raise GraphError(f"{where}: argument {_short(value)} is not a JSON value or a one-key object")
    (kind, inner), = value.items()
    if kind == "ref":
        if inner not in known:
            raise GraphError(f"{where}: refers to {inner!r}, which is not an earlier node")
        return _Ref(inner)
    if kind == "tuple" and isinstance(inner, list):
        return tuple(_decode(where, item, known) for item in inner)
    if kind == "dict" and isinstance(inner, dict):
        return {key: _decode(where, item, known) for key, item in inner.items()}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        return slice(*(_decode(where, item, known) for item in inner))
    if kind == "ellipsis" and inner is True:
        return Ellipsis
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if kind == "dtype" and inner in DTYPES:
        return DTYPES[inner]
    if kind in ("device", "layout", "memory_format"):
        raise GraphError(f"{where}: a {kind} argument ({inner!r}) is not allowed; the server places tensors")
    raise GraphError(f"{where}: argument {_short(value)} is not an allowed encoded value")


def _output(where: str, args: list, kwargs: dict) -> tuple[_Ref, dict[str, _Ref]]:
    returned = args[0] if len(args) == 1 and not kwargs else None
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        raise GraphError(f"{where}: a custom loss returns (loss, metrics)")
    loss, metrics = returned
    if not isinstance(loss, _Ref):
        raise GraphError(f"{where}: the loss must be a computed tensor, got {_short(loss)}")
    if not isinstance(metrics, dict):
        raise GraphError(f"{where}: the metrics must be a dict, got {_short(metrics)}")
    for key, value in metrics.items():
        if not METRIC_KEY.fullmatch(key):
            raise GraphError(f"{where}: metric {key!r} must be named custom/<name>:sum or custom/<name>:mean")
        if not isinstance(value, _Ref):
            raise GraphError(f"{where}: metric {key!r} must be a computed tensor, got {_short(value)}")
    return loss, metrics


def _callable(where: str, op: str, target: str, args: list, kwargs: dict) -> Callable | None:
    if op == "call_method":
        if target not in METHODS:
            raise GraphError(f"{where}: tensor method {target!r} is not allowed")
        if not args:
            raise GraphError(f"{where}: a method call needs the tensor it is called on")
        fn = None
    else:
        fn = FUNCTIONS.get(target)
        if fn is None:
            raise GraphError(f"{where}: function {target!r} is not allowed (see meshrl.losses.fx_graph.FUNCTIONS)")
        if fn is getattr and not (len(args) == 2 and not kwargs and isinstance(args[1], str)
                                  and args[1] in ATTRIBUTES):
            attribute = args[1] if len(args) == 2 else args[1:]
            raise GraphError(f"{where}: reading attribute {attribute!r} is not allowed; only {sorted(ATTRIBUTES)}")
    if "out" in kwargs or kwargs.get("inplace"):
        raise GraphError(f"{where}: out= and inplace=True are not allowed")
    return fn


def _run(name: str, step: _Step, env: dict[str, Any]) -> Any:
    where = f"custom loss {name!r}: node {step.node!r} ({step.op} {step.target!r})"
    args = _resolve(step.args, env)
    kwargs = _resolve(step.kwargs, env)
    if step.op == "call_method":
        this = args[0]
        if not isinstance(this, torch.Tensor):
            raise GraphError(f"{where}: called on {_describe(this)}, not a tensor")
        if step.target == "to" and not (all(isinstance(a, (torch.dtype, torch.Tensor)) for a in args[1:])
                                        and set(kwargs) <= {"dtype"}):
            raise GraphError(f"{where}: to() takes a dtype here; the server places tensors")
        fn, args = getattr(this, step.target), args[1:]
    else:
        fn = step.fn
        if step.target in _ARITHMETIC:
            _check_operands(where, step.target, args)
        elif fn is getattr and not isinstance(args[0], torch.Tensor):
            raise GraphError(f"{where}: reads an attribute of {_describe(args[0])}, not of a tensor")
    try:
        result = fn(*args, **kwargs)
    except GraphError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's graph failed: one line naming the node
        first = (str(e).strip().splitlines() or [""])[0]
        raise GraphError(f"{where}: {type(e).__name__}: {first}") from None
    if isinstance(result, int) and not isinstance(result, bool) and abs(result) >= INT_LIMIT:
        raise GraphError(f"{where}: integer result out of range")
    return result


def _check_operands(where: str, target: str, args: list) -> None:
    if not all(isinstance(a, (torch.Tensor, *_SCALARS)) for a in args):
        raise GraphError(f"{where}: operands must be tensors or numbers, got "
                         f"{', '.join(_describe(a) for a in args)}")
    if target == "operator.pow" and all(isinstance(a, int) for a in args) and abs(args[1]) > 64:
        raise GraphError(f"{where}: integer power {args[1]} is out of range")


def _resolve(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, _Ref):
        return env[value.name]
    if isinstance(value, list):
        return [_resolve(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, env) for v in value)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_resolve(value.start, env), _resolve(value.stop, env), _resolve(value.step, env))
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
