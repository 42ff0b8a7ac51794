"""Tool calling: each family's format (prompt text, parsing, result turns), the bridge of tool turns
against the chat template's tokenisation, tool providers and `ToolEnv`'s turns and error sites.

SmolLM2's own template has no tool support, and no Qwen or Llama 3.1 tokenizer is available
offline: the ChatML tool format is checked against Qwen2.5's template (tests/qwen_tool_template.py)
and the Llama one against Llama 3.1's (tests/llama31_tool_template.py), both written out by hand and
applied with `apply_chat_template(messages, tools=...)` on a copy of the SmolLM2 tokenizer (with
Llama 3's special tokens added for the latter). They prove the text and the token-in/token-out
bridge; they do not prove anything about Qwen's or Llama's own BPE merges.
"""

import copy
import json
import threading
import time
from collections import Counter

import pytest

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.envs.episode_host import FIRST_ROLES, EnvOutputError, check_observation, observation_messages
from meshrl.envs.tools import FunctionTools, ToolBox, ToolEnv, ToolRules, function_schema
from meshrl.renderers import get_renderer
from meshrl.renderers.tools import ChatMLTools, Llama3Tools, ToolCall, ToolCallError
from llama31_tool_template import LLAMA31_TEMPLATE
from qwen_tool_template import QWEN25_TEMPLATE

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                   "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwen_tokenizer(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


# ----------------------------------------------------------------------------- parsing


def test_chatml_parses_several_calls_and_keeps_the_content():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>')
    content, calls = ChatMLTools().parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls == [ToolCall("calculator", {"expression": "12*34"}, "call_0"), ToolCall("lookup", {"key": "a"}, "call_1")]
    assert ChatMLTools().parse_tool_calls("The answer is 408.") == ("The answer is 408.", [])


@pytest.mark.parametrize("text, words", [
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {}</tool_call>", "not valid JSON"),
    ("<tool_call>{\"name\": \"calculator\"", "not closed"),
    ("<tool_call>[1, 2]</tool_call>", "\"name\" string"),
    ("<tool_call>{\"name\": \"c\", \"arguments\": [1]}</tool_call>", "not a JSON object"),
    ("<tool_call>{\"name\": \"c\", \"arguments\": {}, \"x\": 1}</tool_call>", "unexpected keys"),
])
def test_chatml_malformed_calls_are_wrong_format(text, words):
    with pytest.raises(ToolCallError, match=words) as e:
        ChatMLTools().parse_tool_calls(text)
    assert e.value.kind == "wrong_format"


def test_llama3_parses_json_calls():
    fmt = Llama3Tools()
    text = '{"name": "calculator", "parameters": {"expression": "2+2"}}; {"name": "calculator", "parameters": {"expression": "3"}}'
    assert fmt.parse_tool_calls(text) == ("", [ToolCall("calculator", {"expression": "2+2"}, "call_0"),
                                               ToolCall("calculator", {"expression": "3"}, "call_1")])
    assert fmt.parse_tool_calls("<|python_tag|>{\"name\": \"f\", \"parameters\": {}}")[1] == [ToolCall("f", {}, "call_0")]
    assert fmt.parse_tool_calls("It is 4.") == ("It is 4.", [])
    with pytest.raises(ToolCallError, match="not valid JSON") as e:
        fmt.parse_tool_calls('{"name": "f", "parameters": {}')
    assert e.value.kind == "wrong_format"
    assert fmt.tool_results_messages([(ToolCall("f", {}, "call_0"), "4"), (ToolCall("f", {}, "call_1"), "a\nb")]) == [
        {"role": "ipython", "content": '"4"'}, {"role": "ipython", "content": '"a\\nb"'}]
    system = fmt.system_with_tools("Be brief.", [CALC])
    assert system.startswith("You have access to the following functions.") and system.endswith("}\n\nBe brief.")
    assert json.loads(system.split("variables.\n\n")[1].rsplit("\n\nBe brief.")[0]) == CALC


def test_a_tool_that_is_not_an_openai_function_schema_is_refused():
    with pytest.raises(ValueError, match="type: function"):
        ChatMLTools().tools_system_text([{"name": "calculator"}])


# ----------------------------------------------------------------------------- against the template


def _qwen_messages():
    calls = [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
             for e in ("12*34", "5+6")]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12*34 and 5+6?"},
            {"role": "assistant", "content": "Let me compute.", "tool_calls": calls},
            {"role": "tool", "content": "408"}, {"role": "tool", "content": "11"},
            {"role": "assistant", "content": "408 and 11."}]


def test_chatml_tool_turns_match_the_qwen_template_token_for_token(qwen_tokenizer):
    renderer = get_renderer("chatml", qwen_tokenizer, default_system_prompt=None)
    fmt = renderer.tool_format
    sampled = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "calculator", "arguments": {"expression": "5+6"}}\n</tool_call>')
    content, calls = renderer.parse_tool_calls(sampled)
    assert content == "Let me compute." and [c.arguments["expression"] for c in calls] == ["12*34", "5+6"]
    results = fmt.tool_results_messages(list(zip(calls, ["408", "11"])))
    ours = [{"role": "system", "content": fmt.system_with_tools("Be brief.", [CALC])},
            {"role": "user", "content": "What is 12*34 and 5+6?"}]
    template = qwen_tokenizer.apply_chat_template(_qwen_messages(), tools=[CALC], tokenize=False)
    expected = list(qwen_tokenizer.encode(template, add_special_tokens=False))
    # token-in/token-out: the prompt, the sampled turn (tokenised as the template text has it), then the bridge
    prompt = renderer.build_generation_prompt(ours)
    turn = list(qwen_tokenizer.encode(sampled, add_special_tokens=False)) + renderer.get_stop_sequences()
    bridge = renderer.bridge(prompt + turn, results)
    final = list(qwen_tokenizer.encode("408 and 11.", add_special_tokens=False)) + renderer.get_stop_sequences()
    assert prompt + turn + bridge + final + renderer.encode("\n") == expected
    assert renderer.render(ours + [{"role": "assistant", "content": sampled}, *results,
                                   {"role": "assistant", "content": "408 and 11."}]) == expected
    assert renderer.tool_result_message(calls[0], "408") == {"role": "user", "content": "<tool_response>\n408\n</tool_response>"}


LLAMA31_PREAMBLE = "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"


def test_llama3_tool_turns_match_the_llama31_template_token_for_token(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA31_TEMPLATE
    renderer = get_renderer("llama3", tok)
    fmt = renderer.tool_format
    sampled = '{"name": "calculator", "parameters": {"expression": "12*34"}}'
    _, calls = renderer.parse_tool_calls(sampled)
    results = fmt.tool_results_messages([(calls[0], "408")])
    assert results == [{"role": "ipython", "content": '"408"'}]
    # the renderer writes no Llama 3.1 date preamble: the environment's system text carries it here
    ours = [{"role": "system", "content": LLAMA31_PREAMBLE + fmt.system_with_tools("Be brief.", [CALC])},
            {"role": "user", "content": "12*34?"}]
    theirs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12*34?"},
              {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                  "name": "calculator", "arguments": {"expression": "12*34"}}}]},
              {"role": "tool", "content": "408"}]
    text = tok.apply_chat_template(theirs, tools=[CALC], tokenize=False, add_generation_prompt=True,
                                   tools_in_user_message=False)
    expected = list(tok.encode(text, add_special_tokens=False))
    assert renderer.render(ours + [{"role": "assistant", "content": sampled}, *results], add_generation_prompt=True) == expected
    # the result turns are appended after the sampled turn as they are (this tokenizer merges "\n\n{",
    # so the sampled turn is compared as the template tokenises it)
    history = renderer.render(ours + [{"role": "assistant", "content": sampled}])
    assert history + renderer.bridge(history, results) == expected


# ----------------------------------------------------------------------------- providers


def multiply(a: int, b: int, note: str = "") -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b (int): the second factor
    """
    return a * b


def test_function_schema_from_signature_and_docstring():
    assert function_schema(multiply) == {"type": "function", "function": {
        "name": "multiply", "description": "Multiply two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "the first factor"},
            "b": {"type": "integer", "description": "the second factor"}, "note": {"type": "string"}}}}}


def _box(*functions, timeout=2.0, max_calls=3, schemas=None):
    return ToolBox([FunctionTools(list(functions), schemas)], ToolRules("chatml", timeout, max_calls, 50, "Be brief."))


def test_toolbox_checks_names_and_arguments_against_the_schema():
    box = _box(multiply)
    box.check(ToolCall("multiply", {"a": 2, "b": 3}, "call_0"))
    with pytest.raises(ToolCallError, match="no tool named 'mul'.*multiply") as e:
        box.check(ToolCall("mul", {}, "call_0"))
    assert e.value.kind == "tool_not_found"
    with pytest.raises(ToolCallError, match="'b' is a required property") as e:
        box.check(ToolCall("multiply", {"a": 2}, "call_0"))
    assert e.value.kind == "wrong_format"
    with pytest.raises(ToolCallError, match="a: 'x' is not of type 'integer'"):
        box.check(ToolCall("multiply", {"a": "x", "b": 1}, "call_0"))


def hang(seconds: float) -> str:
    """Sleep."""
    time.sleep(seconds)
    return "woke"


def boom() -> str:
    """Raise."""
    raise KeyError("no such row")


def long_text() -> str:
    """A long result."""
    return "x" * 80


def test_failed_timed_out_and_long_results_are_tool_turns_that_say_so():
    box = _box(hang, boom, long_text, timeout=0.3)
    t0 = time.monotonic()
    assert box.run(ToolCall("hang", {"seconds": 5}, "c")).startswith("error: timed out: tool hang gave no answer within 0.3s")
    assert time.monotonic() - t0 < 2
    assert box.run(ToolCall("boom", {}, "c")) == "error: tool boom raised KeyError: 'no such row'"
    assert box.run(ToolCall("long_text", {}, "c")) == "x" * 50 + "\n[... 30 more characters cut]"
    assert box.counts == Counter({"tools/calls": 3, "tools/timed_out": 1, "tools/failed": 1})


def test_explicit_schemas_replace_derived_ones_and_must_name_a_function():
    schema = {"type": "function", "function": {"name": "multiply", "description": "x",
                                               "parameters": {"type": "object", "properties": {}}}}
    assert FunctionTools([multiply], {"multiply": schema}).schemas() == [schema]
    with pytest.raises(ValueError, match="do not exist: \\['divide'\\]"):
        FunctionTools([multiply], {"divide": schema})


# ----------------------------------------------------------------------------- ToolEnv


class Quiz(Environment):
    """What is 123 * 456? One answer; reward 1 for the right number."""

    def __init__(self):
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id)
        return Observation(text="What is 123 * 456?")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        right = "56088" in action.text
        return Observation(text="Correct." if right else "Wrong.", reward=float(right), done=True,
                           metadata={"success": right})

    @property
    def state(self):
        return self._state

    def tools(self):
        return [multiply]


def _call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_tool_env_answers_calls_with_tool_turns_and_passes_the_answer_on():
    env = ToolEnv(Quiz(), _box(boom).with_providers([FunctionTools([multiply])]))
    first = env.reset(episode_id="e")
    system = first.metadata["messages"][0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "multiply"' in system["content"] and '"name": "boom"' in system["content"]
    obs = env.step(TextAction(text="Computing.\n" + _call("multiply", a=123, b=456) + _call("boom")))
    assert not obs.done and obs.error_kind is None and obs.reward == 0.0
    assert obs.metadata["messages"] == [{"role": "user", "content": "<tool_response>\n56088\n</tool_response>\n"
                                         "<tool_response>\nerror: tool boom raised KeyError: 'no such row'\n</tool_response>"}]
    bad = env.step(TextAction(text=_call("divide", a=1)))
    assert bad.error_kind == "tool_not_found" and bad.hint_template_key == "tools.tool_not_found"
    assert "no tool named 'divide'" in bad.text
    malformed = env.step(TextAction(text="<tool_call>{oops</tool_call>"))
    assert malformed.error_kind == "wrong_format"
    too_many = env.step(TextAction(text=_call("multiply", a=1, b=1) * 4))
    assert too_many.error_kind == "wrong_format" and "at most 3" in too_many.text
    final = env.step(TextAction(text="It is 56088."))
    assert final.done and final.reward == 1.0
    assert env.state_at(1)[-1] == obs.metadata["messages"][0]  # the chat before the second action
    assert [c.get("name", c.get("error")) for c in env.trajectory()["tool_calls"]] == [
        "multiply", "boom", "tool_not_found", "wrong_format", "wrong_format"]
    assert env.tools.counts["tools/calls"] == 2 and env.tools.counts["tools/failed"] == 1
    assert env.tools.counts["tools/tool_not_found"] == 1 and env.tools.counts["tools/wrong_format"] == 2


def test_host_checks_every_message_of_a_step():
    limit = 20
    ok = Observation(text="a", metadata={"messages": [{"role": "user", "content": "a"}, {"role": "ipython", "content": "b"}]})
    assert observation_messages(check_observation(ok, "t", limit), "t", limit)[1] == {"role": "ipython", "content": "b"}
    worked = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert observation_messages(Observation(text="a", metadata={"messages": worked}), "t", limit, FIRST_ROLES) == worked
    for messages, words in [(worked, r"messages\[1\]"), ([{"role": "user", "content": "x" * 30}], "over"),
                            ([], "non-empty")]:
        with pytest.raises(EnvOutputError, match=words):
            observation_messages(Observation(text="a", metadata={"messages": messages}), "t", limit)


def test_tool_calls_run_concurrently_across_episodes():
    box = _box(hang, timeout=5.0)
    envs = [ToolEnv(Quiz(), box) for _ in range(4)]
    for e in envs:
        e.reset()
    t0 = time.monotonic()
    threads = [threading.Thread(target=e.step, args=(TextAction(text=_call("hang", seconds=0.5)),)) for e in envs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 < 1.5 and box.counts["tools/calls"] == 4


def test_the_rollout_appends_tool_turns_token_in_token_out(smollm_tokenizer):
    """EpisodeRollout over a real env host with the calculator example: the scripted first turn calls
    the tool, its result is appended as the template's tool turn (bridge, mask 0), the second turn
    answers; the step's metrics carry the env process's tool counters."""
    from meshrl.config.base import load_config
    from meshrl.config.run import RunConfig
    from meshrl.controller.episodes import EpisodeRollout
    from meshrl.controller.rollout import Counters
    from meshrl.engines import SampleRequest
    from meshrl.envs.task_sets import EpisodeSpec
    from meshrl.renderers import renderer_for_tokenizer
    from tests.test_env_task import _Client

    cfg = load_config(RunConfig, "configs/env-tools.yaml", ["task.env.kwargs={low: 2, high: 2, examples: []}"])
    renderer = renderer_for_tokenizer(smollm_tokenizer)
    call = _call("calculator", expression="2 * 2")
    rollout = EpisodeRollout(_Client(cfg, [call, "The answer is 4."]), renderer, 4096, Counters())
    trajectories, step = rollout.collect([EpisodeSpec("s0", {"seed": 0})], 2, SampleRequest(max_tokens=64), "t")
    assert [t.reward for t in trajectories] == [1.0, 1.0] and step["tools/calls"] == 2.0
    t = trajectories[0]
    (_, _, s0, e0), (_, _, s1, e1) = t.info["turns"]
    assert t.tokens[s0:e0] == [ord(c) for c in call] and all(t.mask[s0:e0]) and not any(t.mask[e0:s1])
    assert smollm_tokenizer.decode(t.tokens[e0:s1]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    system = smollm_tokenizer.decode(t.prompt_tokens).split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools") and '"calculator"' in system


def test_config_functions_become_tools_and_bad_ones_are_one_line_errors():
    from types import SimpleNamespace

    from meshrl.config.base import ConfigError, load_config
    from meshrl.config.run import RunConfig
    from meshrl.controller.episodes import EpisodeRollout
    from meshrl.envs.episode_host import EpisodeHost
    from meshrl.envs.hosting import EnvSourceError, env_source
    from meshrl.envs.task_sets import EpisodeSpec

    base = ["task.env.kwargs={own_tool: false, examples: []}"]
    cfg = load_config(RunConfig, "configs/env-tools.yaml", base + ["task.env.tools.functions=[calculator_tools:calculator]"])
    host = EpisodeHost(env_source(cfg.task.env))
    try:
        first = host.reset([("e", EpisodeSpec("s", {"seed": 3}))])[0]["messages"]
        assert '"name": "calculator"' in first[0]["content"]
        assert host.step([("e", _call("calculator", expression="6 * 7"))])[0]["messages"][0]["content"] == (
            "<tool_response>\n42\n</tool_response>")
    finally:
        host.close()
    for functions, words in [("[calculator_tools:nope]", "task.env.tools.functions: module 'calculator_tools' has no function 'nope'"),
                             ("[no_such_module:f]", "task.env.tools.functions: cannot import module 'no_such_module'")]:
        bad = load_config(RunConfig, "configs/env-tools.yaml", base + [f"task.env.tools.functions={functions}"])
        with pytest.raises(EnvSourceError, match=words):
            env_source(bad.task.env)
    session = SimpleNamespace(renderer=SimpleNamespace(name="llama3"))
    with pytest.raises(ConfigError, match="task.env.tools.format is 'chatml' but the model's chat template is 'llama3'"):
        EpisodeRollout.spawn(session, cfg)
