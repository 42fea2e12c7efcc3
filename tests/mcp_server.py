"""A real MCP server for the tests, written with the SDK and run over stdio.

Its tools: ``ping`` (no arguments: a forced call to it is short even from a random-weight
model), ``add`` (two numbers), ``echo`` (text back), ``big`` (a result of ``size``
characters), ``crash`` (the process dies mid-call), ``fail`` (a tool error), ``slow``
(answers after ``seconds``). It says something on stderr at start, as real servers do, and
waits ``$LOCALCHAT_TEST_MCP_DELAY`` seconds before it answers (a slow start). Given a port, it serves
streamable HTTP on loopback instead of stdio.
"""

from __future__ import annotations

import os
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("localchat-test")


@server.tool()
def ping() -> str:
    """Answer pong."""
    return "pong"


@server.tool()
def add(a: float, b: float) -> str:
    """Add two numbers."""
    return str(a + b)


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return text


@server.tool()
def big(size: int) -> str:
    """A long text."""
    return "x" * size


@server.tool()
def crash() -> str:
    """The server dies while answering."""
    os._exit(3)


@server.tool()
def fail() -> str:
    """A tool that fails."""
    raise ValueError("the tool failed on purpose")


@server.tool()
def slow(seconds: float) -> str:
    """Answer after a while."""
    time.sleep(seconds)
    return "done"


if __name__ == "__main__":
    print("localchat-test MCP server starting", file=sys.stderr, flush=True)
    time.sleep(float(os.environ.get("LOCALCHAT_TEST_MCP_DELAY", "0")))  # a slow start
    if len(sys.argv) > 1:  # streamable HTTP on this port, loopback
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
