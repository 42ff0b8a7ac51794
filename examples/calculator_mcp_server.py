"""The `calculator` tool of examples/calculator_tools.py served by an MCP server (fastmcp), for
`task.env.tools.mcp`: over stdio by default, over streamable HTTP with `--port`.

    python examples/calculator_mcp_server.py                 # stdio (task.env.tools.mcp.command)
    python examples/calculator_mcp_server.py --port 8765     # http://127.0.0.1:8765/mcp
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from calculator_tools import calculator  # noqa: E402
from fastmcp import FastMCP  # noqa: E402

server = FastMCP("calculator")
server.tool(calculator)


@server.tool
def wait(seconds: float) -> str:
    """Sleep for a number of seconds, then say so (a tool that can pass its deadline).

    Args:
        seconds: how long to sleep
    """
    time.sleep(min(seconds, 60.0))
    return f"slept {seconds:g}s"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=None, help="serve streamable HTTP on this port (default: stdio)")
    args = parser.parse_args()
    if args.port is None:
        server.run(transport="stdio", show_banner=False)
    else:
        server.run(transport="http", host="127.0.0.1", port=args.port, show_banner=False, log_level="warning")
