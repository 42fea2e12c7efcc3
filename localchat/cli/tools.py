"""``localchat tools``: the MCP servers settings.toml configures, started as an ``ask`` or
the app starts them, with their state, their tools and where their log is."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TextIO

from localchat.cli.parser import EXIT_WORLD
from localchat.paths import app_paths
from localchat.text import shown


def cmd_tools(args: argparse.Namespace, out: TextIO) -> int:
    from localchat.settings import load_settings
    from localchat.tools.servers import ToolServers

    paths = app_paths()
    settings = load_settings(paths.settings_file)
    if not settings.mcp:
        if args.json:
            out.write("[]\n")
        else:
            out.write(f"no MCP servers configured: add [[mcp]] entries to {paths.settings_file}\n")
        return 0
    servers = ToolServers(settings.mcp, paths.logs_dir, settings.tool_result_chars)
    try:
        servers.start()
        statuses = [dataclasses.replace(s) for s in servers.statuses]  # before they stop
    finally:
        servers.close()
    if args.json:
        rows = [
            {
                "server": s.name,
                "where": s.where,
                "state": s.state,
                "log": str(s.log) if s.log else None,
                "tools": [{"name": t.name, "description": t.description} for t in s.tools],
            }
            for s in statuses
        ]
        out.write(json.dumps(rows, indent=2) + "\n")
    else:
        for status in statuses:  # what servers say is shown, control characters spelled out
            out.write(f"{status.name}  {shown(status.state, 300)}  ({shown(status.where, 200)})\n")
            for tool in status.tools:
                summary = " ".join(tool.description.split())
                out.write(
                    f"  {shown(tool.name)}" + (f"  {shown(summary, 100)}" if summary else "") + "\n"
                )
            if status.log is not None and not status.running:
                out.write(f"  log: {status.log}\n")
    return 0 if all(s.running for s in statuses) else EXIT_WORLD
