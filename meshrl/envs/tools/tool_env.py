"""`ToolEnv`: an environment whose agent can call tools before it answers.

Every assistant turn is parsed for tool calls in the model family's format
(meshrl.renderers.tools). A turn with calls gets their results back, as the family's tool turns
(one step may return several messages: `metadata['messages']`), and the episode goes on; a turn
with no call is the agent's answer and goes to the wrapped environment's `step`. At reset the tool
list is put into the system prompt.

What can go wrong in a turn, and what the agent sees:
- a malformed call (bad JSON, unclosed tag, arguments that do not fit the tool's schema, more calls
  than `max_calls_per_turn`): a turn that says so, error site `wrong_format` (for SDPO);
- a call of a tool that does not exist: `tool_not_found`, the turn lists the tools there are;
- a tool that raises or passes its deadline: its result says `error: ...` / `timed out ...`
  (counted `tools/failed`, `tools/timed_out`), the other calls' results stand;
- the tools' server gone (`ToolServerError`): the step raises, the episode fails and the env
  process restarts the server (meshrl.envs.episode_host).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from meshrl.envs.base import Environment, Observation, State, TextAction
from meshrl.envs.tools.providers import ToolFailed, ToolTimedOut
from meshrl.renderers.tools import ToolCall, ToolCallError, tool_format, tool_name


@dataclass(frozen=True)
class ToolRules:
    """How tool calls are parsed, run and shown (from `task.env.tools`)."""

    format: str
    call_timeout_s: float
    max_calls_per_turn: int
    max_result_chars: int
    system_prompt: str


class ToolBox:
    """Tools by name over providers, the rules, and the counters of one env process."""

    def __init__(self, providers: Sequence[Any], rules: ToolRules, counts: Counter | None = None,
                 lock: threading.Lock | None = None):
        self.rules, self.format = rules, tool_format(rules.format)
        self.providers = list(providers)
        self.by_name: dict[str, tuple[Any, dict]] = {}
        for provider in self.providers:
            for schema in provider.schemas():
                name = tool_name(schema)
                if name in self.by_name:
                    raise ValueError(f"two tools are named {name!r}")
                self.by_name[name] = (provider, schema)
        self.counts = counts if counts is not None else Counter()
        self.lock = lock or threading.Lock()

    def with_providers(self, providers: Sequence[Any]) -> "ToolBox":
        """These tools and more (an environment's own), sharing the counters."""
        return ToolBox(self.providers + list(providers), self.rules, self.counts, self.lock)

    def schemas(self) -> list[dict]:
        return [schema for _, schema in self.by_name.values()]

    def count(self, **increments: int) -> None:
        with self.lock:
            self.counts.update({f"tools/{k}": v for k, v in increments.items()})

    def check(self, call: ToolCall) -> None:
        """ToolCallError when ``call`` names no tool or its arguments do not fit the schema."""
        if call.name not in self.by_name:
            raise ToolCallError("tool_not_found", f"there is no tool named {call.name!r}; the tools are "
                                                  f"{', '.join(sorted(self.by_name)) or 'none'}")
        import jsonschema

        parameters = self.by_name[call.name][1]["function"].get("parameters") or {"type": "object"}
        try:
            jsonschema.validate(call.arguments, parameters)
        except jsonschema.ValidationError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "arguments"
            raise ToolCallError("wrong_format", f"the arguments of {call.name} do not fit its schema "
                                                f"({where}: {e.message[:200]})") from None
        except jsonschema.SchemaError as e:
            raise ToolCallError("wrong_format", f"the schema of {call.name} is not valid JSON schema ({e.message[:200]})") from None

    def run(self, call: ToolCall) -> str:
        """The result text of a checked call; a failed or timed-out call's text says so (counted)."""
        provider = self.by_name[call.name][0]
        self.count(calls=1)
        try:
            text = provider.call(call.name, call.arguments, self.rules.call_timeout_s)
        except ToolTimedOut as e:
            self.count(timed_out=1)
            return f"error: timed out: {e}"
        except ToolFailed as e:
            self.count(failed=1)
            return f"error: {e}"
        limit = self.rules.max_result_chars
        return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


class ToolEnv(Environment):
    """``env`` with tools: turns with calls are answered with the tools' results, the turn without
    one goes to ``env``. Keeps the whole chat itself (`state_at`)."""

    def __init__(self, env: Environment, tools: ToolBox):
        self.env, self.tools = env, tools
        self.SUPPORTS_CONCURRENT_SESSIONS = env.SUPPORTS_CONCURRENT_SESSIONS
        self.messages: list[dict] = []
        self.seen: list[list[dict]] = []
        self.calls: list[dict] = []

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        obs = self.env.reset(seed=seed, episode_id=episode_id, **kwargs)
        given = obs.metadata.get("messages")
        messages = [dict(m) for m in given] if isinstance(given, list) and given else [obs.message]
        fmt, schemas = self.tools.format, self.tools.schemas()
        if messages[0].get("role") == "system":
            messages[0] = {"role": "system", "content": fmt.system_with_tools(messages[0]["content"], schemas)}
        else:
            messages.insert(0, {"role": "system", "content": fmt.system_with_tools(self.tools.rules.system_prompt, schemas)})
        self.messages, self.seen, self.calls = messages, [], []
        return obs.model_copy(update={"metadata": {**obs.metadata, "messages": messages}})

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self.seen.append([dict(m) for m in self.messages])
        self.messages.append({"role": "assistant", "content": action.text})
        turn = len(self.seen) - 1
        fmt = self.tools.format
        try:
            _, calls = fmt.parse_tool_calls(action.text)
            if len(calls) > self.tools.rules.max_calls_per_turn:
                raise ToolCallError("wrong_format", f"{len(calls)} tool calls in one turn; at most "
                                                    f"{self.tools.rules.max_calls_per_turn} are run")
            for call in calls:
                self.tools.check(call)
        except ToolCallError as e:
            self.tools.count(**{e.kind: 1})
            self.calls.append({"turn": turn, "error": e.kind, "detail": str(e)})
            return self._tool_turn([{"role": "user", "content": f"Tool call error: {e}"}], e.kind, str(e))
        if not calls:
            obs = self.env.step(action, timeout_s, **kwargs)
            given = obs.metadata.get("messages")
            self.messages += [dict(m) for m in given] if isinstance(given, list) and given else [obs.message]
            return obs
        results = [(call, self.tools.run(call)) for call in calls]
        self.calls += [{"turn": turn, "name": c.name, "arguments": c.arguments, "result": r[:200]} for c, r in results]
        return self._tool_turn(fmt.tool_results_messages(results), None, None)

    def _tool_turn(self, messages: list[dict], error_kind: str | None, error_text: str | None) -> Observation:
        self.messages += messages
        return Observation(text=messages[0]["content"], role=messages[0]["role"], reward=0.0, done=False,
                           error_kind=error_kind, hint_template_key=f"tools.{error_kind}" if error_kind else None,
                           metadata={"messages": messages, "error_text": error_text})

    @property
    def state(self) -> State:
        return self.env.state

    def state_at(self, t: int) -> list[dict]:
        return [dict(m) for m in self.seen[t]]

    def trajectory(self) -> dict[str, Any]:
        return {**self.env.trajectory(), "tool_calls": list(self.calls)}

    def close(self) -> None:
        self.env.close()
