"""A multi-turn tool-use task: multiply two 3-digit numbers, with a `calculator` tool. The 135M model
cannot multiply 3-digit numbers in its head; with the calculator it can, if it calls the tool in its
chat family's format (`<tool_call>` JSON for ChatML) and then answers with the number it got back.

`MultiplyEnv` is an ordinary meshrl `Environment` that declares its tool (`tools()`): meshrl wraps
it in `ToolEnv` (meshrl.envs.tools), which puts the tool list into the system prompt, answers each
turn with calls with the tools' results (tool turns appended token-in/token-out), and passes the
first turn without a call (the answer) to `step`. With `own_tool: false` the calculator comes from
`task.env.tools` instead (a Python function, or the MCP server of examples/calculator_mcp_server.py).
The episode starts with worked examples (`examples`, two by default: a question, the call, the
tool's response, the answer), which show the tiny model the format. Sampled at temperature 0.7, the
135M model called the calculator in 0 of 32 episodes with one example, 2 of 20 with two (and then
answered right; most other replies write a `<tool_response>` of their own), 9 of 10 with three.
Reward 1.0 for the right product, 0 otherwise; a wrong answer is an error site (`wrong_answer`,
`hint_template_key` `calc.wrong_answer`) for SDPO.

    meshrl train -c configs/env-tools.yaml
"""

from __future__ import annotations

import ast
import operator
import random

from meshrl.envs.arithmetic import extract_last_integer
from meshrl.envs.base import Environment, Observation, State, TextAction

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if abs(left) > 1e15 or abs(right) > 1e15:
            raise ValueError("numbers too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+, -, *, /, //, %, parentheses) and return the result.

    Args:
        expression: the expression, e.g. "123 * 456"
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _call_text(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call>'


class MultiplyEnv(Environment):
    """What is a * b (two 3-digit numbers)? One answer after any number of calculator calls."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, low: int = 100, high: int = 999, own_tool: bool = True,
                 examples: list[tuple[int, int]] = ((317, 482), (905, 276))):
        self.low, self.high, self.own_tool = low, high, own_tool
        self.examples = [tuple(pair) for pair in examples]
        self.a = self.b = None
        self._state = State()

    def tools(self) -> list:
        """The calculator, unless it comes from `task.env.tools` (`own_tool: false`: e.g. the MCP
        server of examples/calculator_mcp_server.py)."""
        return [calculator] if self.own_tool else []

    def reset(self, seed: int | None = None, episode_id: str | None = None, split: str = "train", **kwargs) -> Observation:
        if kwargs:
            raise TypeError(f"unexpected reset arguments: {sorted(kwargs)}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rng = random.Random(f"{split}-{seed or 0}")
        self.a, self.b = rng.randint(self.low, self.high), rng.randint(self.low, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        question = f"What is {self.a} * {self.b}?"
        messages = []
        for a, b in self.examples:
            messages += [{"role": "user", "content": f"What is {a} * {b}?"},
                         {"role": "assistant", "content": _call_text(a, b)},
                         {"role": "user", "content": f"<tool_response>\n{a * b}\n</tool_response>"},
                         {"role": "assistant", "content": f"The answer is {a * b}."}]
        messages.append({"role": "user", "content": question})
        return Observation(text=question, metadata={"messages": messages, "answer": self.a * self.b})

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs) -> Observation:
        if self.a is None:
            raise RuntimeError("call reset() first: no episode is running")
        self._state.step_count += 1
        answer, got = self.a * self.b, extract_last_integer(action.text.replace(",", ""))
        if got == answer:
            return Observation(text="Correct.", reward=1.0, done=True, metadata={"success": True})
        said = "You gave no number." if got is None else f"{got} is wrong."
        return Observation(text=f"{said} {self.a} * {self.b} = {answer}.", reward=0.0, done=True,
                           error_kind="wrong_answer", hint_template_key="calc.wrong_answer",
                           metadata={"success": False, "error_text": f"{said} The product is {answer}."})

    @property
    def state(self) -> State:
        return self._state
