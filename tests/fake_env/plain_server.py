"""plain: an MCP env server built with the mcp package's FastMCP, for agentenv.py's tests.

It has no card and answers with SSE. The fast suite (test_agentenv.py) writes it as
envs/plain/server.py of a fake bundle, and runs it on its own for the MCP client's tests.
"""
import os
from mcp.server.fastmcp import FastMCP

if os.environ.get("FAKE_PIDDIR"):
    open(os.path.join(os.environ["FAKE_PIDDIR"], str(os.getpid())), "w").close()
mcp = FastMCP("plain", host=os.environ.get("MCP_HOST", "127.0.0.1"),
              port=int(os.environ["MCP_PORT"]), log_level="WARNING")


@mcp.tool()
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


@mcp.tool()
def fail(why: str) -> str:
    """Always fails, saying why."""
    raise ValueError(why)


if __name__ == "__main__":
    mcp.run(transport="streamable-http")
