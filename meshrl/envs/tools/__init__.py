"""Tools an environment's agent may call: providers (Python callables, an MCP server) and
`ToolEnv`, which answers tool calls with tool turns and passes the final answer to the environment."""

from meshrl.envs.tools.mcp import MCPTools
from meshrl.envs.tools.providers import (
    FunctionTools,
    ToolFailed,
    ToolServerError,
    ToolTimedOut,
    function_schema,
)
from meshrl.envs.tools.tool_env import ToolBox, ToolEnv, ToolRules

__all__ = ["FunctionTools", "MCPTools", "ToolBox", "ToolEnv", "ToolFailed", "ToolRules", "ToolServerError",
           "ToolTimedOut", "function_schema"]
