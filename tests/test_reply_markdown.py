"""A streaming reply's paragraphs repaint alone while their text fits their lines; what the
stream leaves on screen is exactly what the whole reply renders to."""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widgets import Markdown

from localchat.tui.widgets.chat_message import ReplyMarkdown, SteadyParagraph

TEXT = (
    "A first paragraph that runs over several lines of the narrow terminal, word after"
    " word, so that some chunks fit the line it is on and others start a new one.\n\n"
    "A second paragraph, shorter.\n\n- a list item\n- and another"
)


class TwoReplies(App[None]):
    def compose(self) -> ComposeResult:
        yield ReplyMarkdown(id="streamed")
        yield ReplyMarkdown(TEXT, id="whole")


def _paragraphs(markdown: Markdown) -> list[tuple[int, list[str]]]:
    """Each paragraph's height and the text of its rendered lines."""
    shown = []
    for paragraph in markdown.query(SteadyParagraph):
        width, height = paragraph.size
        lines = paragraph.render_lines(Region(0, 0, width, height))
        shown.append((height, [line.text for line in lines]))
    return shown


async def test_a_streamed_reply_ends_as_the_whole_reply_renders() -> None:
    app = TwoReplies()
    async with app.run_test(size=(50, 60)) as pilot:
        streamed = app.query_one("#streamed", ReplyMarkdown)
        stream = Markdown.get_stream(streamed)
        heights: list[int] = []
        for start in range(0, len(TEXT), 7):
            await stream.write(TEXT[start : start + 7])
            await pilot.pause()
            first = streamed.query(SteadyParagraph).first()
            width, height = first.size
            heights.append(height)
            # Never a line of text hidden while it streams: laid out as soon as it grows.
            assert height == first.get_content_height(first.size, first.size, width)
        await stream.stop()
        await pilot.pause()
        whole = app.query_one("#whole", ReplyMarkdown)
        assert _paragraphs(streamed) == _paragraphs(whole)
        assert len(_paragraphs(whole)) == 4 and _paragraphs(whole)[0][0] >= 3  # list items too
        # The first paragraph grew a line at a time as its text came: laid out then only.
        assert max(heights) == _paragraphs(whole)[0][0] and heights == sorted(heights)


class LinkedReply(App[None]):
    def compose(self) -> ComposeResult:
        yield ReplyMarkdown(
            "Plain words only.\n\nSee [the docs](https://example.org) and more.", id="reply"
        )


async def test_only_paragraphs_with_links_pay_for_link_styling() -> None:
    app = LinkedReply()
    async with app.run_test(size=(60, 20)) as pilot:
        await pilot.pause()
        plain, linked = app.query_one("#reply", ReplyMarkdown).query(SteadyParagraph)
        # Textual restyles every line of a linked paragraph at each repaint; a plain one skips it.
        assert not plain.auto_links
        assert linked.auto_links
