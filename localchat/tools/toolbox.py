"""The tools a chat is offered: the MCP servers settings.toml configures, started on first
use, less the tools the user turned off. The app and ``ask`` ask it which tools to offer
and run the calls the user allowed through it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from localchat.chat.tools import TOOL_CHOICES, ToolCall, ToolUse
from localchat.errors import UsageError
from localchat.tools.config import McpServerConfig
from localchat.tools.results import DEFAULT_RESULT_CHARS, ToolResult, failure
from localchat.tools.servers import ServerStatus, ToolServers


class ToolBox:
    """The configured servers (none started until ``start``) and the tools turned off."""

    def __init__(
        self,
        configs: tuple[McpServerConfig, ...],
        log_dir: Path,
        result_chars: int = DEFAULT_RESULT_CHARS,
    ) -> None:
        self.configs, self.log_dir, self.result_chars = configs, log_dir, result_chars
        self.servers: ToolServers | None = None  # once started
        self.off: set[str] = set()  # tools the user turned off (the app's tools screen)

    def start(self, on_late: Callable[[str], object]) -> list[str]:
        """Start the servers (none configured: nothing is imported or started); a line for
        each that could not start (the chat goes on without it). One that answers later
        is offered from then on: ``on_late`` gets its name (on the servers' loop, which
        must not wait on a turn)."""
        if self.servers is not None or not self.configs:
            return []
        self.servers = ToolServers(self.configs, self.log_dir, self.result_chars, on_late)
        return self.servers.start()

    @property
    def statuses(self) -> list[ServerStatus]:
        return self.servers.statuses if self.servers is not None else []

    def server_of(self, tool: str) -> str | None:
        """The name of the server offering ``tool`` (the consent dialog says whose it is)."""
        return self.servers.server_of(tool) if self.servers is not None else None

    def use(self, choice: str = "auto") -> ToolUse | None:
        """The tools the servers offer, with ``choice`` ("auto", "none", "required" or a
        tool's name, which must be one of them); None where there are none."""
        offered = self.servers.tools() if self.servers is not None else []
        tools = tuple(tool for tool in offered if tool.name not in self.off)
        if choice not in TOOL_CHOICES and choice not in {tool.name for tool in tools}:
            names = ", ".join(tool.name for tool in tools) or "none: add [[mcp]] servers"
            raise UsageError(f"no tool named {choice!r} to require (tools: {names})")
        if not tools:
            if choice == "required":
                raise UsageError("--tool-choice required, but no MCP server offers a tool")
            return None
        return ToolUse(tools, choice)

    def turn(self, name: str, on: bool) -> None:
        """Offer a tool to the replies, or stop offering it."""
        (self.off.discard if on else self.off.add)(name)

    def run(self, call: ToolCall, cancel: threading.Event | None = None) -> ToolResult:
        """Run a call the user allowed; its result as the model reads it (an error result
        where the server is down, or ``cancel`` was set while it ran)."""
        if self.servers is None:
            return failure(f"no MCP server has a tool named {call.name!r}")
        return self.servers.call(call, cancel)

    def close(self) -> None:
        if self.servers is not None:
            self.servers.close()
