"""Every key of the app in one list, with ids (Help and the command palette read it too).

Chat keys live on the chat screen, so a dialog above it has its own keys; they take
priority over the message box's own keys (it would otherwise swallow some) except Esc, which
closes dialogs first. ``app.`` actions run on the app (model switching, hardware, help).
"""

from __future__ import annotations

from textual.binding import Binding

CHAT_BINDINGS: list[Binding] = [
    Binding(
        "escape", "stop", "Stop", tooltip="Stop generating; the partial reply is kept", id="stop"
    ),
    *(
        Binding(key, action, description, tooltip=tooltip, priority=True, id=binding_id)
        for key, action, description, tooltip, binding_id in (
            ("ctrl+n", "new_chat", "New", "Start a new conversation", "new-chat"),
            (
                "ctrl+l",
                "conversations",
                "Chats",
                "List, search, resume, rename, delete, export",
                "chats",
            ),
            ("ctrl+o", "app.models", "Models", "Download, switch or add a model", "models"),
            ("ctrl+r", "regenerate", "Regenerate", "Answer the last message again", "regenerate"),
            (
                "ctrl+s",
                "system_prompt",
                "System",
                "Edit this conversation's system prompt",
                "system",
            ),
            ("ctrl+g", "copy_reply", "Copy", "Copy the last reply to the clipboard", "copy"),
            ("f3", "app.hardware", "Hardware", "This machine and what runs on it", "hardware"),
            ("f1", "app.help", "Help", "Every key", "help"),
        )
    ),
    # Not in the footer (it is full): in Help and the command palette.
    Binding(
        "ctrl+t",
        "attach",
        "Attach",
        tooltip="Attach a text file (code, Markdown, logs) or an image to your next message",
        show=False,
        priority=True,
        id="attach",
    ),
    Binding(
        "alt+up",
        "select_message",
        "Messages",
        tooltip="Select the last message (then ↑↓): edit, branches, pin, copy",
        show=False,
        priority=True,
        id="select-message",
    ),
]

# The app's actions among the chat's keys: they act from the chat screen only.
CHAT_APP_ACTIONS = frozenset(
    b.action.removeprefix("app.") for b in CHAT_BINDINGS if b.action.startswith("app.")
)

QUIT_BINDING = Binding(
    "ctrl+q", "quit", "Quit", tooltip="Quit (the last state is saved first)", id="quit"
)
