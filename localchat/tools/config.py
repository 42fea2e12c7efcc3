"""``[[mcp]]`` entries of settings.toml: the MCP servers whose tools a model may call.

A server is a command run over stdio (``command = ["prog", "arg"]``, optionally ``env`` and
``cwd``) or a streamable-HTTP ``url`` (optionally ``headers_env``: header name to the
environment variable that holds its value, so secrets stay out of the file).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from localchat.errors import UsageError

SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,40}")
_KEYS = {"name", "command", "env", "cwd", "url", "headers_env", "timeout_s"}
DEFAULT_CALL_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class McpServerConfig:
    """One MCP server: how to reach it and how long one call may take."""

    name: str
    command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers_env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    @property
    def where(self) -> str:
        """The server in a few words: its command or its address."""
        return self.url or " ".join(self.command)


def parse_mcp_servers(path: Path, value: object) -> tuple[McpServerConfig, ...]:
    """The ``[[mcp]]`` tables; a bad entry is one line naming the file, the server and the key."""
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise UsageError(
            f"{path}: mcp must be [[mcp]] tables, each with a name and a command or url"
        )
    servers: list[McpServerConfig] = []
    for entry in value:
        name = entry.get("name")
        if not isinstance(name, str) or not SERVER_NAME.fullmatch(name):
            raise UsageError(
                f"{path}: each [[mcp]] entry needs a name of letters, digits, - or _ (got {name!r})"
            )
        where = f"{path}: [[mcp]] {name!r}"
        unknown = sorted(set(entry) - _KEYS)
        if unknown:
            raise UsageError(
                f"{where} has no {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}"
            )
        if any(s.name == name for s in servers):
            raise UsageError(f"{where} is named twice; give each server its own name")
        command, url = entry.get("command"), entry.get("url")
        if (command is None) == (url is None):
            raise UsageError(f'{where} needs either command = ["prog", …] or url, not both')
        if command is not None and (
            not isinstance(command, list)
            or not command
            or not all(isinstance(part, str) and part for part in command)
        ):
            raise UsageError(f"{where}: command must be a list of strings, the program first")
        if url is not None and (not isinstance(url, str) or "://" not in url):
            raise UsageError(f"{where}: url must be an address such as http://127.0.0.1:8000/mcp")
        env, headers = entry.get("env", {}), entry.get("headers_env", {})
        for key, table in (("env", env), ("headers_env", headers)):
            if not isinstance(table, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in table.items()
            ):
                raise UsageError(f"{where}: {key} must be a table of names to strings")
        cwd = entry.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise UsageError(f"{where}: cwd must be a folder")
        timeout = entry.get("timeout_s", DEFAULT_CALL_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise UsageError(f"{where}: timeout_s must be a positive number of seconds")
        servers.append(
            McpServerConfig(
                name,
                tuple(command or ()),
                dict(env),
                cwd,
                url,
                dict(headers),
                float(timeout),
            )
        )
    return tuple(servers)
