"""Branches, pins and copy in the app: a selected message is edited into a new branch (only
what follows it is evaluated), its branches are switched with the arrows, a pinned message
stays in the context window while the others leave (dimmed), and a message is copied."""

from __future__ import annotations

from pathlib import Path

from textual.message import Message
from textual.widgets import Label

from localchat.backends.base import Sampling
from localchat.tui.app import LocalChatApp
from localchat.tui.messages import ReplyFinished
from localchat.tui.widgets.chat_message import AssistantMessage, ChatEntry, UserMessage
from localchat.tui.widgets.prompt_input import PromptInput
from tests.tui_helpers import ready, say, until, wait_for

GREEDY = Sampling(temperature=0.0)


def _role(entry: ChatEntry) -> str:
    return str(entry.query_one(".role", Label).render())


async def test_a_selected_message_is_edited_into_a_branch_and_switched_back(
    tiny_model: Path,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=2048, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        for text in ("first question", "second question", "third question"):
            await say(pilot, seen, text)
        await pilot.press("alt+up")  # the last message is selected; three up: the 2nd question
        assert isinstance(app.focused, AssistantMessage)
        await pilot.press("up", "up", "up")
        assert isinstance(app.focused, UserMessage) and app.focused.text == "second question"
        await pilot.press("e")
        box = app.query_one(PromptInput)
        assert box.text == "second question" and app.focused is box
        box.text = "an edited second question"
        mark = len(seen)
        await pilot.press("enter")
        finished = await wait_for(pilot, seen, ReplyFinished, after=mark)
        assert isinstance(finished, ReplyFinished)
        stats = finished.turn.stats_dict()
        assert stats["kept_tokens"] > stats["prompt_tokens_evaluated"] > 0  # from the edit on
        users = list(app.query(UserMessage))
        assert [u.text for u in users] == ["first question", "an edited second question"]
        assert "2/2" in _role(users[1])
        users[1].focus()
        await pilot.press("left")  # the old branch, with everything that followed it
        await pilot.pause(0.2)
        users = list(app.query(UserMessage))
        assert [u.text for u in users] == ["first question", "second question", "third question"]
        assert "1/2" in _role(users[1]) and app.focused is users[1]
        await pilot.press("right")
        await pilot.pause(0.2)
        assert [u.text for u in app.query(UserMessage)][-1] == "an edited second question"
        # The app's Esc cancels an edit and gives the box back as it was.
        box.text = "a draft"
        app.query(UserMessage).first().focus()
        await pilot.press("e")
        assert box.text == "first question"
        await pilot.press("escape")
        assert box.text == "a draft" and app.chat.editing is None


async def test_a_pinned_message_stays_in_the_window_the_others_are_dimmed(
    tiny_model: Path,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=192, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "remember this: the code word is falcon")
        first = app.query(UserMessage).first()
        first.focus()
        await pilot.press("p")
        assert "pinned" in _role(first)
        await pilot.press("tab")  # back to the message box
        assert app.focused is app.query_one(PromptInput)
        conversation = app.conversation
        assert conversation is not None
        moved = None
        for i in range(12):
            finished = await say(pilot, seen, f"question {i} about a topic, please answer it")
            assert isinstance(finished, ReplyFinished)
            if finished.turn.window.dropped_messages:
                moved = finished
                break
        assert moved is not None, "the window never moved"
        assert conversation.window_first > 1
        # The model still reads the pinned exchange; a message that left is dimmed.
        ids = [e.record.id for e in conversation.exchanges[:3]]
        assert [conversation.sees(i) for i in ids] == [True, True, False]
        prompt_text = conversation.engine.detokenize(moved.turn.prompt.tokens)
        assert "falcon" in prompt_text
        entries = list(app.query(ChatEntry))
        assert not entries[1].has_class("out-of-window") and entries[2].has_class("out-of-window")
        assert "pinned" in _role(entries[1]) and "no longer in the context" in _role(entries[2])


async def test_a_selected_message_is_copied(tiny_model: Path) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=512, max_tokens=8, sampling=GREEDY)
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        await say(pilot, seen, "copy me")
        app.query(UserMessage).first().focus()
        await pilot.press("c")
        assert copied == ["copy me"]


async def test_a_file_is_attached_to_the_next_message(tiny_model: Path, tmp_path: Path) -> None:
    from localchat.tui.screens.text_prompt import TextPromptScreen

    notes = tmp_path / "notes.md"
    notes.write_text("# Notes\n\nThe cache keeps every token.\n")
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=512, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)

        async def attach(path: Path) -> None:
            await pilot.press("ctrl+t")
            await pilot.pause(0.1)
            assert isinstance(app.screen, TextPromptScreen)
            app.screen.query_one("#prompt-text").text = str(path)  # type: ignore[attr-defined]
            await pilot.press("ctrl+s")
            await pilot.pause(0.5)

        await attach(tmp_path / "missing.md")
        assert any("no such file" in n.message for n in app._notifications)
        await attach(notes)
        assert any("Attached notes.md:" in n.message for n in app._notifications)
        finished = await say(pilot, seen, "what do my notes say")
        assert isinstance(finished, ReplyFinished)
        sent = finished.turn.user.record.content
        assert sent.startswith("File: notes.md\n```markdown\n# Notes") and sent.endswith(
            "\n\nwhat do my notes say"
        )
        assert not app.chat.attachments  # they went with that message
        big = tmp_path / "big.log"
        big.write_text("line of a long log file\n" * 400)
        await attach(big)
        assert any("use --ctx" in n.message and "big.log" in n.message for n in app._notifications)
        assert not app.chat.attachments


async def test_code_blocks_and_selected_text_are_copied(tiny_model: Path) -> None:
    from localchat.tui.widgets.chat_message import code_blocks

    reply = "Two ways:\n\n```python\nprint(1)\n```\n\nor\n\n```sh\necho 1\n```\n"
    assert code_blocks(reply) == [("python", "print(1)\n"), ("sh", "echo 1\n")]
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=512, max_tokens=8, sampling=GREEDY)
    copied: list[str] = []
    app.copy_to_clipboard = copied.append  # type: ignore[method-assign]
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        log = app.query_one("#log")
        entry = AssistantMessage(reply, message_id=None)
        await log.mount(entry)
        entry.focus()
        for _ in range(100):  # the keys go to the entry once it has the focus
            if app.focused is entry:
                break
            await pilot.pause(0.02)
        await pilot.press("k", "k", "k")  # the last block, the one before, round again
        assert copied == ["echo 1\n", "print(1)\n", "echo 1\n"]
        app.chat.action_copy_code()
        assert copied[-1] == "echo 1\n"
        # Text selected with the mouse: Ctrl+C copies it (to the terminal's clipboard).
        body = entry.query_one(".body")
        body.text_select_all()
        await pilot.pause()
        await pilot.press("ctrl+c")
        assert "Two ways" in copied[-1]


async def test_a_selected_message_forks_a_conversation_from_the_saved_cache(
    tiny_model: Path,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=2048, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        for text in ("first question", "second question", "third question"):
            await say(pilot, seen, text)
        source = app.conversation
        assert source is not None
        list(app.query(AssistantMessage))[1].focus()  # the reply to the second question
        await pilot.press("f")
        for _ in range(100):
            if app.conversation is not None and app.conversation is not source:
                break
            await pilot.pause(0.05)
        fork = app.conversation
        assert fork is not None and fork.record.name != source.record.name
        assert [e.record.content for e in fork.exchanges][::2] == [
            "first question",
            "second question",
        ]
        assert app.focused is app.query_one(PromptInput)
        finished = await say(pilot, seen, "a question only the fork has")
        assert isinstance(finished, ReplyFinished)
        stats = finished.turn.stats_dict()
        assert stats["kept_tokens"] > stats["prompt_tokens_evaluated"]  # from the source's cache
        # The palette's branch commands act on the last message with branches.
        await app.chat.step_last_branch(-1)
        await until(
            pilot,
            lambda: any("no other branches" in n.message for n in app._notifications),
            "the notice that there are no other branches",
        )


async def test_an_edit_left_for_another_conversation_gives_the_box_back(
    tiny_model: Path,
) -> None:
    seen: list[Message] = []
    app = LocalChatApp(tiny_model, n_ctx=1024, max_tokens=8, sampling=GREEDY)
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        await ready(pilot, app, seen)
        for text in ("first question", "second question"):
            await say(pilot, seen, text)
        box = app.query_one(PromptInput)
        box.text = "my draft"
        list(app.query(UserMessage))[1].focus()
        await pilot.press("e")
        assert box.text == "second question"
        await pilot.press("ctrl+n")  # a new conversation: the edit does not follow
        await pilot.pause(0.3)
        assert app.chat.editing is None and box.text == "my draft"
        box.focus()
        finished = await say(pilot, seen, " and more")
        assert isinstance(finished, ReplyFinished)
        assert finished.turn.user.record.content == "my draft and more"
        assert len(finished.turn.conversation.exchanges) == 2
