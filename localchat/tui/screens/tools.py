"""The MCP servers and their tools, each on or off for the replies."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, SelectionList
from textual.widgets.selection_list import Selection

from localchat.tools.servers import ServerStatus


class ToolsScreen(ModalScreen[dict[str, bool] | None]):
    """Space turns a tool on or off; Esc closes, returning each tool's state."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="tools-close"),
    ]

    def __init__(self, statuses: list[ServerStatus], off: set[str]) -> None:
        super().__init__(classes="dialog-screen")
        self.statuses = statuses
        self.off = off

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label("Tools", classes="dialog-title")
            if not self.statuses:
                yield Label(
                    "No MCP servers configured: add [[mcp]] entries to settings.toml",
                    markup=False,
                )
            selections = []
            for status in self.statuses:
                for tool in status.tools:
                    summary = " ".join(tool.description.split())[:60]
                    label = Text(f"{tool.name} · {status.name} · {summary}")
                    selections.append(Selection(label, tool.name, tool.name not in self.off))
            for status in self.statuses:
                if not status.running:
                    yield Label(Text(f"{status.name}: {status.state}"), classes="dialog-hint")
            yield SelectionList[str](*selections, id="tools-list")
            yield Label(
                "Space turns a tool on or off · the tools are at the prompt's head: a change"
                " makes the next reply read the conversation again · Esc closes",
                classes="dialog-hint",
                markup=False,
            )

    def on_mount(self) -> None:
        self.query_one(SelectionList).focus()

    def action_close(self) -> None:
        chosen = set(self.query_one(SelectionList).selected)
        names = [tool.name for status in self.statuses for tool in status.tools]
        self.dismiss({name: name in chosen for name in names})
