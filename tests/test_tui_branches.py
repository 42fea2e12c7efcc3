"""Branches, pins and copy in the app: a selected message is edited into a new branch (only
what follows it is evaluated), its branches are switched with the arrows, a pinned message
stays in the context window while the others leave (dimmed), and a message is copied."""

from __future__ import annotations

from pathlib import Path

from textual.widgets import Label, TextArea

from localchat.models.launch import LaunchOptions
from localchat.tui.app import LocalChatApp
from localchat.tui.widgets.chat_message import AssistantMessage, ChatEntry, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from tests.conftest import GREEDY
from tests.tui_helpers import chat_app, running

SIZE = (120, 40)


def _role(entry: ChatEntry) -> str:
    return str(entry.query_one(".role", Label).render())


async def test_a_selected_message_is_edited_into_a_branch_and_switched_back(
    tiny_model: Path,
) -> None:
    async with chat_app(tiny_model, size=SIZE, n_ctx=2048, max_tokens=8) as ui:
        app, pilot = ui.app, ui.pilot
        for text in ("first question", "second question", "third question"):
            await ui.say(text)
        await pilot.press("alt+up")  # the last message is selected; three up: the 2nd question
        assert isinstance(app.focused, AssistantMessage)
        await pilot.press("up", "up", "up")
        assert isinstance(app.focused, UserMessage) and app.focused.text == "second question"
        await pilot.press("e")
        box = app.query_one(PromptInput)
        assert box.text == "second question" and app.focused is box
        box.text = "an edited second question"
        finished = await ui.send("enter")
        stats = finished.turn.stats_dict()
        assert stats["kept_tokens"] > stats["prompt_tokens_evaluated"] > 0  # from the edit on
        users = list(app.query(UserMessage))
        assert [u.text for u in users] == ["first question", "an edited second question"]
        assert "2/2" in _role(users[1])
        users[1].focus()
        await pilot.press("left")  # the old branch, with everything that followed it
        await ui.until(
            lambda: isinstance(app.focused, UserMessage) and app.focused.text == "second question",
            "the old branch's question to be drawn and selected",
        )
        users = list(app.query(UserMessage))
        assert [u.text for u in users] == ["first question", "second question", "third question"]
        assert "1/2" in _role(users[1]) and app.focused is users[1]
        await pilot.press("right")
        await ui.until(lambda: "branch 2 of 2" in ui.text("#turn-start"), "the edited branch")
        assert [u.text for u in app.query(UserMessage)][-1] == "an edited second question"
        # The app's Esc cancels an edit and gives the box back as it was.
        box.text = "a draft"
        app.query(UserMessage).first().focus()
        await pilot.press("e")
        assert box.text == "first question"
        await pilot.press("escape")
        assert box.text == "a draft" and app.chat.composer.editing is None


async def test_a_pinned_message_stays_in_the_window_the_others_are_dimmed(
    tiny_model: Path,
) -> None:
    async with chat_app(tiny_model, size=SIZE, n_ctx=192, max_tokens=8) as ui:
        app = ui.app
        await ui.say("remember this: the code word is falcon")
        first = app.query(UserMessage).first()
        first.focus()
        await ui.pilot.press("p")
        assert "pinned" in _role(first)
        await ui.pilot.press("tab")  # back to the message box
        assert app.focused is app.query_one(PromptInput)
        conversation = app.conversation
        assert conversation is not None
        moved = None
        for i in range(12):
            finished = await ui.say(f"question {i} about a topic, please answer it")
            if finished.turn.window.dropped_messages:
                moved = finished
                break
        assert moved is not None, "the window never moved"
        assert conversation.window_first > 1
        # The model still reads the pinned exchange; a message that left is dimmed.
        ids = [e.record.id for e in conversation.exchanges[:3]]
        assert [conversation.sees(i) for i in ids] == [True, True, False]
        prompt_text = conversation.backend.detokenize(moved.turn.prompt_tokens)
        assert "falcon" in prompt_text
        entries = list(app.query(ChatEntry))
        assert not entries[1].has_class("out-of-window") and entries[2].has_class("out-of-window")
        assert "pinned" in _role(entries[1]) and "no longer in the context" in _role(entries[2])


async def test_a_selected_message_is_copied(tiny_model: Path) -> None:
    app = LocalChatApp(tiny_model, LaunchOptions(n_ctx=512), max_tokens=8, sampling=GREEDY)
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
    async with running(app, SIZE) as ui:
        await ui.say("copy me")
        app.query(UserMessage).first().focus()
        await ui.pilot.press("c")
        assert copied == ["copy me"]


async def test_a_file_is_attached_to_the_next_message(tiny_model: Path, tmp_path: Path) -> None:
    from localchat.tui.screens.text_prompt import TextPromptScreen

    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe cache keeps every token.\n")
    async with chat_app(tiny_model, size=SIZE, n_ctx=512, max_tokens=8) as ui:
        app = ui.app

        async def attach(path: Path) -> None:
            await ui.pilot.press("ctrl+t")
            prompt = await ui.shown(TextPromptScreen)
            prompt.query_one("#prompt-text", TextArea).text = str(path)
            await ui.pilot.press("ctrl+s")

        await attach(tmp_path / "missing.md")
        await ui.notice("no such file")
        await attach(notes)
        await ui.notice("Attached notes.md:")
        finished = await ui.say("what do my notes say")
        sent = finished.turn.user_text
        assert sent.startswith("File: notes.md\n```markdown\n# Notes") and sent.endswith(
            "\n\nwhat do my notes say"
        )
        assert not app.chat.composer.attachments  # they went with that message
        big = tmp_path / "big.log"
        big.write_text("line of a long log file\n" * 400)
        await attach(big)
        await ui.notice("use --ctx", "big.log")
        assert not app.chat.composer.attachments


async def test_code_blocks_and_selected_text_are_copied(tiny_model: Path) -> None:
    from localchat.tui.widgets.chat_message import code_blocks

    reply = "Two ways:\n\n```python\nprint(1)\n```\n\nor\n\n```sh\necho 1\n```\n"
    assert code_blocks(reply) == [("python", "print(1)\n"), ("sh", "echo 1\n")]
    app = LocalChatApp(tiny_model, LaunchOptions(n_ctx=512), max_tokens=8, sampling=GREEDY)
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
    async with running(app, SIZE) as ui:
        log = app.query_one("#log")
        entry = AssistantMessage(reply, message_id=None)
        await log.mount(entry)
        # The keys go to the entry once it has the focus. Asked for again while waiting:
        # with a CPU hog beside the suite, one focus() right after the mount never took
        # (waited 60 s; the cause is not found yet).
        await ui.until(
            lambda: entry.focus() is not None and app.focused is entry,
            "the reply to have the focus",
        )
        await ui.pilot.press("k", "k", "k")  # the last block, the one before, round again
        assert copied == ["echo 1\n", "print(1)\n", "echo 1\n"]
        app.chat.action_copy_code()
        assert copied[-1] == "echo 1\n"
        # Text selected with the mouse: Ctrl+C copies it (to the terminal's clipboard).
        body = entry.query_one(".body")
        body.text_select_all()
        await ui.pilot.pause()
        await ui.pilot.press("ctrl+c")
        assert "Two ways" in copied[-1]


async def test_a_selected_message_forks_a_conversation_from_the_saved_cache(
    tiny_model: Path,
) -> None:
    async with chat_app(tiny_model, size=SIZE, n_ctx=2048, max_tokens=8) as ui:
        app = ui.app
        for text in ("first question", "second question", "third question"):
            await ui.say(text)
        source = app.conversation
        assert source is not None
        list(app.query(AssistantMessage))[1].focus()  # the reply to the second question
        await ui.pilot.press("f")
        fork = await ui.opened(before=source)
        assert fork is not None and fork.record.name != source.record.name
        assert [e.record.content for e in fork.exchanges][::2] == [
            "first question",
            "second question",
        ]
        await ui.notice("Forked")  # the fork's last step: the box has the focus by then
        assert app.focused is app.query_one(PromptInput)
        finished = await ui.say("a question only the fork has")
        stats = finished.turn.stats_dict()
        assert stats["kept_tokens"] > stats["prompt_tokens_evaluated"]  # from the source's cache
        # The palette's branch commands act on the last message with branches.
        await app.chat.step_last_branch(-1)
        await ui.notice("no other branches")


async def test_an_edit_left_for_another_conversation_gives_the_box_back(
    tiny_model: Path,
) -> None:
    async with chat_app(tiny_model, size=SIZE, n_ctx=1024, max_tokens=8) as ui:
        app = ui.app
        for text in ("first question", "second question"):
            await ui.say(text)
        box = app.query_one(PromptInput)
        box.text = "my draft"
        list(app.query(UserMessage))[1].focus()
        await ui.pilot.press("e")
        assert box.text == "second question"
        old = app.conversation
        await ui.pilot.press("ctrl+n")  # a new conversation: the edit does not follow
        await ui.opened(before=old)
        assert app.chat.composer.editing is None and box.text == "my draft"
        box.focus()
        finished = await ui.say(" and more")
        assert finished.turn.user_text == "my draft and more"
        assert finished.turn.conversation_id == app.conversation.record.id
        assert len(app.conversation.exchanges) == 2
