"""Black-box agents (meshrl.agents, meshrl.controller.agents) without meshes: request validation,
rendering with substitution, segment assembly, the endpoint over real HTTP with the real `openai`
client and a scripted sampler, the program runs' deadlines, and the rollout strategy's accounting
over a fake generator client. The run against the real generator is tests/test_agents_runtime.py."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
import time
from collections import Counter

import openai
import pytest

from meshrl.agents.programs import Outcome, read_result, reward_of, run_callable, run_command
from meshrl.agents.requests import BadRequest, validate
from meshrl.agents.server import AgentEndpoint, AgentServer
from meshrl.agents.transcript import EpisodeLog, ServedCall, assemble, extends, render_prompt
from meshrl.engines import Completion, Sampled
from meshrl.renderers import get_renderer

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def renderer(smollm_tokenizer):
    return get_renderer("chatml", smollm_tokenizer)


# ---- request validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": HELLO, "max_tokens": 10 ** 9}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "max_completion_tokens": 500}, "max_completion_tokens"),
    ({"messages": HELLO, "max_tokens": "8"}, "max_tokens"),
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "stream": True}, "stream"),
    ({"messages": HELLO, "stop": ["\n"]}, "stop"),
    ({"messages": HELLO, "temperature": float("nan")}, "temperature"),
    ({"messages": HELLO, "temperature": 7}, "temperature"),
    ({"messages": HELLO, "top_p": -1}, "top_p"),
    ({"messages": HELLO, "logprobs": "yes"}, "logprobs"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": HELLO, "frequency_penalty": 1.0}, "frequency_penalty"),
    ({"messages": HELLO, "logit_bias": {"5": 100}}, "logit_bias"),
    ({"messages": HELLO, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": HELLO, "tools": ["f"]}, "tools[0]"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     "tool_choice"),
    ({"messages": [*HELLO, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": HELLO, "best_of": 3}, "best_of"),
    ({"messages": HELLO, "model": 3}, "model"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [*HELLO, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*HELLO, {"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"messages": ["hello"]}, "messages[0]"),
])
def test_a_request_meshrl_cannot_serve_exactly_is_refused_naming_its_field(body, field):
    with pytest.raises(BadRequest) as e:
        validate(body, max_tokens_limit=32)
    assert e.value.param == field and e.value.status == 400
    assert field.split("[")[0].split(".")[0] in str(e.value)


def test_a_valid_request_keeps_its_messages_and_defaults_to_the_runs_limit():
    body = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                                        {"role": "assistant", "content": "c", "refusal": None, "tool_calls": None}],
            "temperature": 0.7, "seed": 3, "user": "x", "logprobs": True, "top_logprobs": 2, "n": 1}
    req = validate(body, max_tokens_limit=32)
    assert req.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": "c"}]
    assert (req.max_tokens, req.logprobs, req.top_logprobs, req.model) == (32, True, 2, "m")
    assert validate({"messages": HELLO, "max_tokens": 8}, 32).max_tokens == 8


# ---- assembly and substitution ---------------------------------------------------------------------
def call(prompt, tokens, version=3, text="t", finish="stop"):
    return ServedCall(messages=[], prompt=list(prompt), tokens=list(tokens), logprobs=[-0.5] * len(tokens),
                      text=text, finish_reason=finish, version=version)


def test_a_prompt_that_extends_the_previous_call_continues_its_segment():
    first = call([1, 2, 3], [10, 11], version=5)
    second = call([1, 2, 3, 10, 11, 20, 21], [30], version=4)  # the bridge 20 21 is the agent's turn
    [seg] = assemble([first, second])
    assert seg.prompt == [1, 2, 3]
    assert seg.tokens == [10, 11, 20, 21, 30]
    assert seg.mask == [1, 1, 0, 0, 1]
    assert seg.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert seg.version == 4  # the oldest version that sampled any of it
    assert [(s, e) for _, _, s, e in seg.turns] == [(0, 2), (4, 5)]


def test_a_prompt_that_does_not_extend_starts_a_new_segment_and_a_later_one_can_return():
    a = call([1, 2], [10])
    b = call([1, 9, 9], [11])  # rewrote history: a new segment
    c = call([1, 2, 10, 7], [12])  # continues the first conversation
    d = call([1, 2, 10], [13])  # equals, does not extend: a new segment
    segs = assemble([a, b, c, d])
    assert [s.prompt for s in segs] == [[1, 2], [1, 9, 9], [1, 2, 10]]
    assert segs[0].tokens == [10, 7, 12] and segs[0].mask == [1, 0, 1]
    assert not extends([1, 2], [1, 2]) and extends([1, 2, 3], [1, 2]) and not extends([1, 3, 4], [1, 2])


def test_an_assistant_message_equal_to_a_served_reply_renders_as_its_sampled_tokens(renderer):
    tok = renderer.tokenizer
    messages = [{"role": "user", "content": "What is 40 + 2?"}]
    prompt = render_prompt(renderer, messages, [])
    assert prompt == renderer.build_generation_prompt(messages)
    # the policy sampled "Hello" in two pieces, a split the tokenizer itself never makes
    sampled = renderer.encode("Hel") + renderer.encode("lo") + renderer.get_stop_sequences()
    assert tok.decode(sampled[:-1]) == "Hello" and renderer.encode("Hello") != sampled[:-1]
    served = call(prompt, sampled, text="Hello")
    follow = messages + [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Sure?"}]
    substituted = render_prompt(renderer, follow, [served])
    assert substituted[:len(prompt) + len(sampled)] == prompt + sampled and len(substituted) > len(prompt) + len(sampled)
    assert tok.decode(substituted) == tok.decode(renderer.build_generation_prompt(follow))
    # re-tokenised (the content differs from what was served), the history would not extend
    plain = render_prompt(renderer, follow, [call(prompt, sampled, text="Hello!")])
    assert plain == renderer.build_generation_prompt(follow) and not extends(plain, prompt + sampled)
    [seg] = assemble([served, call(substituted, [5])])
    n = len(sampled)
    assert seg.mask == [1] * n + [0] * (len(substituted) - len(prompt) - n) + [1]


def test_a_truncated_reply_is_closed_with_the_stop_token_when_substituted(renderer):
    tok = renderer.tokenizer
    prompt = render_prompt(renderer, HELLO, [])
    sampled = renderer.encode("Hi there")  # hit max_tokens: no stop token
    served = call(prompt, sampled, text="Hi there", finish="length")
    nxt = render_prompt(renderer, HELLO + [{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": "x"}], [served])
    assert extends(nxt, prompt + sampled)
    assert nxt[len(prompt) + len(sampled)] == renderer.get_stop_sequences()[0]
    assert tok.decode(nxt).count("<|im_end|>") == 4  # system, user, assistant, user


# ---- the endpoint over HTTP, with the real openai client ----------------------------------------------
class ScriptedSampler:
    """Replies ``replies`` in turn (then the last again, "42" by default; ending on the stop token),
    stamped with ``version``; records each prompt."""

    def __init__(self, renderer, version=7, replies=("42",)):
        self.renderer, self.version, self.prompts, self.replies = renderer, version, [], replies

    def __call__(self, key, index, prompt, max_tokens, top):
        reply = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        self.prompts.append(list(prompt))
        tokens = self.renderer.encode(reply)[:max_tokens] + self.renderer.get_stop_sequences()
        topk = ([[t, t + 1] for t in tokens], [[-0.1, -3.0] for _ in tokens]) if top else None
        return Completion(tokens, [-0.25] * len(tokens), "stop", meta={"version": self.version}, topk=topk)


@pytest.fixture
def endpoint(renderer):
    ep = AgentEndpoint(renderer, ScriptedSampler(renderer), max_new_tokens=16, max_model_len=256)
    with AgentServer(ep) as server:
        yield ep, server


def test_the_endpoint_serves_the_openai_client_and_records_every_completion(endpoint, renderer):
    ep, server = endpoint
    log = EpisodeLog(max_calls=3)
    ep.open("key-a", log)
    client = openai.OpenAI(base_url=server.base_url, api_key="key-a", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "What is 40 + 2?"}]
    r = client.chat.completions.create(model="policy", messages=messages, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == "42" and r.choices[0].finish_reason == "stop"
    assert r.system_fingerprint == "meshrl-policy-v7"
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == "42" and all(t.logprob == -0.25 for t in content)
    assert len(content[0].top_logprobs) == 2 and content[0].top_logprobs[0].logprob == pytest.approx(-0.1)
    messages += [r.choices[0].message, {"role": "user", "content": "Sure?"}]  # the reply object, echoed back
    r2 = client.chat.completions.create(model="policy", messages=messages)
    assert r2.choices[0].logprobs is None
    calls = log.served()
    assert [c.version for c in calls] == [7, 7] and calls[0].text == "42"
    assert extends(calls[1].prompt, calls[0].prompt + calls[0].tokens)
    assert r2.usage.prompt_tokens == len(calls[1].prompt)
    client.chat.completions.create(model="policy", messages=HELLO)
    with pytest.raises(openai.RateLimitError, match="max_completions"):  # out of completions
        client.chat.completions.create(model="policy", messages=HELLO)
    log.close()
    with pytest.raises(openai.APIStatusError, match="episode is over") as e:
        client.chat.completions.create(model="policy", messages=HELLO)
    assert e.value.status_code == 409 and len(log.served()) == 3


def test_the_endpoint_refuses_unknown_keys_bad_fields_and_prompts_past_the_context(endpoint):
    ep, server = endpoint
    ep.open("key-b", EpisodeLog(max_calls=8))
    bad = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="policy", messages=HELLO)
    client = openai.OpenAI(base_url=server.base_url, api_key="key-b", max_retries=0, timeout=30)
    for kwargs, field in [({"max_tokens": 100000}, "max_tokens"), ({"n": 3}, "n"),
                          ({"tools": [{"type": "function", "function": {"name": "calc"}}], "tool_choice": "required"},
                           "tool_choice")]:
        with pytest.raises(openai.BadRequestError, match=field) as e:
            client.chat.completions.create(model="policy", messages=HELLO, **kwargs)
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError, match="model.max_model_len"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "word " * 400}])
    assert ep.episodes["key-b"].served() == [] and ep.episodes["key-b"].requested == 0
    assert ep.counts["rejected"] == 5  # the unknown key, three fields, the context
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="policy", prompt="x")


def test_every_episode_of_a_batch_may_call_at_once(endpoint):
    """A batch's programs connect together: none is refused a connection (the listen backlog)."""
    ep, server = endpoint
    keys = [f"k{i}" for i in range(96)]
    for key in keys:
        ep.open(key, EpisodeLog(max_calls=1))
    barrier, errors = threading.Barrier(len(keys)), []

    def one(key):
        with openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60) as client:
            barrier.wait()
            try:
                client.chat.completions.create(model="policy", messages=HELLO)
            except openai.APIError as e:
                errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and all(len(ep.episodes[k].served()) == 1 for k in keys)


def test_the_server_refuses_bodies_it_will_not_read(endpoint):
    import http.client

    ep, server = endpoint
    ep.open("k", EpisodeLog(max_calls=4))
    port = int(server.base_url.split(":")[2].split("/")[0])

    def post(body: bytes, length: str | None = None, path="/v1/chat/completions"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.putrequest("POST", path)
        conn.putheader("Authorization", "Bearer k")
        conn.putheader("Content-Length", length if length is not None else str(len(body)))
        conn.endheaders()
        conn.send(body[:1000])
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())

    status, body = post(b"", str(64 << 20))
    assert status == 413 and "Content-Length" in body["error"]["message"]
    assert post(b"{not json")[0] == 400 and post(b"[1, 2]")[0] == 400
    assert post(b"{}", path="/v1/completions")[0] == 404
    assert ep.episodes["k"].requested == 0


def test_concurrent_calls_of_one_episode_get_their_own_index_and_a_failed_sample_is_a_503(renderer):
    indices = []

    def sample(key, index, prompt, max_tokens, top):
        indices.append(index)
        if index == 5:
            raise RuntimeError("generator.sample: the generator was replaced")
        return Completion([5, 2], [-1.0, -1.0], "stop", meta={"version": 1})

    ep = AgentEndpoint(renderer, sample, max_new_tokens=8, max_model_len=256)
    ep.open("k", EpisodeLog(max_calls=8))
    with AgentServer(ep) as server:
        errors = []

        def one():
            with openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0, timeout=30) as client:
                try:
                    client.chat.completions.create(model="policy", messages=HELLO)
                except openai.InternalServerError as e:
                    errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(indices) == list(range(8))
    assert len(errors) == 1 and errors[0].status_code == 503 and "generator was replaced" in str(errors[0])
    assert ep.counts == Counter(sample_errors=1) and len(ep.episodes["k"].served()) == 7


CALC = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_tool_calls_are_served_and_their_results_extend_the_conversation(renderer):
    replies = ['<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>', "It is 42.",
               "<tool_call>\n{not json}\n</tool_call>"]
    sampler = ScriptedSampler(renderer, replies=replies)
    ep = AgentEndpoint(renderer, sampler, max_new_tokens=64, max_model_len=1024)
    log = EpisodeLog(max_calls=4)
    ep.open("k", log)
    with AgentServer(ep) as server, openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0) as client:
        messages = [{"role": "user", "content": "What is 40 + 2?"}]
        choice = client.chat.completions.create(model="policy", messages=messages, tools=CALC).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [tc] = choice.message.tool_calls
        assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 40, "b": 2}
        text = renderer.tokenizer.decode(sampler.prompts[0])
        # the family's tool list, after the template's default system prompt
        assert text.startswith(f"<|im_start|>system\n{renderer.default_system_prompt}\n\n# Tools")
        assert json.dumps(CALC[0]) in text
        messages += [choice.message, {"role": "tool", "tool_call_id": tc.id, "content": "42"}]
        second = client.chat.completions.create(model="policy", messages=messages, tools=CALC).choices[0]
        assert second.message.content == "It is 42." and second.finish_reason == "stop"
        first, then = log.served()
        assert extends(then.prompt, first.prompt + first.tokens)  # the call's own tokens, replayed
        between = renderer.tokenizer.decode(then.prompt[len(first.prompt) + len(first.tokens):])
        assert between == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        # an echo whose calls were changed, or a result for a call never served, cannot be rendered exactly
        forged = {"role": "assistant", "content": None, "tool_calls": [
            {"id": tc.id, "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}
        with pytest.raises(openai.BadRequestError, match="messages\\[1\\]: an assistant message with tool_calls"):
            client.chat.completions.create(model="policy", messages=[messages[0], forged, messages[2]], tools=CALC)
        with pytest.raises(openai.BadRequestError, match="names no tool call served"):
            client.chat.completions.create(model="policy", tools=CALC, messages=[
                *messages[:2], {"role": "tool", "tool_call_id": "call_9_9", "content": "42"}])
        # a call that cannot be parsed is served as text (and counted)
        third = client.chat.completions.create(model="policy", messages=messages[:1], tools=CALC).choices[0]
        assert third.message.tool_calls is None and third.message.content == replies[2]
    assert ep.counts["malformed_tool_calls"] == 1 and len(log.served()) == 3


# ---- program runs ------------------------------------------------------------------------------------
def test_a_command_gets_the_endpoint_and_episode_and_its_last_line_is_the_result(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        spec = json.loads(sys.stdin.read())
        assert spec == json.loads(os.environ["MESHRL_EPISODE"])
        print("some log line")
        print(json.dumps({"reward": spec["seed"] / 10, "success": True, "url": os.environ["OPENAI_BASE_URL"],
                          "key": os.environ["OPENAI_API_KEY"]}))
    """))
    out = run_command(["python", str(script)], "http://127.0.0.1:1/v1", "k1", {"seed": 5}, 30, [])
    assert out.status == "ok" and out.result == {"reward": 0.5, "success": True, "url": "http://127.0.0.1:1/v1", "key": "k1"}
    assert reward_of(out.result) == (0.5, True)


def test_a_command_past_its_deadline_is_killed_with_everything_it_started(tmp_path):
    marker = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(marker)!r}, "w").write(str(child.pid))
        time.sleep(300)
    """))
    started = time.monotonic()
    out = run_command(["python", str(script)], "http://x/v1", "k", {}, 3, [])
    assert out.status == "timed_out" and "task.agent.timeout_s" in out.detail
    assert time.monotonic() - started < 20
    child = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child), "the program's child outlived the kill"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("code, status, detail", [
    ("import sys; print('boom', file=sys.stderr); sys.exit(3)", "crashed", "exit status 3: boom"),
    ("print('not json')", "bad_result", "not JSON"),
    ("pass", "bad_result", "no result line"),
    ("print('x' * 10_000_000); print(1.5)", "ok", ""),
])
def test_a_commands_exit_and_output_decide_its_outcome(tmp_path, code, status, detail):
    (tmp_path / "a.py").write_text(code)
    out = run_command([sys.executable, str(tmp_path / "a.py")], "http://x/v1", "k", {}, 30, [])
    assert out.status == status and detail in out.detail
    assert run_command(["/no/such/program"], "http://x/v1", "k", {}, 5, []).status == "crashed"


def test_a_command_that_never_reads_a_large_spec_cannot_block(tmp_path):
    (tmp_path / "a.py").write_text("print(2)")
    out = run_command(["python", str(tmp_path / "a.py")], "http://x/v1", "k", {"blob": "x" * (4 << 20)}, 30, [])
    assert out == Outcome("ok", 2)


def test_a_callable_runs_with_a_client_and_is_abandoned_past_its_deadline():
    seen = {}

    def ok(client, episode):
        seen.update(url=str(client.base_url), key=client.api_key, episode=episode)
        return 1

    assert run_callable(ok, "http://127.0.0.1:9/v1", "k9", {"seed": 1}, 10) == Outcome("ok", 1)
    assert seen == {"url": "http://127.0.0.1:9/v1/", "key": "k9", "episode": {"seed": 1}}
    assert run_callable(lambda c, e: time.sleep(30), "http://x/v1", "k", {}, 0.5).status == "timed_out"
    crash = run_callable(lambda c, e: 1 / 0, "http://x/v1", "k", {}, 5)
    assert crash.status == "crashed" and "ZeroDivisionError" in crash.detail
    assert run_callable(lambda c, e: object(), "http://x/v1", "k", {}, 5).status == "bad_result"


@pytest.mark.parametrize("result", [None, "1", True, float("inf"), {"reward": "1"}, {"score": 1},
                                    {"reward": 1, "success": "yes"}])
def test_a_result_that_is_no_reward_is_refused(result):
    with pytest.raises(ValueError):
        reward_of(result)
    assert reward_of(2) == (2.0, None) and read_result("0.25") == Outcome("ok", 0.25)


# ---- the rollout strategy over a fake generator client -----------------------------------------------
class FakeClient:
    """`MeshClient.sample` answered by a scripted "reply N" per call, each call stamped with the next
    policy version (so the oldest version of an episode is its first call's)."""

    def __init__(self, renderer):
        self.renderer, self.step, self.calls, self._lock = renderer, 3, [], threading.Lock()
        self.version = 10

    def sample(self, prompt, request, scoring):
        with self._lock:
            self.calls.append((list(prompt), request))
            version = self.version
            self.version += 1
        tokens = self.renderer.encode(f"reply {version}") + self.renderer.get_stop_sequences()
        return Sampled([Completion(tokens, [-1.0] * len(tokens), "stop", meta={"version": version})])


def agent_rollout(renderer, **agent):
    from meshrl.config.agent_task import AgentTaskConfig
    from meshrl.controller.agents import AgentRollout
    from meshrl.controller.rollout import Counters

    cfg = AgentTaskConfig(**{"callable": "meshrl.testing.agents:scripted", "timeout_s": 5, **agent})
    client = FakeClient(renderer)
    return AgentRollout.bound(cfg)(client, renderer, 512, Counters()), client


def spec(**kwargs):
    from meshrl.envs.task_sets import EpisodeSpec

    return EpisodeSpec(f"e{kwargs}", kwargs)


def test_the_strategy_assembles_each_episode_from_exactly_what_was_sampled(renderer):
    from meshrl.engines import SampleRequest

    strategy, client = agent_rollout(renderer)
    request = SampleRequest(max_tokens=16, temperature=1.0, seed=100, stop_token_ids=(2,))
    trajectories, metrics = strategy.collect([spec(mode="good", seed=1), spec(mode="rewrite", seed=2)], 2, request, "t")
    good = [t for t in trajectories if t.group == 0]
    assert len(good) == 2 and all(t.info["segments"] == 1 and t.reward == 1.0 and t.info["correct"] for t in good)
    for t in good:
        sampled = [c for c in client.calls if t.prompt_tokens == c[0][:len(t.prompt_tokens)]]
        assert len(sampled) >= 2
        sequence = t.prompt_tokens + t.tokens
        first, second = t.info["turns"]
        # the second call's prompt is the first's sequence plus the user turn, token for token
        assert any(p == sequence[:len(p)] and len(p) == len(t.prompt_tokens) + second[2] for p, _ in client.calls)
        assert [t.tokens[i] for i in range(len(t.mask)) if t.mask[i]] == \
            t.tokens[first[2]:first[3]] + t.tokens[second[2]:second[3]]
        assert t.version == int(renderer.tokenizer.decode(t.tokens[first[2]:first[3] - 1]).split()[-1])
    rewrites = [t for t in trajectories if t.group == 1]
    assert len(rewrites) == 4 and {t.info["segment"] for t in rewrites} == {0, 1}  # two segments per episode
    assert all(t.reward == 0.5 and not t.info["correct"] for t in rewrites)
    assert metrics["agents/segments"] == 6 and metrics["agents/calls"] == 8
    assert metrics["episodes/success"] == 0.5
    # each call sampled with the batch's parameters, seeded per episode and call; the step kept
    requests = [r for _, r in client.calls]
    assert {(r.temperature, r.max_tokens, r.stop_token_ids, r.n) for r in requests} == {(1.0, 16, (2,), 1)}
    assert len({r.seed for r in requests}) == 8 and client.step == 3
    assert [r["agent_status"] for r in strategy.episode_records] == ["ok"] * 4


def test_failed_programs_are_dropped_and_counted_never_a_hung_batch(renderer):
    from meshrl.engines import SampleRequest

    strategy, _ = agent_rollout(renderer, timeout_s=1.0)
    modes = ["crash", "hang", "no_calls", "garbage", "good"]
    started = time.monotonic()
    trajectories, metrics = strategy.collect([spec(mode=m) for m in modes], 1, SampleRequest(max_tokens=8), "t")
    assert time.monotonic() - started < 10
    assert [t.group for t in trajectories] == [4]
    assert {k: v for k, v in metrics.items() if k in ("agents/crashed", "agents/timed_out", "agents/no_calls",
                                                      "agents/bad_result")} == \
        {"agents/crashed": 1, "agents/timed_out": 1, "agents/no_calls": 1, "agents/bad_result": 1}
    statuses = Counter(r["agent_status"] for r in strategy.episode_records)
    assert statuses == Counter(crashed=1, timed_out=1, no_calls=1, bad_result=1, ok=1)


def test_a_grader_gives_the_reward_and_a_failing_grader_is_counted(renderer):
    from meshrl.engines import SampleRequest

    strategy, _ = agent_rollout(renderer, grader="meshrl.testing.agents:first_reply_length", success_reward=100)
    trajectories, metrics = strategy.collect([spec(mode="good"), spec(mode="garbage")], 1, SampleRequest(max_tokens=8), "t")
    assert [t.reward for t in trajectories] == [8.0, 8.0]  # len("reply 10") for both: graded, not the result
    assert not any(t.info["correct"] for t in trajectories)  # below success_reward
    failing, _ = agent_rollout(renderer, grader="meshrl.testing.agents:first_reply_length")
    _, metrics = failing.collect([spec(mode="rewrite")], 1, SampleRequest(max_tokens=8), "t")
    assert metrics.get("agents/grader_errors") is None  # rewrite still has a first reply
    failing.grader = lambda episode, transcript: float("nan")
    trajectories, metrics = failing.collect([spec(mode="good")], 1, SampleRequest(max_tokens=8), "t")
    assert trajectories == [] and metrics["agents/grader_errors"] == 1


def test_the_task_kind_is_checked_before_anything_is_spawned(tmp_path):
    from meshrl.config.base import ConfigError, load_config
    from meshrl.config.run import RunConfig
    from meshrl.envs.task_sets import make_task

    def cfg(*overrides):
        return load_config(RunConfig, None, ["task.kind=agent", *overrides])

    with pytest.raises(ConfigError, match="task.agent"):
        cfg()
    with pytest.raises(ConfigError, match="exactly one of command"):
        cfg("task.agent.callable=a:b", "task.agent.command=[python,x.py]")
    with pytest.raises(ConfigError, match="sdpo.alpha"):
        cfg("task.agent.callable=meshrl.testing.agents:scripted", "sdpo.alpha=0.1")
    with pytest.raises(ConfigError, match="task.agent.callable: module 'meshrl.testing.agents' has no function 'nope'"):
        make_task(cfg("task.agent.callable=meshrl.testing.agents:nope").task)
    with pytest.raises(ConfigError, match="no script 'missing.py'"):
        make_task(cfg("task.agent.command=[python,missing.py]").task)
    with pytest.raises(ConfigError, match="task.agent.heldout shares"):
        make_task(cfg("task.agent.callable=meshrl.testing.agents:scripted", "task.agent.heldout.seeds=[0,5]").task)
    run = cfg("task.agent.callable=meshrl.testing.agents:scripted")
    task = make_task(run.task)
    from meshrl.controller.rollout import strategy_for
    from meshrl.meshes.placement import run_slots

    assert strategy_for(task).agent is task.agent and task.heldout(2)[1].kwargs == {"seed": 1000001}
    assert [s.name for s in run_slots(run)] == ["learner", "generator"]  # the programs need no mesh
